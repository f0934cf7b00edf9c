"""Medusa-1 head training, self-distillation and tree calibration (paper 2.2.1, 2.3.2, 2.3.3).

One module per stage, in the order they run:

- ``distill``: the backbone's own replies to seed prompts, greedy or with a chat's sampling settings
  (self-distillation, 2.3.2).
- ``positions``: hidden states of the frozen backbone and each head's target token (2.2.1), cached
  per distillation file and extended as the file grows.
- ``heads``: the loss Σ_k 0.8^k · CE(head k, token t+k+2), the schedule and the resumable loop (2.2.1).
- ``calibrate``: per-head rank accuracies, optimised trees per node budget (2.3.3), each tree's
  acceleration replayed on held-out replies, and each head's temperature (Guo et al. 2017).
- ``cli``: ``python -m medusa_core.train distill | heads | calibrate`` (``--help`` lists the flags).
"""

from .calibrate import (
    accuracy_from_ranks,
    calibration,
    fit_temperature,
    head_temperatures,
    rank_accuracy,
    simulated_acceleration,
    target_ranks,
)
from .cli import main
from .distill import MODEL_TURN, SampledTokens, distill, generate_kwargs, read_distilled, read_prompts
from .heads import LOSS_DECAY, TRAINER_STATE, HeadTrainingConfig, backbone_targets, head_loss, lr_at, train_heads
from .positions import TARGETS, cached_positions, collect_positions

__all__ = [
    "LOSS_DECAY",
    "TARGETS",
    "MODEL_TURN",
    "TRAINER_STATE",
    "HeadTrainingConfig",
    "accuracy_from_ranks",
    "backbone_targets",
    "cached_positions",
    "calibration",
    "collect_positions",
    "distill",
    "fit_temperature",
    "generate_kwargs",
    "SampledTokens",
    "head_loss",
    "head_temperatures",
    "lr_at",
    "main",
    "rank_accuracy",
    "read_distilled",
    "read_prompts",
    "simulated_acceleration",
    "target_ranks",
    "train_heads",
]
