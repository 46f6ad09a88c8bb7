"""``fullband experiment``: the paper's two questions, asked at a size a CPU can answer.

``fullband experiment data-efficiency``
    Does latent feedback buy data efficiency, and is it just more compute? Plain baselines are trained at several
    token budgets (default 0.5×, 0.75×, 1.0×, 1.25×, 1.5× of the base budget; every budget a run of its own with
    its own full LR schedule, not an intermediate checkpoint of a longer run), and one FBT model at 1.0× with the
    recipe given (feedback switched on late, K passes, deep steps, prefix mixing, jitter). All runs share the
    seed, the tokenizer and the data order (so every run reads the same batches in the same order, the longer
    runs then read further). All are evaluated on the same held-out rows: the baselines in standard mode, FBT in
    standard, K-pass and exact mode (exact = the token-by-token recurrence decoding runs; the headline figure).

    Reported: FBT's *effective token multiplier* -- the training tokens at which the baseline curve reaches FBT's
    held-out loss (linear interpolation of loss in log-tokens between the two budgets that bracket it), divided
    by FBT's tokens -- and the same on the compute axis: training FLOPs counting every pass (a K-pass step costs
    K forward+backward passes), ``6·N·tokens + 6·L·T·d·tokens`` per pass (N = parameters used in matrix
    multiplies: the backbone without its input-embedding table, plus the fusion on fused passes; L layers, T the
    sequence length, d the width). A compute multiplier above 1 means a plain transformer would need more FLOPs
    than FBT used to reach FBT's loss; the baseline's loss at FBT's FLOPs is reported next to it (matched
    compute). Where FBT's loss is outside the baseline curve, the report says "below the range" (worse than the
    smallest budget) or "above the range" (better than the largest) instead of extrapolating.

``fullband experiment reasoning``
    A baseline and an FBT model trained on the same synthetic chain-of-thought data (:mod:`fullband.reasoning`:
    2-3 step addition and subtraction by default) for the same tokens, then greedy decoding on held-out problems
    (none of whose questions occur in training): the baseline in standard mode, FBT in standard, soft and exact
    mode.
    Reported: accuracy (math-verify), reasoning-trace length (tokens before ``####``), and paired statistics
    (exact McNemar on correctness, percentile-bootstrap CI of the trace-length difference) between the
    baseline and each FBT mode and between FBT's modes.

Both write ``results.json`` and ``report.md`` (data-efficiency also ``loss_vs_tokens_flops.png``) into ``--out``
and print the tables; the trained models stay in ``OUT/runs/``. Defaults are sized for 2 CPU cores in under
30 minutes each.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import platform
import shutil
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus, Document, pack, tokenize_documents, train_tokenizer
from ..eval.flops import flop_parameters, training_flops
from ..eval.reasoning import (
    ANSWER_MARKER,
    compare_runs,
    evaluate_reasoning,
    format_example,
    make_problems,
    report_markdown,
    summarize,
)
from ..eval.scoring import evaluate_loss
from ..model.generation import MODES
from ..model.modeling import load_model
from ..training.config import TrainConfig, make_config
from ..training.pretrain import build_tokenizer_and_corpus, train
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl
from .quickstart import copy_branch
from .recipe import add_parser as add_recipe_parser

DE_DEFAULTS = dict(out=os.path.join("runs", "experiments", "data-efficiency"), preset="tiny", steps=100,
                   batch_size=16, seq_len=256, vocab_size=4096, multipliers="0.5,0.75,1,1.25,1.5", eval_rows=128,
                   data="shakespeare")
RS_DEFAULTS = dict(out=os.path.join("runs", "experiments", "reasoning"), preset="tiny", steps=600, batch_size=16,
                   seq_len=128, vocab_size=300, task="arithmetic", train_problems=20000, test_problems=200,
                   max_new_tokens=64)
# The default arithmetic problems are 2-3 additions / subtractions of 1..9 ("3+8-9=?" -> "3+8=11; 11-9=2. #### 2"):
# a chain a `tiny` model learns within the CPU budget. Probes of the baseline (tiny, 16 x 128 tokens a step): the
# generator's own default (2-4 operators with *) reached 3.5% accuracy after 300 steps (512-entry BPE) and 10% after
# 600 (300-entry BPE), too close to the floor to compare anything; 2-3 of +/- (300-entry BPE) reached 9% after 300
# steps and 94% after 600, hence 600 steps.
TASK_DEFAULTS = {"arithmetic": {"num_ops": (2, 3), "ops": "+-"}}

# recipe knobs shared by both experiments: (flag, TrainConfig field, type)
RECIPE = (("--feedback-start", "feedback_start", float), ("--num-passes", "num_passes", int),
          ("--deep-passes", "deep_passes", int), ("--deep-fraction", "deep_fraction", float),
          ("--prefix-mix", "prefix_mix", float), ("--jitter", "jitter", float),
          ("--feedback-weight", "feedback_weight", float), ("--fusion-lr-mult", "fusion_lr_mult", float),
          ("--fusion", "fusion", str), ("--lr", "lr", float), ("--lr-schedule", "lr_schedule", str),
          ("--warmup-fraction", "warmup_fraction", float))


# ============================================================================================== shared


def _say(args):
    return (lambda *a: None) if getattr(args, "quiet", False) else (lambda *a: print(*a, file=sys.stderr, flush=True))


def parse_settings(items: list[str] | None) -> dict:
    """``--set NAME=VALUE`` pairs (VALUE parsed as YAML: numbers, true/false, lists) for any ``fullband train``
    option; names with dashes or underscores."""
    names = set(TrainConfig.field_names())
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set takes NAME=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        name = key.strip().lstrip("-").replace("-", "_")
        if name not in names or name in ("out", "steps", "stop_after", "resume", "debug_nan_steps",
                                         "debug_kill_at_step", "init_from"):
            raise ValueError(f"--set: {key!r} is not a `fullband train` option this experiment can set")
        import yaml

        try:
            value = yaml.safe_load(raw)
        except Exception:  # noqa: BLE001 - keep the raw text
            value = raw
        out[name] = value
    return out


def recipe_from_args(args) -> dict:
    """The FBT recipe options given on the command line (``None`` = the ``fullband train`` default)."""
    recipe = {field: getattr(args, field) for _, field, _ in RECIPE if getattr(args, field) is not None}
    if args.detach_state:
        recipe["detach_state"] = True
    return recipe


def add_recipe_arguments(p) -> None:
    defaults = TrainConfig()
    g = p.add_argument_group("FBT recipe (defaults: fullband train's)")
    for flag, field, typ in RECIPE:
        meta = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}[field]
        shown = getattr(defaults, field)
        g.add_argument(flag, dest=field, type=typ, default=None,
                       help=f"{meta['help']} (default: {shown if shown is not None else 'the preset’s'})")
    g.add_argument("--detach-state", action="store_true", help="stop gradients through the fed-back state")
    g.add_argument("--set", dest="settings", action="append", metavar="NAME=VALUE", default=None,
                   help="any other `fullband train` option for every run (repeatable), e.g. --set grad_clip=0.5")


def add_common_arguments(p, defaults: dict) -> None:
    p.add_argument("--out", default=defaults["out"], help="output directory (default: %(default)s)")
    p.add_argument("--preset", default=defaults["preset"],
                   help="model size preset (micro, tiny, small, gpt2-small) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=defaults["steps"],
                   help="optimizer steps per model (data-efficiency: of the FBT run, the 1.0x budget) "
                        "(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=None,
                   help="training tokens per model (data-efficiency: of the FBT run) instead of --steps (rounded "
                        "up to whole steps)")
    p.add_argument("--batch-size", type=int, default=defaults["batch_size"],
                   help="rows per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=defaults["seq_len"], help="tokens per row (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=defaults["vocab_size"],
                   help="BPE vocabulary size (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of init, split, data order (shared by every run) (default: %(default)s)")
    p.add_argument("--no-share-prefix", action="store_true",
                   help="train the FBT run from scratch instead of branching it off the 1.0x baseline at the "
                        "feedback start (the two are bit-identical until then)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", action="store_true", help="print only the tables")


def _steps(args) -> int:
    if args.tokens is not None:
        if args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        return max(1, math.ceil(args.tokens / (args.batch_size * args.seq_len)))
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    return args.steps


def _base_config(args, out: str, steps: int, data: str, **extra):
    values = dict(out=out, steps=steps, seed=args.seed, preset=args.preset, seq_len=args.seq_len,
                  batch_size=args.batch_size, vocab_size=args.vocab_size, data=data, progress=not args.no_progress,
                  tensorboard=False, plot=False, eval_every=steps, eval_rows=32, device=args.device, save_every=0)
    values.update(parse_settings(args.settings))
    values.update(recipe_from_args(args))
    values.update(extra)
    cfg = make_config(values)
    assert isinstance(cfg, TrainConfig)
    return cfg


def _plain(cfg):
    """The baseline of ``cfg``: K = 1 on every step (the FBT class with feedback never on = its backbone)."""
    return dataclasses.replace(cfg, num_passes=1, deep_passes=1)


def train_pair(base_cfg, fbt_cfg, corpus, share: bool = True) -> tuple[dict, dict, int]:
    """Train the baseline and the FBT run (same steps, seed, data). With ``share``, the K = 1 steps before the
    feedback start (identical in both) are trained once and the FBT run resumes from the baseline's checkpoint
    there. Returns both summaries and the number of shared steps."""
    start = fbt_cfg.schedule().start_step(fbt_cfg.steps)
    share = share and 0 < start < fbt_cfg.steps and base_cfg.steps == fbt_cfg.steps
    if share:
        first = train(dataclasses.replace(base_cfg, stop_after=start), overwrite=True, corpus=corpus,
                      name=f"{_name(base_cfg)}+{_name(fbt_cfg)} (shared K=1 steps)")
        copy_branch(base_cfg.out, fbt_cfg.out, first["checkpoint"], start)
        base = train(base_cfg, resume=True, corpus=corpus, name=_name(base_cfg))
        fbt = train(fbt_cfg, resume=True, corpus=corpus, name=_name(fbt_cfg))
    else:
        base = train(base_cfg, overwrite=True, corpus=corpus, name=_name(base_cfg))
        fbt = train(fbt_cfg, overwrite=True, corpus=corpus, name=_name(fbt_cfg))
    for s in (base, fbt):
        _check_done(s)
    return base, fbt, start if share else 0


def _name(cfg) -> str:
    return os.path.basename(os.path.normpath(cfg.out))


def _check_done(summary: dict) -> None:
    if summary["status"] != "done":
        raise RuntimeError(f"training did not finish: {summary['message']}")
    shutil.rmtree(os.path.join(summary["out"], "checkpoints"), ignore_errors=True)


# ============================================================================================== FLOPs


# ============================================================================================== interpolation


def crossing(points: list[tuple[float, float]], loss: float) -> dict:
    """Where a baseline curve ``[(x, loss), ...]`` (x = tokens or FLOPs) first reaches ``loss``, linearly in
    ``log x`` between the two points that bracket it.

    Returns ``{"x", "status", "monotone"}``: ``status`` ``inside`` (``x`` set), ``below_range`` (even the smallest
    x has a loss at or below ``loss``: the baseline needs at most the smallest budget; ``x`` None) or
    ``above_range`` (no point reaches ``loss``: the baseline needs more than the largest budget; ``x`` None).
    ``monotone`` says whether the curve's loss falls with every larger budget."""
    pts = sorted(points)
    if len(pts) < 2:
        raise ValueError("the baseline curve needs at least two budgets")
    monotone = all(b[1] < a[1] for a, b in zip(pts, pts[1:]))
    if pts[0][1] <= loss:
        return {"x": None, "status": "below_range", "monotone": monotone}
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if y1 <= loss:
            frac = (y0 - loss) / (y0 - y1)
            return {"x": math.exp(math.log(x0) + frac * (math.log(x1) - math.log(x0))), "status": "inside",
                    "monotone": monotone}
    return {"x": None, "status": "above_range", "monotone": monotone}


def loss_at(points: list[tuple[float, float]], x: float) -> dict:
    """The baseline curve's loss at ``x`` (linear in ``log x`` between the bracketing points), or ``None`` with
    ``status`` ``below_range`` / ``above_range`` when ``x`` is outside the budgets."""
    pts = sorted(points)
    if x < pts[0][0]:
        return {"loss": None, "status": "below_range"}
    if x > pts[-1][0]:
        return {"loss": None, "status": "above_range"}
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            frac = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return {"loss": y0 + frac * (y1 - y0), "status": "inside"}
    return {"loss": pts[-1][1], "status": "inside"}


def describe_multiplier(c: dict, reference: float, smallest: float, largest: float) -> str:
    if c["status"] == "inside":
        return f"{c['x'] / reference:.3f}x"
    if c["status"] == "below_range":
        return f"< {smallest / reference:.3f}x (below the range)"
    return f"> {largest / reference:.3f}x (above the range)"


# ============================================================================================== data efficiency


def parse_multipliers(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"--multipliers must be comma-separated numbers, got {text!r}") from None
    if len(values) < 2 or any(v <= 0 for v in values):
        raise ValueError(f"--multipliers needs at least two positive budgets, got {text!r}")
    if 1.0 not in values:
        raise ValueError("--multipliers must include 1 (the baseline at FBT's own budget)")
    return values


def run_data_efficiency(args) -> dict:
    hf_logging.disable_progress_bar()
    say = _say(args)
    t_all = time.perf_counter()
    steps = _steps(args)
    mults = parse_multipliers(args.multipliers)
    if args.eval_rows < 1:
        raise ValueError(f"--eval-rows must be >= 1, got {args.eval_rows}")
    runs_dir = os.path.join(args.out, "runs")
    fbt_cfg = _base_config(args, os.path.join(runs_dir, "fbt-1.00x"), steps, args.data)
    if fbt_cfg.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT run, got {fbt_cfg.num_passes}")
    budgets = {}
    for m in mults:
        s = max(1, round(m * steps))
        if s in budgets.values():
            raise ValueError(f"--multipliers {args.multipliers!r} give the same number of steps twice at "
                             f"--steps {steps}")
        budgets[m] = s
    base_cfgs = {m: _plain(dataclasses.replace(fbt_cfg, out=os.path.join(runs_dir, f"baseline-{m:.2f}x"), steps=s,
                                               eval_every=s))
                 for m, s in budgets.items()}
    for c in [fbt_cfg, *base_cfgs.values()]:
        c.validate()

    t = time.perf_counter()
    corpus = build_tokenizer_and_corpus(fbt_cfg)
    t_data = time.perf_counter() - t
    tokens_per_step = fbt_cfg.batch_size * fbt_cfg.seq_len
    say(f"data-efficiency: {corpus.train_rows.numel():,} training tokens, {corpus.val_rows.shape[0]} held-out rows; "
        f"base budget {steps} steps x {tokens_per_step:,} = {steps * tokens_per_step:,} tokens; baselines at "
        + ", ".join(f"{m:g}x ({s} steps)" for m, s in budgets.items()) + "; FBT at 1x")
    if corpus.train_rows.shape[0] < budgets[max(mults)] * fbt_cfg.batch_size:
        say(f"data-efficiency: note: the largest budget reads {budgets[max(mults)] * fbt_cfg.batch_size} rows of "
            f"{corpus.train_rows.shape[0]}: more than one epoch")

    # ---- training
    t = time.perf_counter()
    summaries = {}
    _, fbt_sum, shared = train_pair(base_cfgs[1.0], fbt_cfg, corpus, share=not args.no_share_prefix)
    summaries["fbt"] = fbt_sum
    for m, c in base_cfgs.items():
        if m == 1.0:
            continue
        s = train(c, overwrite=True, corpus=corpus, name=_name(c))
        _check_done(s)
    t_train = time.perf_counter() - t

    # ---- evaluation on the same held-out rows
    t = time.perf_counter()
    rows = corpus.val_rows[: args.eval_rows]
    if rows.shape[0] == 0:
        raise ValueError("no held-out rows: use a --data with more documents or a larger --set val_fraction=...")
    say(f"data-efficiency: evaluating on {rows.shape[0]} held-out rows ({rows[:, 1:].numel():,} predicted tokens)")
    K = fbt_cfg.num_passes
    points = []
    fp = None
    for m, c in base_cfgs.items():
        model = load_model(c.out).eval()
        fp = fp or flop_parameters(model)
        ev = evaluate_loss(model, rows, "standard")
        fl = training_flops(read_jsonl(os.path.join(c.out, "metrics.jsonl")), tokens_per_step, c.seq_len, fp)
        points.append({"run": _name(c), "model": "baseline", "multiplier": m, "steps": c.steps,
                       "tokens": fl["tokens"], "flops": fl["flops"], "passes": fl["passes"],
                       "loss": ev["loss"], "eval_tokens": ev["tokens"]})
        del model
    fbt = load_model(fbt_cfg.out).eval()
    fbt_fp = flop_parameters(fbt)
    fl = training_flops(read_jsonl(os.path.join(fbt_cfg.out, "metrics.jsonl")), tokens_per_step, fbt_cfg.seq_len,
                        fbt_fp)
    fbt_modes = {}
    for mode, label in (("standard", "standard (K=1, no feedback)"), ("passes", f"K-pass (K={K}, teacher-forced)"),
                        ("exact", "exact (token-by-token recurrence)")):
        ev = evaluate_loss(fbt, rows, mode, num_passes=K)
        fbt_modes[mode] = {"label": label, "loss": ev["loss"]}
    t_eval = time.perf_counter() - t

    # ---- comparisons
    tok_curve = [(p["tokens"], p["loss"]) for p in points]
    flop_curve = [(p["flops"], p["loss"]) for p in points]
    base1 = next(p for p in points if p["multiplier"] == 1.0)
    lo_t, hi_t = min(x for x, _ in tok_curve), max(x for x, _ in tok_curve)
    lo_f, hi_f = min(x for x, _ in flop_curve), max(x for x, _ in flop_curve)
    comparisons = {}
    for mode, info in fbt_modes.items():
        ct, cf = crossing(tok_curve, info["loss"]), crossing(flop_curve, info["loss"])
        matched = loss_at(flop_curve, fl["flops"])
        comparisons[mode] = {
            "label": info["label"], "fbt_loss": info["loss"],
            "baseline_same_tokens_loss": base1["loss"], "delta_same_tokens": info["loss"] - base1["loss"],
            "token_multiplier": ct["x"] / fl["tokens"] if ct["x"] else None, "token_status": ct["status"],
            "token_multiplier_text": describe_multiplier(ct, fl["tokens"], lo_t, hi_t),
            "compute_multiplier": cf["x"] / fl["flops"] if cf["x"] else None, "compute_status": cf["status"],
            "compute_multiplier_text": describe_multiplier(cf, fl["flops"], lo_f, hi_f),
            "baseline_matched_compute_loss": matched["loss"], "matched_compute_status": matched["status"],
            "delta_matched_compute": (info["loss"] - matched["loss"]) if matched["loss"] is not None else None,
        }
    monotone = crossing(tok_curve, float("inf"))["monotone"]
    wall = time.perf_counter() - t_all
    results = {
        "experiment": "data-efficiency", "headline_mode": "exact", "headline": comparisons["exact"],
        "baselines": points,
        "fbt": {"run": _name(fbt_cfg), "steps": fbt_cfg.steps, "tokens": fl["tokens"], "flops": fl["flops"],
                "passes": fl["passes"], "modes": fbt_modes, "num_passes": K},
        "comparisons": comparisons, "baseline_curve_monotone": monotone,
        "flop_formula": "per token and pass 6*N + 6*L*T*d (N = backbone matmul parameters, i.e. without the input "
                        "embedding table; L layers, T seq_len, d hidden), plus 6*N_fusion on fused passes; every "
                        "pass of a K-pass step counted; evaluation not counted",
        "flop_parameters": fp, "fbt_flop_parameters": fbt_fp,
        "recipe": {k: getattr(fbt_cfg, k) for k in ("feedback_start", "num_passes", "deep_passes", "deep_fraction",
                                                     "prefix_mix", "jitter", "feedback_weight", "fusion_lr_mult",
                                                     "fusion", "detach_state", "lr_schedule", "warmup_fraction")},
        "lr": fbt_cfg.resolved_lr(), "preset": fbt_cfg.preset, "seed": fbt_cfg.seed, "data": fbt_cfg.data,
        "batch_size": fbt_cfg.batch_size, "seq_len": fbt_cfg.seq_len, "vocab_size": len(corpus.tokenizer),
        "base_steps": steps, "multipliers": mults, "shared_prefix_steps": shared,
        "eval_rows": int(rows.shape[0]), "eval_tokens": base1["eval_tokens"], "val_documents": corpus.val_docs,
        "corpus_train_tokens": corpus.train_rows.numel(),
        "seconds": {"data": t_data, "train": t_train, "eval": t_eval, "total": wall},
        "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "argv": sys.argv[1:],
    }
    plot_path = os.path.join(args.out, "loss_vs_tokens_flops.png")
    try:
        plot_data_efficiency(results, plot_path)
        results["plot"] = os.path.basename(plot_path)
    except Exception as err:  # noqa: BLE001 - a plot is not worth failing a finished experiment
        say(f"warning: could not draw {plot_path}: {err}")
    atomic_write_json(os.path.join(args.out, "results.json"), results)
    tables = data_efficiency_tables(results)
    atomic_write_text(os.path.join(args.out, "report.md"), data_efficiency_report(results, tables))
    print(tables)
    print(f"\n{wall:.0f}s in all (training {t_train:.0f}s, evaluation {t_eval:.0f}s). "
          f"Report: {os.path.join(args.out, 'report.md')}")
    return results


def _fmt_flops(x: float) -> str:
    return f"{x:.3g}"


def data_efficiency_tables(res: dict) -> str:
    lines = ["| run | model / mode | steps | tokens | train FLOPs | held-out loss |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for p in sorted(res["baselines"], key=lambda p: p["tokens"]):
        lines.append(f"| {p['run']} | baseline / standard | {p['steps']} | {p['tokens']:,} | {_fmt_flops(p['flops'])} "
                     f"| {p['loss']:.4f} |")
    f = res["fbt"]
    for mode, info in f["modes"].items():
        lines.append(f"| {f['run']} | FBT / {info['label']} | {f['steps']} | {f['tokens']:,} | "
                     f"{_fmt_flops(f['flops'])} "
                     f"| {info['loss']:.4f} |")
    lines += ["", "| FBT mode | FBT loss | baseline 1.0x (same tokens) | Δ | effective token multiplier | "
                  "baseline at FBT's FLOPs | Δ (matched compute) | compute multiplier |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, c in res["comparisons"].items():
        matched = (f"{c['baseline_matched_compute_loss']:.4f}" if c["baseline_matched_compute_loss"] is not None
                   else c["matched_compute_status"].replace("_", " "))
        dm = f"{c['delta_matched_compute']:+.4f}" if c["delta_matched_compute"] is not None else "–"
        lines.append(f"| {c['label']} | {c['fbt_loss']:.4f} | {c['baseline_same_tokens_loss']:.4f} | "
                     f"{c['delta_same_tokens']:+.4f} | {c['token_multiplier_text']} | {matched} | {dm} | "
                     f"{c['compute_multiplier_text']} |")
    return "\n".join(lines)


def data_efficiency_report(res: dict, tables: str) -> str:
    h = res["headline"]
    r = res["recipe"]
    if h["token_status"] == "inside":
        verdict_tokens = (f"the baseline needs {h['token_multiplier']:.3f}x FBT's tokens to reach FBT's exact-mode "
                          "loss (effective token multiplier)")
    elif h["token_status"] == "below_range":
        verdict_tokens = ("FBT's exact-mode loss is worse than even the smallest baseline budget's "
                          f"({min(res['multipliers']):g}x): effective token multiplier below the range")
    else:
        verdict_tokens = ("FBT's exact-mode loss is better than the largest baseline budget's "
                          f"({max(res['multipliers']):g}x): effective token multiplier above the range")
    if h["compute_status"] == "inside":
        verdict_compute = (f"on the FLOPs axis the baseline reaches it with {h['compute_multiplier']:.3f}x FBT's "
                           f"training compute ({'less' if h['compute_multiplier'] < 1 else 'more'} than FBT used)")
    elif h["compute_status"] == "below_range":
        verdict_compute = "on the FLOPs axis the baseline reaches it with less compute than its smallest budget"
    else:
        verdict_compute = "on the FLOPs axis no baseline budget reaches it"
    lines = [
        "# fullband experiment data-efficiency", "",
        f"Preset `{res['preset']}`, {res['batch_size']} rows x {res['seq_len']} tokens per step, vocabulary "
        f"{res['vocab_size']:,}, seed {res['seed']}, data `{res['data']}` ({res['corpus_train_tokens']:,} training "
        f"tokens). Baselines (K=1 throughout) at {', '.join(f'{m:g}x' for m in res['multipliers'])} of "
        f"{res['base_steps']} steps, each a separate run with its own full {r['lr_schedule']} LR schedule (peak "
        f"{res['lr']:g}); FBT at 1x: plain for the first {r['feedback_start']:.0%} of its steps, then K="
        f"{r['num_passes']} ({r['deep_fraction']:.0%} of the feedback steps at K={r['deep_passes']}), prefix mixing "
        f"p={r['prefix_mix']}, jitter {r['jitter']}, λ={r['feedback_weight']}, fusion `{r['fusion']}` "
        f"(LR x{r['fusion_lr_mult']}){', state detached' if r['detach_state'] else ''}. Same seed, tokenizer and "
        "data order in every run."
        + (f" The first {res['shared_prefix_steps']} steps of FBT and the 1x baseline are identical and were "
           "trained once." if res["shared_prefix_steps"] else ""),
        "",
        f"Held-out loss: {res['eval_rows']} rows of the held-out documents ({res['eval_tokens']:,} predicted tokens), "
        "the same rows for every line.",
        "",
        tables,
        "",
        f"**Headline (FBT in exact mode, what decoding computes):** {h['fbt_loss']:.4f} vs "
        f"{h['baseline_same_tokens_loss']:.4f} "
        f"for the baseline on the same tokens (Δ {h['delta_same_tokens']:+.4f}); {verdict_tokens}; {verdict_compute}.",
        "",
        "Effective multiplier: the tokens (or FLOPs) at which the baseline curve reaches FBT's loss, by linear "
        "interpolation of loss in log-tokens (log-FLOPs) between the two bracketing budgets, over FBT's own. "
        "Matched compute: the baseline curve's loss at FBT's training FLOPs (same interpolation). "
        f"FLOPs: {res['flop_formula']}.",
    ]
    if not res["baseline_curve_monotone"]:
        lines += ["", "Note: the baseline curve is not monotone (a larger budget ended with a higher loss); the "
                      "multiplier uses the first crossing."]
    if res.get("plot"):
        lines += ["", f"![loss vs tokens and FLOPs]({res['plot']})"]
    sec = res["seconds"]
    lines += ["", f"Wall time {sec['total']:.0f}s (data {sec['data']:.0f}s, training {sec['train']:.0f}s, evaluation "
                  f"{sec['eval']:.0f}s), {res['threads']} CPU thread(s), torch {res['torch']}.", ""]
    return "\n".join(lines)


def plot_data_efficiency(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    base = sorted(res["baselines"], key=lambda p: p["tokens"])
    markers = {"exact": "*", "passes": "s", "standard": "^"}
    for ax, key, label in ((axes[0], "tokens", "training tokens"), (axes[1], "flops", "training FLOPs (all passes)")):
        ax.plot([p[key] for p in base], [p["loss"] for p in base], "o-", color="C0", label="baseline (K=1)")
        for p in base:
            ax.annotate(f"{p['multiplier']:g}x", (p[key], p["loss"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color="C0")
        for i, (mode, info) in enumerate(res["fbt"]["modes"].items()):
            ax.plot([res["fbt"][key]], [info["loss"]], markers.get(mode, "x"), ms=9 if mode == "exact" else 7,
                    color=f"C{i + 1}", ls="none", label=f"FBT 1x: {info['label']}")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    axes[0].set_title("loss vs tokens")
    axes[1].set_title("loss vs compute")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


# ============================================================================================== reasoning


def parse_task_options(items: list[str] | None) -> dict:
    """``--task-option NAME=VALUE`` for the problem generator (e.g. ``num_ops=2,3`` -> ``(2, 3)``)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--task-option takes NAME=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        parts = [v.strip() for v in raw.split(",")]
        try:
            vals = [int(v) for v in parts]
            out[key] = tuple(vals) if len(vals) > 1 else vals[0]
        except ValueError:
            out[key] = raw
    return out


def reasoning_problems(task: str, n_train: int, n_test: int, seed: int, options: dict):
    """``(train, test, overlap_removed)``: training problems from ``seed``, test problems from another seed
    with every question that occurs in training removed."""
    if task == "gsm8k":
        raise ValueError("the reasoning experiment trains on synthetic tasks: choose arithmetic, state or permutation")
    try:
        train = make_problems(task, n_train, seed, **options)
        seen = {p.question for p in train}
        pool = make_problems(task, 4 * n_test, seed + 7_919, **options)
    except TypeError as err:
        raise ValueError(f"--task-option: {err}") from None
    test = [p for p in pool if p.question not in seen]
    removed = len(pool) - len(test)
    test = test[:n_test]
    if not test:
        raise ValueError("every test question also occurs in training; use a harder task or fewer training problems")
    return train, test, removed


def run_reasoning_experiment(args) -> dict:
    hf_logging.disable_progress_bar()
    say = _say(args)
    t_all = time.perf_counter()
    steps = _steps(args)
    for name in ("train_problems", "test_problems", "max_new_tokens", "gen_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    fbt_modes = [m.strip() for m in args.fbt_modes.split(",") if m.strip()]
    if not fbt_modes or any(m not in MODES for m in fbt_modes):
        raise ValueError(f"--fbt-modes must be decode modes from {', '.join(MODES)}, got {args.fbt_modes!r}")
    options = {**TASK_DEFAULTS.get(args.task, {}), **parse_task_options(args.task_option)}
    cot = not args.no_cot

    # ---- data: problems, documents, tokenizer, rows
    t = time.perf_counter()
    train_p, test_p, removed = reasoning_problems(args.task, args.train_problems, args.test_problems, args.seed,
                                                  options)
    data_dir = os.path.join(args.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    train_docs = [Document(p.id, format_example(p, cot)) for p in train_p]
    test_docs = [Document(p.id, format_example(p, cot)) for p in test_p]
    train_file = os.path.join(data_dir, "train.jsonl")
    atomic_write_text(train_file, "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in train_docs))
    atomic_write_text(os.path.join(data_dir, "test.jsonl"),
                      "".join(json.dumps(p.to_dict()) + "\n" for p in test_p))
    tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    train_rows = pack(tokenize_documents(tokenizer, train_docs), args.seq_len)
    try:
        val_rows = pack(tokenize_documents(tokenizer, test_docs), args.seq_len)
    except ValueError:
        val_rows = torch.empty(0, args.seq_len, dtype=torch.long)
    corpus = Corpus(tokenizer, train_rows, val_rows, [d.name for d in train_docs], [d.name for d in test_docs])
    t_data = time.perf_counter() - t
    runs_dir = os.path.join(args.out, "runs")
    fbt_cfg = _base_config(args, os.path.join(runs_dir, "fbt"), steps, train_file)
    base_cfg = _plain(dataclasses.replace(fbt_cfg, out=os.path.join(runs_dir, "baseline")))
    if fbt_cfg.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT run, got {fbt_cfg.num_passes}")
    fbt_cfg.validate()
    base_cfg.validate()
    tokens = steps * fbt_cfg.batch_size * fbt_cfg.seq_len
    say(f"reasoning: {args.task}, {len(train_p):,} training problems ({train_rows.numel():,} tokens, "
        f"{tokens / max(1, train_rows.numel()):.2f} epochs over {steps} steps), {len(test_p)} held-out problems "
        f"({removed} candidates dropped as training duplicates)")

    # ---- training
    t = time.perf_counter()
    _, _, shared = train_pair(base_cfg, fbt_cfg, corpus, share=not args.no_share_prefix)
    t_train = time.perf_counter() - t

    # ---- evaluation
    t = time.perf_counter()
    baseline = load_model(base_cfg.out).eval()
    fbt = load_model(fbt_cfg.out).eval()
    K = fbt_cfg.num_passes
    losses = []
    if val_rows.shape[0]:
        rows = val_rows[: args.eval_rows]
        losses.append({"model": "baseline", "mode": "standard", **evaluate_loss(baseline, rows, "standard")})
        for mode in ("standard", "passes", "exact"):
            losses.append({"model": "FBT", **evaluate_loss(fbt, rows, mode, num_passes=K)})
    plan = [("baseline", baseline, "standard")] + [("FBT", fbt, m) for m in fbt_modes]
    runs = []
    for label, model, mode in plan:
        say(f"reasoning: decoding {len(test_p)} problems, {label} in {mode} mode")
        recs = evaluate_reasoning(model, tokenizer, test_p, mode, args.max_new_tokens, cot, (), args.gen_batch_size)
        runs.append({"name": f"{label}/{mode}", "model_name": label, "mode": mode, "summary": summarize(recs),
                     "records": recs})
    comparisons = []

    def add(a, b):
        c = compare_runs(a["records"], b["records"], seed=args.seed, n_resamples=args.bootstrap)
        c["b_count"], c["c_count"] = c.pop("b"), c.pop("c")
        comparisons.append({"a": a["name"], "b": b["name"], **c})

    for r in runs[1:]:
        add(runs[0], r)
    fbt_runs = runs[1:]
    for r in fbt_runs[1:]:
        add(fbt_runs[0], r)
    t_eval = time.perf_counter() - t
    wall = time.perf_counter() - t_all
    report = {
        "experiment": "reasoning",
        "config": {"task": args.task, "task_options": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in options.items()},
                   "data": None, "num_problems": len(test_p), "seed": args.seed, "cot": cot, "shots": 0,
                   "max_new_tokens": args.max_new_tokens, "train_problems": len(train_p),
                   "test_candidates_dropped_as_training_duplicates": removed},
        "runs": runs, "comparisons": comparisons, "notes": [],
        "held_out_loss": losses,
        "training": {"steps": steps, "tokens_per_model": tokens, "train_tokens_available": int(train_rows.numel()),
                     "epochs": tokens / max(1, train_rows.numel()), "shared_prefix_steps": shared,
                     "preset": fbt_cfg.preset, "batch_size": fbt_cfg.batch_size, "seq_len": fbt_cfg.seq_len,
                     "vocab_size": len(tokenizer), "lr": fbt_cfg.resolved_lr(),
                     "recipe": {k: getattr(fbt_cfg, k) for k in ("feedback_start", "num_passes", "deep_passes",
                                                                  "deep_fraction", "prefix_mix", "jitter",
                                                                  "feedback_weight", "fusion_lr_mult", "fusion",
                                                                  "detach_state", "lr_schedule")}},
        "seconds": {"data": t_data, "train": t_train, "eval": t_eval, "total": wall},
        "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "answer_marker": ANSWER_MARKER,
    }
    table = report_markdown(report)
    loss_table = ""
    if losses:
        loss_table = "\n".join(["| model | mode | held-out CoT loss (nats/token) |", "| --- | --- | ---: |"]
                               + [f"| {x['model']} | {x['mode'] if x['mode'] != 'passes' else f'passes (K={K})'} | "
                                  f"{x['loss']:.4f} |" for x in losses])
    atomic_write_json(os.path.join(args.out, "results.json"), report)
    atomic_write_text(os.path.join(args.out, "report.md"), reasoning_report(report, table, loss_table))
    print(table.split("\n", 2)[2] if table.startswith("# ") else table, end="")
    if loss_table:
        print("\n" + loss_table)
    print(f"\n{wall:.0f}s in all (training {t_train:.0f}s, evaluation {t_eval:.0f}s). "
          f"Report: {os.path.join(args.out, 'report.md')}")
    return report


def reasoning_report(report: dict, table: str, loss_table: str) -> str:
    tr, cfg, sec = report["training"], report["config"], report["seconds"]
    r = tr["recipe"]
    lines = [
        "# fullband experiment reasoning", "",
        f"A baseline (K=1 throughout) and an FBT model, preset `{tr['preset']}`, each trained for {tr['steps']} steps "
        f"x {tr['batch_size']} rows x {tr['seq_len']} tokens = {tr['tokens_per_model']:,} tokens "
        f"({tr['epochs']:.2f} epochs) of {cfg['train_problems']:,} synthetic `{cfg['task']}` problems written with "
        f"their chain of thought (`Q: ...\\nA: steps #### answer`, one document each), same seed and data order; "
        f"a {tr['vocab_size']}-entry BPE trained on them; peak LR {tr['lr']:g} ({r['lr_schedule']}). FBT recipe: "
        f"plain for the first {r['feedback_start']:.0%} of the steps, then K={r['num_passes']} "
        f"({r['deep_fraction']:.0%} at K={r['deep_passes']}), prefix mixing p={r['prefix_mix']}, jitter {r['jitter']}, "
        f"λ={r['feedback_weight']}." + (f" The first {tr['shared_prefix_steps']} steps are shared (identical in both "
                                         "runs, trained once)." if tr["shared_prefix_steps"] else ""),
        "",
        f"Evaluation: {cfg['num_problems']} held-out problems (another seed; "
        f"{cfg['test_candidates_dropped_as_training_duplicates']} candidates whose question occurs in training were "
        "dropped), zero-shot, greedy. Modes: *standard* = no feedback; *soft* = the prompt prefilled plainly, every "
        "generated token fused with the previous step's state; *exact* = the whole sequence through the exact "
        "recurrence.",
        "",
        table.split("\n", 2)[2] if table.startswith("# ") else table,
    ]
    if loss_table:
        lines += ["Teacher-forced loss on the held-out problems' worked solutions:", "", loss_table, ""]
    lines += [f"Wall time {sec['total']:.0f}s (data {sec['data']:.0f}s, training {sec['train']:.0f}s, evaluation "
              f"{sec['eval']:.0f}s), {report['threads']} CPU thread(s), torch {report['torch']}.", ""]
    return "\n".join(lines)


# ============================================================================================== CLI


def add_parser(sub) -> None:
    p = sub.add_parser("experiment", help="experiments: data-efficiency (tokens and matched compute), reasoning",
                       description=__doc__.split("\n\n")[0])
    ex = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    d = ex.add_parser("data-efficiency", help="baselines at several token budgets vs FBT at 1x: effective token "
                                              "multiplier and matched-compute comparison",
                      description=__doc__.split("``fullband experiment data-efficiency``")[1].split("``fullband")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(d, DE_DEFAULTS)
    d.add_argument("--data", default=DE_DEFAULTS["data"],
                   help="training text, as `fullband train --data` (default: the embedded corpus)")
    d.add_argument("--multipliers", default=DE_DEFAULTS["multipliers"],
                   help="baseline token budgets as multiples of the FBT run's (must include 1) (default: "
                        f"{DE_DEFAULTS['multipliers']})")
    d.add_argument("--eval-rows", type=int, default=DE_DEFAULTS["eval_rows"],
                   help=f"held-out rows evaluated, the same for every run (default: {DE_DEFAULTS['eval_rows']})")
    add_recipe_arguments(d)
    d.set_defaults(func=lambda args: (run_data_efficiency(args), 0)[1])

    r = ex.add_parser("reasoning", help="baseline vs FBT trained on synthetic chain-of-thought data: accuracy, "
                                        "trace length, paired statistics",
                      description=__doc__.split("``fullband experiment reasoning``")[1].split("Both write")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(r, RS_DEFAULTS)
    r.add_argument("--task", default=RS_DEFAULTS["task"], choices=["arithmetic", "state", "permutation"],
                   help="synthetic task (default: arithmetic)")
    r.add_argument("--task-option", action="append", metavar="NAME=VALUE", default=None,
                   help="generator option, e.g. num_ops=2,4 or max_operand=9 (repeatable); arithmetic defaults to "
                        "num_ops=2,3 and ops=+- (the generator's own default, num_ops=2,4 ops=+-*, is too hard for "
                        "the default budget)")
    r.add_argument("--train-problems", type=int, default=RS_DEFAULTS["train_problems"],
                   help=f"training problems (default: {RS_DEFAULTS['train_problems']})")
    r.add_argument("--test-problems", type=int, default=RS_DEFAULTS["test_problems"],
                   help=f"held-out problems decoded (default: {RS_DEFAULTS['test_problems']})")
    r.add_argument("--no-cot", action="store_true", help="train and evaluate without the chain of thought")
    r.add_argument("--fbt-modes", default="standard,soft,exact", help="FBT decode modes (default: standard,soft,exact)")
    r.add_argument("--max-new-tokens", type=int, default=RS_DEFAULTS["max_new_tokens"],
                   help=f"longest completion (default: {RS_DEFAULTS['max_new_tokens']})")
    r.add_argument("--gen-batch-size", type=int, default=32, help="problems decoded together (default: 32)")
    r.add_argument("--eval-rows", type=int, default=64, help="held-out rows for the teacher-forced loss (default: 64)")
    r.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples (default: 10000)")
    add_recipe_arguments(r)
    r.set_defaults(func=lambda args: (run_reasoning_experiment(args), 0)[1])

    add_recipe_parser(ex)
