"""Compute of a run and of its scoring: the parameters that count, the training FLOPs of its logged steps (every
pass counted, passes without gradient at the cost of their forward), and the inference FLOPs of scoring a row in
each mode (:func:`inference_flops`: forward only, relative to ``standard``)."""

from __future__ import annotations


def flop_parameters(model) -> dict:
    """What the FLOP count needs: ``matmul_params`` (backbone parameters in matrix multiplies: all of them but an
    untied input-embedding table), ``head_params`` (the LM head's, among them), ``fusion_params``, ``layers``,
    ``hidden``."""
    backbone = getattr(model, "backbone", model)
    emb = backbone.get_input_embeddings().weight
    head = backbone.get_output_embeddings()
    tied = head is not None and (head.weight is emb or not emb.is_meta and head.weight.data_ptr() == emb.data_ptr())
    total = sum(p.numel() for p in backbone.parameters())
    matmul = total - (0 if tied else emb.numel())
    cfg = backbone.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    fusion = sum(p.numel() for p in model.feedback.parameters()) if hasattr(model, "feedback") else 0
    return {"matmul_params": int(matmul), "fusion_params": int(fusion), "layers": int(layers), "hidden": int(hidden),
            "total_backbone_params": int(total), "head_params": int(head.weight.numel()) if head is not None else 0}


def training_flops(records: list[dict], tokens_per_step: int, seq_len: int, fp: dict) -> dict:
    """Training FLOPs of a run from its ``metrics.jsonl`` training records (skipped steps cost compute too).

    Per token, a pass with gradient costs ``6·N + 6·L·T·d`` (forward 2, backward 4 FLOPs per matmul weight; the
    attention scores and their weighted sum over the causal half of the ``T x T`` matrix) plus ``6·N_fusion`` when
    it is fused (passes 2..K); a pass without gradient (the first K - N of ``--grad-passes N``) costs its forward
    only and projects no position through the LM head (it is not scored: the K-pass forward computes no logits
    there), ``2·(N - N_head) + 2·L·T·d`` plus ``2·N_fusion`` when fused. A record's ``passes_run`` / ``grad_passes_run`` (logged with ``--grad-passes`` or
    ``--pass-tol``: the passes that ran, means over micro-batches) override ``num_passes`` (all with gradient).
    ``N`` counts the norms' gains as weights too (``flop_parameters``), under 1% of a backbone's matmul weights.
    A record with ``exact_states`` (``--exact-states``) ran the token-by-token recurrence first, without gradient
    and without logits (a forward pass without the LM head, fused: the attention over the cached keys costs what
    a causal pass's does), then its ``passes_run`` teacher-forced passes, every one fused and with gradient.
    A record with ``full_backprop`` (``--full-backprop``) ran the recurrence once with gradient (a fused pass
    with gradient) and, with ``backprop_chunk`` > 0, recomputed its forward in the backward (a fused forward with
    the LM head: ``2·N + 2·L·T·d + 2·N_fusion``): 4/3 of a plain pass in all. That recomputation is an upper
    bound: torch's checkpoint stops once the saved tensors are back, so the LM head of a block's last token is not
    recomputed (about 1% of a step at the micro preset, T = 16, C = 4). ``tests/test_experiments.py`` checks both
    records against torch's FlopCounterMode on a real step.
    """
    per_pass = 6.0 * fp["matmul_params"] + 6.0 * fp["layers"] * seq_len * fp["hidden"]
    free_pass = 2.0 * (fp["matmul_params"] - fp["head_params"]) + 2.0 * fp["layers"] * seq_len * fp["hidden"]
    fused = 6.0 * fp["fusion_params"]
    steps = [r for r in records if r.get("split", "train") == "train" and "num_passes" in r]
    passes = flops_per_token = 0.0
    recompute = 2.0 * fp["matmul_params"] + 2.0 * fp["layers"] * seq_len * fp["hidden"] + fused / 3.0
    for r in steps:
        if r.get("full_backprop"):
            passes += 1
            flops_per_token += per_pass + fused + (recompute if r.get("backprop_chunk", 1) else 0.0)
            continue
        if r.get("exact_states"):
            run = float(r["passes_run"])
            passes += run
            flops_per_token += free_pass + fused / 3.0 + run * (per_pass + fused)
            continue
        run = float(r.get("passes_run", r["num_passes"]))
        grad = min(float(r.get("grad_passes_run", run)), run)
        fused_grad = min(grad, run - 1.0)  # the gradient passes are the last ones; pass 1 is never fused
        fused_free = run - 1.0 - fused_grad
        passes += run
        flops_per_token += (grad * per_pass + (run - grad) * free_pass
                            + fused_grad * fused + fused_free * fused / 3.0)
    flops = tokens_per_step * flops_per_token
    passes = int(passes) if passes == int(passes) else passes
    return {"flops": flops, "steps": len(steps), "passes": passes, "tokens": len(steps) * tokens_per_step,
            "flops_per_token_pass": per_pass}


INFERENCE_MODES = ("standard", "passes", "exact", "soft", "fused")


def inference_flops(mode: str, fp: dict, row_tokens: int, prompt_tokens: int = 0, num_passes: int = 2,
                    prefill_passes: int = 1) -> dict:
    """Forward FLOPs of scoring one row of ``row_tokens`` tokens in ``mode``, counted from what
    :func:`fullband.eval.scoring.token_nll` runs (the tokens after ``max(1, prompt_tokens)`` scored), and their
    ratio to ``standard`` on the same row (``relative``; same model, so per scored token too).

    Costs (``fp`` from :func:`flop_parameters`): a token through the backbone's body ``2·(N - N_head)``; a position
    whose logits are computed ``2·N_head``; attention ``4·L·d`` per (query, key) pair, a query at position p
    attending p + 1 keys (causal); a fused token ``2·N_fusion`` (the gate computed per token, as evaluation does;
    a decode call that fuses at least a vocabulary's worth of tokens looks it up instead). Per mode, for a row of
    T tokens and a prompt of P:

    * ``standard``: one pass over the T tokens, logits at all T;
    * ``passes`` (K = ``num_passes``): K passes over the T tokens, passes 2..K fused at every position; logits at
      all T in the last pass, at one position in each earlier one;
    * ``exact``: the recurrence, T one-token steps over a KV cache (T positions' body, logits and attention pairs
      once, as ``standard``), each but the first fused: the same FLOPs plus T - 1 fusions, but T sequential calls;
    * ``soft``: the prompt in one plain pass (logits at its last position), then the T - P - 1 continuation tokens
      before the last one fused, one step each (the last token's logits come from the step before it);
    * ``fused``: as ``soft`` after ``prefill_passes`` more passes over the prompt (each fused at all P positions,
      logits at one).

    Returns ``{"flops", "scored_tokens", "flops_per_token", "relative", "sequential_calls"}`` (``flops`` per row;
    ``sequential_calls``: backbone calls one after another, a latency proxy)."""
    if mode not in INFERENCE_MODES:
        raise ValueError(f"unknown scoring mode {mode!r}: choose one of {', '.join(INFERENCE_MODES)}")
    T, P = int(row_tokens), int(prompt_tokens)
    if T < 2 or not 0 <= P < T:
        raise ValueError(f"need a row of >= 2 tokens and a prompt shorter than it, got {T} and {P}")
    if mode in ("soft", "fused") and P < 1:
        raise ValueError(f"mode {mode!r} scores a continuation: give prompt_tokens >= 1")
    if num_passes < 1 or prefill_passes < 1:
        raise ValueError("num_passes and prefill_passes must be >= 1")
    body = 2.0 * (fp["matmul_params"] - fp["head_params"])
    head, fuse = 2.0 * fp["head_params"], 2.0 * fp["fusion_params"]
    pair = 4.0 * fp["layers"] * fp["hidden"]

    def pairs(first: int, n: int) -> float:  # (query, key) pairs of n queries at positions first .. first + n - 1
        return n * first + n * (n + 1) / 2.0

    def cost(tokens: float, logits: float, attention_pairs: float, fused: float) -> float:
        return tokens * body + logits * head + attention_pairs * pair + fused * fuse

    standard = cost(T, T, pairs(0, T), 0)
    K, C = int(num_passes), T - P
    if mode == "standard":
        flops, calls = standard, 1
    elif mode == "passes":
        flops, calls = cost(K * T, T + (K - 1), K * pairs(0, T), (K - 1) * T), K
    elif mode == "exact":
        flops, calls = cost(T, T, pairs(0, T), T - 1), T
    else:
        extra = prefill_passes if mode == "fused" else 0
        prompt = cost((1 + extra) * P, 1 + extra, (1 + extra) * pairs(0, P), extra * P)
        steps = cost(C - 1, C - 1, pairs(P, C - 1), C - 1)  # inputs: the continuation but its last token
        flops, calls = prompt + steps, 1 + extra + (C - 1)
    scored = T - max(1, P)
    return {"flops": flops, "scored_tokens": scored, "flops_per_token": flops / scored,
            "relative": flops / standard, "sequential_calls": calls}
