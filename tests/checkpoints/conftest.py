"""The tiny Llama every checkpoint test saves heads for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ARCH_SETTINGS  # plain data, shared with the fixtures
from tiny_models import tiny_backbone, tiny_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama saved with its tokenizer: (folder, the backbone object)."""
    folder = tmp_path_factory.mktemp("base")
    backbone = tiny_backbone("llama", **ARCH_SETTINGS["llama"])
    backbone.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, backbone
