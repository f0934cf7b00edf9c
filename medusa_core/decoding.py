"""The decoding loop of ``MedusaModel.generate`` and the stages of one step (paper 2.1, 2.3.1).

A step: candidates from the heads (2.1.1, ``StepRunner.candidates``), shaped by their calibrated path
probabilities and optionally grafted with a prompt-lookup chain (``steptree``), one tree-attention pass
over all of them (2.1.2, ``tree_forward``), the sampling settings applied to every node's logits given
its own prefix (``processors``), acceptance (2.3.1, ``acceptance.verify_tree``) and the cache update
(``kvcache.compact_cache``). Step 0 is the prompt's reading (``prefill.read_prompt``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
from transformers import DynamicCache

from .acceptance import choose_token, verify_tree
from .generation import StepRecord, step_record
from .invariant import tree_row_keys
from .kvcache import compact_cache
from .lean.drafting import LeanDrafts
from .lean.step import LeanStep
from .prefill import ReadProgress, read_prompt
from .processors import tree_prefixes
from .steptree import StepTree, confident_nodes, graft, hang, prune


class StepRunner:
    """Runs the decoding steps of a ``MedusaModel`` (``generate`` checks the arguments and calls ``run``).

    Args:
        model: the ``MedusaModel``: its backbone (decoder and LM head), heads with their temperatures
            ``head_temperatures``, trees, stopping rules and cache.

    Attributes ``decoder``, ``lm_head``, ``draft_logits`` (heads(hidden [..., H], num_heads) -> [k, ..., S]),
    ``head_dtype`` and ``temperatures`` ([K, 1]) are the parts a step uses; ``bench.stepsplit`` times the stages.
    ``lean`` is the compiled decoding pass (``medusa_core.lean``) when the backbone has one, else None, with
    ``lean_reason`` saying why; ``lean_drafts`` the compiled proposal of the heads (``medusa_core.lean.drafting``)
    or None, with ``lean_drafts_reason``; ``extension`` the compiled module either of them loaded, else None;
    ``report`` (optional) is told when they are compiled (a first start).
    """

    def __init__(self, model: Any, report: Callable[[str], None] | None = None):
        self.model = model
        backbone, heads = model.backbone, model.heads
        self.lean, self.lean_reason = LeanStep.for_backbone(backbone, report)
        self.decoder = backbone.get_decoder()
        self.lm_head = backbone.get_output_embeddings()
        self.temperatures = torch.tensor(model.head_temperatures, device=model.device)[:, None]  # [K, 1]
        # Heads may run in a cheaper dtype than the backbone: they only propose, the backbone verifies.
        self.head_dtype = next(heads.parameters(), backbone.get_input_embeddings().weight).dtype
        self.draft_logits = getattr(heads, "draft_logits", heads)
        self.lean_drafts, self.lean_drafts_reason = LeanDrafts.for_heads(heads, report)  # compiled proposal, or why not
        # the extension either of them loaded (corpus chains use it too)
        self.extension = next((part.module for part in (self.lean, self.lean_drafts) if part is not None), None)
        self._derived_trees: dict[tuple, StepTree] = {}  # pruned and grafted trees (``pruned``, ``grafted``)

    def run(
        self, input_ids, max_new_tokens, full, processors, eps, alpha, seed, rule, drafter, drafts, shape_at, reading
    ) -> Iterator[StepRecord | ReadProgress]:
        """The steps of one reply, as ``MedusaModel.generate`` returns them: step 0 reads ``input_ids`` [1, T]
        (after ``ReadProgress`` records when ``reading["progress"]`` and the prompt takes several chunks) and
        emits its first token; then one ``StepRecord`` per step until a stop reason.

        ``full``: the static tree (None: plain decoding); ``processors``: the sampling settings applied to every
        node's logits; ``eps``, ``alpha``: ε and δ of typical acceptance (paper 2.3.1); ``rule``: "greedy",
        "typical", "exact" or "sample"; ``seed``: the reply's generator seed; ``drafter``: the n-gram drafter
        (None without one); ``drafts``: the draft source ("" with Medusa off); ``shape_at``: τ, the path
        probability a head node needs (0: no shaping); ``reading``: ``{"kept", "progress", "chunk"}``.
        """
        root_only = self.model._tree("baseline")
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        kept = reading["kept"]
        cur_len = input_ids.shape[1]  # tokens in the cache; the root (last token emitted) is not yet
        # The distinct ids of the prompt and the reply so far: what a repetition penalty looks at.
        seen = dict.fromkeys(input_ids[0].tolist()) if processors.needs_prefix else {}
        context = torch.tensor(list(seen), dtype=torch.long, device=self.model.device)  # [C] grown by each step's new ids
        start = time.perf_counter()
        with torch.inference_mode():
            cache, reused = kept.take(self.model, self.model._new_cache, input_ids[0].tolist()) if kept else (self.model._new_cache(), 0)
        widest = full.num_nodes if full is not None else 1
        room = (min(cur_len + max_new_tokens, self.model.max_context) + widest, self.model.max_context + widest)  # this reply, any reply
        observing = hasattr(drafter, "observe")  # a drafter that reads the accepted tokens' states (medusa_core.eagle)
        hidden = yield from read_prompt(self.decoder, cache, input_ids, reused, reading["chunk"], room, kept, reading["progress"],
                                        all_states=observing, lean=self.lean)
        prompt_states, hidden = (hidden, hidden[-1:]) if observing else (None, hidden)
        with torch.inference_mode():
            scores = processors(self.logits(hidden), input_ids)  # [1, V]
            root = choose_token(scores[0], rule == "greedy", generator)  # [] first token
            first = root.item()
            if observing:  # each position read, with the token after it
                drafter.observe(prompt_states, input_ids[0, reused + 1 :].tolist() + [first])
        self.model._sync()
        prefill_s = time.perf_counter() - start
        # Step 0 is the prefill: its token goes out at once (time to first token = prefill time).
        medusa = full is not None
        limits = dict(medusa=medusa, rule=rule, max_new_tokens=max_new_tokens, drafts=drafts,
                      eos_token_ids=self.model.eos_token_ids, max_context=self.model.max_context)
        record = step_record(0, root_only, (0,), [first], [first], prefill_s, produced=0, cur_len=cur_len, **limits)
        yield record
        while record.stop_reason is None:
            start = time.perf_counter()
            remaining = max_new_tokens - record.total_tokens
            tree = full if medusa and remaining > 1 and cur_len + full.num_nodes <= self.model.max_context else root_only
            new_ids = [t for t in dict.fromkeys(record.token_ids) if t not in seen] if processors.needs_prefix else []
            if new_ids:  # the context's ids before the root, root included
                seen.update(dict.fromkeys(new_ids))
                context = torch.cat([context, torch.tensor(new_ids, device=self.model.device)])
            chain = []
            if drafter is not None:
                drafter.extend(record.token_ids)  # the context now ends with the root
                if tree is full:  # room for a chain: the token limit and the context window cap it
                    chain = drafter.propose(min(remaining - 1, self.model.max_context - cur_len - tree.num_nodes))
                    if drafter.verify_alone:  # a long copy or a corpus chain: verify it alone
                        tree = self.model._tree("ngram")
            with torch.inference_mode():
                tokens, log_p = self.candidates(tree, hidden, root, shape_at > 0)  # [N], [N] or None
                if log_p is not None:  # keep the nodes whose path probability reaches shape_at (host sync)
                    keep = confident_nodes(tree, log_p, shape_at)
                    tree, tokens = self.pruned(tree, keep), tokens[keep] if len(keep) < tokens.shape[0] else tokens
                if chain:  # host sync of N tokens: the chain shares the nodes that hold its tokens
                    tree, token_ids = self.grafted(tree, tokens.tolist(), chain)
                    tokens = torch.tensor(token_ids, device=self.model.device) if tree.num_nodes > tokens.shape[0] else tokens
                logits, hidden_all = self.tree_forward(tree, tokens, cur_len, cache)  # [N, V], [N, H]
                prefixes = tree_prefixes(context, tokens, tree.ancestors) if processors.needs_prefix else None
                scores = processors(logits, prefixes)  # [N, V] each node's distribution given its own prefix
                path, length, root = verify_tree(tree, scores, tokens, rule, eps, alpha, generator)
                host = torch.cat([length.view(1), root.view(1), path, tokens]).tolist()  # the step's one host sync (top-p: two)
                nodes, token_list = host[2 : host[0] + 3], host[2 + path.shape[0] :]
                compact_cache(cache, cur_len, nodes, tree.num_nodes)
                hidden = hidden_all[nodes[-1] : nodes[-1] + 1]
                if observing:  # the accepted rows, each with the token after it (the last: the new root)
                    drafter.observe(hidden_all[nodes], [token_list[i] for i in nodes[1:]] + [host[1]])
            if kept is not None:  # the entries now held: the root and the accepted candidates
                kept.token_ids += [token_list[i] for i in nodes]
            cur_len += len(nodes)
            # The accepted candidates, then the token chosen after them: the next step's root.
            new_tokens = [token_list[i] for i in nodes[1:]] + [host[1]]
            record = step_record(record.step + 1, tree, tuple(nodes), token_list, new_tokens, time.perf_counter() - start,
                                 produced=record.total_tokens, cur_len=cur_len, **limits)
            yield record

    @contextlib.contextmanager
    def transformers_pass(self) -> Iterator[None]:
        """Within the block every pass runs transformers' forward, not the lean one (before/after figures)."""
        lean, self.lean = self.lean, None
        try:
            yield
        finally:
            self.lean = lean

    def candidates(
        self, tree: StepTree, hidden: torch.Tensor, root: torch.Tensor, with_log_p: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [N] of a static tree: the root, then each node's rank in its head's top-k (paper 2.1.1),
        and with ``with_log_p`` each node's calibrated log probability under its head k,
        log_softmax(logits_k / T_k) ([N], 0 at the root; T_k from ``head_temperatures``).

        Heads run only at the last accepted position ``hidden`` [1, H] and only the tree's depth of them,
        over their draft vocabulary (S token ids, ``MedusaHeads.restrict_drafts``; the probabilities are then
        normalised over those S tokens), through ``lean_drafts`` where it runs (the same ranks but at near-ties;
        the values within bfloat16 rounding of the ATen path's).
        """
        if tree.num_nodes == 1:
            return root.view(1), None
        depth = tree.head_depth
        if self.lean_drafts is not None:  # the same ranks in two compiled calls (medusa_core.lean.drafting)
            columns, log_p = self.lean_drafts.top(hidden, root, depth, tree.topk, self.temperatures)  # [D, topk] each
        else:
            rooted = {"root": root.view(1)} if getattr(self.model.heads, "root_conditioned", False) else {}  # layout "root"
            head_logits = self.draft_logits(hidden.to(self.head_dtype), num_heads=depth, **rooted)[:, 0]  # [D, S]
            top = head_logits.topk(tree.topk, dim=-1)  # [D, topk]
            columns, log_p = top.indices, None
            if with_log_p:  # T_k > 0 keeps every rank
                scaled = head_logits.float() / self.temperatures[:depth]  # [D, S]
                log_p = top.values.float() / self.temperatures[:depth] - scaled.logsumexp(dim=-1, keepdim=True)  # [D, topk]
        draft_ids = getattr(self.model.heads, "draft_ids", None)  # a frequency-ranked draft vocabulary's token ids
        ranked = columns.flatten() if draft_ids is None else draft_ids[columns.flatten()]
        tokens = torch.cat([root.view(1), ranked])[tree.tree_indices]
        if not with_log_p:
            return tokens, None
        return tokens, torch.cat([log_p.new_zeros(1), log_p.flatten()])[tree.tree_indices]

    def pruned(self, tree: StepTree, keep: list[int]) -> StepTree:
        """``steptree.prune(tree, keep)``, built once per (tree, kept nodes)."""
        return self._built_once((tree, "prune", tuple(keep)), lambda: prune(tree, keep))

    def grafted(self, tree: StepTree, tokens: list[int], chain: list[int]) -> tuple[StepTree, list[int]]:
        """``steptree.graft(tree, tokens, chain)``, each grafted tree built once per (tree, node, new nodes)."""
        return graft(tree, tokens, chain, lambda *key: self._built_once((*key, "hang"), lambda: hang(*key)))

    def _built_once(self, key: tuple, build: Callable[[], StepTree]) -> StepTree:
        """The tree ``build`` makes, kept under ``key`` (which holds the tree it derives from, so that no other
        tree can take its place)."""
        if key not in self._derived_trees:
            if len(self._derived_trees) > 4096:  # shapes of a few small trees: this bound is never reached in practice
                self._derived_trees.clear()
            self._derived_trees[key] = build()
        return self._derived_trees[key]

    def tree_forward(
        self, tree: StepTree, tokens: torch.Tensor, cur_len: int, cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One backbone pass over all N tree tokens (paper 2.1.2); appends N entries to the cache.

        Returns (logits [N, V], final-norm hidden states [N, H]).
        """
        n = tree.num_nodes
        positions = tree.position_ids + cur_len
        # A single token attends to everything: the model's own causal mask is right. The lean step's row kernel
        # reads a tree's rows from its shape; everything else reads the tree mask [1, 1, N, cur_len + N].
        by_shape = n > 1 and getattr(self.lean, "row_kernel", False)
        mask = _tree_mask(tree, cur_len) if n > 1 and not by_shape else None
        rows = tree_row_keys(tree.node_parents, cur_len) if by_shape else None
        hidden = self.lean(tokens, positions, mask, cache, rows) if self.lean is not None else None  # the same bits
        if hidden is None:
            if by_shape:
                mask = _tree_mask(tree, cur_len)
            out = self.decoder(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask, use_cache=True, cache=cache)
            hidden = out.last_hidden_state[0]  # [N, H]
        return self.logits(hidden), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Backbone logits of final-norm hidden states [..., H] -> [..., V], through the backbone's LM
        head (on a CPU a batch-invariant one: ``medusa_core.invariant``, so a row's logits do not depend
        on how many rows the pass has)."""
        logits = self.lm_head(hidden)
        # Gemma-2/3 soft-cap their logits inside the CausalLM forward (transformers 5.x); argmax is unchanged.
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _tree_mask(tree: StepTree, cur_len: int) -> torch.Tensor:
    """The additive mask [1, 1, N, cur_len + N] of a tree pass after ``cur_len`` cached entries (paper 2.1.2)."""
    prefix = torch.zeros(tree.num_nodes, cur_len, dtype=tree.bias.dtype, device=tree.bias.device)
    return torch.cat([prefix, tree.bias], dim=1)[None, None]
