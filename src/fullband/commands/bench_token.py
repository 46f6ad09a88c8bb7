"""``fullband bench token``: the token-by-token pass alone, each way of running it, against a plain forward over the
same rows; and the ``exact`` prefill of a prompt against the ``soft`` one.

Owns :func:`benchmark_token` and :func:`format_token`; ``fullband bench`` (:mod:`fullband.commands.bench`)
registers the sub-command. Each token step (:data:`fullband.model.lean.TOKEN_STEPS` but ``auto``) runs the
recurrence over the same random rows without gradient and without logits (what ``--exact-states`` runs before its
gradient passes); its CPU time (or wall time on CUDA) is set against one plain no-grad forward of the same rows
without the LM head, whose FLOPs it equals but for the fusion: ``flops_rate_vs_plain`` = plain time / token-pass
time. The first call's time (a compiled step's compilation) is reported apart. The prefill rows time
:func:`fullband.model.generation.generate` with one new token on a batch-1 prompt, ``exact`` against ``soft``.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..model.generation import generate
from ..model.modeling import FullBandwidthForCausalLM
from ..training import distributed as D
from ..training.device import load_average
from ..training.presets import backbone_config

SEED = 0
GOALS = {"flops_rate_vs_plain": 0.5, "exact_prefill_vs_soft": 1.5}  # micro, T = 512 / a 512-token prompt


def _clock(device: torch.device):
    """Seconds of the process's CPU time on CPU (immune to other processes' load at one thread), wall time on
    CUDA (synchronised)."""
    if device.type == "cuda":
        def now():
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.process_time


def _model(preset: str, vocab: int, seq: int, device) -> FullBandwidthForCausalLM:
    torch.manual_seed(SEED)
    config = backbone_config(preset, vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             max_position_embeddings=max(2048, seq))
    backbone = AutoModelForCausalLM.from_config(config)
    return FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1).to(device).eval()


def _best(fn, repeats: int, clock) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


@torch.no_grad()
def benchmark_token(args) -> dict:
    """``fullband bench token``: see the module docstring."""
    hf_logging.disable_progress_bar()
    device = D.resolve_device(getattr(args, "device", "auto"))
    clock = _clock(device)
    steps = [s for s in args.token_steps if s != "auto"]
    load_before = load_average()
    g = torch.Generator().manual_seed(SEED)
    rows = []
    for preset in args.presets:
        for seq in args.seq_lens:
            model = _model(preset, args.vocab_size, seq, device)
            ids = torch.randint(3, args.vocab_size, (args.batch_size, seq), generator=g)
            ids[:, 0] = 1
            ids = ids.to(device)
            no_head = torch.empty(0, dtype=torch.long, device=device)
            plain = _best(lambda: model.backbone(input_ids=ids, logits_to_keep=no_head), args.repeats, clock)
            for step in steps:
                model.token_step = step
                t0 = time.perf_counter()
                model.recurrent_forward(ids, need_logits=False)
                first = time.perf_counter() - t0
                tok = _best(lambda: model.recurrent_forward(ids, need_logits=False), args.repeats, clock)
                rows.append({"preset": preset, "seq_len": seq, "token_step": step, "plain_forward_s": plain,
                             "token_pass_s": tok, "first_call_s": first, "flops_rate_vs_plain": plain / tok})
    prefill = []
    for preset in args.presets:
        model = _model(preset, args.vocab_size, args.prompt_len, device)
        prompt = torch.randint(3, args.vocab_size, (1, args.prompt_len), generator=g)
        prompt[:, 0] = 1
        prompt = prompt.to(device)

        def prefill_s(mode: str) -> float:
            return min(generate(model, prompt, mode=mode, max_new_tokens=1).prefill_cpu_seconds
                       if device.type == "cpu" else generate(model, prompt, mode=mode, max_new_tokens=1).prefill_seconds
                       for _ in range(args.repeats))

        soft = prefill_s("soft")
        for step in steps:
            model.token_step = step
            prefill_s("exact")  # the first call: a compiled step's compilation
            exact = prefill_s("exact")
            prefill.append({"preset": preset, "prompt_len": args.prompt_len, "token_step": step,
                            "soft_prefill_s": soft, "exact_prefill_s": exact, "exact_prefill_vs_soft": exact / soft})
    return {"device": str(device), "threads": torch.get_num_threads(), "batch_size": args.batch_size,
            "vocab_size": args.vocab_size, "repeats": args.repeats, "seed": SEED,
            "clock": "wall (synchronised)" if device.type == "cuda" else "process CPU time",
            "load_average": [load_before, load_average()], "token_pass": rows, "prefill": prefill, "goals": GOALS}


def format_token(res: dict) -> str:
    lines = [f"fullband bench token: {res['device']}, {res['threads']} thread(s), batch {res['batch_size']}, "
             f"vocabulary {res['vocab_size']:,}, best of {res['repeats']} ({res['clock']}), load "
             f"{res['load_average'][0]} -> {res['load_average'][1]}", "",
             "| preset | T | token step | plain forward (s) | token pass (s) | first call (s) | FLOP rate vs plain "
             f"(goal >= {res['goals']['flops_rate_vs_plain']:g}) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['preset']} | {r['seq_len']} | {r['token_step']} | {r['plain_forward_s']:.4f} | "
              f"{r['token_pass_s']:.4f} | {r['first_call_s']:.1f} | {r['flops_rate_vs_plain']:.2f} |"
              for r in res["token_pass"]]
    if res["prefill"]:
        lines += ["", "| preset | prompt | token step | soft prefill (s) | exact prefill (s) | exact / soft "
                      f"(goal <= {res['goals']['exact_prefill_vs_soft']:g}) |", "| --- | ---: | --- | ---: | ---: | ---: |"]
        lines += [f"| {r['preset']} | {r['prompt_len']} | {r['token_step']} | {r['soft_prefill_s']:.4f} | "
                  f"{r['exact_prefill_s']:.4f} | {r['exact_prefill_vs_soft']:.1f} |" for r in res["prefill"]]
    return "\n".join(lines)


def markdown_reports(res: dict) -> str:
    """Several ``bench token`` reports (``docs/gen/collect_runs.py``'s ``{"reports": [{"command", "report"}]}``),
    each table under its command."""
    lines = []
    for e in res["reports"]:
        lines += [f"`{e['command']}`", "", format_token(e["report"]), ""]
    return "\n".join(lines)
