"""``fullband experiment data-efficiency``

    Does latent feedback buy data efficiency, and is it just more compute? Plain baselines are trained at several
    token budgets (default 0.5×, 0.75×, 1.0×, 1.25×, 1.5× of the base budget; every budget a run of its own with
    its own full LR schedule, not an intermediate checkpoint of a longer run), and one FBT model at 1.0× with the
    recipe given (feedback switched on late, K passes, deep steps, prefix mixing, jitter). All runs share the
    seed, the tokenizer and the data order (so every run reads the same batches in the same order, the longer
    runs then read further). Two controls are plain runs of FBT's training FLOPs, each with its own full LR
    schedule: ``baseline-flops`` reads further in the data order (``--no-flops-baseline`` skips it),
    ``baseline-epochs`` re-reads exactly the rows FBT read, in a fresh order each epoch (``--unique-batches``;
    ``--no-epochs-baseline`` skips it). All are evaluated on the same held-out rows: the baselines in
    standard mode, FBT in standard, K-pass and exact mode (exact = the token-by-token recurrence decoding runs; the
    headline figure), each with its inference FLOPs relative to standard. Finished runs of the same options and
    data are reused; one that differs is kept and the experiment stops with an error naming the differences,
    unless ``--overwrite``.

    Reported, with paired bootstrap CIs over the held-out rows: FBT against the three controls (equal tokens: the
    1.0x baseline; equal FLOPs with more unique tokens: the baseline curve at FBT's FLOPs, and baseline-flops;
    equal unique tokens and equal FLOPs: baseline-epochs); FBT's *effective token multiplier* -- the unique training tokens at which the
    baseline curve reaches FBT's held-out loss (linear interpolation of loss in log-unique-tokens between the two
    budgets that bracket it), divided by FBT's unique tokens -- and the same on the compute axis: training FLOPs
    counting every pass (a K-pass step costs
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
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, inference_flops, training_flops
from ..eval.scoring import row_losses
from ..model.modeling import load_model
from ..training.device import load_average
from ..training.pretrain import build_tokenizer_and_corpus, spread_rows
from ..utils.io import atomic_write_bytes, read_jsonl
from ..utils.stats import bootstrap_ci
from .common import (
    base_config,
    crossing,
    curve_bootstrap,
    describe_multiplier,
    epochs_config,
    flops_config,
    loss_at,
    plain_config,
    refuse_changed_runs,
    run_name,
    say_for,
    steps_for,
    train_or_reuse,
    train_pair,
    unique_tokens,
    write_results,
)

DE_DEFAULTS = dict(out=os.path.join("runs", "experiments", "data-efficiency"), preset="tiny", steps=100,
                   batch_size=16, seq_len=256, vocab_size=4096, multipliers="0.5,0.75,1,1.25,1.5", eval_rows=128,
                   data="shakespeare", flops_baseline=True, epochs_baseline=True)

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
    t_all, load0 = time.perf_counter(), load_average()
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
    vocab = len(corpus.tokenizer)  # the controls' steps count the model's FLOPs with the tokenizer's vocabulary
    flops_cfg = None if args.no_flops_baseline else flops_config(fbt_cfg, os.path.join(runs_dir, "baseline-flops"), vocab)
    epochs_cfg = (None if args.no_epochs_baseline
                  else epochs_config(fbt_cfg, os.path.join(runs_dir, "baseline-epochs"), vocab))
    controls = [c for c in (flops_cfg, epochs_cfg) if c is not None]
    for c in controls:
        c.validate()
    tokens_per_step = fbt_cfg.batch_size * fbt_cfg.seq_len
    say(f"data-efficiency: {corpus.train_rows.numel():,} training tokens, {corpus.val_rows.shape[0]} held-out rows; "
        f"base budget {steps} steps x {tokens_per_step:,} = {steps * tokens_per_step:,} tokens; baselines at "
        + ", ".join(f"{m:g}x ({s} steps)" for m, s in budgets.items()) + "; FBT at 1x"
        + (f"; baseline-flops: {flops_cfg.steps} steps" if flops_cfg else "")
        + (f"; baseline-epochs: FBT's unique rows for {epochs_cfg.steps} steps" if epochs_cfg else ""))
    if corpus.train_rows.shape[0] < budgets[max(mults)] * fbt_cfg.batch_size:
        say(f"data-efficiency: note: the largest budget reads {budgets[max(mults)] * fbt_cfg.batch_size} rows of "
            f"{corpus.train_rows.shape[0]}: more than one epoch (its unique tokens are fewer than its tokens)")

    # ---- training
    t = time.perf_counter()
    refuse_changed_runs([fbt_cfg, *base_cfgs.values(), *controls], corpus, args.overwrite)  # before any training
    _, _, shared = train_pair(base_cfgs[1.0], fbt_cfg, corpus, share=not args.no_share_prefix,
                              overwrite=args.overwrite)
    for m, c in base_cfgs.items():
        if m != 1.0:  # a finished run of the same options and data is reused
            train_or_reuse(c, corpus)
    if flops_cfg is not None:
        train_or_reuse(flops_cfg, corpus)
    # the new arm's own training time (as its run recorded it; a reused run's from when it was trained)
    t_epochs = train_or_reuse(epochs_cfg, corpus).get("elapsed", 0.0) if epochs_cfg is not None else 0.0
    t_train = time.perf_counter() - t

    # ---- evaluation on the same held-out rows, per row (for the paired CIs)
    t = time.perf_counter()
    rows = spread_rows(corpus.val_rows, args.eval_rows)  # spread over every held-out document, as the quickstart
    if rows.shape[0] == 0:
        raise ValueError("no held-out rows: use a --data with more documents or a larger --set val_fraction=...")
    say(f"data-efficiency: evaluating on {rows.shape[0]} held-out rows ({rows[:, 1:].numel():,} predicted tokens)")
    K = fbt_cfg.num_passes
    T = fbt_cfg.seq_len
    eval_tokens = int(rows[:, 1:].numel())

    fps = {}

    def plain_point(c, model_label: str, **extra) -> dict:
        model = load_model(c.out).eval()
        fp = fps.setdefault("baseline", flop_parameters(model))
        per_row = row_losses(model, rows, "standard")
        fl = training_flops(read_jsonl(os.path.join(c.out, "metrics.jsonl")), tokens_per_step, c.seq_len, fp)
        return {"run": run_name(c), "model": model_label, "steps": c.steps, "tokens": fl["tokens"],
                "unique_tokens": unique_tokens(c, corpus), "flops": fl["flops"], "passes": fl["passes"],
                "loss": float(per_row.mean()), "eval_tokens": eval_tokens, "row_losses": per_row.tolist(),
                "inference_flops": inference_flops("standard", fp, T)["relative"], **extra}

    points = [plain_point(c, "baseline", multiplier=m) for m, c in base_cfgs.items()]
    flops_point = plain_point(flops_cfg, "baseline-flops") if flops_cfg is not None else None
    epochs_point = plain_point(epochs_cfg, "baseline-epochs") if epochs_cfg is not None else None
    fbt = load_model(fbt_cfg.out).eval()
    fbt_fp = flop_parameters(fbt)
    fl = training_flops(read_jsonl(os.path.join(fbt_cfg.out, "metrics.jsonl")), tokens_per_step, fbt_cfg.seq_len,
                        fbt_fp)
    fbt_unique = unique_tokens(fbt_cfg, corpus)
    fbt_modes = {}
    for mode, label in (("standard", "standard (K=1, no feedback)"), ("passes", f"K-pass (K={K}, teacher-forced)"),
                        ("exact", "exact (token-by-token recurrence)")):
        per_row = row_losses(fbt, rows, mode, num_passes=K)
        fbt_modes[mode] = {"label": label, "loss": float(per_row.mean()), "row_losses": per_row.tolist(),
                           "inference_flops": inference_flops(mode, fbt_fp, T, num_passes=K)["relative"]}
    t_eval = time.perf_counter() - t

    # ---- comparisons: the baseline curve read in unique tokens and in FLOPs, with paired bootstrap CIs over rows
    uniq_curve = [(p["unique_tokens"], p["loss"]) for p in points]
    flop_curve = [(p["flops"], p["loss"]) for p in points]
    base1 = next(p for p in points if p["multiplier"] == 1.0)
    lo_t, hi_t = min(x for x, _ in uniq_curve), max(x for x, _ in uniq_curve)
    lo_f, hi_f = min(x for x, _ in flop_curve), max(x for x, _ in flop_curve)
    curve_rows = [p["row_losses"] for p in points]
    comparisons = {}
    for mode, info in fbt_modes.items():
        ct, cf = crossing(uniq_curve, info["loss"]), crossing(flop_curve, info["loss"])
        matched = loss_at(flop_curve, fl["flops"])
        boot_t = curve_bootstrap([p["unique_tokens"] for p in points], curve_rows, info["row_losses"], fbt_unique,
                                 fl["flops"], seed=fbt_cfg.seed)
        boot_f = curve_bootstrap([p["flops"] for p in points], curve_rows, info["row_losses"], fl["flops"],
                                 fl["flops"], seed=fbt_cfg.seed)
        paired = lambda other: bootstrap_ci([a - b for a, b in zip(info["row_losses"], other)],  # noqa: E731
                                            seed=fbt_cfg.seed).as_dict()
        comparisons[mode] = {
            "label": info["label"], "fbt_loss": info["loss"], "inference_flops": info["inference_flops"],
            "baseline_same_tokens_loss": base1["loss"], "delta_same_tokens": info["loss"] - base1["loss"],
            "delta_same_tokens_ci": paired(base1["row_losses"]),
            "token_multiplier": ct["x"] / fbt_unique if ct["x"] else None, "token_status": ct["status"],
            "token_multiplier_text": describe_multiplier(ct, fbt_unique, lo_t, hi_t),
            "token_multiplier_ci": boot_t["multiplier"], "token_range": [lo_t / fbt_unique, hi_t / fbt_unique],
            "compute_multiplier": cf["x"] / fl["flops"] if cf["x"] else None, "compute_status": cf["status"],
            "compute_multiplier_text": describe_multiplier(cf, fl["flops"], lo_f, hi_f),
            "compute_multiplier_ci": boot_f["multiplier"], "compute_range": [lo_f / fl["flops"], hi_f / fl["flops"]],
            "baseline_matched_compute_loss": matched["loss"], "matched_compute_status": matched["status"],
            "delta_matched_compute": (info["loss"] - matched["loss"]) if matched["loss"] is not None else None,
            "delta_matched_compute_ci": boot_f["matched_delta"],
        }
        for key, point in (("flops", flops_point), ("epochs", epochs_point)):
            if point is not None:
                comparisons[mode].update({f"baseline_{key}_loss": point["loss"],
                                          f"delta_{key}": info["loss"] - point["loss"],
                                          f"delta_{key}_ci": paired(point["row_losses"])})
    monotone = crossing(uniq_curve, float("inf"))["monotone"]
    wall = time.perf_counter() - t_all
    results = {
        "experiment": "data-efficiency", "headline_mode": "exact", "headline": comparisons["exact"],
        "baselines": points, "baseline_flops": flops_point, "baseline_epochs": epochs_point,
        "fbt": {"run": run_name(fbt_cfg), "steps": fbt_cfg.steps, "tokens": fl["tokens"], "unique_tokens": fbt_unique,
                "flops": fl["flops"], "passes": fl["passes"], "modes": fbt_modes, "num_passes": K},
        "comparisons": comparisons, "baseline_curve_monotone": monotone,
        "baselines_repeat_data": [p["run"] for p in points if p["unique_tokens"] < p["tokens"]],
        "flop_formula": "per token and pass 6*N + 6*L*T*d (N = backbone matmul parameters, i.e. without the input "
                        "embedding table; L layers, T seq_len, d hidden), plus 6*N_fusion on fused passes; every "
                        "pass of a K-pass step counted; evaluation not counted",
        "flop_parameters": fps["baseline"], "fbt_flop_parameters": fbt_fp,
        "recipe": {k: getattr(fbt_cfg, k) for k in ("feedback_start", "num_passes", "deep_passes", "deep_fraction",
                                                     "prefix_mix", "jitter", "feedback_weight", "fusion_lr_mult",
                                                     "fusion", "detach_state", "lr_schedule", "warmup_fraction")},
        "lr": fbt_cfg.resolved_lr(), "preset": fbt_cfg.preset, "seed": fbt_cfg.seed, "data": fbt_cfg.data,
        "batch_size": fbt_cfg.batch_size, "seq_len": fbt_cfg.seq_len, "vocab_size": len(corpus.tokenizer),
        "base_steps": steps, "multipliers": mults, "shared_prefix_steps": shared,
        "eval_rows": int(rows.shape[0]), "eval_tokens": eval_tokens, "val_documents": corpus.val_docs,
        "corpus_train_tokens": corpus.train_rows.numel(),
        "seconds": {"data": t_data, "train": t_train, "train_baseline_epochs": t_epochs, "eval": t_eval,
                    "total": wall},
        "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "load_average": [load0, load_average()],
    }
    plot_path = os.path.join(args.out, "loss_vs_tokens_flops.png")
    try:
        plot_data_efficiency(results, plot_path)
        results["plot"] = os.path.basename(plot_path)
    except Exception as err:  # noqa: BLE001 - a plot is not worth failing a finished experiment
        say(f"warning: could not draw {plot_path}: {err}")
    tables = data_efficiency_tables(results)
    write_results(args.out, results, data_efficiency_report(results, tables))
    print(tables)
    print(f"\n{wall:.0f}s in all (training {t_train:.0f}s, evaluation {t_eval:.0f}s). "
          f"Report: {os.path.join(args.out, 'report.md')}")
    return results


def _fmt_flops(x: float) -> str:
    return f"{x:.3g}"


def _ci_text(d: dict | None) -> str:
    return "–" if d is None else f"[{d['low']:+.4f}, {d['high']:+.4f}]"


def _multiplier_ci_text(ci: dict, lo: float, hi: float) -> str:
    """A multiplier's CI, a bound outside the budgets written as beyond the range's end."""
    bound = lambda v, status: (f"{v:.3f}x" if status == "inside"  # noqa: E731
                               else f"< {lo:.3f}x" if status == "below_range" else f"> {hi:.3f}x")
    return f"[{bound(ci['low'], ci['low_status'])}, {bound(ci['high'], ci['high_status'])}]"


def data_efficiency_tables(res: dict) -> str:
    lines = ["| run | model / mode | steps | tokens read | unique tokens | train FLOPs | inference FLOPs (× standard) "
             "| held-out loss |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    plain = sorted(res["baselines"], key=lambda p: p["tokens"]) + [
        res[k] for k in ("baseline_flops", "baseline_epochs") if res.get(k)]
    for p in plain:
        lines.append(f"| {p['run']} | {p['model']} / standard | {p['steps']} | {p['tokens']:,} | {p['unique_tokens']:,} "
                     f"| {_fmt_flops(p['flops'])} | {p['inference_flops']:.3f} | {p['loss']:.4f} |")
    f = res["fbt"]
    for mode, info in f["modes"].items():
        lines.append(f"| {f['run']} | FBT / {info['label']} | {f['steps']} | {f['tokens']:,} | {f['unique_tokens']:,} | "
                     f"{_fmt_flops(f['flops'])} | {info['inference_flops']:.3f} | {info['loss']:.4f} |")
    lines += ["", "| FBT mode | FBT loss | inference FLOPs (× standard) | Δ vs baseline 1.0x: equal tokens [95% CI] | "
                  "Δ vs the baseline curve at FBT's FLOPs: equal FLOPs, more unique tokens [95% CI] | "
                  "Δ vs baseline-flops: equal FLOPs, more unique tokens [95% CI] | "
                  "Δ vs baseline-epochs: equal unique tokens + FLOPs [95% CI] |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, c in res["comparisons"].items():
        dm = (f"{c['delta_matched_compute']:+.4f} {_ci_text(c['delta_matched_compute_ci'])}"
              if c["delta_matched_compute"] is not None else c["matched_compute_status"].replace("_", " "))
        controls = " | ".join(f"{c[f'delta_{k}']:+.4f} {_ci_text(c[f'delta_{k}_ci'])}" if f"delta_{k}" in c else "–"
                              for k in ("flops", "epochs"))
        lines.append(f"| {c['label']} | {c['fbt_loss']:.4f} | {c['inference_flops']:.3f} | "
                     f"{c['delta_same_tokens']:+.4f} {_ci_text(c['delta_same_tokens_ci'])} | {dm} | {controls} |")
    lines += ["", "| FBT mode | effective token multiplier (unique tokens) [95% CI] | baseline at FBT's FLOPs | "
                  "compute multiplier [95% CI] |", "| --- | ---: | ---: | ---: |"]
    for mode, c in res["comparisons"].items():
        matched = (f"{c['baseline_matched_compute_loss']:.4f}" if c["baseline_matched_compute_loss"] is not None
                   else c["matched_compute_status"].replace("_", " "))
        lines.append(f"| {c['label']} | {c['token_multiplier_text']} "
                     f"{_multiplier_ci_text(c['token_multiplier_ci'], *c['token_range'])} | {matched} | "
                     f"{c['compute_multiplier_text']} {_multiplier_ci_text(c['compute_multiplier_ci'], *c['compute_range'])} |")
    return "\n".join(lines)


def data_efficiency_report(res: dict, tables: str) -> str:
    h = res["headline"]
    r = res["recipe"]
    if h["token_status"] == "inside":
        verdict_tokens = (f"the baseline needs {h['token_multiplier']:.3f}x FBT's unique tokens to reach FBT's "
                          "exact-mode loss (effective token multiplier)")
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
        f"Held-out loss: {res['eval_rows']} rows spread evenly over the held-out documents "
        f"({', '.join(res['val_documents'])}; {res['eval_tokens']:,} predicted tokens), the same rows for every line.",
        "",
        tables,
        "",
        f"**Headline (FBT in exact mode, what decoding computes):** {h['fbt_loss']:.4f} vs "
        f"{h['baseline_same_tokens_loss']:.4f} "
        f"for the baseline on the same tokens (Δ {h['delta_same_tokens']:+.4f}); {verdict_tokens}; {verdict_compute}.",
        "",
        "Three controls: *equal tokens* (the 1.0x baseline, the same batches as FBT), *equal FLOPs, more unique "
        "tokens* (the baseline curve at FBT's training FLOPs: longer plain runs that read further; and "
        + (f"`baseline-flops`, a plain run of {res['baseline_flops']['steps']} steps, FBT's passes, its own full LR "
           "schedule" if res.get("baseline_flops") else "no `baseline-flops` run: --no-flops-baseline")
        + "), *equal unique tokens + equal FLOPs* (`baseline-epochs`: a plain run of "
        + (f"{res['baseline_epochs']['steps']} steps, its own full LR schedule, on exactly the rows FBT read "
           f"(`--unique-batches {res['fbt']['steps']}`), re-read in a fresh order each epoch; trained in "
           f"{res['seconds']['train_baseline_epochs']:.0f}s)" if res.get("baseline_epochs") else "FBT's FLOPs on "
           "FBT's rows; not trained here: --no-epochs-baseline)") + ". "
        "Effective multiplier: the unique tokens (or FLOPs) at which the baseline curve reaches FBT's loss, by "
        "linear interpolation of loss in log-unique-tokens (log-FLOPs) between the two bracketing budgets, over "
        "FBT's own. Matched compute: the baseline curve's loss at FBT's training FLOPs (same interpolation). CIs: "
        "95% percentile bootstraps over the held-out rows, paired (one draw of rows for every model per resample; "
        "for the multipliers and the matched-compute Δ the whole curve is re-read per resample; a bound outside "
        "the budgets is written as beyond the range). Inference FLOPs: forward FLOPs of scoring a row in that mode "
        "over `standard`'s (`fullband.eval.flops.inference_flops`). "
        f"Training FLOPs: {res['flop_formula']}.",
    ]
    if res.get("baselines_repeat_data"):
        lines += ["", f"Note: {', '.join(res['baselines_repeat_data'])} read more rows than the corpus has (more "
                      "than one epoch): on the unique-token axis they sit at the corpus size."]
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
    for ax, key, label in ((axes[0], "unique_tokens", "unique training tokens"),
                           (axes[1], "flops", "training FLOPs (all passes)")):
        ax.plot([p[key] for p in base], [p["loss"] for p in base], "o-", color="C0", label="baseline (K=1)")
        for p in base:
            ax.annotate(f"{p['multiplier']:g}x", (p[key], p["loss"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color="C0")
        for k, color, what in (("baseline_flops", "C4", "baseline-flops (FBT's FLOPs, fresh rows)"),
                               ("baseline_epochs", "C5", "baseline-epochs (FBT's rows, FBT's FLOPs)")):
            if res.get(k):
                ax.plot([res[k][key]], [res[k]["loss"]], "D", color=color, ls="none", label=what)
        for i, (mode, info) in enumerate(res["fbt"]["modes"].items()):
            ax.plot([res["fbt"][key]], [info["loss"]], markers.get(mode, "x"), ms=9 if mode == "exact" else 7,
                    color=f"C{i + 1}", ls="none", label=f"FBT 1x: {info['label']}")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    axes[0].set_title("loss vs unique tokens")
    axes[1].set_title("loss vs compute")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
