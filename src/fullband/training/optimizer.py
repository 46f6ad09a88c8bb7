"""The optimizer of a training run: AdamW parameter groups and gradient clipping.

Owns :func:`param_groups` (backbone / fusion × decay / no-decay: 1-D parameters such as norms and biases get no
weight decay; the fusion's groups carry ``lr_mult`` = ``--fusion-lr-mult``), :func:`build_optimizer` (AdamW, fused
where available) and :func:`clip_gradients` (one global norm, or one per group with ``--clip-per-group``).
"""

from __future__ import annotations

import torch


def param_groups(model, cfg) -> list[dict]:
    """Backbone / fusion × decay / no-decay (1-D parameters: norms, biases, get no weight decay)."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        fusion = name.startswith("feedback.")
        decay = p.dim() >= 2
        key = ("fusion" if fusion else "backbone", decay)
        groups.setdefault(key, []).append(p)
    out = []
    for (kind, decay), params in sorted(groups.items()):
        out.append({"params": params, "name": f"{kind}{'' if decay else '_no_decay'}",
                    "weight_decay": cfg.weight_decay if decay else 0.0,
                    "lr_mult": cfg.fusion_lr_mult if kind == "fusion" else 1.0})
    return out


def build_optimizer(model, cfg, device: torch.device, sharded: bool = False) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    kwargs = dict(lr=cfg.resolved_lr(), betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if not sharded and device.type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass
    return torch.optim.AdamW(groups, **kwargs)


def set_learning_rates(optimizer: torch.optim.Optimizer, lr: float, fusion_lr: float) -> None:
    """Each group's LR: ``fusion_lr`` for the fusion's groups, ``lr`` for the others, times the group's ``lr_mult``."""
    for group in optimizer.param_groups:
        group["lr"] = (fusion_lr if group["name"].startswith("fusion") else lr) * group.get("lr_mult", 1.0)


def clip_gradients(params: list, max_norm: float) -> float:
    """Clip the gradient norm of ``params`` to ``max_norm`` (0: no clipping); returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
