"""``fullband bench serve``: tokens/s of a fullband model served by vLLM ÷ the same backbone served plainly by vLLM.

Owns the benchmark, its sub-command (registered by :func:`add_bench_parser`, called from ``fullband bench``) and
:func:`summarize_pairs`, the statistics of its paired runs. Both models are built here from one random backbone
(``--size``; the fullband one adds a ``glu`` fusion) and saved to ``--out``; both vLLM engines live in this process
tree at once (one engine-core process each), with the same settings (dtype, ``enforce_eager``, ``max_num_seqs`` =
the largest batch, KV-cache space). A run is one ``LLM.generate`` of ``batch`` prompts of ``--prompt-len`` random
tokens, ``--new-tokens`` each (EOS ignored): tokens/s = batch × new tokens / wall seconds, prefill included. A *pair*
is one fullband run and one plain run of the same batch, back to back (the order flips every repeat), so a slow
patch of a shared machine hits both sides of a pair alike; many short pairs (``--repeats``) rather than a few long
runs. Reported per batch size: the median of the paired ratios (goal >= 0.95) with a distribution-free confidence
interval for that median, their spread (min, quartiles, max), whether the interval is narrow enough to conclude
(``--max-ci-width``), and the load average (``os.getloadavg``) before and after.

``--shared-prefix N`` asks instead what prefix caching buys the fullband model on a shared-system-prompt workload:
every prompt is one N-token prefix followed by its own ``--prompt-len`` tokens, and a pair is the fullband model
with prefix caching on and the same model with it off; reported per batch size: the median paired gain (on ÷ off)
with its CI, and vLLM's own prefix-cache counters over the timed runs of the cached engine (hit tokens ÷ queried
tokens, and hit tokens ÷ the shared prefix's whole blocks of every request: the goal is >= 0.80).

``--profile DIR`` then profiles one run of each engine at the largest batch with vLLM's own torch profiler
(``profiler_config``; set only with the flag): the engine-core process writes its op table, sorted by self CPU
time, and a trace under ``DIR/<engine>/``. :func:`markdown_tables` renders a report: the CLI's text and the docs'
generated results (``docs/gen/results_tables.py``, renderer ``bench-serve``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fullband import FullBandwidthForCausalLM

from ..utils.argtypes import NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT, PROBABILITY
from .commands import require_vllm

SIZES = {"tiny": (256, 4), "small": (768, 12)}


def _size(spec: str) -> tuple[int, int]:
    spec = spec.strip().lower()
    if spec in SIZES:
        return SIZES[spec]
    m = re.fullmatch(r"d(\d+)l(\d+)", spec)
    if not m or int(m.group(1)) % 64 or int(m.group(2)) < 1:
        raise ValueError(f"unknown size {spec!r}: tiny, small or d<width>l<layers> with width a multiple of 64")
    return int(m.group(1)), int(m.group(2))


def _median_ci_rank(n: int, confidence: float) -> tuple[int, float]:
    """``(k, coverage)`` of the order-statistic interval ``[x_(k), x_(n+1-k)]`` for a median of ``n`` values.

    With ``B ~ Binomial(n, 1/2)`` (how many values fall below the true median), the interval misses the median with
    probability ``2 · P(B <= k - 1)``; ``k`` is the largest with that at most ``1 - confidence``, ``coverage`` =
    ``1 - 2 · P(B <= k - 1)``. No distributional assumption. ``k = 0`` when even ``[min, max]`` falls short (n <= 5
    at 95%); ``coverage`` is then that of ``[min, max]``, ``1 - 2^(1-n)``.
    """
    below, k = 0, 0  # below = #{outcomes with B <= k} out of 2^n
    while k < (n + 1) // 2:
        nxt = below + math.comb(n, k)
        if 2 * nxt > (1.0 - confidence) * 2**n:
            break
        below, k = nxt, k + 1
    return k, 1.0 - 2 * (below if k else 1) / 2**n  # k = 0: the coverage of [min, max]


def summarize_pairs(fullband: list[float], plain: list[float], confidence: float = 0.95,
                    max_ci_width: float = 0.10, goal: float = 0.95) -> dict:
    """Statistics of paired tokens/s (``fullband[i]`` and ``plain[i]`` measured back to back).

    Returns ``ratio`` (the median of the paired ratios fullband / plain), ``ci_low`` / ``ci_high`` (the
    order-statistic interval of :func:`_median_ci_rank`, at least ``confidence``; its exact ``ci_coverage``),
    the spread of the paired ratios (``min``, ``q1``, ``q3``, ``max``; quartiles by linear interpolation between
    order statistics), ``conclusive`` (enough pairs for the interval and ``ci_high - ci_low <= max_ci_width``) and
    ``verdict``: ``inconclusive`` when not conclusive, else ``meets goal`` (``ci_low >= goal``), ``below goal``
    (``ci_high < goal``) or ``at goal`` (the interval holds the goal).
    """
    if len(fullband) != len(plain) or not fullband:
        raise ValueError(f"paired runs needed: {len(fullband)} fullband vs {len(plain)} plain")
    if any(not x > 0 for x in [*fullband, *plain]):
        raise ValueError("tokens/s must be positive")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ratios = [f / p for f, p in zip(fullband, plain)]
    xs, n = sorted(ratios), len(ratios)
    k, coverage = _median_ci_rank(n, confidence)
    low, high = (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])
    q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2)) if n > 1 else (xs[0], xs[0])
    if not k:
        conclusive, why = False, f"too few pairs ({n}) for a {confidence:.0%} interval"
    elif high - low > max_ci_width:
        conclusive, why = False, f"CI width {high - low:.3f} > {max_ci_width:g}"
    else:
        conclusive, why = True, ""
    if not conclusive:
        verdict = "inconclusive"
    else:
        verdict = "meets goal" if low >= goal else "below goal" if high < goal else "at goal"
    return {"ratio": statistics.median(xs), "ci_low": low, "ci_high": high, "ci_confidence": confidence,
            "ci_coverage": coverage, "min": xs[0], "q1": q1, "q3": q3, "max": xs[-1], "pairs": n,
            "max_ci_width": max_ci_width, "goal": goal, "conclusive": conclusive, "verdict": verdict,
            "inconclusive_because": why, "paired_ratios": ratios}


def build_models(out: str, d: int, layers: int, vocab: int, seed: int = 0) -> tuple[str, str]:
    """Save a random Llama backbone (``plain``) and the fullband model around it (``fullband``) under ``out``."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                      num_attention_heads=d // 64, num_key_value_heads=d // 64, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    backbone = AutoModelForCausalLM.from_config(cfg).eval()
    plain, fb = os.path.join(out, "plain"), os.path.join(out, "fullband")
    backbone.save_pretrained(plain)
    torch.manual_seed(seed + 1)
    FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu").save_pretrained(fb)
    return plain, fb


def _prefix_counters(llm) -> tuple[float, float]:
    """vLLM's prefix-cache counters of an engine (tokens queried, tokens hit), from its own metrics."""
    values = {m.name: getattr(m, "value", 0.0) for m in llm.get_metrics()}
    return values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0)


def benchmark_serve(args) -> dict:
    require_vllm()
    d, layers = _size(args.size)
    batches = sorted(set(args.batch_sizes))
    if not batches or batches[0] < 1 or args.new_tokens < 1 or args.prompt_len < 1 or args.repeats < 1:
        raise ValueError("--batch-sizes, --prompt-len, --new-tokens and --repeats must be >= 1")
    if args.shared_prefix < 0:
        raise ValueError(f"--shared-prefix must be >= 0 (0: no shared prefix), got {args.shared_prefix}")
    if not 0.0 < args.confidence < 1.0 or not args.max_ci_width > 0:
        raise ValueError("--confidence must be in (0, 1) and --max-ci-width > 0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gib:g}")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the report only
    out = args.out or tempfile.mkdtemp(prefix="fullband-bench-serve-")
    os.makedirs(out, exist_ok=True)
    plain_dir, fb_dir = build_models(out, d, layers, args.vocab_size, args.seed)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    shared = args.shared_prefix
    engine = dict(dtype=args.dtype, enforce_eager=not args.compile, skip_tokenizer_init=True, seed=0,
                  max_num_seqs=max(batches), max_model_len=shared + args.prompt_len + args.new_tokens + 8,
                  enable_prefix_caching=False, disable_log_stats=not shared)
    profile = os.path.abspath(args.profile) if args.profile else None

    def settings(name: str, **more) -> dict:
        if profile:
            more["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": os.path.join(profile, name),
                                       "torch_profiler_with_stack": False}  # ops only, no Python frames
        return {**engine, **more}

    load_before, started = os.getloadavg(), time.perf_counter()
    if shared:  # the pair: the fullband model with prefix caching off, and on (built last, with vLLM's metrics:
        # a new engine's metrics logger unregisters the process's earlier vLLM metrics)
        uncached = LLM(model=fb_dir, **settings("plain", disable_log_stats=True))
        engines = {"fullband": LLM(model=fb_dir, **settings("fullband", enable_prefix_caching=True)),
                   "plain": uncached}
    else:
        engines = {"fullband": LLM(model=fb_dir, **settings("fullband")),
                   "plain": LLM(model=plain_dir, **settings("plain"))}
    rng = random.Random(args.seed)
    head = [1] + [rng.randrange(3, args.vocab_size) for _ in range(shared - 1)] if shared else [1]
    prompts = {b: [TokensPrompt(prompt_token_ids=head + [rng.randrange(3, args.vocab_size)
                                                         for _ in range(args.prompt_len - 1)]) for _ in range(b)]
               for b in batches}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run(name: str, b: int) -> float:
        t = time.perf_counter()
        outs = engines[name].generate(prompts[b], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        return b * args.new_tokens / seconds

    for b in batches:  # warm-up, untimed
        for name in engines:
            run(name, b)
    rates = {b: {"fullband": [], "plain": []} for b in batches}
    counters = {b: [0.0, 0.0] for b in batches}  # the cached engine's (queried, hit) tokens in the timed runs
    for r in range(args.repeats):
        for b in batches:
            for name in (("fullband", "plain") if r % 2 == 0 else ("plain", "fullband")):
                before = _prefix_counters(engines[name]) if shared and name == "fullband" else None
                rates[b][name].append(run(name, b))
                if before is not None:
                    after = _prefix_counters(engines[name])
                    counters[b] = [counters[b][0] + after[0] - before[0], counters[b][1] + after[1] - before[1]]
    load_after = os.getloadavg()
    profiles = {}
    if profile:  # after the timed runs, so the profiler's overhead touches none of them
        for name, llm in engines.items():
            llm.start_profile()
            run(name, batches[-1])
            llm.stop_profile()
            profiles[name] = read_profile_table(os.path.join(profile, name))
    report = {"size": {"d_model": d, "layers": layers, "vocab": args.vocab_size}, "dtype": args.dtype,
              "enforce_eager": not args.compile, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "load_average_before": load_before, "load_average_after": load_after,
              "goal_ratio": 0.95, "shared_prefix": shared, "threads": torch.get_num_threads(),
              "seconds": time.perf_counter() - started, "batch": {}}
    if profile:
        report["profile"] = {"dir": profile, "batch": batches[-1], "steps": args.new_tokens, "engines": profiles}
    if shared:
        block = engines["fullband"].llm_engine.vllm_config.cache_config.block_size
        report.update(compared="fullband with prefix caching on / off", block_size=block, goal_ratio=None,
                      goal_prefix_block_hits=0.80)
    for b in batches:
        row = {"fullband_tokens_per_s": statistics.median(rates[b]["fullband"]),
               "plain_tokens_per_s": statistics.median(rates[b]["plain"])}
        row.update(summarize_pairs(rates[b]["fullband"], rates[b]["plain"], args.confidence, args.max_ci_width))
        row.update(fullband_runs=rates[b]["fullband"], plain_runs=rates[b]["plain"])
        if shared:
            queried, hit = counters[b]
            whole = args.repeats * b * (shared // report["block_size"]) * report["block_size"]
            row.update(prefix_cache_queried_tokens=queried, prefix_cache_hit_tokens=hit,
                       hit_rate=hit / queried if queried else None,
                       prefix_block_hit_rate=hit / whole if whole else None)
        report["batch"][str(b)] = row
    for llm in engines.values():
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
    return report


_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}


def read_profile_table(directory: str) -> dict:
    """The op table vLLM's torch profiler wrote under ``directory`` (``*.profiler_out.txt``, sorted by self CPU
    time): ``{"self_cpu_total_us": ..., "ops": [[name, self CPU µs, calls], ...]}`` in its order."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".profiler_out.txt")) if os.path.isdir(
        directory) else []
    if not files:
        raise RuntimeError(f"vLLM's profiler wrote no op table under {directory}")
    ops, total = [], None
    with open(os.path.join(directory, files[-1]), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"Self CPU time total:\s*([\d.]+)\s*(\w+)", line.strip())
            if m:
                total = float(m.group(1)) * _UNITS[m.group(2)]
                continue
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) == 7 and cells[0] != "Name":
                t = re.fullmatch(r"([\d.]+)(s|ms|us|ns)", cells[2])
                if t and cells[6].isdigit():
                    ops.append([cells[0], float(t.group(1)) * _UNITS[t.group(2)], int(cells[6])])
    return {"self_cpu_total_us": total, "ops": ops}


def _profile_table(prof: dict, rows: int = 12) -> str:
    """Per engine step, the first engine's top ops by self CPU time next to the second's, and every op of the first
    that the second's table lacks ("-": not run, or below its top 50)."""
    engines = list(prof["engines"])
    a, b = (prof["engines"][n] for n in engines)
    ops_b = {op[0]: op for op in b["ops"]}
    steps = prof["steps"]
    chosen = a["ops"][:rows] + [op for op in a["ops"][rows:] if op[0] not in ops_b]
    lines = [f"| op | {engines[0]} µs / step | calls / step | {engines[1]} µs / step | calls / step |",
             "|---|---:|---:|---:|---:|"]
    for name, us, calls in chosen:
        other = ops_b.get(name)
        theirs = f"{other[1] / steps:.1f} | {other[2] / steps:.1f}" if other else "- | -"
        lines.append(f"| `{name}` | {us / steps:.1f} | {calls / steps:.1f} | {theirs} |")
    lines.append(f"| **all ops (self CPU time)** | {a['self_cpu_total_us'] / steps:.1f} | | "
                 f"{b['self_cpu_total_us'] / steps:.1f} | |")
    return (f"vLLM's torch profiler, one run at batch {prof['batch']} ({steps} new tokens a request, so {steps} engine steps: "
            f"the prefill's and {steps - 1} decode steps; self CPU µs per step; vLLM writes the top 50 ops only, so "
            f"'-' is an op the other engine did not run or ran below its top 50):\n\n" + "\n".join(lines))


def markdown_tables(report: dict) -> str:
    """A report of :func:`benchmark_serve` as Markdown (what ``fullband bench serve`` prints without ``--json``, and
    the docs' tables): the settings in a sentence, then a table a batch size."""
    s = report["size"]
    head = (f"d{s['d_model']} L{s['layers']}, vocab {s['vocab']}, {report['dtype']}, "
            f"{'eager' if report['enforce_eager'] else 'vLLM-compiled'}, prompt {report['prompt_len']} tokens, "
            f"{report['new_tokens']} new tokens, {report['repeats']} alternating pairs a batch size; load average "
            f"{report['load_average_before'][0]:.2f} before, {report['load_average_after'][0]:.2f} after.")
    if report.get("shared_prefix"):
        head = (f"{report['shared_prefix']}-token shared prefix, prefix caching on ÷ off for the fullband model "
                f"({report['block_size']}-token blocks); " + head)
        rows = ["| batch | tok/s on | tok/s off | median paired gain | 95% CI | hits / queried tokens | "
                f"hits / shared prefix's whole blocks (goal >= {report.get('goal_prefix_block_hits', 0.80)}) |",
                "|---:|---:|---:|---:|---|---:|---:|"]
        for b, r in report["batch"].items():
            rows.append(f"| {b} | {r['fullband_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                        f"{r['ratio']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['hit_rate'] or 0:.3f} | "
                        f"{r['prefix_block_hit_rate'] or 0:.3f} |")
    else:
        head = "Fullband model ÷ its plain backbone, both through vLLM; " + head
        goal = next(iter(report["batch"].values()))["goal"] if report["batch"] else 0.95
        rows = ["| batch | fullband tok/s | plain tok/s | median paired ratio | 95% CI | min / IQR / max | "
                f"verdict (goal >= {goal}) |", "|---:|---:|---:|---:|---|---|---|"]
        for b, r in report["batch"].items():
            verdict = r["verdict"] + (f" ({r['inconclusive_because']})" if r["inconclusive_because"] else "")
            rows.append(f"| {b} | {r['fullband_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                        f"{r['ratio']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['min']:.3f} / "
                        f"[{r['q1']:.3f}, {r['q3']:.3f}] / {r['max']:.3f} | {verdict} |")
    text = head + "\n\n" + "\n".join(rows)
    if report.get("profile"):
        text += "\n\n" + _profile_table(report["profile"])
    return text


def _run(args) -> int:
    # stdout carries the report only: vLLM's engine processes, which inherit this process's file descriptors, print
    # to theirs (the profiler prints its op table there), so fd 1 points at stderr while they live
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        report = benchmark_serve(args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(report, indent=2) if args.json else markdown_tables(report))
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_bench_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="vLLM tokens/s: fullband model vs the same backbone served plainly",
                             description=__doc__.split("\n\n")[0] + " Needs the 'vllm' extra.",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--size", default="tiny", help="tiny (d256 L4), small (d768 L12) or d<width>l<layers>")
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=4096)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16], help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=POSITIVE_INT, default=32)
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=32)
    p.add_argument("--repeats", type=POSITIVE_INT, default=20,
                   help="timed pairs (one run of each model, back to back) per batch size")
    p.add_argument("--confidence", type=PROBABILITY, default=0.95, help="level of the CI of the median paired ratio")
    p.add_argument("--max-ci-width", type=POSITIVE_FLOAT, default=0.10,
                   help="a CI wider than this (in ratio units) is reported as inconclusive")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    p.add_argument("--kv-cache-gib", type=POSITIVE_FLOAT, default=1.0, help="VLLM_CPU_KVCACHE_SPACE per engine, if unset")
    p.add_argument("--shared-prefix", type=NONNEG_INT, default=0, metavar="N",
                   help="a shared-system-prompt workload: every prompt starts with one N-token prefix, and the pair "
                        "is the fullband model with prefix caching on / off (gain and hit rates); 0: off")
    p.add_argument("--seed", type=NONNEG_INT, default=0)
    p.add_argument("--out", default=None, help="where the two models are saved (default: a temporary directory)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed runs, profile one run of each engine at the largest batch with vLLM's "
                        "torch profiler: op tables (self CPU time) and traces under DIR/fullband, DIR/plain")
    p.set_defaults(func=_run)
