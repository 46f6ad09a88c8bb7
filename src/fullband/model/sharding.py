"""The model's parameters when FSDP2 shards them: what the model layer must do differently there; and the scopes
the token-by-token pass runs in.

Owns :func:`without_dropout` (every sub-module in evaluation mode for a scope, each back to its own mode after: the
token pass's states are the recurrence's, not T dropout masks'), :func:`gathered_once` (the token-by-token recurrence calls each decoder layer once a token: every sharded layer
all-gathered once for the whole pass), :func:`is_sharded` (whether FSDP2 shards any part of a model) and
:func:`embedding_rms` (the RMS of a possibly unevenly sharded embedding matrix, by a scalar all-reduce rather than a
gather).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def without_dropout(module: torch.nn.Module):
    """Every sub-module of ``module`` in evaluation mode for the scope (no dropout), each back to its own mode after
    (a module left in evaluation mode on purpose stays so)."""
    modes = [(m, m.training) for m in module.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def gathered_once(model: torch.nn.Module):
    """Inside this scope every FSDP2-sharded sub-module of ``model`` is all-gathered once, on its first call, and
    kept whole until the scope ends (then resharded as it was): the token-by-token recurrence calls each decoder
    layer T times, and FSDP2 would otherwise all-gather every layer for every token (and free it again). A no-op
    for a model that is not sharded. Memory: the whole model's parameters for the scope."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    before = []
    for m in mods:
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        before.append(group is None or group.post_forward_mesh_info is not None)  # did it reshard after forward
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, reshard in zip(mods, before):
            m.set_reshard_after_forward(reshard, recurse=False)
            if reshard:
                m.reshard()


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``model`` or any of its sub-modules."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def embedding_rms(embeddings) -> float:
    """RMS of an embedding matrix: the scale the fused input is initialised to."""
    weight = embeddings.weight.detach()
    if isinstance(weight, DTensor):  # FSDP2-sharded (possibly unevenly): a scalar all-reduce, not a gather
        return float((weight.float().pow(2).sum().full_tensor() / weight.numel()).sqrt())
    return float(weight.float().pow(2).mean().sqrt())
