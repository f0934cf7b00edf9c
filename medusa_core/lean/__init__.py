"""The lean decoding step: a Llama-family 4-bit decoding pass in one compiled call (``step.LeanStep``),
built once per install from ``lean_step.cpp`` and its headers (``build``). Same bits as transformers' forward (issue 27)."""

from .step import LeanStep, unsupported

__all__ = ["LeanStep", "unsupported"]
