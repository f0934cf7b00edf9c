"""The tree verified in one decoding step: the Medusa tree (paper 2.1.2) with an n-gram draft grafted on.

``static_tree`` turns ``medusa_choices`` into what a step needs on the device (attention bias, position
ids, paths), once per tree. ``graft`` adds a chain of drafted tokens (``drafts.NgramDrafter``) to a
step's tree: the chain follows the existing nodes whose tokens it repeats (siblings stay distinct
tokens, as exact sampling needs) and hangs the rest below the last shared node, after every existing
node, so the order stays parents-before-children and siblings in the order they are tried. Only the
new rows are computed; a step with nothing to graft reuses the static tree as it is.

Shape legend (as ``trees``): ``N`` nodes root included, ``P`` root-to-leaf paths, ``D`` depth,
``L`` grafted tokens. Every node has a source (``NODE_SOURCES``): the root (the backbone's own
token), a head (head k, rank r) or an n-gram copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .trees import build_tree_buffers

#: Where a tree node's token comes from (``StepRecord.node_sources``).
NODE_SOURCES = ("root", "head", "ngram")


@dataclass(frozen=True, eq=False)
class StepTree:
    """One step's tree, on the model's device, with host copies of what the records show.

    Attributes:
        name: the Medusa tree's name (``"baseline"``: root only).
        parents: [N] parent node index (-1 for the root).
        position_ids: [N] depth of each node (add the sequence length at run time).
        bias: [N, N] additive attention mask in the model's dtype: 0 where node i sees node j (itself,
            its ancestors), the dtype's minimum elsewhere.
        retrieve_indices: [P, D+1] node indices of each root-to-leaf path, padded with -1.
        path_nodes: [P, D] index into the N-1 non-root nodes (padding clamped to 0).
        path_valid: [P, D] bool, the position exists.
        tree_indices: [N0] where each static node's token is in ``[root, head0 top-k, ...]``.
        topk: candidates taken from every head; head_depth: heads the static tree uses.
        node_parents / node_heads / node_ranks / node_sources: host tuples [N]; n-gram nodes have
            head -1 and rank 0.
        children: host tuple [N] of each node's children, in the order they are tried.
    """

    name: str
    parents: torch.Tensor
    position_ids: torch.Tensor
    bias: torch.Tensor
    retrieve_indices: torch.Tensor
    path_nodes: torch.Tensor
    path_valid: torch.Tensor
    tree_indices: torch.Tensor
    topk: int
    head_depth: int
    node_parents: tuple[int, ...]
    node_heads: tuple[int, ...]
    node_ranks: tuple[int, ...]
    node_sources: tuple[str, ...]
    children: tuple[tuple[int, ...], ...]
    depth: int

    @property
    def num_nodes(self) -> int:
        """N, root included."""
        return len(self.node_parents)

    @functools.cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, D+1] ``ancestor_index`` of the tree, made once per tree (``processors.tree_prefixes``)."""
        return ancestor_index(self.parents, self.depth)

    @functools.cached_property
    def on_path(self) -> torch.Tensor:
        """[N, N] float32: 1 where node i sees node j (itself, its ancestors), else 0; ``on_path @ x`` sums x [N] along
        each node's path (``confident_nodes``). Made once per tree."""
        return (self.bias == 0).float()


def ancestor_index(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[N, D+1] node indices: each node, its parent, and so on up to the root, which repeats in the rows of
    shallower nodes. ``parents`` [N] (-1 for the root); ``depth`` D, the deepest node's depth."""
    up = parents.clamp(min=0)  # [N] the root is its own parent
    chain = [torch.arange(parents.shape[0], device=parents.device)]
    for _ in range(depth):
        chain.append(up[chain[-1]])
    return torch.stack(chain, dim=1)


def static_tree(name: str, choices: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> StepTree:
    """The ``StepTree`` of ``medusa_choices`` (``[]``: root only). Raises ``ValueError`` for an invalid tree."""
    b = build_tree_buffers(choices).to(device)
    bias = torch.zeros(b.attn_mask.shape, dtype=dtype, device=device)
    bias.masked_fill_(~b.attn_mask, torch.finfo(dtype).min)
    parents = tuple(b.parents.tolist())
    return StepTree(
        name=name, parents=b.parents, position_ids=b.position_ids, bias=bias, retrieve_indices=b.retrieve_indices,
        **_paths(b.retrieve_indices), tree_indices=b.tree_indices, topk=b.topk, head_depth=b.depth,
        node_parents=parents, node_heads=tuple(b.node_heads()), node_ranks=tuple(b.node_ranks()),
        node_sources=("root",) + ("head",) * (len(parents) - 1), children=_children(parents), depth=b.depth,
    )


def graft(
    tree: StepTree, tokens: list[int], chain: Sequence[int], build: Callable[[StepTree, int, int], StepTree] | None = None
) -> tuple[StepTree, list[int]]:
    """``tree`` with the drafted ``chain`` (tokens after the root) added, and the tokens of its nodes.

    Args:
        tree: the step's tree before grafting.
        tokens: [N] host token ids of its nodes, root first.
        chain: [L] drafted tokens, the first one following the root.
        build: what builds the grafted tree's structure from (tree, node, new nodes): ``hang`` (the default) or
            one that keeps what it built.

    Returns:
        (tree, tokens [N + new]): the chain walks down through nodes that already hold its tokens
        (they keep their source) and its remaining tokens become new nodes, appended in chain order
        (``hang``). ``tree`` itself when every token is already in it.
    """
    node, shared = 0, 0
    while shared < len(chain):
        match = next((c for c in tree.children[node] if tokens[c] == chain[shared]), None)
        if match is None:
            break
        node, shared = match, shared + 1
    rest = list(chain[shared:])
    return ((build or hang)(tree, node, len(rest)), tokens + rest) if rest else (tree, tokens)


def hang(tree: StepTree, node: int, new: int) -> StepTree:
    """``tree`` with a chain of ``new`` >= 1 n-gram nodes below ``node``, appended after every existing node: the
    structure ``graft`` gives (it depends on ``node`` and ``new`` only, not on the tokens)."""
    n = tree.num_nodes
    device = tree.parents.device
    parents = tree.node_parents + (node,) + tuple(range(n, n + new - 1))
    ancestry = [node]  # node, its parent, ..., the root
    while ancestry[-1] > 0:
        ancestry.append(tree.node_parents[ancestry[-1]])
    above = len(ancestry) - 1  # node's depth
    # New rows see the old node's ancestry and the chain up to themselves; old rows never see new nodes.
    sees = torch.zeros(n + new, n + new, dtype=torch.bool, device=device)
    sees[:n, :n] = tree.bias == 0
    sees[n:, :n] = sees[node, :n]
    sees[n:, n:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(sees.shape, dtype=tree.bias.dtype, device=device).masked_fill_(~sees, torch.finfo(tree.bias.dtype).min)
    path = ancestry[::-1] + list(range(n, n + new))  # the chain's path; the other paths are kept, padded wider
    old = tree.retrieve_indices
    width = max(old.shape[1], len(path))
    retrieve = torch.full((old.shape[0] + 1, width), -1, dtype=old.dtype, device=device)
    retrieve[:-1, : old.shape[1]] = old
    retrieve[-1, : len(path)] = torch.tensor(path, dtype=old.dtype, device=device)
    positions = torch.cat([tree.position_ids, torch.arange(above + 1, above + 1 + new, device=device)])
    grafted = StepTree(
        name=tree.name, parents=torch.tensor(parents, device=device), position_ids=positions, bias=bias,
        retrieve_indices=retrieve, **_paths(retrieve), tree_indices=tree.tree_indices, topk=tree.topk,
        head_depth=tree.head_depth, node_parents=parents, node_heads=tree.node_heads + (-1,) * new,
        node_ranks=tree.node_ranks + (0,) * new, node_sources=tree.node_sources + ("ngram",) * new,
        children=_children(parents), depth=max(tree.depth, above + new),
    )
    return grafted


def confident_nodes(tree: StepTree, log_p: torch.Tensor, min_probability: float) -> list[int]:
    """Nodes of ``tree`` whose path probability, the product of the heads' probabilities of the tokens from
    the root down to the node (``log_p`` [N]: each node's own log probability, 0 at the root), is at least
    ``min_probability``: a prefix-closed list, root first (a path probability never grows down a path).
    One host sync."""
    path_log_p = tree.on_path.to(log_p.dtype) @ log_p  # [N] Σ log p over each node's ancestors and itself
    return (path_log_p >= math.log(min_probability)).nonzero().flatten().tolist()


def prune(tree: StepTree, keep: Sequence[int]) -> StepTree:
    """The subtree of ``tree`` made of the nodes ``keep`` (sorted, root first, prefix-closed: every kept
    node's parent is kept), in the same order, so siblings keep the order they are tried in.
    ``tree`` itself when every node is kept."""
    if len(keep) == tree.num_nodes:
        return tree
    new = {old: i for i, old in enumerate(keep)}
    parents = (-1,) + tuple(new[tree.node_parents[i]] for i in keep[1:])
    children = _children(parents)
    rows = []
    for leaf in (i for i in range(len(keep)) if not children[i]):
        row = [leaf]
        while row[-1] > 0:
            row.append(parents[row[-1]])
        rows.append(row[::-1])
    device = tree.parents.device
    retrieve = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long, device=device)
    for r, row in enumerate(rows):
        retrieve[r, : len(row)] = torch.tensor(row, device=device)
    index = torch.tensor(list(keep), device=device)
    return StepTree(
        name=tree.name, parents=torch.tensor(parents, device=device), position_ids=tree.position_ids[index],
        bias=tree.bias[index][:, index], retrieve_indices=retrieve, **_paths(retrieve), tree_indices=tree.tree_indices[index],
        topk=tree.topk, head_depth=tree.head_depth, node_parents=parents,
        node_heads=tuple(tree.node_heads[i] for i in keep), node_ranks=tuple(tree.node_ranks[i] for i in keep),
        node_sources=tuple(tree.node_sources[i] for i in keep), children=children, depth=retrieve.shape[1] - 1,
    )


def _paths(retrieve: torch.Tensor) -> dict[str, torch.Tensor]:
    """``path_nodes`` and ``path_valid`` [P, D] of ``retrieve_indices`` [P, D+1]."""
    path = retrieve[:, 1:]
    return {"path_nodes": (path - 1).clamp(min=0), "path_valid": path > 0}


def _children(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Each node's children in index order, from parents [N]."""
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    return tuple(map(tuple, children))
