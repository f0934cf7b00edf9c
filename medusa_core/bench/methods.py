"""The decoding methods under test: HF ``generate``, HF prompt lookup, the plain loop, Medusa per tree, and this
engine's n-gram drafts alone or beside the heads (``generate(drafts=...)``, issue 20)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..processors import SamplingConfig
from . import llama_cpp

#: Method kinds: HF greedy ``generate``, HF prompt lookup decoding, this project's plain loop, Medusa.
METHOD_KINDS = ("hf", "hf_pld", "llama_cpp", "baseline", "medusa")
#: Method names that run this engine's other drafts: n-gram alone (kind ``medusa``, no heads) or beside each tree, the
#: corpus's chains, the EAGLE-style drafter's (``eagle``, needs ``--drafter``).
DRAFT_METHODS = ("ngram", "medusa+ngram", "medusa+corpus", "eagle")
#: Prefix of a Medusa method name (before ``:<tree>``) -> its ``generate(drafts=...)``.
MEDUSA_PREFIXES = {"medusa": "heads", "medusa+ngram": "hybrid", "medusa+corpus": "corpus"}
#: Suffix of a ``baseline`` or Medusa method name that runs it with transformers' forward, not the lean pass.
TRANSFORMERS_PASS = "@transformers"
#: Small trees benchmarked when the model ships none of its own.
DEFAULT_TREES = ("chain_4", "sparse_8", "sparse_16", "sparse_32")


@dataclass(frozen=True)
class Method:
    """A decoding method under test.

    Attributes:
        name: its label in tables: ``hf``, ``hf_pld``, ``baseline``, ``medusa:<tree>``, ``ngram``,
            ``medusa+ngram:<tree>`` or ``medusa+corpus:<tree>``.
        kind: one of ``METHOD_KINDS``.
        choices: the Medusa tree's paths (kind ``medusa`` only; empty for ``ngram``).
        drafts: ``generate(drafts=...)`` of kind ``medusa``: ``heads``, ``ngram``, ``hybrid`` or ``corpus``.
        source: the GGUF file llama.cpp decodes (kind ``llama_cpp`` only).
        lean: kinds ``baseline`` and ``medusa``: False runs transformers' forward instead of the compiled
            decoding pass (``medusa_core.lean``): a name ending in ``TRANSFORMERS_PASS``, for before/after figures.
    """

    name: str
    kind: str
    choices: tuple[tuple[int, ...], ...] = ()
    source: str = ""  # kind llama_cpp: the GGUF file
    drafts: str = "heads"
    lean: bool = True

    @property
    def tree_nodes(self) -> int:
        """N, tokens of the heads' tree verified per step (root included; n-gram chains come on top);
        1 for every non-Medusa method and for ``ngram``."""
        return len(self.choices) + 1


def build_methods(model: Any, methods: Sequence[str], trees: Sequence[str], config: SamplingConfig | None = None) -> list[Method]:
    """Methods from names: ``hf``, ``hf_pld``, ``baseline``, ``medusa`` (one per tree in ``trees``),
    ``medusa:<tree>``, ``ngram`` (n-gram drafts only), ``medusa+ngram`` (the hybrid, one per tree),
    ``medusa+ngram:<tree>``, ``medusa+corpus`` / ``medusa+corpus:<tree>`` (the heads and the model's corpus of its
    replies; skipped, with a line saying so, for a model without one); ``baseline`` and the Medusa names may end in ``TRANSFORMERS_PASS`` (transformers'
    forward instead of the lean pass). The tree ``tuned`` is the one tuned at ``config``'s preset
    (``MedusaModel.tuned_for``, as ``generate`` reads it), named ``tuned`` still. Raises ``ValueError`` for an unknown
    method or a tree the model cannot run."""
    out: list[Method] = []
    for full_name in methods:
        name = full_name.removesuffix(TRANSFORMERS_PASS)
        if name != full_name:
            if name in ("baseline", "ngram") or name.split(":", 1)[0] in MEDUSA_PREFIXES:
                out += [dataclasses.replace(m, name=m.name + TRANSFORMERS_PASS, lean=False)
                        for m in build_methods(model, [name], trees, config)]
                continue
            raise ValueError(f"{TRANSFORMERS_PASS} applies to baseline and Medusa methods, not {name!r}")
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
        elif name == "ngram":
            out.append(Method(name, "medusa", drafts="ngram"))
        elif name == "eagle":
            if not getattr(model, "has_drafter", False):
                print("skipped eagle: the model has no drafter (MedusaModel.load_drafter)")
                continue
            out.append(Method(name, "medusa", drafts="eagle"))
        elif name.split(":", 1)[0] in MEDUSA_PREFIXES:
            prefix = name.split(":", 1)[0]
            drafts = MEDUSA_PREFIXES[prefix]
            if drafts == "corpus" and not getattr(model, "has_corpus", False):
                print(f"skipped {name}: the model has no corpus of its own replies (a distill/ folder beside its heads)")
                continue
            for tree in trees if ":" not in name else [name.split(":", 1)[1]]:
                tuned = model.tuned_for(config) if tree == "tuned" and config is not None else None
                tree_name, choices = model.resolve_tree(tuned.tree if tuned else tree)
                out.append(Method(f"{prefix}:{tree if tuned else tree_name}", "medusa", tuple(map(tuple, choices)), drafts=drafts))
        else:
            raise ValueError(
                f"unknown method {name!r}: use {', '.join(METHOD_KINDS + DRAFT_METHODS)}, medusa:<tree>, medusa+ngram:<tree> "
                "or medusa+corpus:<tree>"
            )
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

