"""``fullband bench train``: training step time and tokens/s for K = 1, K = 2 and K = 2 with a stop-gradient state.

Owns :func:`benchmark_train` (the full step: forward, backward, clip, AdamW, on random tokens, with the engine's
:func:`fullband.training.engine.forward_backward` and optimizer) and :func:`format_benchmark`; ``fullband bench``
(:mod:`fullband.commands.bench`) registers the sub-command.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..model.feedback import build_feedback_mask
from ..model.modeling import FullBandwidthForCausalLM
from ..training import distributed as D
from ..training.config import TrainConfig
from ..training.device import autocast_context, tune_cpu_allocator
from ..training.engine import forward_backward
from ..training.optimizer import build_optimizer
from ..training.presets import backbone_config


def benchmark_train(args) -> dict:
    """``fullband bench train``: seconds per optimizer step and tokens/s for K = 1, K = 2 and K = 2 with a
    stop-gradient fed-back state, on random tokens (the full step: forward, backward, clip, AdamW)."""
    hf_logging.disable_progress_bar()
    tuned = tune_cpu_allocator()  # as `fullband train` does
    preset = getattr(args, "preset", "tiny")
    batch = getattr(args, "batch_size", 16)
    seq = getattr(args, "seq_len", 256)
    vocab = getattr(args, "vocab_size", 4096)
    steps = getattr(args, "steps", 5)
    warmup = getattr(args, "warmup", 2)
    device = D.resolve_device(getattr(args, "device", "auto"))
    autocast, precision = autocast_context(getattr(args, "precision", "auto"), device)
    for name, v in (("--batch-size", batch), ("--seq-len", seq), ("--steps", steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    ids[:, 0] = 1
    ids = ids.to(device)
    cases = [("K1", 1, False), ("K2", 2, False), ("K2_detach", 2, True)]
    cfg = TrainConfig(out="-", preset=preset)
    setups = {}
    for label, K, detach in cases:
        torch.manual_seed(0)
        backbone = AutoModelForCausalLM.from_config(backbone_config(preset, vocab, bos_token_id=1, eos_token_id=2,
                                                                    pad_token_id=0, max_position_embeddings=max(2048, seq)))
        model = FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1, detach_state=detach).to(device).train()
        setups[label] = (model, build_optimizer(model, cfg, device), K)
    mask = build_feedback_mask(ids, None, 1)

    def one_step(label) -> float:
        model, opt, K = setups[label]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward_backward(model, [{"input_ids": ids, "labels": ids, "feedback_mask": mask}], K, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # rounds of one step per case, interleaved, so that a change in machine load hits every case alike
    times = {label: [] for label, *_ in cases}
    for i in range(warmup + steps):
        for label, *_ in cases:
            t = one_step(label)
            if i >= warmup:
                times[label].append(t)
    results = {}
    for label, K, detach in cases:
        ts = sorted(times[label])
        med = ts[len(ts) // 2]
        results[label] = {"num_passes": K, "detach_state": detach, "step_s": med, "tokens_per_s": batch * seq / med,
                          "step_s_min": ts[0], "step_s_all": times[label]}
    ratio = results["K2"]["step_s"] / results["K1"]["step_s"]
    return {"preset": preset, "batch_size": batch, "seq_len": seq, "vocab_size": vocab, "device": str(device),
            "precision": precision, "threads": torch.get_num_threads(), "steps": steps, "warmup": warmup,
            "allocator_tuned": tuned,
            "results": results, "ratio_K2_K1": ratio,
            "ratio_K2_detach_K1": results["K2_detach"]["step_s"] / results["K1"]["step_s"],
            "goal_ratio_K2_K1": 2.1, "meets_goal": ratio <= 2.1}


def format_benchmark(res: dict) -> str:
    lines = [f"fullband bench train: preset {res['preset']}, batch {res['batch_size']} x {res['seq_len']} tokens, "
             f"{res['device']} {res['precision']}, {res['threads']} thread(s), median of {res['steps']} steps",
             "", "| case | step (s) | tokens/s |", "| --- | ---: | ---: |"]
    for label, r in res["results"].items():
        lines.append(f"| {label} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |")
    lines += ["", f"K=2 / K=1 = {res['ratio_K2_K1']:.2f} (goal <= {res['goal_ratio_K2_K1']}: "
                  f"{'met' if res['meets_goal'] else 'NOT met'}); K=2 detached / K=1 = {res['ratio_K2_detach_K1']:.2f}"]
    return "\n".join(lines)
