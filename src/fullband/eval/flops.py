"""Training compute of a run: the parameters that count and the FLOPs of its logged steps (every pass counted)."""

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
    """Training FLOPs of a run from its ``metrics.jsonl`` training records (skipped steps cost compute too):
    per token and pass ``6·N + 6·L·T·d``, plus ``6·N_fusion`` on every fused pass (passes 2..K)."""
    per_pass = 6.0 * fp["matmul_params"] + 6.0 * fp["layers"] * seq_len * fp["hidden"]
    fused = 6.0 * fp["fusion_params"]
    steps = [r for r in records if r.get("split", "train") == "train" and "num_passes" in r]
    passes = sum(int(r["num_passes"]) for r in steps)
    fused_passes = sum(int(r["num_passes"]) - 1 for r in steps)
    flops = tokens_per_step * (passes * per_pass + fused_passes * fused)
    return {"flops": flops, "steps": len(steps), "passes": passes, "tokens": len(steps) * tokens_per_step,
            "flops_per_token_pass": per_pass}
