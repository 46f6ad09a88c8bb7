"""``fullband experiment state``: running-state tasks with a label at every position -- does a long feedback
recurrence carry the state where a fixed-depth transformer runs out of layers?

Owns the state experiment: its arms, their training on the tasks of :mod:`fullband.eval.state_tasks` (the S3 and
S5 word problems, parity, variable tracking; mixed in one training stream, the label at every position), the
per-position evaluation at the training length T and at 2T and 4T (length generalisation) in every decode mode,
the state interventions, the cost of long recurrences per K and per ``--grad-passes``, and the report. Training
shares the depth experiment's machinery (:mod:`fullband.experiments.synthetic`: the same initial backbones,
``fullband train``'s engine, finished runs reused only for the same options, data and initial weights, the
equal-FLOPs controls).

Seeds (``--seeds 0,1``): each seed is a run of the whole experiment of its own, in ``OUT/seed{N}/`` (its initial
backbones in ``OUT/seed{N}/init/``, its arms in ``OUT/seed{N}/runs/``: training rows, test rows, initial weights and
data order all from that seed), so a later invocation with more seeds and the same ``--out`` trains only the new
ones. The tables show the mean over seeds with a 95% CI that resamples the test rows within each seed
(:func:`fullband.utils.stats.bootstrap_ci_within_seeds`; each seed has test rows of its own), the per-seed values
beside it in ``results.json``.

Arms (every one the same steps on the same rows -- equal tokens -- except the two equal-FLOPs controls):

* ``baseline-L`` / ``baseline-2L`` / ``baseline-4L``: plain, L / 2L / 4L layers;
* ``fbt-L``: L layers, residual entry, trained with the long recurrence K = T + 1 (the exact recurrence on every
  labelled position; :func:`fullband.eval.state_tasks.exact_passes`) from the first step, all passes
  backpropagated, no prefix mixing, no deep steps; ``fbt-L-glu``: the same with the paper's pure GLU;
* ``baseline-L-flops``: plain, L layers, trained for the training FLOPs of the first FBT arm (every pass counted,
  a pass without gradient at a third: :func:`fullband.eval.flops.training_flops`) on fresh rows;
* ``baseline-L-epochs``: the same steps as baseline-L-flops, re-reading exactly baseline-L's rows epoch after epoch
  (``--unique-batches`` = ``--steps``: equal unique tokens AND equal FLOPs), its own full LR schedule;
* not in the default set (``--arms``): ``fbt-L-glu-g2`` / ``-g1`` (``--grad-passes 2`` / ``1``), ``fbt-L-glu-tol``
  (``--pass-tol`` early stop), ``fbt-L-glu-cur`` (a curriculum in K over the first half of the steps): the cheaper settings.

FBT arms are scored in ``standard`` (no feedback), ``K=2`` (two teacher-forced passes) and ``exact`` (the
token-by-token recurrence) mode, all through :func:`fullband.eval.scoring.mode_logits`; in exact mode the fed-back
state is zeroed (``exact/zero``) or taken from another row of the same task (``exact/shuffle``) to show whether it
is used. Reported per (task, length): per-position accuracy and last-position accuracy with 95% bootstrap CIs, each
mode's inference FLOPs per token (x the L-layer model's standard pass, counted from what the scorer runs:
:func:`fullband.experiments.synthetic.mode_cost`), the paired per-row differences to baseline-L and baseline-4L (and,
for the FBT arms, to both equal-FLOPs controls), the interventions' paired effects, and the cost table.
Writes ``results.json`` (per-row results included), ``report.md`` and ``state.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..data.corpus import Corpus
from ..eval.flops import flop_parameters
from ..eval.scoring import load_any_model, mode_logits
from ..eval.state_tasks import (
    CHANCE,
    LabelTable,
    dense_labels,
    encode_state_rows,
    exact_passes,
    make_state_problems,
    predicted_states,
    state_tokenizer,
)
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.pretrain import PretrainRecipe
from ..utils.stats import bootstrap_ci, bootstrap_ci_within_seeds
from .common import accuracy_panels, apply_quick, pick_arms, refuse_changed_runs, write_outputs
from .state_cost import measure_costs
from .synthetic import (
    CONTROL_ARMS,
    EPOCHS_ARM,
    FLOPS_ARM,
    Arm,
    arm_config,
    control_reference,
    init_backbone,
    mode_cost,
    run_flops,
    train_arm,
    train_controls,
)

LONG = dict(feedback_start=0.0, deep_fraction=0.0, prefix_mix=0.0)  # the long recurrence from the first step
ARM_NAMES = ("baseline-L", "baseline-2L", "baseline-4L", "fbt-L", "fbt-L-glu", FLOPS_ARM, EPOCHS_ARM,
             "fbt-L-glu-g2", "fbt-L-glu-g1", "fbt-L-glu-tol", "fbt-L-glu-cur")
DEFAULT_ARMS = ARM_NAMES[:7]
FBT_MODES = (("standard", "standard", 1), ("K=2", "passes", 2), ("exact", "exact", None))
INTERVENTIONS = ("zero", "shuffle")
MULTIPLES = (1, 2, 4)
REFS = ("baseline-L", "baseline-4L", FLOPS_ARM, EPOCHS_ARM)  # paired references; the controls for FBT arms only

DEFAULTS = dict(out=os.path.join("runs", "experiments", "state"), layers=2, hidden=128, heads=4, steps=600,
                batch_size=64, lr=2e-3, tasks="s3,s5,parity,vars", length=10, test_rows=200, pass_tol=0.01, seeds="0")
QUICK = dict(layers=1, hidden=32, heads=2, steps=6, batch_size=8, length=4, test_rows=8)


def make_arms(args) -> dict[str, Arm]:
    K = exact_passes(args.length)
    fbt = dict(num_passes=K, **LONG)
    arms = [Arm("baseline-L", "plain, L layers", 1, dict(num_passes=1)),
            Arm("baseline-2L", "plain, 2L layers", 2, dict(num_passes=1)),
            Arm("baseline-4L", "plain, 4L layers", 4, dict(num_passes=1)),
            Arm("fbt-L", f"L layers, residual entry, K = {K} (exact recurrence) on every step", 1, fbt),
            Arm("fbt-L-glu", f"L layers, pure GLU, K = {K} (exact recurrence) on every step", 1,
                fbt | {"fusion": "glu"}),
            Arm(FLOPS_ARM, "plain, L layers, trained for the first FBT arm's training FLOPs on fresh rows", 1,
                dict(num_passes=1)),
            Arm(EPOCHS_ARM, "plain, L layers, trained for the first FBT arm's training FLOPs re-reading exactly "
                "baseline-L's rows (--unique-batches --steps), its own full LR schedule", 1, dict(num_passes=1)),
            Arm("fbt-L-glu-g2", f"fbt-L-glu with --grad-passes 2 (passes 1..{K - 2} without gradient)", 1,
                fbt | {"fusion": "glu", "grad_passes": 2}),
            Arm("fbt-L-glu-g1", f"fbt-L-glu with --grad-passes 1 (passes 1..{K - 1} without gradient)", 1,
                fbt | {"fusion": "glu", "grad_passes": 1}),
            Arm("fbt-L-glu-tol", f"fbt-L-glu with --pass-tol {args.pass_tol} (early stop)", 1,
                fbt | {"fusion": "glu", "pass_tol": args.pass_tol}),
            Arm("fbt-L-glu-cur", "fbt-L-glu with a curriculum in K (2 -> K over the first half)", 1,
                fbt | {"fusion": "glu", "pass_curriculum": 0.5})]
    return {a.name: a for a in arms}


class StateRecipe(PretrainRecipe):
    """Pre-training on running-state rows with a label at every input position (:func:`dense_labels`)."""

    def batch(self, step, num_passes, generator, env):
        sb = super().batch(step, num_passes, generator, env)
        table = getattr(self, "_table", None) or LabelTable(self.tokenizer)
        self._table = table
        for mb in sb.micro:
            mb["labels"] = dense_labels(mb["input_ids"], table)
        return sb


def training_corpus(args, tokenizer, steps: int, seed: int) -> Corpus:
    rows = encode_state_rows(tokenizer, make_state_problems(args.tasks_list, steps * args.batch_size, seed,
                                                            args.length))
    return Corpus(tokenizer, rows, torch.empty(0, rows.shape[1], dtype=torch.long), ["state-train"], [])


def parse_seeds(args) -> list[int]:
    """The training seeds of ``--seeds`` (comma-separated) or ``--seed N`` (one), ``DEFAULTS["seeds"]`` when
    neither is given; a one-line error for both, a repeated seed or one that is not an integer >= 0."""
    if args.seeds is not None and args.seed is not None:
        raise ValueError("give --seeds or --seed, not both (--seed N is --seeds N)")
    text = args.seeds if args.seeds is not None else str(args.seed) if args.seed is not None else DEFAULTS["seeds"]
    try:
        seeds = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, e.g. 0,1; got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs distinct integers >= 0, got {text!r}")
    return seeds


def seed_args(args, seed: int):
    """The options of one seed's run of the experiment: that seed, in ``OUT/seed{N}/``."""
    return argparse.Namespace(**(vars(args) | {"seed": seed, "out": os.path.join(args.out, f"seed{seed}")}))


def plain_arms(names: list[str]) -> list[str]:
    return [n for n in names if n not in CONTROL_ARMS]


def train_all(args, arms: dict, names: list[str], corpus, say) -> dict:
    """Train (or reuse) every arm of one seed (``args``: :func:`seed_args`); returns ``{name: (cfg, seconds,
    flops)}``."""
    out = {}
    for name in plain_arms(names):
        cfg, elapsed = train_arm(args, arms[name], corpus, say, StateRecipe, "state")
        out[name] = (cfg, elapsed, run_flops(cfg))
    fresh = lambda a, steps: training_corpus(a, corpus.tokenizer, steps, a.seed + 7)  # noqa: E731 - fresh rows
    train_controls(args, arms, names, out, corpus, fresh, say, StateRecipe, "state")
    return out


# ---------------------------------------------------------------------------------------------- evaluation


def test_sets(args, tokenizer) -> dict:
    """``{(task, length): rows}``: fresh rows of each task at T, 2T and 4T (other seeds than training's)."""
    sets = {}
    for j, task in enumerate(args.tasks_list):
        for m in MULTIPLES:
            probs = make_state_problems([task], args.test_rows, args.seed + 1_000_003 * (1 + m) + 101 * j,
                                        args.length * m)
            sets[(task, args.length * m)] = encode_state_rows(tokenizer, probs)
    return sets


@torch.no_grad()
def per_row(model, rows, table, mode: str, num_passes: int = 1, hook: str | None = None, batch: int = 256):
    """``(per-position accuracy per row, last-position correctness per row, accuracy per position)``."""
    marks = []
    for i in range(0, rows.shape[0], batch):
        r = rows[i:i + batch]
        if hook is None:
            logits = mode_logits(model, r, mode, num_passes)
        else:
            def state_hook(t, prev):
                return torch.zeros_like(prev) if hook == "zero" else prev.roll(1, dims=0)
            logits = model.recurrent_forward(r, state_hook=state_hook).logits
        marks.append(predicted_states(logits, r, table).cpu())
    m = torch.cat(marks).double()
    return m.mean(1).tolist(), m[:, -1].long().tolist(), m.mean(0).tolist()


def evaluate_arm(model, sets: dict, table, device) -> dict:
    """``{mode: {"task/length": {"pos": [...], "last": [...], "by_position": [...]}}}``."""
    plans = [("standard", "standard", 1, None)]
    if has_feedback(model):
        plans = [(key, mode, k, None) for key, mode, k in FBT_MODES]
        plans += [(f"exact/{h}", "exact", None, h) for h in INTERVENTIONS]
    res = {}
    for key, mode, k, hook in plans:
        res[key] = {}
        for (task, length), rows in sets.items():
            pos, last, curve = per_row(model, rows.to(device), table, mode, k or 1, hook)
            res[key][f"{task}/{length}"] = {"pos": pos, "last": last, "by_position": curve}
    return res


def inference_costs(model, ref_fp: dict, sets: dict) -> dict:
    """``{mode: {"T": inference FLOPs per token}}`` of ``model``'s scoring modes on the test rows of each length
    (x the L-layer model's standard pass on those rows: :func:`fullband.experiments.synthetic.mode_cost`)."""
    fp = flop_parameters(model)
    modes = FBT_MODES if has_feedback(model) else FBT_MODES[:1]
    return {key: {str(length): mode_cost(fp, ref_fp, rows.shape[1], mode, k or 1) for (_, length), rows in sets.items()}
            for key, mode, k in modes}


def _ci(groups: list[list[float]], boot: int) -> dict:
    """The mean over seeds of each seed's mean of ``groups[seed]``, with a 95% CI that resamples the rows within each
    seed (each seed has its own test rows); one seed: the percentile bootstrap of its rows."""
    if len(groups) == 1:
        return bootstrap_ci(groups[0], seed=0, n_resamples=boot).as_dict()
    return bootstrap_ci_within_seeds(groups, seed=0, n_resamples=boot) | {"confidence": 0.95}


def _mean(values) -> float:
    return sum(values) / len(values)


def _paired(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    """Per seed, the per-row differences ``a - b`` (the same test rows in both)."""
    return [[x - y for x, y in zip(sa, sb)] for sa, sb in zip(a, b)]


def analyse(res: dict, boot: int = 2000) -> dict:
    """The table rows (accuracy with CIs, mean over seeds, and the per-seed means), the paired differences to the
    baselines (the equal-FLOPs controls: for the FBT arms) and the interventions."""
    seeds = [res["per_seed"][str(s)] for s in res["seeds"]]
    refs = [n for n in REFS if n in res["arms"]]
    table, deltas, inter = [], [], []
    for arm in res["arms"]:
        for mode, cells in seeds[0][arm]["correct"].items():
            for cell in cells:
                task, length = cell.split("/")

                def rows(a, m, field="pos", cell=cell):
                    return [s[a]["correct"][m][cell][field] for s in seeds]

                pos = rows(arm, mode)
                if "/" in mode:
                    base = rows(arm, "exact")
                    inter.append({"arm": arm, "task": task, "length": int(length), "intervention": mode.split("/")[1],
                                  "exact": _mean([_mean(b) for b in base]), "delta": _ci(_paired(pos, base), boot)})
                    continue
                last = rows(arm, mode, "last")
                table.append({"arm": arm, "mode": mode, "task": task, "length": int(length),
                              "pos": _ci(pos, boot), "last": _ci(last, boot),
                              "per_seed": {"pos": [_mean(p) for p in pos], "last": [_mean(x) for x in last]},
                              "inference_flops": res["runs"][arm]["inference_flops"][mode][length]})
                for ref in refs:
                    if ref != arm and (ref not in CONTROL_ARMS or arm.startswith("fbt")):
                        deltas.append({"arm": arm, "mode": mode, "task": task, "length": int(length), "vs": ref,
                                       "delta": _ci(_paired(pos, rows(ref, "standard")), boot)})
    return {"table": table, "deltas": deltas, "interventions": inter}


def fmt_ci(d, digits=2, sign=False):
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{fmt.format(d['estimate'])} [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"


def tables(res: dict) -> str:
    lengths = sorted({r["length"] for r in res["table"]})
    count = len(res["seeds"])
    seeds = f"mean of {count} seeds, CI over the rows within each seed" if count > 1 else f"seed {res['seeds'][0]}"
    out = []
    for task in res["settings"]["tasks"].split(","):
        out += [f"**{task}** (per-position accuracy [95% CI] / last-position accuracy, {seeds}; trained at T = "
                f"{res['settings']['length']}; chance {CHANCE[task]:.3f}; inference FLOPs per token x the L-layer "
                "model's standard pass, at each T)", "",
                "| arm | mode | " + " | ".join(f"T={n}" for n in lengths) + " | inference FLOPs |",
                "| --- | --- |" + " ---: |" * (len(lengths) + 1)]
        rows = {}
        for r in res["table"]:
            if r["task"] == task:
                rows.setdefault((r["arm"], r["mode"]), {})[r["length"]] = r
        for (arm, mode), by_len in rows.items():
            out.append(f"| {arm} | {mode} | " + " | ".join(
                f"{fmt_ci(by_len[n]['pos'])} / {by_len[n]['last']['estimate']:.2f}" if n in by_len else ""
                for n in lengths) + " | " + "/".join(f"{by_len[n]['inference_flops']:.3f}" for n in lengths
                                                     if n in by_len) + " |")
        out.append("")
    if res["deltas"]:
        out += ["**Paired per-row difference in per-position accuracy** (FBT exact mode and the other baselines "
                f"minus the reference; FBT arms also vs the equal-FLOPs controls; Δ [95% CI], {seeds})", "",
                "| arm | mode | task | vs | " + " | ".join(f"T={n}" for n in lengths) + " |",
                "| --- | --- | --- | --- |" + " ---: |" * len(lengths)]
        rows = {}
        for d in res["deltas"]:
            if d["mode"] in ("exact", "standard") and not (d["mode"] == "standard" and d["arm"].startswith("fbt")):
                rows.setdefault((d["arm"], d["mode"], d["task"], d["vs"]), {})[d["length"]] = d["delta"]
        for (arm, mode, task, vs), by_len in rows.items():
            out.append(f"| {arm} | {mode} | {task} | {vs} | "
                       + " | ".join(fmt_ci(by_len[n], sign=True) if n in by_len else "" for n in lengths) + " |")
        out.append("")
    if res["interventions"]:
        out += ["**Is the fed-back state used?** Exact-mode per-position accuracy and its paired change when the "
                f"state is zeroed or taken from another row of the same task (Δ [95% CI], {seeds})", "",
                "| arm | task | T | exact | " + " | ".join(INTERVENTIONS) + " |",
                "| --- | --- | ---: | ---: |" + " ---: |" * len(INTERVENTIONS)]
        rows = {}
        for r in res["interventions"]:
            rows.setdefault((r["arm"], r["task"], r["length"]), {"exact": r["exact"]})[r["intervention"]] = r["delta"]
        for (arm, task, length), v in rows.items():
            out.append(f"| {arm} | {task} | {length} | {v['exact']:.2f} | "
                       + " | ".join(fmt_ci(v[n], sign=True) for n in INTERVENTIONS) + " |")
        out.append("")
    if res.get("cost"):
        out += [f"**Cost of a training step** (seed {res['seeds'][0]}, S3 rows, T = {res['settings']['length']}, batch "
                f"{res['settings']['batch_size']}, fusion glu; median of the timed steps; activation memory = the "
                "bytes autograd saved for the backward)", "",
                "| K | grad passes | pass tol | passes run | step time (s) | activation memory (MiB) | FLOPs vs K=1 |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {c['num_passes']} | {c['grad_passes']} | {c['pass_tol'] or '-'} | {c['passes_run']:.1f} | "
                f"{c['step_seconds']:.3f} | {c['saved_mib']:.1f} | {c['flops_ratio']:.2f} |" for c in res["cost"]]
        out.append("")
    return "\n".join(out)


def plot(res: dict, path: str) -> str:
    longest = max(r["length"] for r in res["table"])
    seeds = [res["per_seed"][str(s)] for s in res["seeds"]]
    panels = []
    for task in res["settings"]["tasks"].split(","):
        lines = []
        for i, arm in enumerate(res["arms"]):
            for mode, style in (("standard", "-"), ("exact", ":")):
                curves = [s[arm]["correct"].get(mode, {}).get(f"{task}/{longest}") for s in seeds]
                if curves[0] is not None and not (mode == "standard" and arm.startswith("fbt")):
                    mean = [_mean(v) for v in zip(*(c["by_position"] for c in curves))]  # over seeds
                    lines.append((range(1, longest + 1), mean, style, f"C{i}", f"{arm} {mode}"))
        panels.append({"title": f"{task}: accuracy per position (T={longest})", "chance": CHANCE[task],
                       "lines": lines, "vline": res["settings"]["length"]})
    return accuracy_panels(panels, path, "position")


# ---------------------------------------------------------------------------------------------- command


def run_state(args, show: bool = True) -> dict:
    """The experiment (``args``: the command's options); ``show=False`` writes the outputs without printing the
    tables (the quickstart prints them in its own report)."""
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for name in ("steps", "batch_size", "test_rows", "layers", "length", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pass_tol <= 0:
        raise ValueError(f"--pass-tol must be > 0, got {args.pass_tol}")
    seeds = parse_seeds(args)
    args.seeds, args.seed = ",".join(map(str, seeds)), None
    args.tasks_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    arms = make_arms(args)
    names = pick_arms(args.arms, arms, list(DEFAULT_ARMS))
    control_reference(names)  # controls without an FBT arm: refused before anything trains
    t0, load0 = time.perf_counter(), load_average()
    tokenizer = state_tokenizer()
    table = LabelTable(tokenizer)
    runs = {s: seed_args(args, s) for s in seeds}
    sets = {s: test_sets(a, tokenizer) for s, a in runs.items()}  # fails fast on an unknown task
    device = str(resolve_device(args.device))
    corpora = {s: training_corpus(a, tokenizer, a.steps, s) for s, a in runs.items()}
    for s, a in runs.items():  # before anything trains: a finished run of other options or data is refused
        refuse_changed_runs([arm_config(a, arms[n], corpora[s]) for n in plain_arms(names)], corpora[s],
                            args.overwrite)
    res = {"arms": names, "arm_descriptions": {n: arms[n].description for n in names}, "seeds": seeds,
           "settings": {k: getattr(args, k) for k in DEFAULTS if k != "out"} | {
               "quick": bool(args.quick), "num_passes": exact_passes(args.length),
               "lengths": [args.length * m for m in MULTIPLES]},
           "chance": {t: CHANCE[t] for t in args.tasks_list}, "runs": {}, "per_seed": {}}
    ref_fp = flop_parameters(load_any_model(init_backbone(runs[seeds[0]], tokenizer, 1))[0])
    for s, a in runs.items():
        trained = train_all(a, arms, names, corpora[s], say)
        res["per_seed"][str(s)] = {}
        for name in names:
            cfg, elapsed, flops = trained[name]
            model = load_any_model(cfg.out, device=device)[0].eval()
            t = time.perf_counter()
            say(f"state: evaluating {name} (seed {s})")
            res["per_seed"][str(s)][name] = {"train_seconds": elapsed, "steps": cfg.steps, "train_flops": flops,
                                             "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
                                             "unique_batches": cfg.unique_batches,
                                             "correct": evaluate_arm(model, sets[s], table, device),
                                             "eval_seconds": time.perf_counter() - t}
            if name not in res["runs"]:  # per arm, not per seed: the first seed's model (same shapes and rows)
                res["runs"][name] = {"layers": args.layers * arms[name].depth,
                                     "parameters": sum(p.numel() for p in model.parameters()),
                                     "inference_flops": inference_costs(model, ref_fp, sets[s])}
    for name in names:
        per = [res["per_seed"][str(s)][name] for s in seeds]
        res["runs"][name] |= {"steps": per[0]["steps"], "tokens": per[0]["tokens"],
                              "train_flops": _mean([r["train_flops"] for r in per]),
                              "train_seconds": sum(r["train_seconds"] or 0.0 for r in per)}
    res |= analyse(res)
    if not args.no_cost:
        say("state: measuring the cost per K and --grad-passes")
        res["cost"] = measure_costs(runs[seeds[0]], tokenizer, table, device)
    res["seconds"], res["load_average"] = time.perf_counter() - t0, [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "state.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("per_seed",),
                  lead=f"{len(seeds)} seed(s), ", show=show)
    return res


def report(res: dict, text: str) -> str:
    s = res["settings"]
    train_s = sum(r["train_seconds"] for r in res["runs"].values())
    lines = ["# fullband experiment state", "",
             f"Tasks {s['tasks']}{' (mixed in one stream)' if ',' in s['tasks'] else ''}, rows of T = "
             f"{s['length']} inputs with a label at every position; every arm {s['steps']} steps x "
             f"{s['batch_size']} rows (equal tokens; baseline-L-flops: more steps on fresh rows, to the first FBT "
             "arm's training FLOPs; baseline-L-epochs: as many steps re-reading baseline-L's rows), Llama "
             f"d{s['hidden']} with {s['heads']} heads, L = {s['layers']}, seeds {s['seeds']} (each its own training "
             f"rows, initial weights and test rows, in OUT/seed{{N}}/), peak LR {s['lr']}; FBT arms trained with "
             f"K = {s['num_passes']} passes. Test: {s['test_rows']} fresh rows per task, length and seed "
             f"({', '.join(map(str, s['lengths']))}). Training {train_s:.0f}s summed over the runs; this invocation "
             f"{res['seconds']:.0f}s wall (finished runs are reused), load average {res['load_average'][0]} at the "
             f"start and {res['load_average'][1]} at the end, {res['threads']} thread(s).", "", "Arms:", ""]
    lines += [f"* `{n}` ({r['layers']} layers, {r['parameters']:,} parameters, {r['steps']} steps, "
              f"{r['train_flops']:.3g} training FLOPs): {res['arm_descriptions'][n]}" for n, r in res["runs"].items()]
    lines += ["", "Modes: `standard` no feedback; `K=2` two teacher-forced passes; `exact` the token-by-token "
              "recurrence (T sequential one-token calls). Inference FLOPs per token are counted from what each "
              "mode runs (`fullband.eval.flops.inference_flops`), relative to the L-layer model's standard pass on "
              "the same rows.", "", text, "![state](state.png)", ""]
    return "\n".join(lines)
