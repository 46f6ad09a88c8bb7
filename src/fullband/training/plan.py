"""A plan before a big run (``fullband train --dry-run``): what a configuration will cost, computed without data,
weights or a device.

Owns :func:`make_plan` and :func:`format_plan`: the parameters (backbone built on PyTorch's ``meta`` device, so a
1B-parameter config costs no memory; the fusion counted from its own module), the training FLOPs of one step for
every K the feedback schedule uses and of the whole run (:func:`fullband.eval.flops.training_flops`, as experiments
count a finished run: ``6·N + 6·L·T·d`` per token and pass with gradient, plus ``6·N_fusion`` per fused pass, a third
of that for the passes ``--grad-passes`` runs without gradient), the memory of one device (weights, gradients
and AdamW state under DDP or sharded by FSDP; the activations as the run's ``--activation-checkpointing`` and
``--loss-chunk`` keep them, and what both levers together would keep; with ``--full-backprop``,
:func:`full_backprop_bytes`) and the time at a stated MFU on a named GPU, plus, for ``--exact-states`` and
``--full-backprop``, the latency of their token-by-token steps at an assumed time per layer and step. Every memory
and time figure is an estimate: the assumptions are printed with it.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..data.corpus import load_tokenizer
from ..eval.flops import training_flops
from ..model.configuration import FullBandwidthConfig
from ..model.feedback import build_fusion
from .config import TrainConfig
from .presets import backbone_config, check_tying

# dense bf16 tensor-core peak, FLOP/s (vendors' data sheets, without sparsity)
GPU_PEAK_BF16 = {"h200": 989e12, "h100": 989e12, "a100": 312e12, "l40s": 362e12, "rtx4090": 165e12, "a10g": 125e12}
GPU_MEMORY_GIB = {"h200": 141, "h100": 80, "a100": 80, "l40s": 48, "rtx4090": 24, "a10g": 24}
GIB = 1024 ** 3
# --exact-states: seconds one decoder layer takes for one token step of the token-by-token pass on a GPU (an
# assumption, not a measurement: at small batch a layer's dozen kernels are launch-bound, ~10 us each in eager
# PyTorch; CUDA graphs or a fused kernel would lower it)
TOKEN_STEP_LAYER_SECONDS = 1.5e-4
# --full-backprop: a one-token layer step's backward, in forward steps' time (about twice its kernels; assumed)
TOKEN_STEP_BACKWARD_FACTOR = 2.0


def _backbone_config(cfg: TrainConfig):
    """The backbone's HF config (and the vocabulary size) without reading the corpus."""
    if cfg.init_from is not None:
        try:
            conf = AutoConfig.from_pretrained(cfg.init_from)
        except (OSError, ValueError) as err:
            raise ValueError(f"--init-from {cfg.init_from!r} is not a loadable HF checkpoint: "
                             f"{str(err).splitlines()[0]}") from None
        if isinstance(conf, FullBandwidthConfig):
            conf = conf.text_config
        check_tying(cfg.tie_embeddings, bool(getattr(conf, "tie_word_embeddings", False)), f"--init-from {cfg.init_from!r}")
        return conf
    vocab = cfg.vocab_size
    if cfg.tokenizer is not None:
        vocab = len(load_tokenizer(cfg.tokenizer))
    return backbone_config(cfg.preset, vocab, max_position_embeddings=max(2048, cfg.seq_len),
                           tie_word_embeddings=cfg.tie_embeddings, num_hidden_layers=cfg.layers)


def count_parameters(cfg: TrainConfig) -> dict:
    """Backbone parameters (built on the meta device), the fusion's, and the shapes the FLOP count needs."""
    conf = _backbone_config(cfg)
    with torch.device("meta"):
        backbone = AutoModelForCausalLM.from_config(conf)
        emb = backbone.get_input_embeddings()
        fusion = build_fusion(cfg.fusion, conf.hidden_size, emb.embedding_dim)
    head = backbone.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    total = sum(p.numel() for p in backbone.parameters())
    return {"backbone_params": int(total), "fusion_params": int(sum(p.numel() for p in fusion.parameters())),
            "matmul_params": int(total - (0 if tied else emb.weight.numel())), "tied_embeddings": tied,
            "head_params": int(head.weight.numel()) if head is not None else 0,
            "layers": int(conf.num_hidden_layers), "hidden": int(conf.hidden_size),
            "intermediate": int(getattr(conf, "intermediate_size", 4 * conf.hidden_size)),
            "heads": int(conf.num_attention_heads), "vocab": int(emb.num_embeddings),
            "kv_heads": int(getattr(conf, "num_key_value_heads", None) or conf.num_attention_heads),
            "architecture": type(backbone).__name__}


def passes_histogram(cfg: TrainConfig) -> dict[int, int]:
    """How many steps of the run use each K (the schedule is a function of the step index alone: a pass mix's
    draws are the run's own)."""
    return cfg.schedule().histogram(cfg.steps)


def activation_bytes_per_token(p: dict, act_bytes: int, checkpointing: bool, gpu_attention: bool,
                               loss_chunk: int = 0) -> float:
    """Saved activations of one token through the backbone, one pass (an estimate).

    A Llama-style layer saves about ``10·d + 4·f`` values per token for its backward (norm inputs and outputs,
    q/k/v after RoPE, the attention output, the MLP's gate, up, activation and product); eager attention (CPU) also
    keeps ``2·heads·T`` probabilities per token, which fused attention kernels (GPU) do not. With activation
    checkpointing only each layer's input (``d``) is kept, and one layer is recomputed at a time. The LM head's
    fp32 logits (``V`` values, kept for the loss's backward) are added unless ``loss_chunk`` (``--loss-chunk``)
    computes the loss without them (:func:`loss_chunk_bytes` is then the loss's memory)."""
    d, f, L = p["hidden"], p["intermediate"], p["layers"]
    per_layer = 10 * d + 4 * f + (0 if gpu_attention else 2 * p["heads"] * p["seq_len"])
    layers = L * d + per_layer if checkpointing else L * per_layer
    return layers * act_bytes + (0 if loss_chunk else p["vocab"] * 4)


def full_backprop_bytes(p: dict, micro_tokens: int, chunk: int, act_bytes: int, loss_chunk: int = 0) -> float:
    """``--full-backprop``'s activations (an estimate, :mod:`fullband.model.full_backprop`): kept until the
    backward, each token's final state and its keys and values in every layer (``d + 2·L·d_kv``) and its fp32
    logits (``V``, none with ``--loss-chunk``: counted by the caller), plus, while one block of ``chunk`` tokens is
    recomputed, its steps' insides (a layer's ``10·d + 4·f`` per token) and each step's keys and values over the
    row (``2·L·d_kv·T`` a step). ``chunk = 0``: every step's insides and keys kept (quadratic in T)."""
    d, f, L, T = p["hidden"], p["intermediate"], p["layers"], p["seq_len"]
    kv = p["kv_heads"] * (d // p["heads"])
    rows = micro_tokens / T
    kept = micro_tokens * (d + 2 * L * kv) * act_bytes + (0 if loss_chunk else micro_tokens * p["vocab"] * 4)
    block = T if chunk == 0 else min(chunk, T)
    insides = rows * block * (L * (10 * d + 4 * f) + 2 * L * kv * T) * act_bytes
    return kept + insides


def loss_chunk_bytes(p: dict, loss_chunk: int, micro_tokens: int) -> float:
    """The chunked loss's memory: one chunk's fp32 logits and their gradient (``2 x 4`` bytes per position and
    vocabulary entry) while that chunk is recomputed in the backward; none without ``--loss-chunk``."""
    return 8 * min(loss_chunk, micro_tokens) * p["vocab"] if loss_chunk else 0


def make_plan(cfg: TrainConfig, world_size: int = 1, gpu: str = "h200", mfu: float = 0.4,
              parallel: str | None = None) -> dict:
    """The plan of ``cfg`` on ``world_size`` devices of kind ``gpu`` at model-FLOP utilisation ``mfu``."""
    if gpu not in GPU_PEAK_BF16:
        raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(GPU_PEAK_BF16)}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--plan-mfu must be in (0, 1], got {mfu}")
    if world_size < 1:
        raise ValueError(f"--plan-devices must be >= 1, got {world_size}")
    cfg.validate(world_size)
    parallel = parallel or cfg.parallel
    p = count_parameters(cfg)
    p["seq_len"] = cfg.seq_len
    tokens_per_step = cfg.batch_size * cfg.seq_len
    fp = {k: p[k] for k in ("matmul_params", "head_params", "fusion_params", "layers", "hidden")}
    hist = passes_histogram(cfg)
    gp = cfg.grad_passes  # truncated gradients: the first K - N passes run forward only

    def step_record(k: int) -> dict:  # what the engine logs for a step of K = k
        if cfg.full_backprop and k > 1:  # the recurrence with gradient, its blocks recomputed in the backward
            return {"num_passes": k, "full_backprop": True, "backprop_chunk": cfg.backprop_chunk}
        if cfg.exact_states and k > 1:  # the token-by-token pass, then N gradient passes
            return {"num_passes": k, "exact_states": True, "passes_run": gp, "grad_passes_run": gp}
        return {"num_passes": k, "grad_passes_run": min(gp, k) if gp else k}

    per_k = {k: training_flops([step_record(k)], tokens_per_step, cfg.seq_len, fp)["flops"] for k in hist}
    total_flops = sum(per_k[k] * n for k, n in hist.items())
    # memory of one device: fp32 master weights, fp32 gradients, AdamW's two fp32 moments (16 bytes a parameter);
    # bf16 autocast keeps bf16 copies of the weights during a step (2 more); FSDP shards all of it
    n_params = p["backbone_params"] + p["fusion_params"]
    shard = world_size if parallel == "fsdp" else 1
    states = {"weights": 4 * n_params / shard, "gradients": 4 * n_params / shard, "adamw": 8 * n_params / shard,
              "bf16_weight_copies": 2 * n_params / shard}
    micro_tokens = cfg.batch_size // (world_size * cfg.grad_accum) * cfg.seq_len
    k_max = max(hist)
    grad_passes = cfg.grad_passes or k_max  # passes that keep their graph for the backward
    graphs = grad_passes if cfg.exact_states and k_max > 1 else min(grad_passes, k_max)
    if cfg.full_backprop and k_max > 1:
        graphs = 1
    ckpt, chunk = cfg.activation_checkpointing, cfg.loss_chunk
    per_token = activation_bytes_per_token(p, 2, ckpt, gpu_attention=True, loss_chunk=chunk)
    activations = micro_tokens * per_token * graphs + loss_chunk_bytes(p, chunk, micro_tokens)
    if cfg.full_backprop and k_max > 1:  # kept: hidden states, keys/values (+ logits); one block's insides
        activations = (full_backprop_bytes(p, micro_tokens, cfg.backprop_chunk, 2, chunk)
                       + loss_chunk_bytes(p, chunk, micro_tokens))
    # what both levers would keep (--activation-checkpointing, --loss-chunk at the run's or 4,096 positions)
    lever_chunk = chunk or 4096
    with_levers = (micro_tokens * activation_bytes_per_token(p, 2, True, gpu_attention=True, loss_chunk=lever_chunk)
                   * graphs + loss_chunk_bytes(p, lever_chunk, micro_tokens))
    if cfg.full_backprop and k_max > 1:  # its blocks are recomputed already: only --loss-chunk is a lever
        with_levers = (full_backprop_bytes(p, micro_tokens, cfg.backprop_chunk, 2, lever_chunk)
                       + loss_chunk_bytes(p, lever_chunk, micro_tokens))
    static = sum(states.values())
    fits = None  # the smallest --grad-accum whose activations (with the run's options) fit in 90% of the device
    per_row = per_token * cfg.seq_len * graphs
    if cfg.full_backprop and k_max > 1:
        per_row = full_backprop_bytes(p, cfg.seq_len, cfg.backprop_chunk, 2, chunk)
    rows = cfg.batch_size // world_size
    for accum in (a for a in range(1, rows + 1) if rows % a == 0):
        micro = rows // accum * cfg.seq_len
        if static + per_row * rows // accum + loss_chunk_bytes(p, chunk, micro) <= 0.9 * GPU_MEMORY_GIB[gpu] * GIB:
            fits = accum
            break
    peak = GPU_PEAK_BF16[gpu]
    seconds = total_flops / (world_size * peak * mfu)
    token_pass = None
    if cfg.exact_states or cfg.full_backprop:  # the token-by-token pass is latency-bound: T dependent steps
        fed = sum(n for k, n in hist.items() if k > 1)
        sequential = fed * cfg.grad_accum * cfg.seq_len
        # --full-backprop: the forward's steps, their recomputation and their backward, one token after another
        sweeps = (1 + (cfg.backprop_chunk > 0) + TOKEN_STEP_BACKWARD_FACTOR) if cfg.full_backprop else 1
        latency = sequential * p["layers"] * TOKEN_STEP_LAYER_SECONDS * sweeps
        token_pass = {"fed_back_steps": fed, "sequential_token_steps": sequential,
                      "assumed_seconds_per_layer_step": TOKEN_STEP_LAYER_SECONDS, "layer_step_sweeps": sweeps,
                      "mode": "full_backprop" if cfg.full_backprop else "exact_states", "latency_seconds": latency}
        seconds += latency
    return {
        "model": p, "tokens_per_step": tokens_per_step, "steps": cfg.steps, "tokens": tokens_per_step * cfg.steps,
        "passes_histogram": hist, "flops_per_step": per_k, "total_flops": total_flops,
        "flops_per_token_pass": training_flops([{"num_passes": 1}], 1, cfg.seq_len, fp)["flops"],
        "memory_per_device_bytes": {**states, "activations": activations},
        "activations_with_levers_bytes": with_levers, "lever_loss_chunk": lever_chunk,
        "activation_checkpointing": ckpt, "loss_chunk": chunk,
        "micro_batch_tokens": micro_tokens, "grad_accum_to_fit": fits, "passes_with_graph": graphs,
        "devices": world_size, "parallel": parallel, "gpu": gpu, "gpu_memory_gib": GPU_MEMORY_GIB[gpu],
        "gpu_peak_bf16_flops": peak, "mfu": mfu, "seconds": seconds, "exact_states_pass": token_pass,
        "assumptions": ("estimates: FLOPs 6N+6LTd per token and pass with gradient (+6 N_fusion per fused pass; "
                        "without gradient its forward without the LM head, 2(N-N_head)+2LTd), causal attention; memory fp32 weights+grads+AdamW (16 B/param, sharded under FSDP) plus bf16 weight "
                        "copies, bf16 activations of the deepest K's passes with fused attention (with "
                        "--activation-checkpointing: each layer's input and one layer's insides), fp32 logits "
                        "V x 4 B per token and pass (with --loss-chunk N: none, but one chunk's logits and gradient, "
                        "N x V x 8 B); time = total FLOPs / (devices x peak x MFU)"),
    }


def _si(x: float) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def format_plan(plan: dict) -> str:
    """The plan as lines for a person."""
    m, mem = plan["model"], plan["memory_per_device_bytes"]
    tied = "tied" if m["tied_embeddings"] else "untied"
    lines = [
        f"model: {m['architecture']} d{m['hidden']} L{m['layers']} heads {m['heads']} MLP {m['intermediate']} "
        f"vocab {m['vocab']:,} ({tied} head): {m['backbone_params']:,} backbone + {m['fusion_params']:,} fusion "
        "parameters",
        f"run: {plan['steps']:,} steps x {plan['tokens_per_step']:,} tokens = {plan['tokens']:,} tokens; steps per K: "
        + ", ".join(f"K={k}: {n:,}" for k, n in plan["passes_histogram"].items()),
        "training FLOPs per step: " + ", ".join(f"K={k}: {_si(v)}" for k, v in plan["flops_per_step"].items())
        + f"; whole run {_si(plan['total_flops'])}FLOP",
        f"memory per device ({plan['devices']} x {plan['gpu'].upper()}, {plan['gpu_memory_gib']} GiB, "
        f"{plan['parallel']}; micro-batch {plan['micro_batch_tokens']:,} tokens, {plan['passes_with_graph']} "
        f"pass(es) with a graph; activation checkpointing {'on' if plan['activation_checkpointing'] else 'off'}, "
        + (f"loss chunks of {plan['loss_chunk']:,} positions" if plan["loss_chunk"] else "full fp32 logits") + "): "
        + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f} GiB" for k, v in mem.items()),
        f"time at {plan['mfu']:.0%} MFU of {_si(plan['gpu_peak_bf16_flops'])}FLOP/s bf16 per device: "
        f"{_duration(plan['seconds'])}",
    ]
    tok = plan.get("exact_states_pass")
    if tok and tok["mode"] == "full_backprop":
        lines.append(f"--full-backprop: the recurrence with gradient is {tok['sequential_token_steps']:,} dependent "
                     f"token steps of {m['layers']} layers over the run ({tok['fed_back_steps']:,} fed-back steps x "
                     f"micro-batches x row length), each run {tok['layer_step_sweeps']:g} times over (forward, "
                     "recomputation, backward at an assumed twice a forward): latency-bound, not FLOP-bound; at an "
                     f"assumed {tok['assumed_seconds_per_layer_step'] * 1e3:.2f} ms per layer and forward step (eager "
                     f"PyTorch at small batch: kernel launches; not measured) it adds {_duration(tok['latency_seconds'])}"
                     ", included in the time above")
    elif tok:
        lines.append(f"--exact-states: the token-by-token pass is {tok['sequential_token_steps']:,} dependent token "
                     f"steps of {m['layers']} layers over the run ({tok['fed_back_steps']:,} fed-back steps x "
                     "micro-batches x row length): latency-bound, not FLOP-bound; at an assumed "
                     f"{tok['assumed_seconds_per_layer_step'] * 1e3:.2f} ms per layer and step (eager PyTorch at "
                     f"small batch: kernel launches; not measured) it adds {_duration(tok['latency_seconds'])}, "
                     "included in the time above")
    lines.append(f"({plan['assumptions']})")
    static = sum(v for k, v in mem.items() if k != "activations")
    need = (static + mem["activations"]) / GIB
    if need > plan["gpu_memory_gib"]:
        fits = plan["grad_accum_to_fit"]
        levers = []
        if not plan["activation_checkpointing"]:
            levers.append("--activation-checkpointing")
        if not plan["loss_chunk"]:
            levers.append(f"--loss-chunk {plan['lever_loss_chunk']}")
        hint = (f"; with {' '.join(levers)}: about {(static + plan['activations_with_levers_bytes']) / GIB:.0f} GiB"
                if levers else "")
        lines.append(f"warning: about {need:.0f} GiB per device exceeds the {plan['gpu_memory_gib']} GiB of one "
                     + plan["gpu"].upper() + ": " + (f"--grad-accum {fits} fits (micro-batches of "
                                                    f"{plan['tokens_per_step'] // plan['devices'] // fits:,} tokens)"
                                                    if fits else "no --grad-accum fits; use more devices (FSDP)")
                     + hint)
    return "\n".join(lines)
