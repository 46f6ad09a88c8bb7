"""Training compute of a run: the parameters that count and the FLOPs of its logged steps (every pass counted,
passes without gradient at the cost of their forward)."""

from __future__ import annotations


def flop_parameters(model) -> dict:
    """What the FLOP count needs: ``matmul_params`` (backbone parameters in matrix multiplies: all of them but an
    untied input-embedding table), ``fusion_params``, ``layers``, ``hidden``."""
    backbone = getattr(model, "backbone", model)
    emb = backbone.get_input_embeddings().weight
    head = backbone.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() for p in backbone.parameters())
    matmul = total - (0 if tied else emb.numel())
    cfg = backbone.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    fusion = sum(p.numel() for p in model.feedback.parameters()) if hasattr(model, "feedback") else 0
    return {"matmul_params": int(matmul), "fusion_params": int(fusion), "layers": int(layers), "hidden": int(hidden),
            "total_backbone_params": int(total)}


def training_flops(records: list[dict], tokens_per_step: int, seq_len: int, fp: dict) -> dict:
    """Training FLOPs of a run from its ``metrics.jsonl`` training records (skipped steps cost compute too).

    Per token, a pass with gradient costs ``6·N + 6·L·T·d`` (forward 2, backward 4 FLOPs per matmul weight; the
    attention scores and their weighted sum over the causal half of the ``T x T`` matrix) plus ``6·N_fusion`` when
    it is fused (passes 2..K); a pass without gradient (the first K - N of ``--grad-passes N``) costs its forward
    only, a third of that. A record's ``passes_run`` / ``grad_passes_run`` (logged with ``--grad-passes`` or
    ``--pass-tol``: the passes that ran, means over micro-batches) override ``num_passes`` (all with gradient).
    ``N`` counts the norms' gains as weights too (``flop_parameters``), under 1% of a backbone's matmul weights.
    """
    per_pass = 6.0 * fp["matmul_params"] + 6.0 * fp["layers"] * seq_len * fp["hidden"]
    fused = 6.0 * fp["fusion_params"]
    steps = [r for r in records if r.get("split", "train") == "train" and "num_passes" in r]
    passes = flops_per_token = 0.0
    for r in steps:
        run = float(r.get("passes_run", r["num_passes"]))
        grad = min(float(r.get("grad_passes_run", run)), run)
        fused_grad = min(grad, run - 1.0)  # the gradient passes are the last ones; pass 1 is never fused
        fused_free = run - 1.0 - fused_grad
        passes += run
        flops_per_token += (grad * per_pass + (run - grad) * per_pass / 3.0
                            + fused_grad * fused + fused_free * fused / 3.0)
    flops = tokens_per_step * flops_per_token
    passes = int(passes) if passes == int(passes) else passes
    return {"flops": flops, "steps": len(steps), "passes": passes, "tokens": len(steps) * tokens_per_step,
            "flops_per_token_pass": per_pass}
