"""``fullband bench decode``: decode tokens/s per mode, our lean loop against Hugging Face ``generate()``.

Owns :func:`benchmark_decode` (tokens/s of the decode modes, standard / soft / fused / exact, for the lean loop
:func:`fullband.model.generation.generate` and HF ``generate()``, on the same randomly initialised backbone, the
same prompts and the same number of new tokens, at batch 1 and 16, for a tiny size (d256 L4) and a GPT-2-small-like
size (d768 L12); the ratios, the FLOP-bound overhead of feedback (extra MACs / total MACs per token) and the
KV-cache bytes per mode), :func:`format_report` (its Markdown) and :func:`markdown_reports` (a collected set, for
the generated results pages). Goals (a benchmark, not a timed test): soft / standard >= 0.98 at d768 L12 batch 1
and >= 0.95 at the tiny size; lean loop >= HF ``generate()`` in standard mode; KV-cache bytes identical across
modes. ``fullband bench`` (:mod:`fullband.commands.bench`) registers the sub-command.
"""

from __future__ import annotations

import re
import statistics
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from ..model.cache import cache_bytes
from ..model.generation import MODES, generate, interleaved_decode_times
from ..model.modeling import FullBandwidthForCausalLM

SIZES = {"tiny": (256, 4), "small": (768, 12)}  # name -> (d_model, layers); "small" is GPT-2 small's shape
SEED = 0  # the random backbone's weights (the prompts: seed 1234 + batch)
GOALS = {"soft_vs_standard_small_b1": 0.98, "soft_vs_standard_tiny": 0.95, "lean_vs_hf_standard": 1.0}


def parse_size(spec: str) -> tuple[str, int, int]:
    """``tiny``, ``small`` or ``d<width>l<layers>`` (e.g. ``d64l2``) -> (name, d_model, layers)."""
    spec = spec.strip().lower()
    if spec in SIZES:
        return (spec, *SIZES[spec])
    m = re.fullmatch(r"d(\d+)l(\d+)", spec)
    if not m or int(m.group(1)) < 8 or int(m.group(2)) < 1:
        raise ValueError(f"unknown size {spec!r}: use tiny, small or d<width>l<layers> such as d64l2")
    return spec, int(m.group(1)), int(m.group(2))


def build_bench_model(family: str, d: int, layers: int, vocab: int | None, seed: int = 0, positions: int = 1024):
    """A randomly initialised fullband model (glu fusion) of the given shape; no EOS, so every run makes the same
    number of tokens."""
    heads = max(1, d // 64)
    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab or 50257, n_embd=d, n_layer=layers, n_head=heads, n_positions=positions,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif family == "llama":
        inter = int(round(8 * d / 3 / 64)) * 64 or 2 * d
        cfg = LlamaConfig(vocab_size=vocab or 32000, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=positions,
                          **common)
    else:
        raise ValueError(f"unknown family {family!r}: choose gpt2 or llama")
    torch.manual_seed(seed)
    backbone = AutoModelForCausalLM.from_config(cfg).eval()
    model = FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    backbone.generation_config.eos_token_id = None
    backbone.generation_config.pad_token_id = 0
    return model


def _linear_macs(module: nn.Module) -> int:
    """Weights used once per token in matmuls (Linear and GPT-2's Conv1D; not the embedding lookups)."""
    return sum(m.weight.numel() for m in module.modules()
               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


def flop_accounting(model, prompt_len: int, new_tokens: int, prefill_passes: int = 1) -> dict:
    """MACs per token and the extra MACs of feedback, analytically (FLOP-bound view; memory traffic aside).

    Decode, per new token: backbone matmuls + LM head + attention (2 * context * n_heads * head_dim per layer, at
    the mean context of the run). Feedback adds ``W_U h`` (+ a multiply and an RMSNorm, ~3d) and the gate: ``W_G
    norm(e)`` (+ the norm and a sigmoid, ~3d) computed per token, which is what a decode call does unless it fuses
    at least ``vocab`` tokens; such a call builds a gate table once (``vocab x d^2``) and then only looks the gate
    up (``flop_overhead_table_lookup``, the build left out: it is ``gate_table_macs``, per call). Prefill:
    ``fused`` repeats the prompt forward ``prefill_passes`` more times (+ both fusion matmuls per prompt token),
    ``exact`` adds the fusion per prompt token (same MACs as a plain pass, but token by token).
    """
    bcfg = model.config.text_config
    backbone = model.backbone
    d = bcfg.hidden_size
    layers = bcfg.num_hidden_layers
    heads = bcfg.num_attention_heads
    head_dim = getattr(bcfg, "head_dim", None) or d // heads
    head_macs = backbone.get_output_embeddings().weight.numel()
    body = _linear_macs(backbone) - head_macs
    ctx = prompt_len + new_tokens / 2
    per_token = body + head_macs + 2 * layers * ctx * heads * head_dim
    fusion = model.feedback
    w_u = fusion.value_proj.weight.numel()
    w_g = fusion.gate_proj.weight.numel()
    lookup = w_u + 3 * fusion.value_proj.out_features
    extra = lookup + w_g + 3 * fusion.gate_proj.in_features
    prompt_attn = 2 * layers * (prompt_len + 1) / 2 * heads * head_dim  # mean context inside the prompt
    prefill_plain = prompt_len * (body + prompt_attn) + head_macs
    prefill_extra = {"standard": 0, "soft": 0,
                     "fused": prefill_passes * (prefill_plain + prompt_len * (w_u + w_g)),
                     "exact": prompt_len * (w_u + w_g)}
    return {
        "macs_per_token": per_token,
        "extra_macs_per_token": extra,
        "flop_overhead": {m: (0.0 if m == "standard" else extra / per_token) for m in MODES},
        "flop_overhead_table_lookup": lookup / per_token,
        "gate_table_macs": model.get_input_embeddings().num_embeddings * w_g,
        "prefill_macs": prefill_plain,
        "prefill_flop_overhead": {m: prefill_extra[m] / prefill_plain for m in MODES},
    }


def _time_run(fn) -> tuple[float, float, object]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def resolve_clock(clock: str) -> str:
    """``cpu`` (this process's CPU time: immune to other processes taking the cores, valid with one thread and
    no accelerator), ``wall``, or ``auto`` (cpu when single-threaded on CPU, else wall)."""
    if clock == "auto":
        return "cpu" if torch.get_num_threads() == 1 and not torch.cuda.is_available() else "wall"
    return clock


def benchmark_size(name: str, d: int, layers: int, args) -> dict:
    clock = resolve_clock(args.clock)
    model = build_bench_model(args.family, d, layers, args.vocab, seed=SEED)
    vocab = model.get_input_embeddings().num_embeddings
    N, P = args.new_tokens, args.prompt_len
    modes = [m for m in args.modes if m in MODES]
    result = {"size": name, "family": args.family, "d_model": d, "layers": layers, "vocab": vocab,
              "parameters": sum(p.numel() for p in model.backbone.parameters()),
              "fusion_parameters": sum(p.numel() for p in model.feedback.parameters()),
              "prompt_len": P, "new_tokens": N, "prefill_passes": args.prefill_passes, "runs": [], "cache": {},
              "paired_decode_ratios": {}, "paired_run_ratios": {},
              **flop_accounting(model, P, N, args.prefill_passes)}
    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(1234 + batch)
        ids = torch.randint(1, vocab, (batch, P), generator=g)
        ones = torch.ones_like(ids)
        runs = []
        for mode in modes:
            if "lean" in args.loops:
                runs.append((mode, "lean", lambda m=mode: generate(
                    model, ids, mode=m, max_new_tokens=N, prefill_passes=args.prefill_passes, ignore_eos=True,
                    cache_implementation=args.cache)))
            if "hf" in args.loops:
                runs.append((mode, "hf", lambda m=mode: model.generate(
                    ids, attention_mask=ones, max_new_tokens=N, do_sample=False, feedback_mode=m,
                    prefill_passes=args.prefill_passes, eos_token_id=None, pad_token_id=0)))
        if "hf" in args.loops and "standard" in modes:
            runs.append(("standard", "hf-backbone", lambda: model.backbone.generate(
                ids, attention_mask=ones, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)))
        times = {(m, loop): {"wall": [], "cpu": []} for m, loop, _ in runs}
        decode = {(m, loop): {"wall": [], "cpu": []} for m, loop, _ in runs}
        outputs = {}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):  # the first round warms up and is not counted
                for mode, loop, fn in runs:
                    wall, cpu, out = _time_run(fn)
                    if rep == 0:
                        outputs[(mode, loop)] = out
                        continue
                    times[(mode, loop)]["wall"].append(wall)
                    times[(mode, loop)]["cpu"].append(cpu)
                    if loop == "lean":
                        steps = max(out.num_new_tokens - 1, 1)
                        decode[(mode, loop)]["wall"].append(out.decode_seconds / steps)
                        decode[(mode, loop)]["cpu"].append(out.decode_cpu_seconds / steps)
        for (mode, loop), ts in times.items():
            # best of the rounds: on a shared machine the fastest round is the one least disturbed
            t = min(ts[clock])
            run = {"mode": mode, "loop": loop, "batch": batch, "seconds": t, "tokens_per_s": batch * N / t,
                   "median_tokens_per_s": batch * N / statistics.median(ts[clock]),
                   "wall_tokens_per_s": batch * N / min(ts["wall"]), "cpu_tokens_per_s": batch * N / min(ts["cpu"]),
                   "all_wall_seconds": ts["wall"], "all_cpu_seconds": ts["cpu"]}
            if decode[(mode, loop)][clock]:
                run["decode_tokens_per_s"] = batch / min(decode[(mode, loop)][clock])
            out = outputs[(mode, loop)]
            seq = out.sequences if hasattr(out, "sequences") else out
            lean = outputs.get((mode, "lean"))
            if lean is not None and loop != "lean":
                run["same_tokens_as_lean"] = bool(torch.equal(seq, lean.sequences))
            if loop == "lean":
                sizes = cache_bytes(out.cache)
                result["cache"].setdefault(mode, {"kv_bytes": sizes["kv"], "state_bytes": sizes["state"],
                                                  "batch": batch, "cache": type(out.cache).__name__})
            result["runs"].append(run)
        for (mode, loop), ts in times.items():
            # the runs of one round ran back to back: the median of the per-round ratios is a paired measure
            std = times.get(("standard", loop))
            if mode != "standard" and std is not None and loop != "hf-backbone":
                result["paired_run_ratios"][f"{mode}/standard {loop} b{batch}"] = statistics.median(
                    a / b for a, b in zip(std[clock], ts[clock]))
        if "lean" in args.loops and "standard" in modes and len(modes) > 1:
            # the same decode steps run in lockstep: a paired measure of feedback's decode cost
            tick = time.process_time if clock == "cpu" else time.perf_counter
            steps = {m: [] for m in modes}
            for _ in range(max(1, args.repeats)):
                for m, ts in interleaved_decode_times(model, ids, modes, N, args.cache, tick,
                                                      args.prefill_passes).items():
                    steps[m].extend(ts)
            std = statistics.median(steps["standard"])
            for m in modes:
                if m != "standard":
                    result["paired_decode_ratios"][f"{m}/standard lean b{batch}"] = std / statistics.median(steps[m])
    result["ratios"] = _ratios(result["runs"])
    return result


def _ratios(runs: list[dict]) -> dict:
    by = {(r["mode"], r["loop"], r["batch"]): r for r in runs}
    ratios = {}
    for (mode, loop, batch), r in by.items():
        std = by.get(("standard", loop, batch))
        if std is not None and mode != "standard":
            ratios[f"{mode}/standard {loop} b{batch}"] = r["tokens_per_s"] / std["tokens_per_s"]
            if "decode_tokens_per_s" in r and "decode_tokens_per_s" in std:
                ratios[f"{mode}/standard {loop} b{batch} decode-only"] = (r["decode_tokens_per_s"]
                                                                         / std["decode_tokens_per_s"])
        if loop == "lean":
            for other in ("hf", "hf-backbone"):
                o = by.get((mode, other, batch))
                if o is not None:
                    ratios[f"lean/{other} {mode} b{batch}"] = r["tokens_per_s"] / o["tokens_per_s"]
    return ratios


def _goal_checks(report: dict) -> list[dict]:
    checks = []
    for size in report["sizes"]:
        r = size["ratios"]
        goal = GOALS["soft_vs_standard_small_b1"] if size["size"] == "small" else GOALS["soft_vs_standard_tiny"]
        for name, value in (("soft/standard lean b1 (separate runs)", r.get("soft/standard lean b1")),
                            ("soft/standard lean b1 decode (paired steps)",
                             size["paired_decode_ratios"].get("soft/standard lean b1"))):
            if value is not None:
                checks.append({"size": size["size"], "check": name, "value": value, "goal": goal,
                               "met": value >= goal})
        for key, value in r.items():
            if key.startswith("lean/hf standard") or key.startswith("lean/hf-backbone standard"):
                checks.append({"size": size["size"], "check": key, "value": value,
                               "goal": GOALS["lean_vs_hf_standard"], "met": value >= GOALS["lean_vs_hf_standard"]})
        kv = {m["kv_bytes"] for m in size["cache"].values()}
        if not kv:  # no lean-loop run (--loops hf): no cache was measured
            continue
        checks.append({"size": size["size"], "check": "kv bytes identical across modes", "value": len(kv) == 1,
                       "goal": True, "met": len(kv) == 1})
    return checks


def benchmark_decode(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cache": args.cache,
              "clock": resolve_clock(args.clock), "repeats": args.repeats, "seed": SEED, "sizes": []}
    for spec in args.sizes:
        name, d, layers = parse_size(spec)
        report["sizes"].append(benchmark_size(name, d, layers, args))
    report["goals"] = _goal_checks(report)
    return report


def format_report(report: dict) -> str:
    """The report as Markdown (what ``fullband bench decode`` prints without ``--json``, and the generated results
    page): per size its runs, the ratios (separate runs, paired by round, decode steps interleaved), the FLOP
    overhead and the KV-cache bytes; then the goals."""
    lines = [f"fullband bench decode: {report['threads']} thread(s), torch {report['torch']}, lean-loop cache "
             f"{report['cache']}, clock {report['clock']}, best of {report.get('repeats', '?')} rounds"]
    for size in report["sizes"]:
        lines += ["", f"**{size['size']}**: {size['family']} d{size['d_model']} L{size['layers']} vocabulary "
                      f"{size['vocab']:,} ({size['parameters'] / 1e6:.1f}M parameters, fusion "
                      f"{size['fusion_parameters'] / 1e6:.2f}M); prompt {size['prompt_len']}, {size['new_tokens']} "
                      "new tokens", "",
                  "| mode | loop | batch | tokens/s | decode tokens/s | same tokens as the lean loop |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]
        for r in size["runs"]:
            dec = f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "-"
            same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_lean"), "")
            lines.append(f"| {r['mode']} | {r['loop']} | {r['batch']} | {r['tokens_per_s']:.1f} | {dec} | {same} |")
        lines += ["", "| ratio | separate runs (best rounds) | paired by round (median) | decode steps interleaved "
                      "(median step) |", "| --- | ---: | ---: | ---: |"]
        for k in dict.fromkeys([*size["ratios"], *size["paired_run_ratios"], *size["paired_decode_ratios"]]):
            if k.endswith("decode-only"):
                continue
            cells = [size[d].get(k) for d in ("ratios", "paired_run_ratios", "paired_decode_ratios")]
            lines.append(f"| {k} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in cells) + " |")
        lines += ["", f"FLOP overhead per decoded token (extra MACs / total MACs), gate computed per token: "
                      f"{size['flop_overhead']['soft']:.4%} ({size['extra_macs_per_token']:,} / "
                      f"{size['macs_per_token']:,.0f}); a call that fuses >= {size['vocab']:,} tokens looks it up "
                      f"in a table instead: {size['flop_overhead_table_lookup']:.4%} per token + "
                      f"{size['gate_table_macs']:,} MACs once per call. Prefill FLOP overhead: "
                      + ", ".join(f"{m} {v:.2%}" for m, v in size["prefill_flop_overhead"].items()) + ".",
                  "", "KV-cache bytes per mode: " + (", ".join(
                      f"{m} {c['kv_bytes']:,} (+{c['state_bytes']:,} state, batch {c['batch']}, {c['cache']})"
                      for m, c in size["cache"].items()) or "not measured (no lean-loop run)") + "."]
    lines += ["", "Goals:", ""] if report["goals"] else ["", "Goals: none apply to these runs (they need the lean loop)."]
    for c in report["goals"]:
        value = f"{c['value']:.3f}" if isinstance(c["value"], float) else str(c["value"])
        lines.append(f"- {'met' if c['met'] else '**NOT met**'}: {c['size']}, {c['check']} = {value} "
                     f"(goal {c['goal']})")
    return "\n".join(lines)


def markdown_reports(res: dict) -> str:
    """A set of ``bench decode`` reports (``{"reports": [{"command", "report"}, ...]}``, as
    ``docs/gen/collect_runs.py`` writes them), each under its command."""
    return "\n\n".join(f"`{e['command']}`\n\n{format_report(e['report'])}" for e in res["reports"])


def print_report(report: dict) -> None:
    print(format_report(report))
