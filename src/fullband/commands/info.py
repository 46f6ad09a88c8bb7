"""``fullband info``: what a saved model is (backbone family, sizes, feedback settings)."""

from __future__ import annotations

import json
import os

from ..model.modeling import load_model


def describe(model_dir: str) -> dict:
    model = load_model(model_dir)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    if not hasattr(model, "feedback"):
        return {"path": os.path.abspath(model_dir), "backbone": cfg.model_type, "parameters": n_params,
                "fusion": None, "note": "a plain causal LM without latent feedback: only the standard mode applies"}
    n_fusion = sum(p.numel() for p in model.feedback.parameters())
    return {
        "path": os.path.abspath(model_dir),
        "backbone": cfg.text_config.model_type,
        "parameters": n_params,
        "fusion_parameters": n_fusion,
        "fusion": cfg.fusion,
        "feedback_weight": cfg.feedback_weight,
        "jitter": cfg.jitter,
        "detach_state": cfg.detach_state,
        "embed_rms": cfg.embed_rms,
        "default_feedback_mode": cfg.default_feedback_mode,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a saved fullband model",
                       description="Print what a saved fullband model is, as JSON.")
    p.add_argument("--model", required=True, help="model directory (save_pretrained output)")
    p.set_defaults(func=lambda args: print(json.dumps(describe(args.model), indent=2)))
