"""What the experiments share: the recipe options (:data:`RECIPE`, and reading them back from the parsed arguments;
:mod:`fullband.commands.experiments` registers the flags), the paired baseline/FBT training, reusing finished runs
(which one is reused and which refused without ``--overwrite`` is
:func:`fullband.training.pretrain.run_differences`'s), the controls of an FBT run (``baseline-flops``: the plain
model for the FBT run's training FLOPs, reading further; ``baseline-epochs``: the plain model for those FLOPs on
exactly the FBT run's unique rows, re-read epoch after epoch), reading a baseline curve (where it reaches a
loss, its loss at a budget, both with bootstrap CIs over the held-out rows), and writing an experiment's
``results.json`` and ``report.md`` with their provenance (:func:`write_results`, the one writer of both)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..data.order import distinct_rows_read
from ..eval.flops import flop_parameters, training_flops
from ..model.configuration import FullBandwidthConfig
from ..model.modeling import FullBandwidthForCausalLM
from ..training.checkpoint import CKPT_DIR, LATEST, METRICS, TOKENIZER_DIR, step_dir_name
from ..training.checkpoint import clear_outputs as _clear_outputs
from ..training.config import TrainConfig, make_config, same_path
from ..training.presets import backbone_config
from ..training.pretrain import (
    PretrainRecipe,
    finished,
    read_summary,
    refuse_changed_runs,
    require_done,
    run_to_end,
    stopped_checkpoint,
    train,
)
from ..utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_jsonl, rewrite_jsonl
from ..utils.provenance import provenance, provenance_line

# recipe knobs shared by both experiments: (flag, TrainConfig field, type)
RECIPE = (("--feedback-start", "feedback_start", float), ("--num-passes", "num_passes", int),
          ("--deep-passes", "deep_passes", int), ("--deep-fraction", "deep_fraction", float),
          ("--prefix-mix", "prefix_mix", float), ("--jitter", "jitter", float),
          ("--feedback-weight", "feedback_weight", float), ("--fusion-lr-mult", "fusion_lr_mult", float),
          ("--fusion", "fusion", str), ("--lr", "lr", float), ("--lr-schedule", "lr_schedule", str),
          ("--warmup-fraction", "warmup_fraction", float))



# ============================================================================================== shared


def say_for(args):
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


def steps_for(args) -> int:
    if args.tokens is not None:
        if args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        return max(1, math.ceil(args.tokens / (args.batch_size * args.seq_len)))
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    return args.steps


def base_config(args, out: str, steps: int, data: str, **extra):
    values = dict(out=out, steps=steps, seed=args.seed, preset=args.preset, seq_len=args.seq_len,
                  batch_size=args.batch_size, vocab_size=args.vocab_size, data=data, progress=not args.no_progress,
                  tensorboard=False, plot=False, eval_every=steps, eval_rows=32, device=args.device, save_every=0)
    values.update(parse_settings(args.settings))
    values.update(recipe_from_args(args))
    values.update(extra)
    cfg = make_config(values)
    assert isinstance(cfg, TrainConfig)
    return cfg


def plain_config(cfg):
    """The baseline of ``cfg``: K = 1 on every step (the FBT class with feedback never on = its backbone)."""
    return dataclasses.replace(cfg, num_passes=1, deep_passes=1)


def planned_records(cfg) -> list[dict]:
    """The training records ``cfg``'s run will log, as far as :func:`fullband.eval.flops.training_flops` reads
    them: each step's K from its pass schedule and, on a fed-back step, the passes ``--grad-passes`` /
    ``--exact-states`` / ``--full-backprop`` run (what :meth:`fullband.training.engine.Trainer.train_step` records;
    ``tests/test_controls.py`` checks the two agree on real runs). ``--pass-tol`` may stop passes early: the
    plan then counts every pass, an upper bound."""
    sched = cfg.schedule()
    out = []
    for i in range(cfg.steps):
        K = sched.passes_at(i, cfg.steps)
        rec = {"num_passes": K}
        if K > 1 and cfg.full_backprop:
            rec.update(full_backprop=True, backprop_chunk=cfg.backprop_chunk)
        elif K > 1 and cfg.exact_states:
            rec.update(exact_states=True, passes_run=cfg.grad_passes, grad_passes_run=cfg.grad_passes)
        elif K > 1 and cfg.grad_passes:
            rec.update(passes_run=K, grad_passes_run=min(cfg.grad_passes, K))
        out.append(rec)
    return out


def planned_flop_parameters(cfg, vocab_size: int) -> dict:
    """:func:`fullband.eval.flops.flop_parameters` of the model ``cfg`` trains with a tokenizer of ``vocab_size``
    entries, without building its weights: the backbone on the meta device (its config as
    :func:`fullband.training.pretrain.build_model` makes it, or ``--init-from``'s), the fusion beside it."""
    if cfg.init_from is not None:
        config = AutoConfig.from_pretrained(cfg.init_from)
        config = getattr(config, "text_config", None) if config.model_type == FullBandwidthConfig.model_type else config
    else:
        config = backbone_config(cfg.preset, vocab_size, max_position_embeddings=max(2048, cfg.seq_len),
                                 tie_word_embeddings=cfg.tie_embeddings, num_hidden_layers=cfg.layers)
    with torch.device("meta"):
        backbone = AutoModelForCausalLM.from_config(config)
        model = FullBandwidthForCausalLM.from_backbone(backbone, fusion=cfg.fusion, embed_rms=1.0)
    return flop_parameters(model)


def flops_matched_steps(fbt_cfg, vocab_size: int) -> int:
    """Steps of a plain run with at least as many training FLOPs as ``fbt_cfg``'s run, counted as the run's own
    metrics are (:func:`fullband.eval.flops.training_flops` over :func:`planned_records`: every pass, a pass
    without gradient at its forward, the fusion's FLOPs included), with the model's parameters
    (:func:`planned_flop_parameters`); rounded up, so the control has the FBT run's FLOPs plus under one plain
    step. ``--pass-tol`` may stop passes early: this is then an upper bound."""
    fp = planned_flop_parameters(fbt_cfg, vocab_size)
    tokens, T = fbt_cfg.batch_size * fbt_cfg.seq_len, fbt_cfg.seq_len
    fbt = training_flops(planned_records(fbt_cfg), tokens, T, fp)["flops"]
    plain = training_flops([{"num_passes": 1}], tokens, T, fp)["flops"]
    return math.ceil(fbt / plain - 1e-9)


def flops_config(fbt_cfg, out: str, vocab_size: int):
    """``baseline-flops``: the plain model trained for the FBT run's FLOPs (:func:`flops_matched_steps`, a
    tokenizer of ``vocab_size`` entries), its own full LR schedule, reading further in the data order (more unique
    tokens than the FBT run)."""
    steps = flops_matched_steps(fbt_cfg, vocab_size)
    return dataclasses.replace(plain_config(fbt_cfg), out=out, steps=steps,
                               eval_every=steps if fbt_cfg.eval_every else 0)


def epochs_config(fbt_cfg, out: str, vocab_size: int):
    """``baseline-epochs``: the plain model trained for the FBT run's FLOPs on exactly its unique rows (the rows
    of its ``steps`` batches from its ``--data-offset``: ``--unique-batches``), re-read in a fresh order each
    epoch; its own full LR schedule (a run of that many steps, not a continuation)."""
    return dataclasses.replace(flops_config(fbt_cfg, out, vocab_size), unique_batches=fbt_cfg.steps)


def unique_tokens(cfg, corpus) -> int:
    """The unique training tokens a run reads: its distinct rows (:func:`fullband.data.order.distinct_rows_read`)
    times the row length."""
    return cfg.seq_len * distinct_rows_read(cfg.steps, cfg.batch_size, corpus.train_rows.shape[0], cfg.seed,
                                            getattr(corpus, "order", "randperm"), cfg.data_offset,
                                            cfg.unique_batches)


def train_or_reuse(cfg, corpus, name: str | None = None) -> dict:
    """The summary of ``cfg``'s run: the finished run in ``cfg.out`` when it is this very run (same options, data
    and initial model), else trained (:func:`fullband.training.pretrain.run_to_end`: from where the stability guard
    stopped this very run, else from scratch; check :func:`refuse_changed_runs` before)."""
    if finished(cfg, corpus):
        return read_summary(cfg.out)
    summary = run_to_end(PretrainRecipe(cfg, corpus, name or run_name(cfg)), corpus)
    check_done(summary)
    return summary


def copy_branch(base_dir: str, fbt_dir: str, ckpt: str, step: int) -> None:
    """Seed a branch run (``fbt_dir``) with the baseline's checkpoint at ``step`` (and its log up to there)."""
    if os.path.isdir(fbt_dir):
        _clear_outputs(fbt_dir)
    os.makedirs(os.path.join(fbt_dir, CKPT_DIR), exist_ok=True)
    name = step_dir_name(step)  # the plain step name `latest` must hold, whatever the source directory is called
    shutil.copytree(ckpt, os.path.join(fbt_dir, CKPT_DIR, name))
    atomic_write_text(os.path.join(fbt_dir, CKPT_DIR, LATEST), name + "\n")
    shutil.copytree(os.path.join(base_dir, TOKENIZER_DIR), os.path.join(fbt_dir, TOKENIZER_DIR))
    rows = [r for r in read_jsonl(os.path.join(base_dir, METRICS)) if r.get("step", 0) <= step]
    rewrite_jsonl(os.path.join(fbt_dir, METRICS), rows)


def branch_step(base_cfg, other_cfg) -> int:
    """How many first steps ``other_cfg`` shares with ``base_cfg`` (:func:`fullband.training.config.same_path`: the
    same LR, no feedback yet); 0 when none."""
    n = min(base_cfg.steps, other_cfg.steps)
    lo, hi = 0, n  # the largest shared prefix, by bisection (same_path of a prefix holds for every shorter one)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same_path(base_cfg, other_cfg, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def train_pair(base_cfg, fbt_cfg, corpus, share: bool = True, longer_cfg=None,
               overwrite: bool = False) -> tuple[dict, dict, int]:
    """Train the baseline and the FBT run (same steps, seed, data), and ``longer_cfg`` when given (a plain run of more
    steps, e.g. the baseline at the FBT run's training FLOPs). With ``share``, steps identical in several runs are
    trained once: the K = 1 steps before the feedback start, and the baseline's steps before its LR schedule parts
    from ``longer_cfg``'s (:func:`branch_step`); each branch resumes from the baseline's checkpoint there. Returns
    the baseline's and FBT's summaries (and checks ``longer_cfg``'s) and the number of steps FBT shares. Finished
    runs of the same configuration and data are reused when all are, and when the stability guard stopped one
    (:class:`fullband.utils.errors.TrainingStopped`) a re-run reuses the finished ones and resumes the stopped ones
    from their last good step (:func:`fullband.training.pretrain.stopped_checkpoint`); one that differs is refused
    (:func:`refuse_changed_runs`) unless ``overwrite``."""
    start = fbt_cfg.schedule().start_step(fbt_cfg.steps)
    share = share and 0 < start < fbt_cfg.steps and base_cfg.steps == fbt_cfg.steps
    cfgs = [c for c in (base_cfg, fbt_cfg, longer_cfg) if c is not None]
    refuse_changed_runs(cfgs, corpus, overwrite)
    todo = [c for c in cfgs if not finished(c, corpus)]
    if todo and all(stopped_checkpoint(c, corpus) for c in todo):
        for c in todo:  # nothing to branch again: each stopped run continues from its own last good step
            check_done(run_to_end(PretrainRecipe(c, corpus, run_name(c)), corpus))
        todo = []
    if not todo:
        base, fbt = (read_summary(c.out) for c in (base_cfg, fbt_cfg))
        return base, fbt, start if share else 0
    branches = [(start, fbt_cfg)] if share else []
    if longer_cfg is not None and share:
        at = min(branch_step(base_cfg, longer_cfg), base_cfg.steps - 1)
        if at > 0:
            branches.append((at, longer_cfg))
    resume = False
    for at in sorted({at for at, _ in branches}):
        names = "+".join(run_name(c) for a, c in branches if a == at)
        first = train(dataclasses.replace(base_cfg, stop_after=at), resume=resume, overwrite=not resume, corpus=corpus,
                      name=f"{run_name(base_cfg)}+{names} (shared steps)")
        if first["status"] == "stopped":
            require_done(first, f"{run_name(base_cfg)} (the steps it shares with {names})")
        for cfg in (c for a, c in branches if a == at):
            copy_branch(base_cfg.out, cfg.out, first["checkpoint"], at)
        resume = True
    base = check_done(train(base_cfg, resume=resume, overwrite=not resume, corpus=corpus, name=run_name(base_cfg)))
    fbt = check_done(train(fbt_cfg, resume=share, overwrite=not share, corpus=corpus, name=run_name(fbt_cfg)))
    if longer_cfg is not None:
        branched = any(cfg is longer_cfg for _, cfg in branches)
        check_done(train(longer_cfg, resume=branched, overwrite=not branched, corpus=corpus, name=run_name(longer_cfg)))
    return base, fbt, start if share else 0


def run_name(cfg) -> str:
    """The run's directory name (``cfg``: a config, or a run's summary)."""
    return os.path.basename(os.path.normpath(cfg["out"] if isinstance(cfg, dict) else cfg.out))


def check_done(summary: dict) -> dict:
    """``summary``, its finished run's checkpoints removed; :class:`fullband.utils.errors.TrainingStopped` for a run
    the stability guard stopped (its checkpoint kept: a re-run resumes there)."""
    require_done(summary, run_name(summary))
    shutil.rmtree(os.path.join(summary["out"], "checkpoints"), ignore_errors=True)
    return summary


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


def _resampled_means(rows: np.ndarray, seed: int, n_resamples: int) -> np.ndarray:
    """``[n_resamples, models]`` means of ``rows`` ``[models, rows]`` over row indices drawn with replacement (one
    draw per resample, shared by every model: paired)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, rows.shape[1], size=(n_resamples, rows.shape[1]))
    return np.stack([rows[:, i].mean(axis=1) for i in idx])


def curve_bootstrap(xs: list[float], curve_rows, fbt_rows, reference: float, fbt_x: float, seed: int = 0,
                    n_resamples: int = 2000, confidence: float = 0.95) -> dict:
    """Percentile-bootstrap CIs, over the held-out rows (each resample one draw of row indices for every model), of
    the two readings of a baseline curve: the multiplier (:func:`crossing` of FBT's mean loss, over
    ``reference``) and the matched-budget difference (FBT's mean minus the curve's :func:`loss_at` ``fbt_x``).

    ``xs``: the budget of each baseline, ``curve_rows``: their per-row losses ``[baselines][rows]``, ``fbt_rows``:
    FBT's. A resample whose crossing falls outside the budgets counts as below (``-inf``) or above (``+inf``) the
    range, so a bound outside the range is reported as ``None`` with its side in ``low_status`` / ``high_status``;
    the fractions of resamples inside / below / above are returned too."""
    rows = np.asarray([list(map(float, r)) for r in curve_rows] + [list(map(float, fbt_rows))], dtype=np.float64)
    means = _resampled_means(rows, seed, n_resamples)
    mult, delta = np.empty(n_resamples), np.full(n_resamples, np.nan)
    for i, m in enumerate(means):
        curve = list(zip(xs, m[:-1].tolist()))
        c = crossing(curve, float(m[-1]))
        mult[i] = c["x"] / reference if c["status"] == "inside" else (-np.inf if c["status"] == "below_range" else np.inf)
        at = loss_at(curve, fbt_x)
        if at["loss"] is not None:
            delta[i] = m[-1] - at["loss"]
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(mult, [alpha, 1.0 - alpha], method="inverted_cdf")  # sample values: no inf arithmetic
    side = lambda v: "inside" if np.isfinite(v) else ("below_range" if v < 0 else "above_range")  # noqa: E731
    out = {"multiplier": {"low": float(lo) if np.isfinite(lo) else None, "high": float(hi) if np.isfinite(hi) else None,
                          "low_status": side(lo), "high_status": side(hi), "confidence": confidence,
                          "inside": float(np.isfinite(mult).mean()), "below": float((mult == -np.inf).mean()),
                          "above": float((mult == np.inf).mean())},
           "matched_delta": None, "n_resamples": n_resamples}
    ok = ~np.isnan(delta)
    if ok.mean() >= 1.0 - alpha:  # the matched budget inside the budgets for (nearly) every resample
        dlo, dhi = np.quantile(delta[ok], [alpha, 1.0 - alpha])
        out["matched_delta"] = {"low": float(dlo), "high": float(dhi), "confidence": confidence}
    return out


def describe_multiplier(c: dict, reference: float, smallest: float, largest: float) -> str:
    if c["status"] == "inside":
        return f"{c['x'] / reference:.3f}x"
    if c["status"] == "below_range":
        return f"< {smallest / reference:.3f}x (below the range)"
    return f"> {largest / reference:.3f}x (above the range)"


# ============================================================================================== run bookkeeping


def apply_quick(args, defaults: dict, quick: dict) -> None:
    """``--quick``: every option still at its default takes its smoke-test value."""
    if getattr(args, "quick", False):
        for k, v in quick.items():
            if getattr(args, k) == defaults[k]:
                setattr(args, k, v)


def pick_arms(text: str | None, known: dict, default: list[str]) -> list[str]:
    """The arm names of a comma-separated ``--arms`` (``default`` when not given); a one-line error for unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()] if text else list(default)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}: choose from {', '.join(known)}")
    return names


def save_png(fig, path: str, dpi: int = 110) -> str:
    """Write a matplotlib figure as a PNG atomically and close it."""
    import matplotlib.pyplot as plt  # heavy: only when a plot is drawn

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def write_results(out: str, res: dict, markdown: str | None = None) -> None:
    """The one writer of an experiment's ``results.json`` (atomically), with ``res["provenance"]`` set to what
    produced it (:func:`fullband.utils.provenance.provenance`), and of its ``report.md`` (``markdown``, when given)
    ending in that provenance's line. A re-run reproduces everything but the keys of
    :data:`fullband.utils.provenance.UNREPRODUCIBLE_KEYS`."""
    res["provenance"] = provenance()
    atomic_write_json(os.path.join(out, "results.json"), res)
    if markdown is not None:
        atomic_write_text(os.path.join(out, "report.md"),
                          markdown.rstrip("\n") + "\n\n" + provenance_line(res["provenance"]) + "\n")


def write_outputs(out: str, res: dict, markdown: str, table: str, as_json: bool, omit=(), lead: str = "",
                  show: bool = True) -> None:
    """``results.json`` and ``report.md`` into ``out`` (:func:`write_results`), then (``show``) the results as JSON
    (without the bulky keys in ``omit``) or the table and where the report is."""
    write_results(out, res, markdown)
    if not show:
        return
    if as_json:
        print(json.dumps({k: v for k, v in res.items() if k not in omit}, indent=2))
    else:
        print(table)
        print(f"\n{lead}{res['seconds']:.0f}s; report: {os.path.join(out, 'report.md')}")


def accuracy_panels(panels: list[dict], path: str, xlabel: str, height: float = 3.4) -> str:
    """Accuracy curves, one panel per entry of ``panels`` side by side, written as a PNG (:func:`save_png`). A
    panel: ``{"title", "chance" (a dashed grey line), "lines": [(x, y, style, color, label)]}``, optionally
    ``"vline"`` (an x to mark), ``"xticks"`` and ``"marker"``; accuracy from 0 to 1, the legend on the last panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), height), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for x, y, style, color, label in panel["lines"]:
            ax.plot(x, y, style, color=color, label=label, marker=panel.get("marker"), ms=3)
        if panel.get("xticks") is not None:
            ax.set_xticks(panel["xticks"])
        if panel.get("vline") is not None:
            ax.axvline(panel["vline"], color="grey", lw=0.7)
        ax.axhline(panel["chance"], color="grey", lw=0.7, ls="--")
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    return save_png(fig, path)
