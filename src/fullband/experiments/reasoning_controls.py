"""The reasoning experiment's exact-trained FBT recipe, its two controls from the latent-reasoning literature, and
the accuracy-against-trace-length frontier they are judged on.

Owns :data:`EXACT_RECIPE` (``--fbt-recipe exact``: the whole recurrence at linear cost on every step, exact states
then 2 gradient passes, as the state experiment's ``fbt-L-x2``), the configurations of the **pause-token** plain
model (``baseline-pause``: :data:`~fullband.eval.problems.PAUSE` fillers after every prompt, in training and in
decoding, after Goyal et al., *Think before you speak*) and of the **stepwise-internalization** plain model
(``baseline-internalized``: S + 1 chained stages, stage j trained on the traces with the first j/S of their steps
removed, each stage starting from the previous one's weights with a fresh optimizer and LR schedule, after Deng et
al., *From explicit CoT to implicit CoT*), both trained for FBT's training FLOPs; :func:`frontier_trace` (the trace
a model's accuracy-against-trace frontier needs to reach an accuracy) and :func:`trace_savings` (FBT's trace
against each plain model's at FBT's accuracy, with problem-bootstrap CIs), and the curve's PNG.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ..eval.problems import PAUSE, format_prompt
from .common import accuracy_panels, parse_settings, plain_config, recipe_from_args
from ..utils.stats import SEEDS_THEN_ROWS, seed_draw_counts
from .reasoning_report import BASELINE, EPOCHS, FBT, FLOPS, INTERN, PAUSE_ARM

EXACT_RECIPE = dict(num_passes=2, exact_states=True, grad_passes=2, feedback_start=0.0, deep_fraction=0.0,
                    prefix_mix=0.0)
FBT_RECIPES = ("default", "exact")
CHANCE = {"s3": 1 / 6}
SAVING_FLOOR = -10.0  # a saving below this (a plain model needing almost no trace) is reported as the floor


def fbt_recipe(args) -> dict:
    """The options ``--fbt-recipe`` adds to FBT's run: none (``default``: ``fullband train``'s recipe) or
    :data:`EXACT_RECIPE` (``exact``), where an option given on the command line (a recipe flag, ``--set``) wins."""
    if args.fbt_recipe not in FBT_RECIPES:
        raise ValueError(f"--fbt-recipe must be one of {', '.join(FBT_RECIPES)}, got {args.fbt_recipe!r}")
    if args.fbt_recipe == "default":
        return {}
    given = set(recipe_from_args(args)) | set(parse_settings(args.settings))
    return {k: v for k, v in EXACT_RECIPE.items() if k not in given}


def stage_label(j: int, stages: int) -> str:
    """The run label of internalization stage ``j`` of ``0..stages`` (the last is ``baseline-internalized``)."""
    return INTERN if j == stages else f"{INTERN}@{j}"


def stage_drops(stages: int) -> list[float]:
    """The fraction of each trace's steps removed at each stage: 0, 1/S, ..., 1 (none without stages)."""
    return [j / stages for j in range(stages + 1)] if stages > 0 else []


def pause_count(requested: int | None, tokenizer, problems, texts) -> int:
    """The pause-token control's fillers per prompt: ``requested``, or by default the held-out prompts' mean token
    count (BOS included, rounded): what FBT's ``fused`` mode spends on its extra pass over the prompt. Checked: no
    training text holds the filler, and ``n`` fillers after a prompt are ``n`` tokens of their own."""
    if requested is not None and requested < 0:
        raise ValueError(f"--pause-tokens must be >= 0, got {requested}")
    if any(PAUSE in t for t in texts):
        raise ValueError(f"the training texts hold the pause filler {PAUSE!r}: the pause control needs a byte no "
                         "problem text holds")
    n = requested if requested is not None else round(
        sum(len(tokenizer(format_prompt(p))["input_ids"]) for p in problems) / len(problems))
    p = problems[0]
    plain, paused = (len(tokenizer(format_prompt(p, pause=k), add_special_tokens=False)["input_ids"]) for k in (0, n))
    if paused - plain != n:
        raise ValueError(f"{n} pause fillers tokenize into {paused - plain} tokens after a prompt; expected one each")
    return n


def control_configs(base_cfg, flops_steps: int, root: str, data_dir: str, pause: int, stages: int) -> dict:
    """``baseline-pause`` (``pause`` > 0) and the internalization stages (``stages`` > 0), plain runs of
    ``base_cfg``'s options for FBT's training FLOPs (``flops_steps`` plain steps; the stages ``ceil(flops_steps /
    (stages + 1))`` each, together at least as many). Stage j > 0 starts from stage j - 1's weights (``--init-from``)
    with a fresh optimizer and its own LR schedule at the baseline's LR."""
    cfgs = {}
    if pause > 0:
        cfgs[PAUSE_ARM] = dataclasses.replace(
            plain_config(base_cfg), out=os.path.join(root, PAUSE_ARM), steps=flops_steps, eval_every=flops_steps,
            data=os.path.join(data_dir, "train-pause.jsonl"))
    if stages > 0:
        each, prev = math.ceil(flops_steps / (stages + 1)), None
        for j in range(stages + 1):
            cfg = dataclasses.replace(
                plain_config(base_cfg), out=os.path.join(root, f"internalize{j}"), steps=each, eval_every=each,
                data=os.path.join(data_dir, f"train-internalize{j}.jsonl"), init_from=prev,
                lr=base_cfg.resolved_lr())
            cfgs[stage_label(j, stages)] = cfg
            prev = cfg.out
    return cfgs


# ============================================================================================== the frontier


def frontier_trace(points: list[tuple[float, float]], accuracy: float) -> tuple[float | None, str]:
    """The trace length a model's accuracy-against-trace frontier needs to reach ``accuracy``: ``points`` are its
    ``(mean trace tokens, accuracy)`` decodes (verbosities, stages); the frontier keeps each point more accurate
    than every shorter one and is read linearly between them. ``(trace, how)``: ``how`` is ``"interpolated"``,
    ``"at most"`` (the shortest point is already as accurate: its trace, an upper bound) or ``"never"`` (no point
    is as accurate: ``None``)."""
    front = []
    for t, a in sorted(points):
        if not front or a > front[-1][1]:
            front.append((t, a))
    if accuracy <= front[0][1]:
        return front[0][0], "at most"
    for (t0, a0), (t1, a1) in zip(front, front[1:]):
        if accuracy <= a1:
            return t0 + (t1 - t0) * (accuracy - a0) / (a1 - a0), "interpolated"
    return None, "never"


def _saving(fbt_trace: float, needed: float | None) -> float:
    """1 - FBT's trace / the plain model's trace at FBT's accuracy: 1 where the plain model never gets there, the
    floor where it needs (almost) no trace."""
    if needed is None:
        return 1.0
    if needed <= 0:
        return 0.0 if fbt_trace <= 0 else SAVING_FLOOR
    return max(SAVING_FLOOR, 1.0 - fbt_trace / needed)


def control_groups(keys, stages: int) -> dict[str, list[tuple]]:
    """Per plain model, the (model, mode, style) decodes that make its frontier (the internalization control: every
    stage's)."""
    groups = {}
    for name in (BASELINE, FLOPS, EPOCHS, PAUSE_ARM):
        got = [k for k in keys if k[0] == name]
        if got:
            groups[name] = got
    got = [k for k in keys if k[0] in {stage_label(j, stages) for j in range(stages + 1)}]
    if got and stages > 0:
        groups[INTERN] = got
    return groups


def trace_savings(runs: list[dict], seeds: list[int], stages: int, seed: int, n_resamples: int) -> list[dict]:
    """For each FBT mode's free decode: its accuracy and trace, and against each plain model the trace that model's
    frontier needs for that accuracy (:func:`frontier_trace`) and the saving ``1 - FBT's / that`` (the goal: >= 0.15
    against the best plain model), with percentile-bootstrap 95% CIs that draw the seeds (with replacement, one
    draw for every model) and one set of problems per resample for every seed and decode, so they hold the
    seed-to-seed spread as well as the problems'."""
    arrays = {}
    for key in dict.fromkeys((r["model"], r["mode"], r["style"]) for r in runs):
        per = {r["seed"]: r["records"] for r in runs if (r["model"], r["mode"], r["style"]) == key}
        if sorted(per) != sorted(seeds):
            continue
        arrays[key] = (np.array([[x["correct"] for x in per[s]] for s in seeds], dtype=float),
                       np.array([[x["trace_tokens"] for x in per[s]] for s in seeds], dtype=float))
    groups = control_groups(list(arrays), stages)
    fbt_keys = [k for k in arrays if k[0] == FBT and k[2] == "free"]
    if not fbt_keys or not groups:
        return []
    n = next(iter(arrays.values()))[0].shape[1]
    rng = np.random.default_rng(seed)
    draws = np.concatenate([np.arange(n)[None], rng.integers(0, n, (n_resamples, n))])  # row 0: the estimate
    k_seeds = len(seeds)  # each resample's seed counts ([seeds, resamples + 1]; column 0: every seed once)
    counts = np.ones((k_seeds, len(draws)))
    if k_seeds > 1:
        counts[:, 1:] = seed_draw_counts(np.random.default_rng([seed, 1]), k_seeds, n_resamples)

    def pooled(x: np.ndarray) -> np.ndarray:  # [seeds, problems] -> the resampled means over seeds and problems
        return (x[:, draws].mean(axis=2) * counts).sum(axis=0) / k_seeds

    means = {k: (pooled(t), pooled(c)) for k, (c, t) in arrays.items()}
    out = []
    for fk in fbt_keys:
        ft, fa = means[fk]
        rows = {}
        for name, keys in groups.items():
            values = []
            for i in range(len(draws)):
                need, how = frontier_trace([(means[k][0][i], means[k][1][i]) for k in keys], fa[i])
                values.append((_saving(ft[i], need), need, how))
            boot = np.array([v[0] for v in values[1:]])
            rows[name] = {"needed_trace": values[0][1], "how": values[0][2], "saving": values[0][0],
                          "low": float(np.percentile(boot, 2.5)) if len(boot) else values[0][0],
                          "high": float(np.percentile(boot, 97.5)) if len(boot) else values[0][0],
                          "points": [[float(means[k][0][0]), float(means[k][1][0]), f"{k[0]}/{k[2]}"] for k in keys]}
        best = min(rows, key=lambda g: rows[g]["saving"])
        out.append({"fbt": f"{FBT}/{fk[1]}", "accuracy": float(fa[0]), "trace": float(ft[0]), "against": rows,
                    "best_control": best, "goal_met": rows[best]["low"] >= 0.15, "resamples": n_resamples,
                    "resampled": SEEDS_THEN_ROWS.replace("rows", "problems") if k_seeds > 1 else "problems"})
    return out


def curve_png(runs_table: list[dict], stages: int, task: str, path: str) -> str:
    """Accuracy against mean trace tokens, one line per model over its decodes (verbosities sorted by trace; the
    internalization control over its stages' free decodes), FBT one line per mode."""
    lines, colors = [], iter(["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9"] * 3)
    groups = control_groups([(r["model"], r["mode"], r["style"]) for r in runs_table], stages)
    by = {(r["model"], r["mode"], r["style"]): r for r in runs_table}
    for mode in dict.fromkeys(r["mode"] for r in runs_table if r["model"] == FBT):
        groups[f"{FBT}/{mode}"] = [k for k in by if k[0] == FBT and k[1] == mode]
    for name, keys in groups.items():
        pts = sorted((by[k]["mean_trace_tokens"], by[k]["accuracy"]) for k in keys)
        lines.append(([p[0] for p in pts], [p[1] for p in pts], "-" if name.startswith(FBT) else "--",
                      next(colors), name))
    return accuracy_panels([{"title": f"{task}: accuracy against trace length (pooled over seeds)",
                             "chance": CHANCE.get(task, 0.0), "lines": lines, "marker": "o"}],
                           path, "mean trace tokens before ####", height=4.0)
