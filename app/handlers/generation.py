"""Running the engine for the page: the prompt that fits the context window, and the loop that
records every ``StepRecord`` in the session's statistics and the reply's text (shared by the chat
and Compare).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Iterator

import torch

from medusa_core import MedusaModel, ReadProgress, StepRecord

from ..engine import Engine
from ..session import Session
from ..stats import StepRow
from ..text import ReplyText, StreamingDetokenizer, chat_messages, prompt_ids
from .controls import Controls, sampling_config

#: Earlier chat replies the n-gram lookup searches beside the prompt (``generate(earlier_replies=...)``).
EARLIER_REPLIES = 8


def record_steps(
    engine: Engine,
    session: Session,
    steps: Iterator[tuple[StepRecord | ReadProgress, datetime]],
    controls: Controls,
    source: str,
    reply_index: int,
    reply: ReplyText,
) -> Iterator[StepRecord | ReadProgress]:
    """Consume the engine's steps (``Engine.steps``: each record with the time it was made): record each in the
    session's statistics (stamped with that time) and the reply's text; ``ReadProgress`` records (a long prompt being
    read) are passed on as they are.

    Stops after the current step, or the current chunk of the prompt, when Stop is pressed; closing
    this generator closes the engine's iterator, which releases the KV cache (a conversation's kept
    cache keeps what was written). A chat reply's token ids join the session's index of
    earlier replies (``Session.reply_tokens``, the latest ``EARLIER_REPLIES``) for later n-gram drafts.
    """
    session.last_records = []
    detok = StreamingDetokenizer(engine.model.tokenizer)
    ids: list[int] = []
    try:
        for record, made_at in steps:
            if isinstance(record, ReadProgress):
                yield record
                if session.stop_requested.is_set():
                    break
                continue
            session.rows.append(
                StepRow.from_record(
                    record,
                    session_id=session.id,
                    reply_index=reply_index,
                    source=source,
                    config=sampling_config(controls),
                    posterior_threshold=controls.posterior_threshold,
                    posterior_alpha=controls.posterior_alpha,
                    when=made_at,
                )
            )
            session.last_records.append(record)
            ids += record.token_ids
            for j, token in enumerate(record.token_ids):
                reply.append(detok.push(token), free=j > 0)  # token 0 is the backbone's own
            yield record
            if session.stop_requested.is_set() and record.stop_reason is None:
                session.rows[-1] = dataclasses.replace(session.rows[-1], stop_reason="stopped")
                break
    finally:
        steps.close()
        reply.append(detok.flush(), free=False)
        if source == "chat" and ids:
            session.reply_tokens = [*session.reply_tokens, ids][-EARLIER_REPLIES:]


#: No tokenizer packs more characters than this into one token on average: a longer message cannot fit
#: the context and is refused without tokenizing it (a 2.5 M-character paste would take seconds).
MAX_CHARS_PER_TOKEN = 64


def too_long(model: MedusaModel | None, controls: Controls, user: str) -> str:
    """Why ``user`` cannot be sent ("" when it can, or while no model is loaded): alone with the system
    prompt, its prompt fills the model's context window, so ``generate`` would refuse it."""
    if model is None:
        return ""
    limit = model.max_context
    why = f"shorten it: the model's {limit}-token context must hold it with the system prompt and the reply"
    if len(user) > MAX_CHARS_PER_TOKEN * limit:
        return f"The message is too long ({len(user):,} characters): {why}."
    tokens = prompt_ids(model.tokenizer, chat_messages(controls.system_prompt, [], user)).shape[1]
    if tokens >= limit:
        return f"The message is too long ({tokens:,} tokens with the system prompt): {why}."
    return ""


def fit_prompt(model: MedusaModel, controls: Controls, history: list[tuple[str, str]], user: str) -> tuple[torch.Tensor, int]:
    """Prompt ids [1, T]; the oldest turns are left out while the prompt leaves less than
    min(max_new_tokens, context / 4) tokens for the reply. Returns (ids, turns left out)."""
    room = min(controls.max_new_tokens, model.max_context // 4)
    dropped = 0
    while True:
        ids = prompt_ids(model.tokenizer, chat_messages(controls.system_prompt, history, user))
        if not history or ids.shape[1] + room <= model.max_context:
            return ids, dropped
        history, dropped = history[1:], dropped + 1

