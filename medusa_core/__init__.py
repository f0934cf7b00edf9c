"""medusa_core: Medusa decoding (Cai et al., ICML 2024) for Hugging Face decoder-only models.

Works on token ids and knows no UI. Public API:

- ``MedusaHeads`` (paper 2.1.1) and checkpoint I/O: ``load_medusa_model``, ``save_medusa_heads``,
  ``export_vllm``, ``MedusaCheckpointError``.
- Trees (paper 2.1.2, 2.3.3): ``TREE_PRESETS``, ``MAX_TREE_NODES``, ``build_tree_buffers``, ``TreeBuffers``,
  ``resolve_tree``, ``validate_tree``, ``dense_tree``, ``chain_tree``, ``optimal_tree``.
- Acceptance (paper 2.3.1): ``evaluate_posterior``.
- The engine: ``MedusaModel.generate`` yields one ``StepRecord`` per decoding step.
"""

from .acceptance import evaluate_posterior
from .export import export_vllm, save_medusa_heads
from .heads import MedusaHeads
from .loading import DEMO_MODEL_DIR, MedusaCheckpointError, heads_from_state_dict, load_medusa_model
from .model import STOP_REASONS, MedusaModel, StepRecord
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
    "DEMO_MODEL_DIR",
    "MAX_TREE_NODES",
    "STOP_REASONS",
    "TREE_PRESETS",
    "MedusaCheckpointError",
    "MedusaHeads",
    "MedusaModel",
    "StepRecord",
    "TreeBuffers",
    "build_tree_buffers",
    "chain_tree",
    "dense_tree",
    "evaluate_posterior",
    "export_vllm",
    "heads_from_state_dict",
    "load_medusa_model",
    "optimal_tree",
    "resolve_tree",
    "save_medusa_heads",
    "validate_tree",
]
