"""Verification of candidate paths: greedy exact match, typical acceptance (paper 2.3.1) and exact
rejection sampling over the tree (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al. 2024).

Pure functions on tensors. ``evaluate_posterior`` takes the per-path layout of the reference; the
decode loop scores each tree node once (``score_children``) and reads paths out of that with
``select_path``, which is the same arithmetic without gathering ``[P, D+1, V]`` logits.
``try_children`` and ``residual_distributions`` are the per-node rule of exact sampling; the engine
walks the tree with them (``verify_tree``, the per-step verification the engine calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def score_children(
    logits: torch.Tensor,
    parent_rows: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    posterior_threshold: float,
    posterior_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge each candidate token against the backbone distribution at its parent.

    Args:
        logits: [M, V] backbone logits, or processed scores (``NodeProcessors``, -inf where a filter
            removed a token; pass temperature 1 when they are already divided by T); row m predicts
            the token after position m.
        parent_rows: [C] row of ``logits`` that judges each candidate.
        tokens: [C] candidate token ids.
        temperature: 0 for greedy exact match, > 0 for typical acceptance.
        posterior_threshold: ε, the hard threshold of typical acceptance.
        posterior_alpha: δ, the entropy-dependent threshold factor.

    Returns:
        (accepted [C] bool, log_prob [C] float32): greedy accepts the argmax; typical acceptance
        accepts x when ``p(x) > min(ε, δ·exp(−H(p)))`` with p = softmax(logits / T) (paper 2.3.1).
        ``log_prob`` is log p(x) (zeros when greedy).
    """
    if temperature <= 0:
        accepted = logits.argmax(dim=-1)[parent_rows] == tokens
        return accepted, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)  # [M, V]
    p = log_p.exp()
    entropy = -torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(dim=-1)  # [M]; 0·log 0 = 0 (filtered tokens)
    token_log_p = log_p[parent_rows, tokens]  # [C]
    threshold = torch.minimum(
        torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy)
    )[parent_rows]
    return token_log_p.exp() > threshold, token_log_p


def select_path(
    accepted: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the path to keep from per-position acceptance, on the device (no host sync).

    Args:
        accepted: [P, D] bool, candidate at depth j+1 of path p accepted.
        log_prob: [P, D] log p of those candidates.
        valid: [P, D] bool, position exists (paths shorter than D are padded).
        temperature: 0 → the first path with the longest accepted prefix; > 0 → among the longest,
            the largest sum of log p over the accepted prefix; path 0 when nothing is accepted
            (every path then scores 0 and ``argmax`` returns the first maximum).

    Returns:
        (best_path, accept_length): 0-dim long tensors on ``accepted``'s device.
    """
    prefix = torch.cumprod((accepted & valid).to(torch.int32), dim=1)  # [P, D]
    lengths = prefix.sum(dim=1)  # [P]
    if temperature <= 0:
        best = torch.argmax(lengths)  # argmax returns the first maximum
    else:
        score = torch.where(prefix.bool(), log_prob, torch.zeros_like(log_prob)).sum(dim=1)  # [P]
        score = torch.where(lengths == lengths.max(), score, torch.full_like(score, float("-inf")))
        best = torch.argmax(score)
    return best, lengths.gather(0, best.view(1))[0]  # gather: indexing by a 0-dim tensor would sync


def evaluate_posterior(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    temperature: float,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    path_lengths: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Choose the best candidate path (paper 2.3.1).

    Args:
        logits: [P, D+1, V] backbone logits along each path; position j predicts position j+1.
        candidates: [P, D+1] token ids of each path, root first.
        temperature: 0 → greedy exact match; > 0 → typical acceptance.
        posterior_threshold: ε (default 0.09).
        posterior_alpha: δ (default 0.3).
        path_lengths: [P] valid nodes of each path, root included (default: all D+1 valid).

    Returns:
        (best_candidate, accept_length): the chosen path index and the number of its candidates
        after the root that are accepted (0..D).
    """
    num_paths, width, vocab = logits.shape
    rows = torch.arange(num_paths * width, device=logits.device).view(num_paths, width)[:, :-1]
    accepted, log_prob = score_children(
        logits.reshape(-1, vocab),
        rows.reshape(-1),
        candidates[:, 1:].reshape(-1),
        temperature,
        posterior_threshold,
        posterior_alpha,
    )
    if path_lengths is None:
        valid = torch.ones(num_paths, width - 1, dtype=torch.bool, device=logits.device)
    else:
        valid = torch.arange(1, width, device=logits.device)[None, :] < path_lengths[:, None]
    best, length = select_path(accepted.view(num_paths, -1), log_prob.view(num_paths, -1), valid, temperature)
    return int(best), int(length)


def try_children(
    probs: torch.Tensor, parent_rows: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Recursive rejection sampling of point-mass drafts: which candidate each parent accepts.

    The candidates of one parent are tried in the order they are listed (the tree's rank order).
    Candidate x is accepted with probability ``p_res(x)``, p_res being the parent's distribution with
    the earlier, rejected siblings' tokens set to 0 and renormalised; the first accepted sibling wins.
    Drawing every candidate's uniform up front (used or not) gives the same law as trying them one by
    one, and needs no loop: candidate c is accepted *if tried* when
    ``u_c · (1 − Σ_{earlier siblings s} p(x_s)) < p(x_c)``, and tried when no earlier sibling was.

    Args:
        probs: [M, V] target distributions p = softmax(logits / T) (rows sum to 1).
        parent_rows: [C] row of ``probs`` at each candidate's parent.
        tokens: [C] candidate token ids; siblings hold distinct tokens (distinct ranks of one top-k).
        uniforms: [C] independent U[0, 1) draws, one per candidate.

    Returns:
        [C] bool: True for the one candidate each parent accepts (at most one per parent).
    """
    c = torch.arange(tokens.shape[0], device=tokens.device)
    earlier = ((parent_rows[:, None] == parent_rows[None, :]) & (c[None, :] < c[:, None])).to(probs.dtype)  # [C, C]
    p = probs[parent_rows, tokens]  # [C] p(x_c) under the parent's distribution
    mass_left = (1 - earlier @ p).clamp(min=0)  # [C] mass not yet rejected
    passes = uniforms * mass_left < p  # [C] accepted if tried
    return passes & ~(earlier @ passes.to(probs.dtype) > 0)  # float matmul: CUDA has no integer one


def residual_distributions(probs: torch.Tensor, parent_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's distribution with all its candidates' tokens removed (unnormalised).

    After every candidate of a node is rejected (or at a leaf, which has none), the step's last token
    is drawn from this residual: together with the accepted candidates it makes the token at that
    position distributed exactly as p (see ``verify_tree``).

    Args:
        probs: [M, V] target distributions.
        parent_rows: [C] row of each candidate's parent.
        tokens: [C] candidate token ids.

    Returns:
        [M, V] float: ``probs`` with ``[parent_rows[c], tokens[c]]`` set to 0; ``draw`` normalises it.
        A row is all zero only if its candidates held all of p's mass.
    """
    return probs.index_put((parent_rows, tokens), torch.zeros((), dtype=probs.dtype, device=probs.device))


#: Status of a tree node after exact sampling (``StepRecord.node_status``).
NODE_STATUSES = ("accepted", "rejected", "untried")


def node_status(parents: Sequence[int], nodes: Sequence[int]) -> tuple[str, ...]:
    """Each node's fate in one exact-sampling walk, from the tree and the accepted path.

    Args:
        parents: [N] parent node index of every node (-1 for the root); siblings appear in the
            order they were tried (rank order).
        nodes: node indices of the accepted path, root first.

    Returns:
        [N] ``"accepted"`` (on the path, the root included), ``"rejected"`` (tried and rejected: the
        siblings before an accepted node, and every child of the path's last node) or ``"untried"``.
    """
    status = ["untried"] * len(parents)
    next_on_path = dict(zip(nodes, list(nodes[1:]) + [None]))  # path node -> its accepted child
    for n in nodes:
        status[n] = "accepted"
    for c, a in enumerate(parents):
        if a in next_on_path and status[c] != "accepted":
            taken = next_on_path[a]
            if taken is None or c < taken:
                status[c] = "rejected"
    return tuple(status)


def verify_tree(
    tree, scores: torch.Tensor, tokens: torch.Tensor, rule: str, eps: float, alpha: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a path of a tree step and choose the next step's root (paper 2.3.1; exact sampling below).

    Args:
        tree: the step's ``steptree.StepTree`` (N nodes).
        scores: [N, V] the tree forward's logits after ``NodeProcessors`` (each node's distribution is
            softmax(scores) given its own prefix; greedy takes the argmax).
        tokens: [N] the nodes' tokens.
        rule: one of ``generation.SAMPLING_RULES``.
        eps, alpha: ε and δ of typical acceptance.

    Returns (path [D+1] node indices of a root-to-leaf path padded with -1, accept_length [] of its
    accepted candidates, next root []), all on the device: the caller syncs once. Where the compiled kernels load
    (``SAMPLING_KERNELS``) the greedy and the exact walk on a CPU are one call (``sampling.h`` tree_walk: the same rule
    from the same uniforms, reading only the walked rows; greedy walks into the child holding its parent's argmax, the
    one longest accepted prefix where siblings hold distinct tokens, as in every tree the engine builds).

    Exact sampling (Leviathan et al. 2023, "Fast inference from transformers via speculative
    decoding", and Chen et al. 2023, "Accelerating LLM decoding with speculative sampling", for
    one draft; SpecInfer, Miao et al. 2024, and multi-draft speculative sampling for a tree).
    A step starts at the root, a token already drawn from the backbone's distribution (from the
    prompt's logits, or the previous step's bonus token). At the current node, with target p =
    softmax(processed logits) of the backbone there (``NodeProcessors`` given the node's prefix),
    its children x_1, x_2, ... (distinct tokens: ranks of one head's top-k, or a chain's one draft) are tried
    in rank order. The drafts (heads, n-gram or corpus chains, the drafter's) are deterministic given the
    prefix, i.e. point-mass drafts q(x_i) = 1, so the speculative-sampling test
    ``u < min(1, p(x)/q(x))`` becomes ``u < p_res(x_i)``, with p_res the residual: p with the
    tokens of the already rejected siblings set to 0 and renormalised. On rejection x_i leaves the
    residual. If a child is accepted the walk moves to it; if every child is rejected (or the node
    is a leaf) the step's last token, the bonus, is drawn from the residual at that node and
    becomes the next step's root. Why the token after a node is distributed as p: x_1 comes out
    with probability p(x_1); x_i with probability Π_{j<i}(1 − p_res,j(x_j)) · p_res,i(x_i) =
    (1 − Σ_{j<i} p(x_j)) · p(x_i) / (1 − Σ_{j<i} p(x_j)) = p(x_i); and any other y with
    probability (1 − Σ_j p(x_j)) · p(y) / (1 − Σ_j p(x_j)) = p(y). An accepted child's node holds
    the backbone's logits given exactly that prefix, so by induction over positions the whole
    reply follows plain sampling; stopping rules (EOS, token limit) only cut it. The uniforms of
    all candidates are drawn up front, which leaves the law unchanged (``try_children``).
    """
    path0 = tree.retrieve_indices[0]  # [D+1]
    greedy = rule == "greedy"
    if tree.num_nodes == 1:  # root only: the next token is the argmax or a sample of p
        return path0, path0.new_zeros(()), choose_token(scores[0], greedy, generator)
    rows, cands = tree.parents[1:], tokens[1:]  # [N-1] each candidate's parent and token
    exact = rule == "exact"
    uniforms = torch.rand(cands.shape, generator=generator, device=scores.device) if exact else None  # [N-1]
    if (greedy or exact) and _compiled(scores):  # the same walk (and residual draw) in one call, reading the walked rows
        u = _uniform(generator, scores.device) if exact else 0.0
        out = SAMPLING_KERNELS["tree_walk"](scores.contiguous(), tree.parents, tokens, tree.retrieve_indices,
                                            uniforms if exact else _NO_UNIFORMS, u, greedy)  # [2 + D + 1]
        return out[2:], out[0], out[1]  # path, length, next root
    if exact:
        probs = torch.softmax(scores, dim=-1)  # [N, V]
        taken = try_children(probs, rows, cands, uniforms)  # [N-1], at most one child per node
        walk = taken[tree.path_nodes]  # [P, D]
        # Every longest accepted prefix is the same walk (one child per node): the first such path will do.
        best, length = select_path(walk, torch.zeros(walk.shape, device=walk.device), tree.path_valid, 0.0)
        path = tree.retrieve_indices.index_select(0, best.view(1))[0]  # [D+1]
        last = path.gather(0, length.view(1))  # [1]
        # Only the last node's residual is drawn from: row 0 is its p, row 1 a scratch copy for the other candidates.
        pair = probs.index_select(0, torch.cat([last, last]))  # [2, V]
        residual = residual_distributions(pair, (rows != last).long(), cands)[0]  # [V]
        # All zero only if float rounding rejected a child holding all the mass left: fall back to p.
        residual = torch.where(residual.sum() > 0, residual, probs.index_select(0, last)[0])
        return path, length, draw(residual, generator)
    temperature = 0.0 if greedy else 1.0  # the scores are already divided by T
    accepted, log_prob = score_children(scores, rows, cands, temperature, eps, alpha)  # [N-1]
    best, length = select_path(accepted[tree.path_nodes], log_prob[tree.path_nodes], tree.path_valid, temperature)
    path = tree.retrieve_indices.index_select(0, best.view(1))[0]  # [D+1]
    last = path.gather(0, length.view(1))  # [1]
    return path, length, choose_token(scores.index_select(0, last)[0], greedy, generator)


#: The compiled sampling calls (``medusa_core.lean`` ``sampling.h``): ``draw_index(values [V], u, logits)`` for ``draw``
#: and ``choose_token``, ``tree_walk(scores, parents, tokens, retrieve, uniforms, u, greedy)`` for ``verify_tree``'s
#: greedy and exact walks; set by ``invariant.load_kernel`` where the kernels build, empty elsewhere (the ATen ops below).
SAMPLING_KERNELS: dict[str, Callable[..., Any]] = {}
_NO_UNIFORMS = torch.empty(0)  # a greedy walk's uniforms


def choose_token(scores: torch.Tensor, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """The next token from processed scores [V]: the argmax, or a sample of softmax(scores); a 0-d
    tensor on the scores' device (no host sync, but for the compiled draw on a CPU)."""
    if greedy:
        return scores.argmax()
    if _compiled(scores):  # softmax's weights, in one call
        return _drawn(SAMPLING_KERNELS["draw_index"](scores.contiguous(), _uniform(generator, scores.device), True))
    return draw(torch.softmax(scores, dim=-1), generator)


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index i drawn with probability ``weights[i] / weights.sum()``, by the inverse of the cumulative
    distribution: one uniform, a float64 cumulative sum, a binary search. ``torch.multinomial`` draws one
    exponential per entry even for a single sample (2 ms for 49,152 on this project's CPU, against 0.06).
    Where the compiled kernels load (``SAMPLING_KERNELS``), float32 weights on a CPU take one call that sums them 16
    at a time and walks one block (``sampling.h`` draw_index: the same law up to float rounding, from the same uniform).

    Args:
        weights: [V] finite, >= 0, not all zero (need not sum to 1).

    Returns a 0-d long tensor on ``weights``' device (no host sync but for the compiled draw); an index of zero
    weight is never drawn.
    """
    if _compiled(weights):
        return _drawn(SAMPLING_KERNELS["draw_index"](weights.contiguous(), _uniform(generator, weights.device), False))
    cumulative = weights.cumsum(0, dtype=torch.float64)  # [V]
    total = cumulative[-1:]  # [1]
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=weights.device) * total  # [1] in [0, total)
    index = torch.searchsorted(cumulative, u, right=True)  # first entry whose cumulative sum exceeds u
    last = torch.searchsorted(cumulative, total)  # the last entry of nonzero weight: where u * total rounds up to it
    return torch.minimum(index, last)[0]


def _uniform(generator: torch.Generator, device: torch.device) -> float:
    """The one uniform in [0, 1) a draw takes from ``generator`` (as ``draw`` takes it)."""
    return float(torch.rand(1, dtype=torch.float64, generator=generator, device=device))


def _drawn(index: int) -> torch.Tensor:
    """A compiled call's index as ``draw`` returns it: a 0-d long tensor (on the CPU, where those calls run)."""
    return torch.tensor(index, dtype=torch.long)


def _compiled(values: torch.Tensor) -> bool:
    """Whether the compiled sampling calls take ``values`` (loaded, float32 on a CPU)."""
    return bool(SAMPLING_KERNELS) and values.device.type == "cpu" and values.dtype == torch.float32
