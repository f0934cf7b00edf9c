"""The decoding methods under test: HF ``generate``, HF prompt lookup, the plain loop, Medusa per tree."""

from __future__ import annotations


from dataclasses import dataclass
from typing import Any, Sequence

from . import llama_cpp

#: Method kinds: HF greedy ``generate``, HF prompt lookup decoding, this project's plain loop, Medusa.
METHOD_KINDS = ("hf", "hf_pld", "llama_cpp", "baseline", "medusa")
#: Small trees benchmarked when the model ships none of its own.
DEFAULT_TREES = ("chain_4", "sparse_8", "sparse_16", "sparse_32")


@dataclass(frozen=True)
class Method:
    """A decoding method under test.

    Attributes:
        name: its label in tables: ``hf``, ``hf_pld``, ``baseline`` or ``medusa:<tree>``.
        kind: one of ``METHOD_KINDS``.
        choices: the Medusa tree's paths (kind ``medusa`` only).
        source: the GGUF file llama.cpp decodes (kind ``llama_cpp`` only).
    """

    name: str
    kind: str
    choices: tuple[tuple[int, ...], ...] = ()
    source: str = ""  # kind llama_cpp: the GGUF file

    @property
    def tree_nodes(self) -> int:
        """N, tokens verified per step (root included); 1 for every non-Medusa method."""
        return len(self.choices) + 1


def build_methods(model: Any, methods: Sequence[str], trees: Sequence[str]) -> list[Method]:
    """Methods from names: ``hf``, ``hf_pld``, ``baseline``, ``medusa`` (one per tree in ``trees``)
    or ``medusa:<tree>``. Raises ``ValueError`` for an unknown method or a tree the model cannot run."""
    out: list[Method] = []
    for name in methods:
        if name in ("hf", "hf_pld", "baseline"):
            out.append(Method(name, name))
        elif name == "llama_cpp":
            path = getattr(model, "backbone_file", None)
            if not path or not str(path).lower().endswith(".gguf"):
                print(llama_cpp.NOT_GGUF)
                continue
            if not llama_cpp.available():
                print(llama_cpp.MISSING)
                continue
            out.append(Method(name, name, source=str(path)))
        elif name == "medusa" or name.startswith("medusa:"):
            for tree in trees if name == "medusa" else [name.split(":", 1)[1]]:
                tree_name, choices = model.resolve_tree(tree)
                out.append(Method(f"medusa:{tree_name}", "medusa", tuple(map(tuple, choices))))
        else:
            raise ValueError(f"unknown method {name!r}: use {', '.join(METHOD_KINDS)} or medusa:<tree>")
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {names}")
    return out


def default_trees(model: Any) -> list[str]:
    """The model's own trees (calibrated, tuned) when it has any, else small presets that fit its heads."""
    if model.trees:
        return list(model.trees)
    names = [t for t in DEFAULT_TREES if t in model.tree_names()]
    if model.device.type == "cuda" and "mc_sim_7b_63" in model.tree_names():
        names.append("mc_sim_7b_63")
    return names or [f"chain_{model.num_heads}"]

