"""What a head folder may hold beside its heads: the trees of ``medusa_calibration.json`` and the entries of
``medusa_tuned.json`` that fit the heads (``fitting_trees``, ``tuned_threshold``, ``tuned_chain``), and the corpus of
the backbone's own replies in ``distill/`` (``corpus_of``, ``CorpusIndex``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..datastore import Datastore
from ..errors import MedusaCheckpointError
from ..gguf import cache_dir
from ..heads import MedusaHeads
from ..trees import resolve_tree, validate_tree

log = logging.getLogger(__name__)


def tuned_threshold(tuned_file: Path, key: str, entry: Any) -> float:
    """τ of ``entry``, the tuned entry ``key`` of ``tuned_file`` (``min_head_probability``, chosen by
    ``bench tune``), 0.0 when there is none. Raises ``MedusaCheckpointError`` naming the file and the value
    when it is not a number in [0, 1]."""
    value = entry.get("min_head_probability", 0.0) if isinstance(entry, dict) else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: min_head_probability must be in [0, 1], got {value}")
    return float(value)


def tuned_chain(tuned_file: Path, key: str, entry: Any) -> tuple[int | None, float | None, float | None]:
    """(chain_depth, chain_threshold, chain_measured_speedup) of the tuned entry ``key`` of ``tuned_file``: the
    drafter's chain ``bench tune`` chose, Nones where it has none. Raises ``MedusaCheckpointError`` naming the file
    and the value when the depth is not an integer >= 1 or the threshold not a number in [0, 1]."""
    if not isinstance(entry, dict) or "chain_depth" not in entry:
        return None, None, None
    depth, threshold = entry["chain_depth"], entry.get("chain_threshold")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: chain_depth must be an integer >= 1, got {depth!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise MedusaCheckpointError(f"{tuned_file} [{key!r}]: chain_threshold must be in [0, 1], got {threshold!r}")
    speedup = entry.get("chain_measured_speedup")
    return depth, float(threshold), float(speedup) if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) else None


def fitting_trees(
    tuned_file: Path, tuned: dict[str, tuple[str, Any]], calibration_file: Path, calibration: dict[str, Any], heads: MedusaHeads
) -> tuple[dict[str, list[list[int]]], str | None]:
    """The model's own trees and default tree from ``medusa_calibration.json`` and ``tuned``, this device
    and precision's entries of ``medusa_tuned.json`` by tree name: ``"tuned"`` (greedy's, or a file's
    entry from before entries were per settings), ``"tuned_chat"`` -> (key, entry).

    A tree that does not fit the heads (too deep, a rank >= the vocabulary, invalid) is dropped with
    a logged warning naming the file and the reason. The default is the tree ``"tuned"``, else the
    calibration's ``default_tree``, else (both missing or dropped, with a warning) None: the model's
    default for its device.
    Raises ``MedusaCheckpointError`` when a file's layout is wrong.
    """
    found: list[tuple[Path, str, Any]] = []  # (file, tree name, paths), first found wins
    defaults: list[tuple[Path, Any]] = []  # (file, tree name), in order of preference
    for name, (key, entry) in tuned.items():
        if not isinstance(entry, dict) or "choices" not in entry:
            raise MedusaCheckpointError(f'{tuned_file}: entry {key!r} must be an object with "choices" (a list of paths)')
        found.append((tuned_file, name, entry["choices"]))
    if "tuned" in tuned:
        defaults.append((tuned_file, "tuned"))
    calibrated = calibration.get("trees", {})
    if not isinstance(calibrated, dict):
        raise MedusaCheckpointError(f'{calibration_file}: "trees" must be an object of tree name → list of paths')
    found += [(calibration_file, name, paths) for name, paths in calibrated.items()]
    if "default_tree" in calibration:
        defaults.append((calibration_file, calibration["default_tree"]))

    trees: dict[str, list[list[int]]] = {}
    dropped: dict[str, str] = {}  # tree name → why
    for file, name, paths in found:
        if name in trees or name in dropped:
            continue
        try:
            validate_tree(paths, heads.num_heads, vocab_size=heads.vocab_size)
        except ValueError as e:
            log.warning("%s: tree %r dropped: %s", file, name, e)
            dropped[name] = str(e)
            continue
        trees[name] = [list(p) for p in paths]
    for file, name in defaults:
        if not isinstance(name, str):
            raise MedusaCheckpointError(f'{file}: "default_tree" must be a tree name, got {name!r}')
        if name in trees:
            return trees, name
        if name not in dropped:
            try:
                resolve_tree(name, num_heads=heads.num_heads, vocab_size=heads.vocab_size)
                return trees, name
            except ValueError as e:
                dropped[name] = str(e)
        log.warning("%s: default tree %r not used: %s", file, name, dropped[name])
    if defaults:
        log.warning("%s: using the model's default tree for its device instead", tuned_file.parent)
    return trees, None


def corpus_of(folder: Path, quantization: str | None, report: Callable[[str], None] | None) -> CorpusIndex | None:
    """What makes the index of ``folder/distill``'s replies of this precision's backbone (held-out splits left
    out) when first asked for, or None when there are none."""
    files = sorted(f for f in (folder / "distill").glob(f"*-{quantization or 'none'}-*.jsonl.gz") if not f.name.startswith("heldout"))
    return CorpusIndex(tuple(files), cache_dir().parent / "corpus", report) if files else None


@dataclass(frozen=True)
class CorpusIndex:
    """A head folder's corpus as ``MedusaModel(corpus=...)`` takes it: the index of the replies in ``files``
    (``Datastore.cached``, kept in ``folder``), made when first asked for. Calling it reads the index, or builds it in
    this process, with ``report`` told; ``prepare_apart`` builds it in a low-priority process of its own
    (``Datastore.cache_apart``), which ``MedusaModel.index_corpus_in_background`` does first, so that a reply decoded
    meanwhile keeps the CPU and the GIL."""

    files: tuple[Path, ...]
    folder: Path
    report: Callable[[str], None] | None = None

    def __call__(self) -> Datastore:
        self._announce()
        return Datastore.cached(self.files, self.folder)

    def prepare_apart(self) -> None:
        self._announce()
        Datastore.cache_apart(self.files, self.folder)

    def _announce(self) -> None:
        if self.report is not None and not Datastore.is_cached(self.files, self.folder):
            self.report(f"Indexing the model's own replies ({len(self.files)} files) for corpus drafts, once…")
