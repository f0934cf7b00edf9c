"""The Medusa decoding engine: a Hugging Face causal LM, Medusa heads and tree decoding (paper 2.1, 2.3.1).

One decoding step reads like the paper: candidates from the heads (2.1.1), optionally with a chain of
tokens copied from the context by prompt lookup grafted into the same tree (``drafts``, ``steptree``:
the drafts are one more source of tree nodes, not a second loop), one tree-attention forward pass
over all candidates (2.1.2), the sampling settings applied to every node's logits given
that node's own prefix (``processors``: HF ``generate``'s repetition penalty, temperature, top-k,
top-p, min-p), acceptance (2.3.1: greedy, typical, or exact rejection sampling after Leviathan et al.
2023 / Chen et al. 2023) on those processed distributions, and cache compaction so only the
accepted path's K/V entries stay. Plain autoregressive decoding (``medusa=False``) is the same loop
with a root-only tree, so both modes share cache, stopping rules and timing.

Tree attention goes only through the model's public inputs: a 4-D additive attention mask,
``position_ids`` and its own ``DynamicCache``; no modelling code is copied. What the model is (device, widths,
context, default tree and settings, ``describe``) is its base class's, ``model_facts.ModelFacts``; its corpus of its
own replies is made by ``corpus.LazyCorpus``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from .corpus import LazyCorpus
from .decoding import StepRunner
from .datastore import Datastore
from .drafts import DraftConfig, NgramDrafter
from .eagle import EagleDrafter, EagleDrafts
from .generation import CHAIN_SOURCES, StepRecord, check_generate_args, check_head_temperatures, eos_ids
from .heads import _dense_weight
from .kvcache import new_cache
from .lean.build import load_extension
from .model_facts import ModelFacts
from .prefill import PREFILL_CHUNK, ConversationCache, ReadProgress
from .processors import NodeProcessors, SamplingConfig
from .quant.layers import Int4Linear
from .steptree import StepTree, static_tree
from .trees import resolve_tree, validate_tree
from .tuned import TunedSettings


class MedusaModel(ModelFacts):
    """A frozen Hugging Face decoder-only model with Medusa heads (paper 2.1).

    Args:
        backbone: a ``transformers`` causal LM whose attention takes a 4-D mask (Llama, Mistral,
            Qwen2, Gemma, Phi-3, ...), possibly quantized with bitsandbytes.
        heads: ``MedusaHeads`` (or any module with ``num_heads`` and ``heads(hidden [B, H],
            num_heads) -> [k, B, V]``; heads whose ``root_conditioned`` is true also get ``root=`` [B],
            the step's root token).
        tokenizer: optional; kept for callers (the app) and never used by the engine, which works on ids.
        name / base_model / quantization: descriptive, shown by UIs.
        trees: the model's own named trees (calibrated or machine-tuned), listed before the presets.
        default_tree: name of the tree used when ``generate(tree=None)``.
        rank_accuracy: the heads' calibrated rank accuracies ``[K][ranks]``, if known.
        head_temperatures: [K] temperature T_k of each head (temperature scaling, Guo et al. 2017, "On
            calibration of modern neural networks"; fitted by ``train.fit_temperature``): a node's
            probability under head k is softmax(logits_k / T_k), which shapes trees per step. None: 1.0
            for every head (the raw softmax). Ranks, hence the candidates, do not depend on it.
        min_head_probability: τ, the path probability a head node needs to be verified when
            ``generate``'s ``draft_config`` leaves it unset (``bench tune``'s choice; 0 = every node).
        tuned: ``bench tune``'s choices per settings preset (``medusa_core.tuned``): a reply's settings
            take their preset's tree when ``generate(tree=None)`` and its τ when ``draft_config`` leaves it unset.
        corpus: an index of this backbone's own replies (``datastore.Datastore``), or a function that makes it
            (called once, at the first ``generate(drafts="corpus")``, which drafts chains from it); None: the model
            has none (that draft source then raises ``ValueError``).
        report: told of slow first-start work (compiling the lean decoding step, ``medusa_core.lean``).

    Raises ``ValueError`` when the heads do not match the backbone's hidden size, when one of
    ``trees`` or ``default_tree`` does not fit the model (see ``resolve_tree``), when
    ``head_temperatures`` has not one finite value > 0 per head, or ``min_head_probability`` is outside [0, 1].
    """

    def __init__(
        self,
        backbone: nn.Module,
        heads: nn.Module,
        tokenizer: Any = None,
        *,
        name: str | None = None,
        base_model: str | None = None,
        quantization: str | None = None,
        trees: dict[str, list[list[int]]] | None = None,
        default_tree: str | None = None,
        rank_accuracy: list[list[float]] | None = None,
        head_temperatures: Sequence[float] | None = None,
        min_head_probability: float = 0.0,
        tuned: Mapping[str, TunedSettings] | None = None,
        corpus: Datastore | Callable[[], Datastore] | None = None,
        report: Callable[[str], None] | None = None,
    ):
        self.backbone = backbone.eval()
        self.heads = heads.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(backbone.config, "_name_or_path", "model")
        self.base_model = base_model or self.name
        self.quantization = quantization
        self.trees = dict(trees or {})
        self.rank_accuracy = rank_accuracy
        self.config = backbone.config.get_text_config(decoder=True)
        hidden = getattr(heads, "hidden_size", self.config.hidden_size)
        if hidden != self.config.hidden_size:
            raise ValueError(
                f"Medusa heads expect hidden size {hidden}, the backbone has {self.config.hidden_size}"
            )
        self.eos_token_ids = eos_ids(backbone)
        self.head_temperatures = check_head_temperatures(head_temperatures, heads.num_heads)
        if not 0 <= min_head_probability <= 1:
            raise ValueError(f"min_head_probability must be in [0, 1], got {min_head_probability}")
        self.min_head_probability = float(min_head_probability)
        self.tuned = dict(tuned or {})
        self._corpus = LazyCorpus(corpus)
        self._trees: dict[str, StepTree] = {}
        self._default_tree = default_tree
        for tree in [*self.trees, *([default_tree] if default_tree else []), *(t.tree for t in self.tuned.values())]:
            try:
                self.resolve_tree(tree)
            except ValueError as e:
                raise ValueError(f"the model's tree {tree!r} does not fit: {e}") from None
        self._steps = StepRunner(self, report)  # the decoding loop and the stages of a step (``medusa_core.decoding``)
        self._drafter = None  # (EagleDrafter, projection [S, H], draft ids [S] or None): ``load_drafter``

    def load_drafter(self, path) -> None:
        """Give the model an EAGLE-style drafter (``medusa_core.eagle``; ``generate(drafts="eagle")``) from a
        safetensors file; it drafts among the heads' draft vocabulary through the backbone's LM head rows.
        Raises ``MedusaCheckpointError`` for a file that does not fit the backbone, ``ValueError`` on a GPU or
        where the lean step's compiled extension does not load (its layer runs there, on a CPU)."""
        if self.device.type != "cpu":
            raise ValueError(f"the drafter runs on a CPU (4-bit products); the model is on {self.device}")
        module, why = (self._steps.extension, "") if self._steps.extension is not None else load_extension()
        if module is None:
            raise ValueError(f"the drafter runs in the lean step's compiled extension, which is not available here: {why}")
        ids = getattr(self.heads, "draft_ids", None)
        weight = _dense_weight(self.backbone.get_output_embeddings())  # [V, H] the LM head's rows
        projection = Int4Linear.quantize(weight if ids is None else weight[ids.to(weight.device)])
        self._drafter = (EagleDrafter(path, self.config, module), projection, None if ids is None else ids.cpu())

    @property
    def has_drafter(self) -> bool:
        """Whether ``load_drafter`` gave the model a drafter (``generate(drafts="eagle")``)."""
        return self._drafter is not None

    def index_corpus_in_background(self) -> None:
        """Start making the corpus index (``corpus``: ~9 s for the demo at a first start in this process, ~12 s apart,
        then read from the cache folder) in a daemon thread, so that a caller who will want corpus drafts soon does not
        wait for it: the app at ``ready``, a reply that found it not ready (``corpus.LazyCorpus.index_in_background``:
        a head folder's replies are indexed in a low-priority process of their own first). Nothing without a corpus,
        once it is made, or while such a thread runs."""
        self._corpus.index_in_background(self._steps.extension)

    # ------------------------------------------------------------------------------------- the corpus
    @property
    def has_corpus(self) -> bool:
        """Whether the model has a corpus of its own replies (``generate(drafts="corpus")``)."""
        return self._corpus.present

    @property
    def corpus_ready(self) -> bool:
        """Whether the model has a corpus that is already made (``corpus`` then returns at once)."""
        return self._corpus.ready

    @property
    def corpus(self) -> Datastore | None:
        """The index of the model's own replies (``datastore.Datastore``), made on first use (thread-safe: a
        caller may warm it in the background); None without one."""
        return self._corpus.get(self._steps.extension)

    # ------------------------------------------------------------------------------------- generate
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        tree: str | Sequence[Sequence[int]] | None = None,
        config: SamplingConfig | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        medusa: bool = True,
        seed: int | None = None,
        sampling: str = "typical",
        drafts: str = "heads",
        draft_config: DraftConfig = DraftConfig(),
        earlier_replies: Sequence[Sequence[int]] = (),
        kept: ConversationCache | None = None,
        progress: bool = False,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> Iterator[StepRecord | ReadProgress]:
        """Decode a reply, yielding one ``StepRecord`` per decoding step (paper 2.1–2.3), after the
        prompt's ``ReadProgress`` records if ``progress``.

        Args:
            input_ids: [1, T] prompt token ids (batch size 1).
            max_new_tokens: limit in tokens (tokens accepted past it are dropped).
            tree: a tree name (the model's own trees, ``TREE_PRESETS``, ``chain_D``, ``dense_AxB``),
                a list of paths, or None: the tuned tree of the settings' preset (``tuned_for``), else ``default_tree``;
                ``"tuned"`` too stands for the tree tuned at the settings' preset when there is one.
            config: the sampling settings (``SamplingConfig``); None: ``sampling_defaults``, which
                is what HF ``generate`` would use for this model (its generation config, else greedy).
            temperature, top_k, top_p, min_p, repetition_penalty: override the fields of ``config``
                (HF ``generate`` semantics, see ``SamplingConfig``). Temperature 0 → greedy in every
                mode: the argmax of the penalised logits, so the output equals HF
                ``generate(do_sample=False, repetition_penalty=...)`` token for token; > 0 → sampling
                from p = softmax(processed logits), verified as ``sampling`` says. The processors run
                at every tree node on the distribution given that node's own prefix (context + its
                ancestors), so p at a node is exactly what plain decoding would see there.
            posterior_threshold: ε of typical acceptance (paper default 0.09); typical only.
            posterior_alpha: δ of typical acceptance (paper default 0.3); typical only.
            medusa: False → plain autoregressive decoding through the same loop, one token per step.
            seed: seeds the sampling generator (temperature > 0); None draws a fresh seed. The same
                seed repeats a reply in every mode.
            sampling: how candidates are verified at temperature > 0, one of ``SAMPLING_MODES``:
                ``"typical"`` (paper 2.3.1): the root is sampled, a candidate x is accepted when
                ``p(x) > min(ε, δ·exp(−H(p)))``; fast, but the reply no longer follows p.
                ``"exact"``: recursive rejection sampling over the tree; the reply is distributed
                exactly as plain sampling (``medusa=False``) from p. See below.
            drafts: where a Medusa step's candidates come from, one of ``DRAFT_SOURCES``:
                ``"heads"`` (default, the paper's Medusa): the tree's nodes, ranks of the heads' top-k (2.1.2);
                ``"ngram"``: prompt lookup only, the tokens that followed the latest earlier occurrence
                of the context's last tokens (``drafts.NgramDrafter`` over the prompt and the reply so
                far), as one chain; a step without a match verifies the root alone;
                ``"hybrid"``: the heads' tree with the n-gram chain grafted on (``steptree.graft``), both
                verified in the same pass;
                ``"corpus"``: the heads' tree, but a step where the model's ``corpus`` of its own replies
                has a confident chain (the tokens that most often followed the context's last tokens there,
                ``Datastore.chain``) verifies the root and that chain alone (REST, SuffixDecoding); needs a
                model with a corpus. ``"eagle"``: the root and the chain of the drafter ``load_drafter`` gave
                the model (``medusa_core.eagle``: up to ``DEPTH`` drafts while confident), or the corpus's chain
                where the model has a corpus and it has one, verified alone; while ``index_corpus_in_background``
                is still making the corpus's index, the drafter's chains alone (no wait). Drafts are point masses like the heads' candidates, so greedy
                output stays plain greedy output and exact sampling stays exact. Ignored with
                ``medusa=False``.
            draft_config: n-gram sizes and the longest chain (``DraftConfig``); the chain is also cut so
                the step's tree fits the context window and the token limit. With ``chain_only_from`` = L > 0 a
                ``hybrid`` step whose chain has at least L tokens verifies the root and the chain alone (no
                heads' pass; its ``StepRecord.tree_name`` is ``"ngram"``). Its ``min_head_probability``
                τ > 0 shapes the heads' tree per step (EAGLE-2, Li et al. 2024: the tree given is the
                budget): a node is verified only when its path probability, the product of the heads'
                probabilities softmax(logits_k / T_k) (``head_temperatures``) of the tokens on its path,
                is at least τ; a deterministic choice given the context, so exactness is unchanged. None
                (the default) means the tuned τ of the settings' preset (``tuned_for``), else the model's
                ``min_head_probability``; 0 turns shaping off. Its ``chain_depth`` and ``chain_threshold`` set the
                drafter's chains (``drafts="eagle"``); None: the chain tuned at the settings' preset, else
                ``eagle.DEPTH`` and ``eagle.THRESHOLD``.
            earlier_replies: token ids of earlier replies that the prompt does not hold (e.g. the reply
                that Regenerate replaces), indexed for the n-gram lookup beside the context (``hybrid``
                and ``ngram`` only).
            kept: a conversation's ``ConversationCache`` (``medusa_core.prefill``): the prompt is read from
                the end of its longest common prefix with the tokens the cache holds, and the cache keeps
                the prompt's and the reply's entries for the next turn. None: a fresh cache, freed at the end.
            progress: also yield ``ReadProgress`` records (not ``StepRecord``: tell them apart with
                ``isinstance``) while a prompt that takes more than one chunk is read: one before the first
                chunk, then one after every chunk but the last, so a caller can show the reading's
                progress and stop between chunks (closing the iterator).
            prefill_chunk: prompt tokens read per pass (an integer >= 1).

        Exact sampling (Leviathan et al. 2023; Chen et al. 2023; SpecInfer, Miao et al. 2024): the walk over the
        tree and why the reply follows plain sampling are in ``acceptance.verify_tree``.

        Returns an iterator; stopping the iteration early releases the KV cache (a ``kept`` one keeps
        the entries written so far, and what they hold).

        Raises ``ValueError`` (before any work) naming the value and what is allowed, for: an empty
        or too-long prompt, a batch size other than 1, ``max_new_tokens`` not an integer >= 1, a
        sampling setting outside its range (``SamplingConfig``: temperature a finite number >= 0,
        top_k an integer >= 0, top_p in (0, 1], min_p in [0, 1], repetition_penalty > 0), ε or δ
        outside (0, 1], a seed outside [0, 2**63), an unknown ``sampling`` or ``drafts``, a tree that
        ``resolve_tree`` refuses, ``drafts="corpus"`` for a model without a corpus, ``drafts="eagle"`` for one without a drafter, or ``prefill_chunk`` not an
        integer >= 1.
        """
        check_generate_args(max_new_tokens, posterior_threshold, posterior_alpha, seed, sampling, drafts)
        if drafts == "corpus" and medusa and not self.has_corpus:
            raise ValueError("drafts='corpus' needs a model with a corpus of its own replies (a distill/ folder beside "
                             f"its heads, load_medusa_model); {self.name} has none: use 'heads', 'hybrid' or 'ngram'")
        if drafts == "eagle" and medusa and not self.has_drafter:
            raise ValueError(f"drafts='eagle' needs a drafter (MedusaModel.load_drafter); {self.name} has none")
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1 (prompt tokens per pass), got {prefill_chunk!r}")
        overrides = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        settings = dataclasses.replace(
            self.sampling_defaults if config is None else config, **{k: v for k, v in overrides.items() if v is not None}
        )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
        prompt_len = input_ids.shape[1]
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.max_context:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; the model's context window is {self.max_context} tokens"
            )
        tuned = self.tuned_for(settings)
        full = None
        if medusa:
            if tree is None or tree == "tuned":  # the tree tuned on this machine at these settings, where there is one
                tree = tuned.tree if tuned else tree or self.default_tree
            full = self._tree("ngram") if drafts in CHAIN_SOURCES else self._tree(tree)
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        rule = "greedy" if settings.greedy else sampling if medusa else "sample"
        drafter = corpus_chains = None
        # the corpus's chains ("corpus" checked above); the drafter drafts alone rather than wait for a background index
        waits = drafts == "eagle" and not self.corpus_ready and self._corpus.indexing
        if medusa and drafts in ("corpus", "eagle") and self.has_corpus and not waits:
            corpus_chains = NgramDrafter(draft_config, input_ids[0].tolist(), corpus=self.corpus, copy=False)
        if medusa and drafts == "corpus":
            drafter = corpus_chains
        elif medusa and drafts == "eagle":
            depth, threshold = draft_config.chain_depth, draft_config.chain_threshold  # else the tuned chain, else eagle's
            if depth is None and tuned:
                depth = tuned.chain_depth
            if threshold is None and tuned:
                threshold = tuned.chain_threshold
            drafter = EagleDrafts(self._drafter[0], self.backbone.get_input_embeddings(), *self._drafter[1:],
                                  capacity=prompt_len + max_new_tokens + 1, chains=corpus_chains, depth=depth,
                                  threshold=threshold)
        elif medusa and drafts != "heads":
            drafter = NgramDrafter(draft_config, input_ids[0].tolist(), earlier_replies)
        shape_at = draft_config.min_head_probability
        if shape_at is None:
            shape_at = self.shaping_threshold(settings)
        reading = dict(kept=kept, progress=progress, chunk=prefill_chunk)
        steps = self._steps.run(
            input_ids.to(self.device), max_new_tokens, full, NodeProcessors(settings), posterior_threshold, posterior_alpha,
            seed, rule, drafter, drafts if medusa else "", shape_at if drafts not in CHAIN_SOURCES else 0.0, reading,
        )
        return steps if kept is None else _settling(steps, kept)

    def _new_cache(self) -> DynamicCache:
        return new_cache(self.backbone.config)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------------------------------- trees
    def resolve_tree(self, tree: str | Sequence[Sequence[int]]) -> tuple[str, list[list[int]]]:
        """``(name, medusa_choices)`` of a tree given by name (model's own first) or as paths.

        Raises ``ValueError`` for an unknown name, an invalid tree, one deeper than the heads, a
        rank >= the heads' draft vocabulary, more than ``MAX_TREE_NODES`` nodes, or more nodes than fit in
        the context window beside a one-token prompt.
        """
        if isinstance(tree, str) and tree in self.trees:
            name, choices = tree, [list(p) for p in self.trees[tree]]
            validate_tree(choices, self.num_heads, vocab_size=self._draft_vocabulary)
        else:
            name, choices = resolve_tree(tree, num_heads=self.num_heads, vocab_size=self._draft_vocabulary)
        if len(choices) + 1 >= self.max_context:
            raise ValueError(
                f"tree {name!r} has {len(choices) + 1} nodes (root included) but the model's context window is "
                f"{self.max_context} tokens: use a tree of at most {self.max_context - 1} nodes"
            )
        return name, choices

    def _tree(self, tree: str | Sequence[Sequence[int]]) -> StepTree:
        """The static ``StepTree`` of a tree, built once; ``"baseline"`` and ``"ngram"`` are the root alone."""
        if tree in ("baseline", "ngram"):
            name, choices = tree, []
        else:
            name, choices = self.resolve_tree(tree)
        key = name if isinstance(tree, str) else repr(sorted(map(tuple, choices)))
        if key not in self._trees:
            self._trees[key] = static_tree(name, choices, self.dtype, self.device)
        return self._trees[key]


def _settling(steps: Iterator[StepRecord | ReadProgress], kept: ConversationCache) -> Iterator[StepRecord | ReadProgress]:
    """``steps``, then (however the reply ends) ``kept.settle()``: between turns a conversation's cache holds
    only its entries, within its memory budget."""
    try:
        yield from steps
    finally:
        kept.settle()
