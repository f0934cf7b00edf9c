"""Candidate trees and their buffers (paper 2.1.2 tree attention, 2.3.3 optimised sparse trees).

A tree is given as ``medusa_choices``: a list of paths. A path ``(r0, ..., r_{d-1})`` is a node at
depth d whose token is rank ``r_j`` of head j's top-k; the root (depth 0) is the backbone's own next
token. Shape legend used throughout the package: ``N`` tree nodes including the root, ``P`` root-to-
leaf paths, ``D`` tree depth (heads used), ``K`` heads, ``H`` hidden size, ``V`` vocabulary, ``T``
tokens.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Sequence

import torch

Path_ = tuple[int, ...]

#: Largest tree accepted, root included: the published trees have 64 nodes, and one verification
#: pass over N nodes needs an [N, N] mask and N positions of the context window.
MAX_TREE_NODES = 1024

#: Top-k taken from every head: the flat candidate vector is ``[root, head0 top-k, head1 top-k, ...]``
#: (reference layout, so ``tree_indices`` can be cross-checked against it).
REFERENCE_TOPK = 10

# Rank accuracies a_k(i) of small Medusa heads on a 2-core-CPU-sized code model (rank 1, 2, 3 of heads
# 1-4, from the project's feasibility run); the CPU presets below are ``optimal_tree`` of this table.
SMALL_MODEL_RANK_ACCURACY = (
    (0.652, 0.096, 0.040),
    (0.551, 0.102, 0.047),
    (0.481, 0.097, 0.056),
    (0.445, 0.101, 0.048),
)


def _published_presets() -> dict[str, list[list[int]]]:
    text = resources.files("medusa_core").joinpath("data/medusa_trees.json").read_text(encoding="utf-8")
    return json.loads(text)["presets"]


def chain_tree(depth: int) -> list[list[int]]:
    """The top-1 chain of ``depth`` nodes: ``[[0], [0, 0], ...]``."""
    if depth < 1:
        raise ValueError(f"a chain tree needs depth >= 1, got {depth}")
    return [[0] * d for d in range(1, depth + 1)]


def dense_tree(sizes: Sequence[int]) -> list[list[int]]:
    """Cartesian-product tree of paper 2.1.2: top-``s_k`` of head k at depth k.

    ``dense_tree([2, 3])`` has 2 + 2*3 = 8 nodes. Raises ``ValueError`` for an empty list or a size < 1.
    """
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"dense tree sizes must be a non-empty list of integers >= 1, got {list(sizes)}")
    paths: list[list[int]] = []
    for depth in range(1, len(sizes) + 1):
        paths.extend(list(p) for p in itertools.product(*(range(s) for s in sizes[:depth])))
    return paths


def optimal_tree(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> tuple[list[list[int]], float]:
    """Greedy optimised sparse tree (paper 2.3.3).

    Args:
        rank_accuracy: ``a[k][i]`` = probability that rank i (0-based) of head k is the right token
            (top-(i+1) accuracy minus top-i accuracy), measured on calibration data. [K][ranks]
        num_nodes: node budget, root excluded.

    Returns:
        (paths, expected_accept_length): the chosen ``medusa_choices`` in insertion order and the sum
        of the chosen nodes' values, i.e. the expected number of tokens accepted from the heads per step
        (add 1 for the root to get the expected acceleration rate).

    The value of a node is the product of its ranks' accuracies; the frontier (next sibling or first
    child of a chosen node) is expanded greedily, which is optimal because a node's value never
    exceeds its parent's or its previous sibling's when accuracies fall with rank.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    depth = len(rank_accuracy)
    # heap of (-value, path, parent_value)
    frontier: list[tuple[float, Path_, float]] = []
    if depth and rank_accuracy[0]:
        heapq.heappush(frontier, (-rank_accuracy[0][0], (0,), 1.0))
    chosen: list[list[int]] = []
    total = 0.0
    while frontier and len(chosen) < num_nodes:
        neg_value, path, parent_value = heapq.heappop(frontier)
        value = -neg_value
        chosen.append(list(path))
        total += value
        d, r = len(path) - 1, path[-1]
        if r + 1 < len(rank_accuracy[d]):  # next sibling
            sibling = path[:-1] + (r + 1,)
            heapq.heappush(frontier, (-parent_value * rank_accuracy[d][r + 1], sibling, parent_value))
        if d + 1 < depth and rank_accuracy[d + 1]:  # first child
            heapq.heappush(frontier, (-value * rank_accuracy[d + 1][0], path + (0,), value))
    return chosen, total


def _cpu_presets() -> dict[str, list[list[int]]]:
    presets = {"chain_4": chain_tree(4)}
    for n in (8, 16, 32):
        presets[f"sparse_{n}"] = optimal_tree(SMALL_MODEL_RANK_ACCURACY, n)[0]
    return presets


#: Tree presets by name: the nine published trees (63 nodes) and small trees that suit CPUs.
TREE_PRESETS: dict[str, list[list[int]]] = {**_cpu_presets(), **_published_presets()}

_CHAIN = re.compile(r"^chain_(\d+)$")
_DENSE = re.compile(r"^dense_(\d+(?:x\d+)*)$")


def resolve_tree(
    tree: str | Sequence[Sequence[int]],
    *,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> tuple[str, list[list[int]]]:
    """Turn a tree given by name or as paths into ``(name, medusa_choices)``, checked by ``validate_tree``.

    Names: a key of ``TREE_PRESETS``, ``chain_D`` (top-1 chain of depth D) or ``dense_3x2x2``
    (Cartesian tree of top-3, top-2, top-2). A list of paths is named ``custom_<N>``.
    A named tree's depth and node count are checked before it is built.
    Raises ``ValueError`` for an unknown name or a tree that ``validate_tree`` rejects.
    """
    limits = dict(num_heads=num_heads, vocab_size=vocab_size, max_nodes=max_nodes)
    if not isinstance(tree, str):
        validate_tree(tree, **limits)
        choices = [list(p) for p in tree]
        return f"custom_{len(choices)}", choices
    if tree in TREE_PRESETS:
        choices = [list(p) for p in TREE_PRESETS[tree]]
    elif m := _CHAIN.match(tree):
        depth = int(m.group(1))
        _check_named_size(tree, depth, depth + 1, num_heads, max_nodes)
        choices = chain_tree(depth)
    elif m := _DENSE.match(tree):
        sizes = [int(s) for s in m.group(1).split("x")]
        _check_named_size(tree, len(sizes), _dense_nodes(sizes), num_heads, max_nodes)
        choices = dense_tree(sizes)
    else:
        raise ValueError(
            f"unknown tree {tree!r}: use one of {sorted(TREE_PRESETS)}, 'chain_D', 'dense_AxBxC' or a list of paths"
        )
    validate_tree(choices, **limits)
    return tree, choices


def _check_named_size(name: str, depth: int, nodes: int, num_heads: int | None, max_nodes: int) -> None:
    """Refuse a ``chain_D`` / ``dense_AxB`` tree of too many heads or nodes (root included) before it is built."""
    if num_heads is not None and depth > num_heads:
        raise ValueError(f"tree {name!r} has depth {depth} but the model has only {num_heads} Medusa heads")
    if nodes > max_nodes:
        raise ValueError(f"tree {name!r} has {nodes} nodes (root included); at most {max_nodes} are allowed")


def _dense_nodes(sizes: Sequence[int]) -> int:
    """Nodes of ``dense_tree(sizes)``, root included: 1 + Σ_k Π_{i≤k} s_i."""
    nodes = width = 1
    for s in sizes:
        width *= s
        nodes += width
    return nodes


def validate_tree(
    choices: Sequence[Sequence[int]],
    num_heads: int | None = None,
    *,
    vocab_size: int | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> None:
    """Check ``medusa_choices``: a non-empty list of unique, prefix-closed paths of integer ranks >= 0.

    Args:
        choices: the paths (the root is implicit).
        num_heads: K, when given: no path may be deeper.
        vocab_size: V, when given: every rank must be < V (a head ranks V tokens).
        max_nodes: most nodes allowed, root included (default ``MAX_TREE_NODES``).

    Raises ``ValueError`` naming the offending path, or the tree's size and the limit.
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
        raise ValueError(f"a tree is a non-empty list of paths such as [[0], [1], [0, 0]], got {choices!r:.80}")
    if len(choices) + 1 > max_nodes:
        raise ValueError(f"the tree has {len(choices) + 1} nodes (root included); at most {max_nodes} are allowed")
    seen: set[Path_] = set()
    for path in choices:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
            raise ValueError(f"path {path!r:.80} is not a list of ranks such as [0, 1]")
        p = tuple(path)
        if not p:
            raise ValueError("empty path [] in tree: the root is implicit")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in p):
            raise ValueError(f"path {list(p)}: ranks must be integers >= 0")
        if vocab_size is not None and max(p) >= vocab_size:
            raise ValueError(
                f"path {list(p)}: rank {max(p)} is not below the vocabulary size {vocab_size} "
                f"(ranks must be 0..{vocab_size - 1})"
            )
        if p in seen:
            raise ValueError(f"path {list(p)} appears twice")
        seen.add(p)
    for p in seen:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"path {list(p)} has no parent {list(p[:-1])}: a tree must be prefix-closed")
    if num_heads is not None:
        deepest = max(seen, key=len)
        if len(deepest) > num_heads:
            raise ValueError(
                f"path {list(deepest)} has depth {len(deepest)} but the model has only {num_heads} Medusa heads"
            )


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Static index tensors of one tree (paper 2.1.2), in the reference layout.

    Node order: root first, then the paths sorted by ``(len(path), path)``.

    Attributes:
        choices: the sorted paths.
        attn_mask: [N, N] bool, node i sees itself, the root and its ancestors.
        tree_indices: [N] index of each node's token in ``[root, head0 top-k, head1 top-k, ...]``.
        position_ids: [N] depth of each node (add the sequence length at run time).
        retrieve_indices: [P, D+1] node indices of each root-to-leaf path, padded with -1.
        path_lengths: [P] number of valid nodes of each path (root included).
        parents: [N] parent node index (-1 for the root).
        topk: number of candidates taken from every head.
    """

    choices: tuple[Path_, ...]
    attn_mask: torch.Tensor
    tree_indices: torch.Tensor
    position_ids: torch.Tensor
    retrieve_indices: torch.Tensor
    path_lengths: torch.Tensor
    parents: torch.Tensor
    topk: int

    @property
    def num_nodes(self) -> int:
        """N, root included."""
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        """D: the deepest path, i.e. the number of heads the tree uses."""
        return max((len(c) for c in self.choices), default=0)

    def node_heads(self) -> list[int]:
        """Head that proposed each node ([N]); -1 for the root (the backbone's own token)."""
        return [-1] + [len(c) - 1 for c in self.choices]

    def node_ranks(self) -> list[int]:
        """Rank of each node's token in its head's top-k ([N]); 0 for the root."""
        return [0] + [c[-1] for c in self.choices]

    def to(self, device: torch.device | str) -> "TreeBuffers":
        """A copy with every tensor on ``device``."""
        return TreeBuffers(
            choices=self.choices,
            attn_mask=self.attn_mask.to(device),
            tree_indices=self.tree_indices.to(device),
            position_ids=self.position_ids.to(device),
            retrieve_indices=self.retrieve_indices.to(device),
            path_lengths=self.path_lengths.to(device),
            parents=self.parents.to(device),
            topk=self.topk,
        )


def build_tree_buffers(choices: Sequence[Sequence[int]]) -> TreeBuffers:
    """Build the tree-attention buffers of ``medusa_choices`` (paper 2.1.2); a root-only tree for ``[]``.

    Raises ``ValueError`` for an invalid tree (see ``validate_tree``).
    """
    if choices:
        validate_tree(choices)
    paths = sorted((tuple(c) for c in choices), key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(paths)}
    n = len(paths) + 1
    topk = max([REFERENCE_TOPK] + [r + 1 for p in paths for r in p])

    attn_mask = torch.eye(n, dtype=torch.bool)
    attn_mask[:, 0] = True
    parents = [-1] * n
    tree_indices = [0] * n
    position_ids = [0] * n
    for p, i in index.items():
        for d in range(1, len(p)):
            attn_mask[i, index[p[:d]]] = True
        parents[i] = index[p[:-1]] if len(p) > 1 else 0
        tree_indices[i] = p[-1] + topk * (len(p) - 1) + 1
        position_ids[i] = len(p)

    # Leaf paths, reference order: walk the sorted list backwards, skip prefixes of rows taken.
    rows: list[list[int]] = []
    taken: set[Path_] = set()
    for p in reversed(paths):
        if p in taken:
            continue
        rows.append([0] + [index[p[:d]] for d in range(1, len(p) + 1)])
        taken.update(p[:d] for d in range(1, len(p) + 1))
    if not rows:
        rows = [[0]]
    width = max(len(r) for r in rows)
    retrieve = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        retrieve[r, : len(row)] = torch.tensor(row)
    return TreeBuffers(
        choices=tuple(paths),
        attn_mask=attn_mask,
        tree_indices=torch.tensor(tree_indices, dtype=torch.long),
        position_ids=torch.tensor(position_ids, dtype=torch.long),
        retrieve_indices=retrieve,
        path_lengths=torch.tensor([len(r) for r in rows], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        topk=topk,
    )
