"""``FullBandwidthOutput``: what a forward of a fullband model returns (K-pass forward and exact recurrence)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput


@dataclass
class FullBandwidthOutput(ModelOutput):
    """Output of a K-pass forward.

    ``loss`` = ``L_1 + λ·mean(L_2..L_K)``; ``logits`` and ``last_hidden_state`` (the final hidden states, the
    ones the LM head reads) are the last pass's; ``pass_losses`` holds the K per-pass losses (detached). The exact
    recurrence can also return ``hidden_states`` (every layer's residual stream, embedding output first) and
    ``inputs_embeds`` (what entered the backbone at each position: fused or plain).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    pass_losses: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    inputs_embeds: torch.Tensor | None = None
    passes_run: int | None = None  # passes the K-pass forward ran (fewer than K after an early stop)
    grad_passes_run: int | None = None  # of them, the passes run with gradient (grad_passes)
    z_loss: torch.Tensor | None = None  # with a z-loss coefficient: its term inside ``loss`` (detached)
    pass_changes: list[float] | None = None  # with an early-stop tolerance: max|h_k - h_{k-1}| / max|h_{k-1}|
