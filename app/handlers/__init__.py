"""Event handlers of the page, grouped by feature, as plain functions of (engine, settings, session,
controls, values).

Every handler returns (or yields, for the streaming ones) a dict of named outputs, e.g.
``{"chatbot": [...], "tree_plot": Figure}``; ``app.ui`` maps names to components, so a handler never
depends on the order of an outputs list and tests read results by name. A handler that changes
nothing still returns a name (with ``gr.skip()``): Gradio reads an empty dict as a missing output.

| module | what |
|---|---|
| ``controls`` | ``Controls`` (what a reply reads when it starts), sampling presets, tree choices, custom-tree check, inactive controls, the Medusa toggle's note |
| ``views`` | chat messages, status line, live view, model panel |
| ``generation`` | the prompt that fits the context, recording the engine's steps |
| ``chat`` | send, reply (its text, the tree and speed chart beside it, the final view), Stop, Regenerate, edit and resend, Clear, restore after a reload, step slider, highlight |
| ``compare`` | Compare Medusa off and its draft sources |
| ``export`` | CSV statistics, Markdown and JSON transcripts |
| ``loading`` | the page while the model loads |
"""

from __future__ import annotations

from .chat import (
    add_user, clear, edit_user, finish_reply, follow_reply, regenerate, rerender_chat, respond, restore_chat, show_step, stop, waiting_turn,
)
from .compare import compare
from .controls import (
    CONTROL_NAMES,
    CUSTOM_TREE,
    GREEDY_PRESET,
    Controls,
    chat_preset,
    check_tree,
    explain_controls,
    greedy_preset,
    medusa_notice,
    tree_choices,
)
from .export import export_csv, export_transcript
from .loading import page_status
from .views import model_panel

LIVE_VIEW = ("tree_plot", "step_slider", "speed_plot", "summary")
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "sampling")  # the chat preset's controls
#: The named outputs each handler may return. Each event updates only these components: Gradio rebuilds every
#: output a streamed update leaves out, so a reply's streaming events name as few as they can (``app.handlers.chat``).
#: ``saved`` is the conversation in the browser's storage (``gr.BrowserState``), written when a message is sent,
#: about once a second while its reply streams (``settings.save_interval_s``) and when the reply ends.
OUTPUTS: dict[str, tuple[str, ...]] = {
    "page_status": ("banner", "timer", "tree", "model_panel", "tree_status", "drafts", "medusa", *SAMPLING),
    "restore_chat": ("chatbot", "reply_status"),
    "add_user": ("message", "chatbot", "reply_status", "send", "saved", "step_slider"),
    "respond": ("chatbot", "reply_status"),
    "follow_reply": ("tree_plot", "speed_plot", "summary", "saved"),
    "finish_reply": ("chatbot", "reply_status", "model_panel", "tree_status", "send", "saved", *LIVE_VIEW),
    "regenerate": ("chatbot", "reply_status", "send", "saved", "step_slider"),
    "edit_user": ("chatbot", "reply_status", "send", "saved", "step_slider"),
    "compare": ("compare_result", "model_panel", *LIVE_VIEW),
    "stop": ("chatbot", "reply_status", "model_panel", "compare_result", "send", "saved", *LIVE_VIEW),
    "clear": ("chatbot", "message", "reply_status", "send", "saved", *LIVE_VIEW),
    "rerender_chat": ("chatbot",),
    "show_step": ("tree_plot", "step_slider"),
    "check_tree": ("tree_status",),
    "medusa_notice": ("medusa",),
    "explain_controls": ("tree", "drafts", "posterior_threshold", "posterior_alpha", "top_k", "top_p", "min_p"),
    "greedy_preset": tuple(GREEDY_PRESET),
    "chat_preset": SAMPLING,
    "export_csv": ("export_file", "export_path"),
    "export_transcript": ("export_file", "export_path"),
}

__all__ = [
    "CONTROL_NAMES", "CUSTOM_TREE", "GREEDY_PRESET", "OUTPUTS", "Controls", "add_user", "chat_preset", "check_tree", "clear",
    "compare", "edit_user", "explain_controls", "export_csv", "export_transcript", "finish_reply", "follow_reply", "greedy_preset", "medusa_notice", "model_panel",
    "page_status", "regenerate", "rerender_chat",
    "respond", "restore_chat", "show_step", "stop", "tree_choices", "waiting_turn",
]
