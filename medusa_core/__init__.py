"""medusa_core: Medusa decoding (Cai et al., ICML 2024) for Hugging Face decoder-only models.

Works on token ids and knows no UI. Public API:

- ``MedusaHeads`` (paper 2.1.1) and checkpoint I/O: ``load_medusa_model``, ``save_medusa_heads``,
  ``export_vllm``, ``MedusaCheckpointError``.
- Trees (paper 2.1.2, 2.3.3): ``TREE_PRESETS``, ``MAX_TREE_NODES``, ``build_tree_buffers``, ``TreeBuffers``,
  ``resolve_tree``, ``validate_tree``, ``dense_tree``, ``chain_tree``, ``optimal_tree``.
- Acceptance (paper 2.3.1): ``evaluate_posterior``; exact rejection sampling over the tree (Leviathan
  et al. 2023, Chen et al. 2023): ``try_children``, ``residual_distributions``, ``node_status``, ``draw``.
- The engine: ``MedusaModel.generate`` yields one ``StepRecord`` per decoding step (the loop and a step's
  stages: ``decoding.StepRunner``); ``SAMPLING_MODES``
  (its ``sampling=`` argument), ``DRAFT_SOURCES`` (its ``drafts=``; ``CHAIN_SOURCES`` those that verify a chain alone), ``SAMPLING_RULES``, ``NODE_STATUSES``
  and ``NODE_SOURCES`` (fields of the record).
- Reading the prompt (``prefill``): a conversation's KV cache kept between turns, ``ConversationCache``
  (``generate(kept=...)``), and ``ReadProgress`` records while a long prompt is read in ``PREFILL_CHUNK``-token
  chunks (``generate(progress=True)``).
- N-gram drafts in the tree (prompt lookup beside the heads, issue 20): ``NgramDrafter``, ``DraftConfig``; drafts
  from the model's own replies (REST, SuffixDecoding; ``generate(drafts="corpus")``): ``Datastore``, ``CorpusRule``.
- An EAGLE-style drafter as a draft source (``MedusaModel.load_drafter``, ``generate(drafts="eagle")``):
  ``medusa_core.eagle``.
- Sampling settings with HF ``generate`` semantics, applied at every tree node: ``SamplingConfig``
  (temperature, top-k, top-p, min-p, repetition penalty) and ``CHAT_PRESET``.
- Trees tuned per machine and settings preset by ``bench tune``: ``TunedSettings``, ``TUNED_PRESETS``
  (``MedusaModel.tuned_for``).
- ``physical_cores``: the default torch thread count of the app and the benchmark.
"""

import os

# oneDNN's bfloat16 matmuls (BF16Linear: an LM head's or the heads' product) on AMX tiles block a call by its number of
# rows, so a row's bits change with it (33 rows against 1 on an AMX CPU), where its AVX512-BF16 kernels do not: cap
# oneDNN there (read once, at its first use, so before torch runs one; a value set by the user stays). The 4-bit
# product's own AMX path (medusa_core/lean/int4_matmul.h) is batch-invariant.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

from .acceptance import NODE_STATUSES, draw, evaluate_posterior, node_status, residual_distributions, try_children
from .cpu import physical_cores
from .export import export_vllm, save_medusa_heads
from .datastore import CorpusRule, Datastore
from .drafts import DraftConfig, NgramDrafter
from .generation import CHAIN_SOURCES, DRAFT_SOURCES, SAMPLING_MODES, SAMPLING_RULES, STOP_REASONS, StepRecord
from .heads import MedusaHeads
from .loading import DEMO_MODEL_DIR, MedusaCheckpointError, heads_from_state_dict, load_medusa_model
from .model import MedusaModel
from .prefill import PREFILL_CHUNK, ConversationCache, ReadProgress
from .processors import CHAT_PRESET, SamplingConfig
from .tuned import TUNED_PRESETS, TunedSettings
from .steptree import NODE_SOURCES
from .trees import (
    MAX_TREE_NODES,
    TREE_PRESETS,
    TreeBuffers,
    build_tree_buffers,
    chain_tree,
    dense_tree,
    optimal_tree,
    resolve_tree,
    validate_tree,
)

__all__ = [
    "CHAT_PRESET",
    "DEMO_MODEL_DIR",
    "CHAIN_SOURCES",
    "DRAFT_SOURCES",
    "MAX_TREE_NODES",
    "NODE_SOURCES",
    "NODE_STATUSES",
    "PREFILL_CHUNK",
    "SAMPLING_MODES",
    "SAMPLING_RULES",
    "STOP_REASONS",
    "TREE_PRESETS",
    "ConversationCache",
    "CorpusRule",
    "Datastore",
    "DraftConfig",
    "MedusaCheckpointError",
    "MedusaHeads",
    "MedusaModel",
    "NgramDrafter",
    "ReadProgress",
    "SamplingConfig",
    "StepRecord",
    "TUNED_PRESETS",
    "TreeBuffers",
    "TunedSettings",
    "build_tree_buffers",
    "chain_tree",
    "dense_tree",
    "draw",
    "evaluate_posterior",
    "export_vllm",
    "heads_from_state_dict",
    "load_medusa_model",
    "node_status",
    "optimal_tree",
    "physical_cores",
    "residual_distributions",
    "resolve_tree",
    "save_medusa_heads",
    "try_children",
    "validate_tree",
]
