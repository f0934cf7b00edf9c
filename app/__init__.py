"""The Gradio app on ``medusa_core``: settings, the shared engine, per-session state, handlers and the page."""
