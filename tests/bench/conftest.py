"""The tiny model and prompt file the benchmark's smoke runs use."""

from __future__ import annotations

import pytest
from tiny_models import write_tiny_medusa


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    heads = write_tiny_medusa(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):", "category": "python"}\n{"prompt": "return a + b", "category": "coding"}\n')
    return heads, prompts
