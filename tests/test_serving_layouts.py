"""Which serving engine reads which heads folder this project writes (README, "Serving engines").

Each engine's Medusa loader is restated here as facts — the files it opens, the config fields it reads,
the tensor names and shapes it asks for — read from its public source (paths below), not copied. A
cell of the README table says "yes" when one of the engine's loaders finds everything it reads in the
folder and, applied to those tensors, computes the same logits as ``MedusaHeads``; "no" when a file,
field or tensor it reads is missing (the tests name which).

- text-generation-inference (huggingface/text-generation-inference):
  ``server/text_generation_server/models/__init__.py`` (``get_model``: a config with
  ``medusa_num_heads`` is a Medusa folder; ``base_model_name_or_path`` names the backbone; the
  weights file is ``medusa_lm_head.safetensors``), ``layers/speculative.py`` (a config with
  ``architectures`` is not taken for Medusa; ``MedusaHeadV1`` is tried, ``MedusaHeadV2`` when it
  raises), ``layers/medusa.py`` (V1: ``{i}.{j}.linear.weight/bias`` for j < ``medusa_num_layers``
  and ``{i}.{L}.weight``; V2: asserts ``medusa_num_layers == 1``, reads ``{i}.0.linear.weight/bias``
  and projects with the backbone's LM head).
- vLLM (vllm-project/vllm): ``vllm/transformers_utils/configs/medusa.py`` (``model_type`` "medusa";
  any config field holding "num" and "heads" becomes ``num_heads``, "num" and "layers"
  ``num_hidden_layers``; ``hidden_size``, ``vocab_size``, ``truncated_vocab_size`` default to the
  vocabulary), ``vllm/model_executor/models/medusa.py`` (``blocks.{i}.layers.{j}.weight``, and
  ``.bias`` only when ``medusa_fc_bias`` is true; ``lm_heads.{i}.weight`` [V, H]; names that are no
  parameter are skipped); the default loader reads every ``*.safetensors`` in the folder.
- TensorRT-LLM (NVIDIA/TensorRT-LLM): ``tensorrt_llm/models/medusa/weight.py`` (``load_medusa_hf``:
  opens ``medusa_lm_head.pt``, else ``medusa_lm_head.safetensors``; reads ``{h}.{l}.linear.weight``,
  ``{h}.{l}.linear.bias`` and ``{h}.{num_medusa_layers}.weight`` for every head), head and block
  counts from ``examples/medusa/convert_checkpoint.py``'s ``--num_medusa_heads`` /
  ``--num_medusa_layers`` or ``medusa_num_layers`` in the config (``tensorrt_llm/models/medusa/model.py``).
- FasterDecoding/Medusa, ``medusa/model/medusa_model.py`` (main, April 2024,
  ``MedusaModelABC.from_pretrained``): a config without ``model_type`` is a head-only folder; the
  base config gets ``medusa_num_heads = 5`` whatever the folder's config says; ``medusa_num_layers``
  from the config; only ``medusa_lm_head.pt`` is read, into ``nn.Sequential(ResBlock..., Linear)``
  per head with ``load_state_dict(strict=False)``, so a missing tensor is silently left untrained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from medusa_core import MedusaHeads, export_vllm, save_medusa_heads

H, V = 8, 16  # hidden size, vocabulary of the pretend backbone
PRESENT, ABSENT = object(), object()  # config requirements: any value / the field must not be there
README = Path(__file__).resolve().parent.parent / "README.md"


@dataclass(frozen=True)
class Loader:
    """One way an engine reads a heads folder, written as the facts it relies on.

    files: glob patterns tried in order; the first that matches is opened (every file it matches).
    config: field → required value (``PRESENT``: any value; ``ABSENT``: must not be there).
    blocks: per head, per residual block, the (weight [H, H], bias [H] or None) tensor names.
    projections: per head, its [V, H] projection's name, or None for the backbone's own LM head.
    """

    files: tuple[str, ...]
    config: dict[str, Any]
    blocks: list[list[tuple[str, str | None]]]
    projections: list[str | None]


# ------------------------------------------------------------------------- the engines, as facts
def tgi_loaders(config: dict) -> list[Loader]:
    """text-generation-inference: ``MedusaHeadV1``, then ``MedusaHeadV2`` if V1 fails."""
    k, layers = config.get("medusa_num_heads", 0), config.get("medusa_num_layers", 0)
    needs = {"medusa_num_heads": PRESENT, "medusa_num_layers": PRESENT,
             "base_model_name_or_path": PRESENT, "architectures": ABSENT}
    v1 = Loader(
        files=("medusa_lm_head.safetensors",),
        config=needs,
        blocks=[[(f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias") for j in range(layers)] for i in range(k)],
        projections=[f"{i}.{layers}.weight" for i in range(k)],
    )
    v2 = Loader(
        files=("medusa_lm_head.safetensors",),
        config={**needs, "medusa_num_layers": 1},
        blocks=[[(f"{i}.0.linear.weight", f"{i}.0.linear.bias")] for i in range(k)],
        projections=[None] * k,
    )
    return [v1, v2]


def vllm_loaders(config: dict) -> list[Loader]:
    """vLLM's ``Medusa`` draft model; its config class renames the head and block count fields."""
    renamed = dict(config)
    for key in list(renamed):
        if "num" in key and "heads" in key:
            renamed["num_heads"] = renamed.pop(key)
        elif "num" in key and "layers" in key:
            renamed["num_hidden_layers"] = renamed.pop(key)
    k, layers = renamed.get("num_heads", 5), renamed.get("num_hidden_layers", 1)
    bias = renamed.get("medusa_fc_bias", False)
    return [Loader(
        files=("*.safetensors",),
        # without medusa_fc_bias the blocks have no bias parameter and the trained biases are skipped
        config={"model_type": "medusa", "hidden_size": H, "vocab_size": V, "medusa_fc_bias": True},
        blocks=[[(f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias" if bias else None)
                 for j in range(layers)] for i in range(k)],
        projections=[f"lm_heads.{i}.weight" for i in range(k)],
    )]


def tensorrt_llm_loaders(config: dict) -> list[Loader]:
    """TensorRT-LLM's ``load_medusa_hf``, with --num_medusa_heads/--num_medusa_layers set from the config."""
    k, layers = config.get("medusa_num_heads", 0), config.get("medusa_num_layers", 0)
    return [Loader(
        files=("medusa_lm_head.pt", "medusa_lm_head.safetensors"),
        config={"medusa_num_heads": PRESENT, "medusa_num_layers": PRESENT},
        blocks=[[(f"{h}.{l}.linear.weight", f"{h}.{l}.linear.bias") for l in range(layers)] for h in range(k)],
        projections=[f"{h}.{layers}.weight" for h in range(k)],
    )]


def reference_loaders(config: dict) -> list[Loader]:
    """FasterDecoding/Medusa's head-only path: always 5 heads, ``strict=False`` into Sequential heads."""
    layers = config.get("medusa_num_layers", 0)
    return [Loader(
        files=("medusa_lm_head.pt",),
        config={"model_type": ABSENT, "base_model_name_or_path": PRESENT, "medusa_num_layers": PRESENT},
        blocks=[[(f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias") for j in range(layers)] for i in range(5)],
        projections=[f"{i}.{layers}.weight" for i in range(5)],
    )]


ENGINES: dict[str, Callable[[dict], list[Loader]]] = {
    "text-generation-inference": tgi_loaders,
    "vLLM": vllm_loaders,
    "TensorRT-LLM": tensorrt_llm_loaders,
    "FasterDecoding/Medusa": reference_loaders,
}


# ------------------------------------------------------------------------------- applying them
def open_tensors(folder: Path, loader: Loader) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The tensors the loader would read and the file names, or (None, why) when no file matches."""
    for pattern in loader.files:
        files = sorted(folder.glob(pattern))
        if files:
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(f) if f.suffix == ".safetensors" else torch.load(f, weights_only=True))
            return state, ", ".join(f.name for f in files)
    return None, f"no {' or '.join(loader.files)}"


def problems(folder: Path, loader: Loader) -> list[str]:
    """Everything the loader reads that the folder lacks or has in another shape; [] if it loads."""
    config = json.loads((folder / "config.json").read_text())
    found: list[str] = []
    for field, want in loader.config.items():
        if want is ABSENT:
            if field in config:
                found.append(f"config has {field}")
        elif field not in config:
            found.append(f"config lacks {field}")
        elif want is not PRESENT and config[field] != want:
            found.append(f"config {field}={config[field]!r}, needs {want!r}")
    state, why = open_tensors(folder, loader)
    if state is None:
        return found + [why]
    shapes: dict[str, tuple[int, ...]] = {}
    for head in loader.blocks:
        for w, b in head:
            shapes[w] = (H, H)
            if b is not None:
                shapes[b] = (H,)
    shapes.update({p: (V, H) for p in loader.projections if p is not None})
    for key, shape in shapes.items():
        if key not in state:
            found.append(f"missing {key}")
        elif tuple(state[key].shape) != shape:
            found.append(f"{key} is {list(state[key].shape)}, needs {list(shape)}")
    return found


def engine_logits(folder: Path, loader: Loader, lm_head: nn.Linear, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Logits [K, B, V] of the first ``num_heads`` heads as the engine computes them from the tensors it read."""
    state, _ = open_tensors(folder, loader)
    assert state is not None
    out = []
    for head, proj in list(zip(loader.blocks, loader.projections))[:num_heads]:
        x = hidden  # [B, H]
        for w, b in head:
            x = x + nn.functional.silu(nn.functional.linear(x, state[w].float(), None if b is None else state[b].float()))
        out.append(nn.functional.linear(x, lm_head.weight if proj is None else state[proj].float()))  # [B, V]
    return torch.stack(out)


def loads(folder: Path, engine: str) -> bool:
    """True when one of the engine's loaders finds everything it reads in ``folder``."""
    config = json.loads((folder / "config.json").read_text())
    return any(not problems(folder, loader) for loader in ENGINES[engine](config))


# ---------------------------------------------------------------------------------- the folders
def _heads(num_heads: int, num_layers: int, shared: nn.Linear | None, seed: int = 0) -> MedusaHeads:
    """Heads with random weights (so a wrong mapping changes the logits) in fp16-exact values."""
    heads = MedusaHeads(H, V, num_heads, num_layers, shared_lm_head=shared)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g).half().float())
    return heads.eval()


@pytest.fixture
def lm_head() -> nn.Linear:
    """The pretend backbone's LM head [V, H]."""
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(head.weight.half().float())
    return head


LAYOUTS = ("Medusa-1 head-only", "version 2 head-only", "vLLM export")


def write(
    layout: str, folder: Path, lm_head: nn.Linear, num_heads: int = 5, num_layers: int = 1, shared: bool | None = None
) -> MedusaHeads:
    """Write ``layout`` for fresh heads into ``folder`` with this project's writers; returns the heads.

    ``shared``: heads that use the backbone's LM head (version 2); default: all but Medusa-1 head-only.
    Five heads by default, the number the reference code always builds.
    """
    shared = layout != "Medusa-1 head-only" if shared is None else shared
    heads = _heads(num_heads, num_layers, lm_head if shared else None)
    if layout == "vLLM export":
        export_vllm(heads, folder)
    else:
        save_medusa_heads(heads, folder, base_model_name_or_path="base")
    return heads


def convert_to_pt(folder: Path) -> None:
    """What a user of the reference code does: the same tensors, pickled as ``medusa_lm_head.pt``."""
    torch.save(load_file(folder / "medusa_lm_head.safetensors"), folder / "medusa_lm_head.pt")


# ------------------------------------------------------------------------------------ the table
#: The README table as data: engine → layout → loads it. ``test_the_readme_table_says_...`` holds the two equal.
TABLE = {
    "text-generation-inference": {"Medusa-1 head-only": True, "version 2 head-only": True, "vLLM export": False},
    "vLLM": {"Medusa-1 head-only": False, "version 2 head-only": False, "vLLM export": True},
    "TensorRT-LLM": {"Medusa-1 head-only": True, "version 2 head-only": False, "vLLM export": False},
    "FasterDecoding/Medusa": {"Medusa-1 head-only": False, "version 2 head-only": False, "vLLM export": False},
}


@pytest.mark.parametrize("engine", list(TABLE))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_engine_loads_exactly_the_layouts_the_table_says_and_computes_the_same_logits(tmp_path, lm_head, engine, layout):
    folder = tmp_path / "heads"
    heads = write(layout, folder, lm_head)  # the vLLM export of version 2 heads: the harder case
    config = json.loads((folder / "config.json").read_text())
    assert loads(folder, engine) == TABLE[engine][layout], [problems(folder, ld) for ld in ENGINES[engine](config)]
    if TABLE[engine][layout]:
        loader = next(ld for ld in ENGINES[engine](config) if not problems(folder, ld))
        hidden = torch.randn(3, H)
        expected = heads(hidden)
        assert torch.allclose(engine_logits(folder, loader, lm_head, hidden, heads.num_heads), expected, atol=1e-3)


def test_text_generation_inference_reads_version2_heads_through_its_v2_fallback_only_with_one_block(tmp_path, lm_head):
    write("version 2 head-only", tmp_path / "one", lm_head, num_heads=4)
    v1, v2 = tgi_loaders(json.loads((tmp_path / "one" / "config.json").read_text()))
    assert problems(tmp_path / "one", v1) == [f"missing {i}.1.weight" for i in range(4)]
    assert problems(tmp_path / "one", v2) == []
    write("version 2 head-only", tmp_path / "two", lm_head, num_heads=4, num_layers=2)
    v1, v2 = tgi_loaders(json.loads((tmp_path / "two" / "config.json").read_text()))
    assert problems(tmp_path / "two", v1) == [f"missing {i}.2.weight" for i in range(4)]
    assert problems(tmp_path / "two", v2) == ["config medusa_num_layers=2, needs 1"]


def test_tensorrt_llm_needs_a_projection_per_head_that_version2_heads_do_not_have(tmp_path, lm_head):
    write("version 2 head-only", tmp_path, lm_head, num_heads=4)
    (loader,) = tensorrt_llm_loaders(json.loads((tmp_path / "config.json").read_text()))
    assert problems(tmp_path, loader) == [f"missing {h}.1.weight" for h in range(4)]


def test_vllm_reads_version2_heads_only_from_export_vllm_which_copies_the_lm_head_per_head(tmp_path, lm_head):
    write("version 2 head-only", tmp_path / "heads", lm_head, num_heads=4)
    (loader,) = vllm_loaders(json.loads((tmp_path / "heads" / "config.json").read_text()))
    found = problems(tmp_path / "heads", loader)
    assert "config lacks model_type" in found and "missing lm_heads.0.weight" in found and "missing blocks.0.layers.0.weight" in found
    write("vLLM export", tmp_path / "export-v2", lm_head, num_heads=4)
    (loader,) = vllm_loaders(json.loads((tmp_path / "export-v2" / "config.json").read_text()))
    assert problems(tmp_path / "export-v2", loader) == []
    state = load_file(tmp_path / "export-v2" / "model.safetensors")
    for i in range(4):
        assert torch.equal(state[f"lm_heads.{i}.weight"].float(), lm_head.weight)
    heads = write("vLLM export", tmp_path / "export-m1", lm_head, num_heads=4, shared=False)  # own projections too
    (loader,) = vllm_loaders(json.loads((tmp_path / "export-m1" / "config.json").read_text()))
    assert problems(tmp_path / "export-m1", loader) == []
    hidden = torch.randn(3, H)
    assert torch.allclose(engine_logits(tmp_path / "export-m1", loader, lm_head, hidden, 4), heads(hidden), atol=1e-3)


def test_vllm_would_drop_the_block_biases_without_medusa_fc_bias(tmp_path, lm_head):
    write("vLLM export", tmp_path, lm_head, num_heads=2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_fc_bias"] is True
    (without,) = vllm_loaders({**config, "medusa_fc_bias": False})
    assert all(b is None for head in without.blocks for _, b in head)  # no bias parameter to load into


def test_serving_engines_do_not_read_each_others_folders(tmp_path, lm_head):
    write("vLLM export", tmp_path / "export", lm_head, num_heads=4)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    (tgi_v1, _), (trt,) = tgi_loaders(config), tensorrt_llm_loaders(config)
    assert problems(tmp_path / "export", tgi_v1)[:3] == ["config lacks medusa_num_heads", "config lacks medusa_num_layers", "config lacks base_model_name_or_path"]
    assert "no medusa_lm_head.safetensors" in problems(tmp_path / "export", tgi_v1)
    assert "no medusa_lm_head.pt or medusa_lm_head.safetensors" in problems(tmp_path / "export", trt)


def test_the_reference_code_reads_only_medusa_lm_head_pt_and_always_five_heads(tmp_path, lm_head):
    write("Medusa-1 head-only", tmp_path / "five", lm_head, num_heads=5)
    (loader,) = reference_loaders(json.loads((tmp_path / "five" / "config.json").read_text()))
    assert problems(tmp_path / "five", loader) == ["no medusa_lm_head.pt"]
    convert_to_pt(tmp_path / "five")
    assert problems(tmp_path / "five", loader) == []

    write("Medusa-1 head-only", tmp_path / "four", lm_head, num_heads=4)
    convert_to_pt(tmp_path / "four")
    (loader,) = reference_loaders(json.loads((tmp_path / "four" / "config.json").read_text()))
    assert problems(tmp_path / "four", loader) == ["missing 4.0.linear.weight", "missing 4.0.linear.bias", "missing 4.1.weight"]

    write("version 2 head-only", tmp_path / "v2", lm_head, num_heads=5)
    convert_to_pt(tmp_path / "v2")
    (loader,) = reference_loaders(json.loads((tmp_path / "v2" / "config.json").read_text()))
    assert problems(tmp_path / "v2", loader) == [f"missing {i}.1.weight" for i in range(5)]  # strict=False: left untrained


def test_the_readme_table_says_what_these_tests_show():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Serving engines"):]
    lines = section.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("|"))
    rows = list(takewhile(lambda line: line.startswith("|"), lines[start:]))
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[1:] == [
        "Medusa-1 head-only (`save_medusa_heads`)",
        "version 2 head-only (`save_medusa_heads`)",
        "vLLM layout (`export_vllm`)",
    ]
    table = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        engine = re.sub(r"[\[\]`*]|\(.*?\)", "", cells[0]).strip()
        table[engine] = {layout: cell.lower().startswith("yes") for layout, cell in zip(LAYOUTS, cells[1:])}
    assert table == TABLE
