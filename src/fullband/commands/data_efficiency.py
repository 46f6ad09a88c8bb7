"""``fullband experiment data-efficiency``

    Does latent feedback buy data efficiency, and is it just more compute? Plain baselines are trained at several
    token budgets (default 0.5×, 0.75×, 1.0×, 1.25×, 1.5× of the base budget; every budget a run of its own with
    its own full LR schedule, not an intermediate checkpoint of a longer run), and one FBT model at 1.0× with the
    recipe given (feedback switched on late, K passes, deep steps, prefix mixing, jitter). All runs share the
    seed, the tokenizer and the data order (so every run reads the same batches in the same order, the longer
    runs then read further). All are evaluated on the same held-out rows: the baselines in standard mode, FBT in
    standard, K-pass and exact mode (exact = the token-by-token recurrence decoding runs; the headline figure).
    Finished runs of the same options and data are reused; one that differs is kept and the experiment stops with
    an error naming the differences, unless ``--overwrite``.

    Reported: FBT's *effective token multiplier* -- the training tokens at which the baseline curve reaches FBT's
    held-out loss (linear interpolation of loss in log-tokens between the two budgets that bracket it), divided
    by FBT's tokens -- and the same on the compute axis: training FLOPs counting every pass (a K-pass step costs
    K forward+backward passes), ``6·N·tokens + 6·L·T·d·tokens`` per pass (N = parameters used in matrix
    multiplies: the backbone without its input-embedding table, plus the fusion on fused passes; L layers, T the
    sequence length, d the width). A compute multiplier above 1 means a plain transformer would need more FLOPs
    than FBT used to reach FBT's loss; the baseline's loss at FBT's FLOPs is reported next to it (matched
    compute). Where FBT's loss is outside the baseline curve, the report says "below the range" (worse than the
    smallest budget) or "above the range" (better than the largest) instead of extrapolating.
"""

from __future__ import annotations

import dataclasses
import io
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import evaluate_loss
from ..model.modeling import load_model
from ..training.pretrain import build_tokenizer_and_corpus, train
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl
from .experiment_common import (
    base_config,
    check_done,
    crossing,
    describe_multiplier,
    finished,
    loss_at,
    plain_config,
    refuse_changed_runs,
    run_name,
    say_for,
    steps_for,
    train_pair,
)

DE_DEFAULTS = dict(out=os.path.join("runs", "experiments", "data-efficiency"), preset="tiny", steps=100,
                   batch_size=16, seq_len=256, vocab_size=4096, multipliers="0.5,0.75,1,1.25,1.5", eval_rows=128,
                   data="shakespeare")

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
    say = say_for(args)
    t_all = time.perf_counter()
    steps = steps_for(args)
    mults = parse_multipliers(args.multipliers)
    if args.eval_rows < 1:
        raise ValueError(f"--eval-rows must be >= 1, got {args.eval_rows}")
    runs_dir = os.path.join(args.out, "runs")
    fbt_cfg = base_config(args, os.path.join(runs_dir, "fbt-1.00x"), steps, args.data)
    if fbt_cfg.num_passes < 2:
        raise ValueError(f"--num-passes must be >= 2 for the FBT run, got {fbt_cfg.num_passes}")
    budgets = {}
    for m in mults:
        s = max(1, round(m * steps))
        if s in budgets.values():
            raise ValueError(f"--multipliers {args.multipliers!r} give the same number of steps twice at "
                             f"--steps {steps}")
        budgets[m] = s
    base_cfgs = {m: plain_config(dataclasses.replace(fbt_cfg, out=os.path.join(runs_dir, f"baseline-{m:.2f}x"), steps=s,
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
    refuse_changed_runs([fbt_cfg, *base_cfgs.values()], corpus, args.overwrite)  # before anything is trained
    _, fbt_sum, shared = train_pair(base_cfgs[1.0], fbt_cfg, corpus, share=not args.no_share_prefix,
                                    overwrite=args.overwrite)
    summaries["fbt"] = fbt_sum
    for m, c in base_cfgs.items():
        if m == 1.0 or finished(c, corpus):  # a finished run of the same options and data is reused
            continue
        s = train(c, overwrite=True, corpus=corpus, name=run_name(c))
        check_done(s)
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
        points.append({"run": run_name(c), "model": "baseline", "multiplier": m, "steps": c.steps,
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
        "fbt": {"run": run_name(fbt_cfg), "steps": fbt_cfg.steps, "tokens": fl["tokens"], "flops": fl["flops"],
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
