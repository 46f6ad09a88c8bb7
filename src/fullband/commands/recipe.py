"""``fullband experiment recipe``: which feedback recipe keeps feedback from hurting its own model, measured.

Owns the recipe grid (:data:`ARMS`), its runs, its evaluation and its report. One plain **trunk** per seed is
trained first (constant LR after warmup, saved as the plain HF checkpoint it is); every arm then continues that
trunk for the same number of steps on the same next batches (``--init-from`` the trunk, ``--data-offset`` where it
stopped), so the arms differ only in what the arm says:

* baselines (K = 1): ``baseline`` (WSD: constant, then a linear decay over the last 30%), ``baseline-decayed``
  (the LR the shipped recipe switches feedback on at: cosine from 0.25x down to 0.1x of the peak) and
  ``baseline-flops`` (WSD, more steps: as many training FLOPs as the costliest FBT arm), from which the baseline's
  loss at each arm's FLOPs is interpolated (per row, linearly in log FLOPs);
* FBT arms, a ladder of levers: the shipped recipe (paper GLU, K = 2 with 10% K = 4, at a decayed LR) -> WSD
  (feedback at the peak LR) -> switch-on warm-up (fusion LR x10 warmed up over 10% of the branch, per-group
  clipping, lambda ramped over 20%) -> the token-preserving ``residual`` entry (``u = e + GLU(h, e)``, exactly the
  plain model at switch-on) -> K = 3 / a fusion-only phase / the ``add`` and ``concat`` entries; plus the public
  reproduction's retrofit (GLU, K = 2 at a constant LR, no levers; its SFT-with-K=3 stage needs chat data and is
  not run here).

Every run is evaluated on the same held-out rows (documents never trained on) in every mode: ``standard``,
K = 2 and K = 3 teacher-forced passes, ``exact`` (the token-by-token recurrence), and decoding-style ``soft`` and
``fused`` scoring of each row's continuation after a ``--prompt-tokens`` prompt; all modes score the same
tokens (each row's positions after the prompt). Reported per arm and mode: the loss (mean over seeds, and per
seed), the paired difference to the baseline at equal tokens and at equal training FLOPs (percentile bootstrap
over rows, per seed; the pooled CI resamples rows within each seed: each seed's held-out rows come from its own
seeded validation split, so the seeds share no rows), and the switch-on diagnostics (pass-2 minus
pass-1 loss and gradient norm over the first feedback steps). Writes ``results.json``, ``report.md`` and
``recipe.png`` into ``--out``. Finished runs of the same options, data and trunk are reused, and their evaluations
as long as the model's weights and the scored rows are the same; a finished run that differs is kept and the
experiment stops with an error naming the differences, unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import load_any_model, row_losses
from ..model.configuration import has_feedback
from ..training.checkpoint import evaluation_key
from ..training.config import TrainConfig
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.presets import get_preset
from ..training.pretrain import build_tokenizer_and_corpus, rows_fingerprint, spread_rows, train
from ..utils.io import atomic_write_json, read_jsonl
from ..utils.stats import bootstrap_ci, bootstrap_ci_within_seeds
from .experiment_common import (
    add_overwrite_argument,
    apply_quick,
    finished,
    pick_arms,
    refuse_changed_runs,
    save_png,
    write_outputs,
)

# ---------------------------------------------------------------------------------------------- the grid

_WSD = dict(lr_schedule="wsd", warmup_fraction=0.05, decay_fraction=0.3, min_lr_ratio=0.1)
_DECAYED = dict(lr_schedule="cosine", warmup_fraction=0.0, min_lr_ratio=0.4)  # and lr = 0.25 x peak
_CONSTANT = dict(lr_schedule="constant", warmup_fraction=0.05)
_WARM = dict(fusion_lr_mult=10.0, fusion_warmup=0.1, clip_per_group=True, feedback_ramp=0.2)
_PAPER_K = dict(num_passes=2, deep_passes=4, deep_fraction=0.1)


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    description: str
    settings: dict
    lr_scale: float = 1.0  # x the preset's peak LR
    reference: str = "baseline"  # the equal-token baseline arm with the same LR schedule
    default: bool = True


ARMS: tuple[Arm, ...] = (
    Arm("baseline", "plain, WSD", dict(num_passes=1, **_WSD)),
    Arm("baseline-decayed", "plain, cosine from 0.25x to 0.1x peak", dict(num_passes=1, **_DECAYED), lr_scale=0.25),
    Arm("baseline-constant", "plain, constant LR", dict(num_passes=1, **_CONSTANT)),
    Arm("shipped", "paper GLU, K=2 (+10% K=4), switched on at a decayed LR (the old default)",
        dict(fusion="glu", **_PAPER_K, **_DECAYED), lr_scale=0.25, reference="baseline-decayed"),
    Arm("glu-wsd", "paper GLU, K=2 (+10% K=4), WSD (feedback at the peak LR)", dict(fusion="glu", **_PAPER_K, **_WSD)),
    Arm("glu-warm", "glu-wsd + fusion LR x10 warmed up, per-group clipping, lambda ramp",
        dict(fusion="glu", **_PAPER_K, **_WSD, **_WARM)),
    Arm("residual-warm", "glu-warm with the token-preserving entry u = e + GLU(h, e)",
        dict(fusion="residual", **_PAPER_K, **_WSD, **_WARM)),
    Arm("residual-warm-k3", "residual-warm with K=3 (+10% K=4)",
        dict(fusion="residual", num_passes=3, deep_passes=4, deep_fraction=0.1, **_WSD, **_WARM)),
    Arm("residual-fusion-only", "residual-warm with the backbone frozen for the first 20% of the branch",
        dict(fusion="residual", **_PAPER_K, **_WSD, **_WARM, fusion_only=0.2)),
    Arm("add-warm", "glu-warm with the additive entry u = e + W h", dict(fusion="add", **_PAPER_K, **_WSD, **_WARM)),
    Arm("concat-warm", "glu-warm with the concat entry u = W [e; h]", dict(fusion="concat", **_PAPER_K, **_WSD, **_WARM),
        default=False),
    Arm("retrofit-repro", "public reproduction's retrofit: paper GLU, K=2, constant LR, no levers",
        dict(fusion="glu", num_passes=2, deep_fraction=0.0, **_CONSTANT), reference="baseline-constant"),
)
ARM_BY_NAME = {a.name: a for a in ARMS}
FLOPS_BASELINE = "baseline-flops"
FBT_MODES = (("standard", 1), ("passes", 2), ("passes", 3), ("exact", None), ("soft", None), ("fused", None))

DEFAULTS = dict(out=os.path.join("runs", "experiments", "recipe"), preset="tiny", trunk_steps=250, branch_steps=100,
                batch_size=16, seq_len=128, vocab_size=4096, seeds="0,1", eval_rows=64, prompt_tokens=32,
                flops_multiplier=2.3)
QUICK = dict(preset="micro", trunk_steps=6, branch_steps=4, batch_size=4, seq_len=32, vocab_size=300, eval_rows=4,
             prompt_tokens=8)


def mode_key(mode: str, k: int | None) -> str:
    return f"K={k}" if mode == "passes" else mode


# ---------------------------------------------------------------------------------------------- runs


# every recipe setting an arm may change, pinned here so that the arms mean the same whatever the defaults of
# `fullband train` are (the defaults were chosen from this grid); an arm overrides what it names
_PINNED = dict(fusion="glu", lr_schedule="cosine", warmup_fraction=0.05, decay_fraction=0.2, min_lr_ratio=0.1,
               num_passes=2, deep_passes=4, deep_fraction=0.1, fusion_lr_mult=1.0, fusion_warmup=0.0,
               clip_per_group=False, feedback_ramp=0.0, fusion_only=0.0, prefix_mix=0.25, jitter=0.02,
               feedback_weight=1.0, feedback_start=0.75)


def _config(args, out: str, steps: int, seed: int, **extra) -> TrainConfig:
    return TrainConfig(out=out, steps=steps, seed=seed, preset=args.preset, batch_size=args.batch_size,
                       seq_len=args.seq_len, vocab_size=args.vocab_size, device=args.device,
                       progress=not args.no_progress, tensorboard=False, plot=False, save_every=0, eval_every=0,
                       eval_rows=8, **{**_PINNED, **extra})


def _train(cfg: TrainConfig, corpus, name: str) -> dict:
    summary = train(cfg, overwrite=True, corpus=corpus, name=name)
    if summary["status"] != "done":
        raise RuntimeError(f"{name}: training did not finish: {summary['message']}")
    return summary


def switch_on_stats(records: list[dict], first: int = 10) -> dict | None:
    """Pass-2 minus pass-1 loss and gradient norm over the first ``first`` feedback steps of a run."""
    fb = [r for r in records if r.get("split") == "train" and r.get("num_passes", 1) > 1 and not r.get("skipped")]
    if not fb:
        return None
    head, tail = fb[:first], fb[-first:]
    gap = lambda rs: sum(r["pass_losses"][1] - r["pass_losses"][0] for r in rs) / len(rs)  # noqa: E731
    return {"first_gap": gap(head), "last_gap": gap(tail), "first_max_grad_norm": max(r["grad_norm"] for r in head),
            "last_mean_grad_norm": sum(r["grad_norm"] for r in tail) / len(tail)}


def evaluate_run(cfg: TrainConfig, rows: torch.Tensor, args) -> dict:
    """Per-row losses of a finished run in every mode it has (cached in ``OUT/recipe_eval.json``, keyed by the
    model scored, :func:`fullband.training.checkpoint.evaluation_key`, and the rows and prompt it was scored on),
    its training FLOPs and its switch-on statistics."""
    key = evaluation_key(cfg.out, rows_sha256=rows_fingerprint(rows), prompt_tokens=args.prompt_tokens)
    path = os.path.join(cfg.out, "recipe_eval.json")
    try:
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return cached["result"]
    except (OSError, ValueError):
        pass
    model = load_any_model(cfg.out, device=args.device_resolved)[0]
    records = read_jsonl(os.path.join(cfg.out, "metrics.jsonl"))
    fl = training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, flop_parameters(model))
    feedback = has_feedback(model)
    t = time.perf_counter()
    losses = {mode_key(mode, k): row_losses(model, rows, mode, num_passes=k or 1,
                                            prompt_length=args.prompt_tokens).tolist()
              for mode, k in (FBT_MODES if feedback else (("standard", 1),))}
    result = {"steps": cfg.steps, "flops": fl["flops"], "passes": fl["passes"], "tokens": fl["tokens"],
              "losses": losses, "eval_seconds": time.perf_counter() - t,
              "switch_on": switch_on_stats(records) if feedback else None,
              "skipped_steps": sum(1 for r in records if r.get("skipped"))}
    atomic_write_json(path, {"key": key, "result": result})
    return result


def _elapsed(out: str) -> float | None:
    """Training seconds of a finished run (its summary.json)."""
    try:
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f).get("elapsed")
    except (OSError, ValueError):
        return None


def seed_plan(args, seed: int, arms: list[Arm]) -> tuple[TrainConfig, dict[str, TrainConfig]]:
    """The trunk's config of one seed and every arm's (the FLOP-matched baseline last), validated."""
    root = os.path.join(args.out, f"seed{seed}")
    peak = args.lr or get_preset(args.preset).lr
    trunk_cfg = _config(args, os.path.join(root, "trunk"), args.trunk_steps, seed, num_passes=1, lr=peak,
                        lr_schedule="constant", warmup_fraction=0.05)
    plan = [(a.name, a.settings, a.lr_scale, args.branch_steps) for a in arms]
    plan.append((FLOPS_BASELINE, dict(num_passes=1, **_WSD), 1.0, math.ceil(args.branch_steps * args.flops_multiplier)))
    cfgs = {name: _config(args, os.path.join(root, name), steps, seed, init_from=trunk_cfg.out, feedback_start=0.0,
                          lr=peak * lr_scale, data_offset=args.trunk_steps, **settings)
            for name, settings, lr_scale, steps in plan}
    trunk_cfg.validate()
    for cfg in cfgs.values():  # the trunk they continue may not exist yet
        dataclasses.replace(cfg, init_from=None).validate()
    return trunk_cfg, cfgs


def run_seed(args, seed: int, trunk_cfg: TrainConfig, cfgs: dict[str, TrainConfig], corpus, say) -> dict:
    """Trunk, every arm and the FLOP-matched baseline of one seed (finished runs of the same options, data and
    trunk are reused); per-row losses of each (run, mode)."""
    if not finished(trunk_cfg, corpus):
        say(f"recipe: seed {seed}: trunk, {args.trunk_steps} plain steps")
        _train(trunk_cfg, corpus, f"seed {seed} trunk")
    rows = spread_rows(corpus.val_rows, args.eval_rows)
    runs = {}
    for name, cfg in cfgs.items():
        if not finished(cfg, corpus):  # also when the trunk it continues was retrained
            say(f"recipe: seed {seed}: {name}, {cfg.steps} steps")
            _train(cfg, corpus, f"seed {seed} {name}")
        runs[name] = dict(evaluate_run(cfg, rows, args), train_seconds=_elapsed(cfg.out))
    return {"seed": seed, "runs": runs, "eval_rows": int(rows.shape[0]),
            "scored_tokens": int(rows.shape[0] * (rows.shape[1] - args.prompt_tokens))}


# ---------------------------------------------------------------------------------------------- analysis


def _interp_rows(lo: list[float], hi: list[float], f_lo: float, f_hi: float, f: float) -> list[float] | None:
    """Per-row baseline loss at FLOPs ``f``, linear in log FLOPs between two baseline runs (None outside)."""
    if not f_lo <= f <= f_hi * (1 + 1e-9):
        return None
    w = 0.0 if f_hi == f_lo else (math.log(f) - math.log(f_lo)) / (math.log(f_hi) - math.log(f_lo))
    return [a + w * (b - a) for a, b in zip(lo, hi)]


def analyse(seeds: list[dict], arms: list[Arm], boot_seed: int = 0) -> list[dict]:
    """One table row per (arm, mode): loss per seed and mean, paired deltas at equal tokens and equal FLOPs."""
    table = []
    for arm in arms:
        first = seeds[0]["runs"][arm.name]
        for mode in first["losses"]:
            per_seed, d_tok, d_flop, d_self, flop_ok = [], [], [], [], True
            for s in seeds:
                runs = s["runs"]
                run, ref = runs[arm.name], runs[arm.reference]
                mine = run["losses"][mode]
                per_seed.append(sum(mine) / len(mine))
                d_tok.append([a - b for a, b in zip(mine, ref["losses"]["standard"])])
                d_self.append([a - b for a, b in zip(mine, run["losses"]["standard"])])
                base, big = runs["baseline"], runs[FLOPS_BASELINE]
                at = _interp_rows(base["losses"]["standard"], big["losses"]["standard"], base["flops"], big["flops"],
                                  run["flops"])
                if at is None or arm.reference != "baseline":
                    flop_ok = False
                else:
                    d_flop.append([a - b for a, b in zip(mine, at)])
            row = {"arm": arm.name, "mode": mode, "loss": sum(per_seed) / len(per_seed), "loss_per_seed": per_seed,
                   "reference": arm.reference, "flops": [s["runs"][arm.name]["flops"] for s in seeds]}
            if arm.name != arm.reference:
                # each seed scores rows of its own seeded validation split: resampled within each seed
                row["delta_tokens"] = bootstrap_ci_within_seeds(d_tok, boot_seed)
                row["delta_tokens_per_seed"] = [bootstrap_ci(d, seed=boot_seed).as_dict() for d in d_tok]
            if mode != "standard":
                row["delta_vs_own_standard"] = bootstrap_ci_within_seeds(d_self, boot_seed)
            if flop_ok and arm.name != "baseline":
                row["delta_flops"] = bootstrap_ci_within_seeds(d_flop, boot_seed)
            table.append(row)
    return table


def _ci(d: dict | None) -> str:
    if not d:
        return ""
    return f"{d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def tables(res: dict) -> str:
    lines = ["| arm | mode | loss (mean of seeds) | per seed | Δ vs baseline, equal tokens [95% CI] | "
             "Δ vs baseline, equal FLOPs | Δ vs own standard |", "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in res["table"]:
        per = " / ".join(f"{x:.4f}" for x in r["loss_per_seed"])
        lines.append(f"| {r['arm']} | {r['mode']} | {r['loss']:.4f} | {per} | {_ci(r.get('delta_tokens'))} | "
                     f"{_ci(r.get('delta_flops'))} | {_ci(r.get('delta_vs_own_standard'))} |")
    lines += ["", "| arm | first-10-step L2−L1 | last-10-step L2−L1 | first-10 max grad norm | last-10 mean grad norm |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, so in res["switch_on"].items():
        if so:
            lines.append(f"| {name} | {so['first_gap']:+.3f} | {so['last_gap']:+.3f} | "
                         f"{so['first_max_grad_norm']:.2f} | {so['last_mean_grad_norm']:.2f} |")
    return "\n".join(lines)


def best_feedback_arm(res: dict) -> dict:
    """The FBT arm whose best feedback mode has the lowest mean loss, with that mode."""
    best = None
    for r in res["table"]:
        if r["arm"].startswith("baseline") or r["mode"] == "standard":
            continue
        if best is None or r["loss"] < best["loss"]:
            best = r
    return best


def plot(res: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in res["arms"] if not a.startswith("baseline")]
    modes = ["standard", "K=2", "exact", "soft", "fused"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(arms)), 4))
    width = 0.8 / len(modes)
    by = {(r["arm"], r["mode"]): r for r in res["table"]}
    for j, mode in enumerate(modes):
        xs, ys, errs = [], [], []
        for i, arm in enumerate(arms):
            r = by.get((arm, mode))
            if r and r.get("delta_tokens"):
                d = r["delta_tokens"]
                xs.append(i + (j - len(modes) / 2 + 0.5) * width)
                ys.append(d["estimate"])
                errs.append([[d["estimate"] - d["low"]], [d["high"] - d["estimate"]]])
        if xs:
            err = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            ax.bar(xs, ys, width, yerr=err, label=mode, capsize=2)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels(arms, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out loss − baseline (nats/token)")
    ax.set_title("recipe grid: Δ vs the equal-token baseline (95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)


# ---------------------------------------------------------------------------------------------- command


def run_recipe(args) -> dict:
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    if len(seeds) < 1:
        raise ValueError("--seeds must name at least one seed (two or more for a fair comparison)")
    names = pick_arms(args.arms, ARM_BY_NAME, [a.name for a in ARMS if a.default])
    for need in ("baseline",):
        if need not in names:
            names.insert(0, need)
    for n in list(names):
        ref = ARM_BY_NAME[n].reference
        if ref not in names:
            names.insert(0, ref)
    arms = [ARM_BY_NAME[n] for n in dict.fromkeys(names)]
    for name in ("trunk_steps", "branch_steps", "batch_size", "eval_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.prompt_tokens < args.seq_len - 1:
        raise ValueError(f"--prompt-tokens must be in [1, --seq-len - 1), got {args.prompt_tokens}")
    args.device_resolved = str(resolve_device(args.device))
    say = (lambda *a: None) if args.no_progress and args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    load0, t0 = load_average(), time.perf_counter()
    plans = {s: seed_plan(args, s, arms) for s in seeds}
    corpora = {s: build_tokenizer_and_corpus(plans[s][0]) for s in seeds}
    for s, (trunk_cfg, cfgs) in plans.items():  # before anything is trained
        refuse_changed_runs([trunk_cfg, *cfgs.values()], corpora[s], args.overwrite)
    per_seed = [run_seed(args, s, *plans[s], corpora[s], say) for s in seeds]
    res = {"arms": [a.name for a in arms] + [FLOPS_BASELINE],
           "arm_descriptions": {a.name: a.description for a in arms}, "seeds": seeds,
           "settings": {k: getattr(args, k) for k in DEFAULTS if k != "out"} | {"quick": bool(args.quick)},
           "per_seed": per_seed}
    res["table"] = analyse(per_seed, arms)
    res["switch_on"] = {a.name: per_seed[0]["runs"][a.name]["switch_on"] for a in arms}
    res["best"] = best_feedback_arm(res)
    res["seconds"] = time.perf_counter() - t0
    res["train_seconds"] = sum(r["train_seconds"] or 0.0 for s in per_seed for r in s["runs"].values()) + sum(
        _elapsed(os.path.join(args.out, f"seed{s}", "trunk")) or 0.0 for s in seeds)
    res["load_average"] = [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "recipe.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("per_seed",), lead=f"{len(seeds)} seed(s), ")
    return res


def report(res: dict, text: str) -> str:
    s = res["settings"]
    best = res["best"]
    lines = ["# fullband experiment recipe", "",
             f"Preset `{s['preset']}`; per seed a plain trunk of {s['trunk_steps']} steps, then every arm "
             f"{s['branch_steps']} steps from it on the same next batches ({s['batch_size']} x {s['seq_len']} "
             f"tokens a step); seeds {res['seeds']}; {s['eval_rows']} held-out rows, each scored after a "
             f"{s['prompt_tokens']}-token prompt in every mode. Training took {res['train_seconds']:.0f}s summed over the "
             f"runs (trunks included); this invocation {res['seconds']:.0f}s wall (finished runs are reused), load average "
             f"{res['load_average'][0]} at the start and {res['load_average'][1]} at the end, "
             f"{res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}`: {d}" for n, d in res["arm_descriptions"].items()]
    lines += [f"* `{FLOPS_BASELINE}`: plain, WSD, as many training FLOPs as the costliest arm", "", text, ""]
    if best:
        lines.append(f"Best feedback arm and mode: `{best['arm']}` in `{best['mode']}`, {best['loss']:.4f} "
                     f"(Δ vs baseline at equal tokens {_ci(best.get('delta_tokens'))}).")
    lines += ["", "![recipe](recipe.png)", ""]
    return "\n".join(lines)


def add_parser(ex) -> None:
    """Register ``fullband experiment recipe`` on the ``experiment`` sub-parsers."""
    r = ex.add_parser("recipe", help="the feedback recipe grid: switch-on, fusion entry, LR schedule, K; every mode, "
                                     "equal tokens and equal FLOPs, >= 2 seeds",
                      description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--out", default=DEFAULTS["out"], help=f"output directory (default: {DEFAULTS['out']})")
    add_overwrite_argument(r)
    r.add_argument("--preset", default=DEFAULTS["preset"], help="backbone size preset (default: tiny; small / "
                                                                "gpt2-small with --device cuda)")
    r.add_argument("--trunk-steps", type=int, default=DEFAULTS["trunk_steps"], help="plain trunk steps per seed")
    r.add_argument("--branch-steps", type=int, default=DEFAULTS["branch_steps"], help="steps of every arm")
    r.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="rows per step")
    r.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per row")
    r.add_argument("--vocab-size", type=int, default=DEFAULTS["vocab_size"], help="BPE entries")
    r.add_argument("--lr", type=float, default=None, help="peak LR (default: the preset's)")
    r.add_argument("--seeds", default=DEFAULTS["seeds"], help="comma-separated seeds (default: 0,1)")
    r.add_argument("--arms", default=None, help="comma-separated arms (default: all but concat-warm); one of "
                                                 + ", ".join(ARM_BY_NAME))
    r.add_argument("--flops-multiplier", type=float, default=DEFAULTS["flops_multiplier"],
                   help="steps of the FLOP-matched baseline as a multiple of --branch-steps (its FLOPs bound the "
                        "equal-FLOPs comparison; an arm costlier than that is reported out of range)")
    r.add_argument("--eval-rows", type=int, default=DEFAULTS["eval_rows"], help="held-out rows scored")
    r.add_argument("--prompt-tokens", type=int, default=DEFAULTS["prompt_tokens"],
                   help="prompt length before the scored continuation of each row")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda")
    r.add_argument("--quick", action="store_true", help="a smoke-test size (micro preset, a few steps)")
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.set_defaults(func=lambda args: (run_recipe(args), 0)[1])
