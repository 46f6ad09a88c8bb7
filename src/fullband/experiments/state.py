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
ones. The tables show the mean over seeds with a 95% CI that resamples the test rows within each seed only
(:func:`fullband.utils.stats.bootstrap_ci_within_seeds`; it does not cover seed-to-seed variation), and the range
of the per-seed values beside it (``{min..max}``; the values themselves in ``results.json``).

Held-out rows: each seed draws its test rows (each task at T, 2T, 4T) and validation rows (each task at T) first;
no arm's training rows include one of them (training draws skip them; :class:`HeldOut` checks the token rows before
anything is scored and refuses otherwise). At T = 10 parity has only 1,024 strings: without this every test row
was a training row. ``--plain-lrs a,b,c`` trains baseline-L/2L/4L at each LR and keeps the one best on the
validation rows; ``--random-positions`` trains every arm on randomized position ids covering the 4T rows' relative
distances, the control that separates carrying the state from RoPE extrapolation at 2T / 4T.

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
  (``--pass-tol`` early stop), ``fbt-L-glu-cur`` (a curriculum in K over the first half of the steps): the
  cheaper settings.

FBT arms are scored in ``standard`` (no feedback), ``K=2`` (two teacher-forced passes) and ``exact`` (the
token-by-token recurrence) mode, all through :func:`fullband.eval.scoring.mode_logits`; in exact mode the fed-back
state alone is replaced (the token kept) by the mean over the test rows of the state at that step (``exact/mean``)
or by the state another row of the same task had at that step (``exact/shuffle``), and by a zero state
(``exact/zero``) only where that keeps the token (the residual entry; on the pure GLU a zero state zeroes the whole
input): :func:`intervention_hook`. Reported per (task, length): per-position accuracy and last-position accuracy
with 95% bootstrap CIs, each mode's inference FLOPs per token (x the L-layer model's standard pass, counted from
what the scorer runs: :func:`fullband.experiments.synthetic.mode_cost`), the paired per-row differences to
baseline-L and baseline-4L (and, for the FBT arms, to both equal-FLOPs controls), the interventions' paired effects,
and the cost table.
Writes ``results.json`` (per-row results included), ``report.md`` and ``state.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import torch
from transformers.utils import logging as hf_logging

from ..eval.flops import flop_parameters, training_flops
from ..eval.scoring import load_any_model, mode_logits
from ..eval.state_tasks import (
    CHANCE,
    LabelTable,
    exact_passes,
    predicted_states,
    state_tokenizer,
)
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from .common import apply_quick, pick_arms, refuse_changed_runs, write_outputs
from .interventions import (  # noqa: F401 - INTERVENTIONS, zero_keeps_token: the experiment's API
    INTERVENTIONS, exact_states, intervention_hook, interventions_for, zero_keeps_token)
from .state_cost import measure_costs
from .state_data import (  # noqa: F401 - StateCorpus, curriculum_length, random_positions: the experiment's API
    CURRICULUM_START,
    MULTIPLES,
    HeldOut,
    StateCorpus,
    StateRecipe,
    curriculum_length,
    held_out,
    position_range,
    random_positions,
    training_corpus,
)
from .state_report import SWEPT, _mean, analyse, fmt_ci, plot, report, tables  # noqa: F401 - fmt_ci: API
from .synthetic import (
    CONTROL_ARMS,
    EPOCHS_ARM,
    FLOPS_ARM,
    MAX_POSITIONS,
    Arm,
    arm_config,
    control_reference,
    init_backbone,
    mode_cost,
    run_flops,
    train_arm,
    train_controls,
)
from ..utils.argtypes import POSITIVE_FRACTION, POSITIVE_INT

LONG = dict(feedback_start=0.0, deep_fraction=0.0, prefix_mix=0.0)  # the long recurrence from the first step
ARM_NAMES = ("baseline-L", "baseline-2L", "baseline-4L", "fbt-L", "fbt-L-glu", FLOPS_ARM, EPOCHS_ARM,
             "fbt-L-glu-g2", "fbt-L-glu-g1", "fbt-L-glu-tol", "fbt-L-glu-cur", "fbt-L-glu-x2", "fbt-L-x2",
             "fbt-L-glu-fb", "fbt-L-fb")
DEFAULT_ARMS = ARM_NAMES[:7]
FBT_MODES = (("standard", "standard", 1), ("K=2", "passes", 2), ("exact", "exact", None))

DEFAULTS = dict(out=os.path.join("runs", "experiments", "state"), layers=2, hidden=128, heads=4, steps=600,
                batch_size=64, lr=2e-3, tasks="s3,s5,parity,vars", length=10, test_rows=200, pass_tol=0.01, seeds="0")
OPTIONS = dict(plain_lrs=None, random_positions=False, length_curriculum=None,
               curriculum_start=CURRICULUM_START)  # the options of add_arguments (absent: these)
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
                fbt | {"fusion": "glu", "pass_curriculum": 0.5}),
            # the exact recurrence at linear cost: its states token by token, then 2 gradient passes (any T)
            Arm("fbt-L-glu-x2", "L layers, pure GLU, exact states + 2 gradient passes on every step "
                "(--exact-states --grad-passes 2: linear in T)", 1,
                dict(num_passes=2, exact_states=True, grad_passes=2, fusion="glu", **LONG)),
            Arm("fbt-L-x2", "L layers, residual entry, exact states + 2 gradient passes on every step", 1,
                dict(num_passes=2, exact_states=True, grad_passes=2, **LONG)),
            # full backpropagation through the token-by-token recurrence (blocks of 8 tokens recomputed)
            Arm("fbt-L-glu-fb", "L layers, pure GLU, full backpropagation through the recurrence on every step "
                "(--full-backprop --backprop-chunk 8: the last of K = T + 1 passes' gradient, linear in T)", 1,
                dict(num_passes=2, full_backprop=True, backprop_chunk=8, fusion="glu", **LONG)),
            Arm("fbt-L-fb", "L layers, residual entry, full backpropagation through the recurrence on every step", 1,
                dict(num_passes=2, full_backprop=True, backprop_chunk=8, **LONG))]
    return {a.name: a for a in arms}


def k_exact_flops(model, cfg, length: int) -> float:
    """The training FLOPs the run's steps would cost as K = T + 1 passes, every one with gradient (what ``fbt-L`` /
    ``fbt-L-glu`` train): the cost an exact-states or full-backpropagation arm is there to avoid."""
    records = [{"split": "train", "num_passes": exact_passes(length)}] * cfg.steps
    return training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, flop_parameters(model))["flops"]


def add_arguments(r) -> None:
    """The state experiment's own options beyond the synthetic experiments' shared ones (``OPTIONS``)."""
    r.add_argument("--plain-lrs", default=None,
                   help="comma-separated peak LRs, e.g. 1e-3,3e-3,1e-2: baseline-L/2L/4L are each trained at every "
                        "one and reported at the LR best on held-out validation rows (never the test rows) "
                        "(default: --lr only)")
    r.add_argument("--random-positions", action="store_true",
                   help="train every arm on randomized positions (BOS at 0, the other position ids a sorted random "
                        "subset of 1..4T+1), so the 2T / 4T test rows' relative distances were all seen in training")
    r.add_argument("--length-curriculum", type=POSITIVE_FRACTION, default=None, metavar="FRACTION",
                   help="train every arm (plain and FBT) with a curriculum in length: over the first FRACTION of its "
                        "steps the labelled length grows linearly from --curriculum-start to T, then stays at T "
                        "(the loss only at the first n inputs of each row; a causal model's later positions change "
                        "nothing before them, so this is training on length-n rows; FLOPs are counted on whole rows) "
                        "(default: none, every label from the first step)")
    r.add_argument("--curriculum-start", type=POSITIVE_INT, default=OPTIONS["curriculum_start"], metavar="N",
                   help="the labelled length at the first step of --length-curriculum (default: %(default)s)")


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


def parse_lrs(args) -> list[float] | None:
    """The LRs of ``--plain-lrs`` (``None``: not given); a one-line error for a value that is not a number > 0."""
    if args.plain_lrs is None:
        return None
    try:
        lrs = [float(x) for x in str(args.plain_lrs).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--plain-lrs takes comma-separated numbers, e.g. 1e-3,3e-3,1e-2; got {args.plain_lrs!r}"
                         ) from None
    if not lrs or min(lrs) <= 0 or len(set(lrs)) != len(lrs):
        raise ValueError(f"--plain-lrs needs distinct LRs > 0, got {args.plain_lrs!r}")
    return lrs


def lr_variants(args, arm: Arm) -> list[tuple[float, argparse.Namespace, Arm]]:
    """``[(lr, options, arm)]`` to train for ``arm``: one at ``--lr`` in the arm's own directory, or, for the swept
    plain arms under ``--plain-lrs``, one per LR in ``runs/{arm}-lr{lr}``."""
    lrs = parse_lrs(args)
    if lrs is None or arm.name not in SWEPT:
        return [(args.lr, args, arm)]
    return [(lr, argparse.Namespace(**(vars(args) | {"lr": lr})), dataclasses.replace(arm, name=f"{arm.name}-lr{lr:g}"))
            for lr in lrs]


def validation_accuracy(cfg, held: HeldOut, table, device) -> float:
    """Per-position accuracy (standard mode) on the validation rows, the mean over tasks: what the sweep maximises."""
    model = load_any_model(cfg.out, device=device)[0].eval()
    return _mean([_mean(per_row(model, rows.to(device), table, "standard")[0]) for rows in held.val.values()])


def train_all(args, arms: dict, names: list[str], corpus, held: HeldOut, table, device, say) -> tuple[dict, dict, dict]:
    """Train (or reuse) every arm of one seed (``args``: :func:`seed_args`); returns ``({name: (cfg, seconds,
    flops)}, {name: the corpus it trained on}, {swept arm: {"val": {lr: accuracy}, "lr": the chosen LR}})``."""
    out, corpora, sweep = {}, {}, {}
    for name in plain_arms(names):
        runs = []
        for lr, a, arm in lr_variants(args, arms[name]):
            cfg, elapsed = train_arm(a, arm, corpus, say, StateRecipe, "state")
            runs.append((lr, cfg, elapsed))
        if len(runs) > 1:  # chosen on the validation rows, never the test rows
            val = {lr: validation_accuracy(cfg, held, table, device) for lr, cfg, _ in runs}
            best = max(runs, key=lambda r: val[r[0]])
            sweep[name] = {"val": {f"{lr:g}": v for lr, v in val.items()}, "lr": best[0],
                           "train_seconds": sum(r[2] or 0.0 for r in runs)}
            runs = [best]
        _, cfg, elapsed = runs[0]
        out[name], corpora[name] = (cfg, elapsed, run_flops(cfg)), corpus

    def fresh(a, steps):  # the equal-FLOPs control's fresh rows (held-out rows excluded too)
        corpora[FLOPS_ARM] = training_corpus(a, corpus.tokenizer, steps, a.seed + 7, held)
        return corpora[FLOPS_ARM]

    train_controls(args, arms, names, out, corpus, fresh, say, StateRecipe, "state")
    if EPOCHS_ARM in out:
        corpora[EPOCHS_ARM] = corpus
    return out, corpora, sweep


# ---------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def per_row(model, rows, table, mode: str, num_passes: int = 1, intervention: str | None = None, batch: int = 256):
    """``(per-position accuracy per row, last-position correctness per row, accuracy per position)``; with
    ``intervention`` (exact mode), the recurrence fed the states of :func:`intervention_hook`."""
    states = exact_states(model, rows, batch) if intervention is not None else None
    marks = []
    for i in range(0, rows.shape[0], batch):
        r = rows[i:i + batch]
        if intervention is None:
            logits = mode_logits(model, r, mode, num_passes)
        else:
            index = torch.arange(i, i + r.shape[0])
            logits = model.recurrent_forward(r, state_hook=intervention_hook(intervention, states, index)).logits
        marks.append(predicted_states(logits, r, table).cpu())
    m = torch.cat(marks).double()
    return m.mean(1).tolist(), m[:, -1].long().tolist(), m.mean(0).tolist()


def evaluate_arm(model, sets: dict, table, device) -> dict:
    """``{mode: {"task/length": {"pos": [...], "last": [...], "by_position": [...]}}}``."""
    plans = [("standard", "standard", 1, None)]
    if has_feedback(model):
        plans = [(key, mode, k, None) for key, mode, k in FBT_MODES]
        plans += [(f"exact/{h}", "exact", None, h) for h in interventions_for(model)]
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


# ---------------------------------------------------------------------------------------------- command


def run_state(args, show: bool = True) -> dict:
    """The experiment (``args``: the command's options); ``show=False`` writes the outputs without printing the
    tables (the quickstart prints them in its own report)."""
    hf_logging.disable_progress_bar()
    for k, v in OPTIONS.items():  # a parser without add_arguments: their defaults
        if not hasattr(args, k):
            setattr(args, k, v)
    apply_quick(args, DEFAULTS, QUICK)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for name in ("steps", "batch_size", "test_rows", "layers", "length", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.test_rows < 2:
        raise ValueError(f"--test-rows must be >= 2 (the shuffle intervention feeds each row another row's state), "
                         f"got {args.test_rows}")
    if args.pass_tol <= 0:
        raise ValueError(f"--pass-tol must be > 0, got {args.pass_tol}")
    if args.length_curriculum is not None and not 0 < args.length_curriculum <= 1:
        raise ValueError(f"--length-curriculum is the fraction of the steps the length grows over, in (0, 1]; got "
                         f"{args.length_curriculum}")
    if args.length_curriculum is not None and not 1 <= args.curriculum_start <= args.length:
        raise ValueError(f"--curriculum-start must be in 1..--length ({args.length}), got {args.curriculum_start}")
    seeds = parse_seeds(args)
    parse_lrs(args)
    if position_range(args) > MAX_POSITIONS:
        raise ValueError(f"--random-positions draws positions up to 4T + 1 = {position_range(args) - 1}, past the "
                         f"backbone's {MAX_POSITIONS} positions: lower --length")
    longest = MULTIPLES[-1] * args.length + 2  # the 4T test rows, BOS and EOS: refused before anything is trained
    if longest > MAX_POSITIONS:
        raise ValueError(f"--length {args.length}: the 4T test rows are {longest} tokens, past the backbone's "
                         f"{MAX_POSITIONS} positions; use --length {(MAX_POSITIONS - 2) // MULTIPLES[-1]} or less")
    args.seeds, args.seed = ",".join(map(str, seeds)), None
    args.tasks_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    arms = make_arms(args)
    names = pick_arms(args.arms, arms, list(DEFAULT_ARMS))
    control_reference(names)  # controls without an FBT arm: refused before anything trains
    t0, load0 = time.perf_counter(), load_average()
    tokenizer = state_tokenizer()
    table = LabelTable(tokenizer)
    runs = {s: seed_args(args, s) for s in seeds}
    held = {s: held_out(a, tokenizer) for s, a in runs.items()}  # fails fast on an unknown task
    sets = {s: h.test for s, h in held.items()}
    device = str(resolve_device(args.device))
    corpora = {s: training_corpus(a, tokenizer, a.steps, s, held[s]) for s, a in runs.items()}
    for s, a in runs.items():  # before anything trains: a finished run of other options or data is refused
        refuse_changed_runs([arm_config(v, arm, corpora[s]) for n in plain_arms(names)
                             for _, v, arm in lr_variants(a, arms[n])], corpora[s], args.overwrite)
    res = {"arms": names, "arm_descriptions": {n: arms[n].description for n in names}, "seeds": seeds,
           "settings": {k: getattr(args, k) for k in (DEFAULTS | OPTIONS) if k != "out"} | {
               "quick": bool(args.quick), "num_passes": exact_passes(args.length),
               "lengths": [args.length * m for m in MULTIPLES], "position_range": position_range(args),
               "validation_rows": args.test_rows},
           "chance": {t: CHANCE[t] for t in args.tasks_list}, "runs": {}, "per_seed": {}, "lr_sweep": {}}
    ref_fp = flop_parameters(load_any_model(init_backbone(runs[seeds[0]], tokenizer, 1))[0])
    for s, a in runs.items():
        trained, trained_on, sweep = train_all(a, arms, names, corpora[s], held[s], table, device, say)
        if sweep:
            res["lr_sweep"][str(s)] = sweep
        res["per_seed"][str(s)] = {}
        for name in names:
            cfg, elapsed, flops = trained[name]
            checked = held[s].refuse(trained_on[name].train_rows, name)  # never score a row an arm trained on
            model = load_any_model(cfg.out, device=device)[0].eval()
            t = time.perf_counter()
            say(f"state: evaluating {name} (seed {s})")
            res["per_seed"][str(s)][name] = {"train_seconds": elapsed, "steps": cfg.steps, "train_flops": flops,
                                             "lr": cfg.lr, "rows_checked_held_out": checked,
                                             "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
                                             "unique_batches": cfg.unique_batches,
                                             "correct": evaluate_arm(model, sets[s], table, device),
                                             "eval_seconds": time.perf_counter() - t}
            if name not in res["runs"]:  # per arm, not per seed: the first seed's model (same shapes and rows)
                res["runs"][name] = {"layers": args.layers * arms[name].depth,
                                     "parameters": sum(p.numel() for p in model.parameters()),
                                     "inference_flops": inference_costs(model, ref_fp, sets[s])}
                if has_feedback(model):
                    res["runs"][name]["train_flops_k_exact"] = k_exact_flops(model, cfg, args.length)
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
