"""The multi-pass training objective.

Owns how the K per-pass language-model losses are combined (``L_1 + λ · mean(L_2..L_K)``). Which K a training
step uses lives with the other step-indexed schedules in :mod:`fullband.training.schedule`.
"""

from __future__ import annotations

import torch


def combine_pass_losses(pass_losses: list[torch.Tensor] | torch.Tensor, feedback_weight: float = 1.0) -> torch.Tensor:
    """``L_1 + feedback_weight · mean(L_2..L_K)``; just ``L_1`` when K == 1."""
    first, rest = pass_losses[0], pass_losses[1:]
    if len(rest) == 0:
        return first
    return first + feedback_weight * torch.stack(list(rest)).mean()
