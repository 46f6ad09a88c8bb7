"""``fullband experiment programs``: the Feedback Transformer's algorithmic task -- programs of ``=``, ``++``, ``--``,
``if`` and ``print`` statements over 3 or 5 variables with values 1..10, scored on the printed values -- FBT with L
layers against plain models of L, 2L and 4L layers and the equal-FLOPs plain controls.

Owns the experiment: its arms, training them through ``fullband train``'s labelled recipe, the LR choice on the
validation programs, scoring every decode mode, the learning curves and the results. The programs each seed trains,
chooses and is tested on are :mod:`fullband.experiments.programs_data`'s; the analysis, tables, figures and report
:mod:`fullband.experiments.programs_report`'s. Built on:

* the task of :mod:`fullband.eval.program_tasks` (the generator of ``fullband data make-programs``), in the
  grammar ``--grammar`` names: ``published`` (the default: Fan et al.'s generator as they published it) or
  ``fullband`` (the package's earlier variant, the one the committed 20-statement results used), at the published
  sizes by default (10,000 training, 1,000 validation and 1,000 test programs per seed): seed S trains on exactly
  the programs of ``fullband data make-programs --grammar G --vars V --statements N --rows R --val-rows V --test-rows
  M --seed S`` (``train.jsonl``), chooses on its ``val.jsonl`` and is tested on its ``test.jsonl`` (N statements)
  plus ``--test-statements`` longer programs (each length its own stream, ``test-{n}.jsonl`` in
  ``OUT/seed{S}/data/``: length generalisation); no training program is a test or validation program, no
  validation program a test program (drawn apart, then checked on the training rows themselves, by
  :func:`fullband.data.labelled.row_key`, before anything trains and again before each arm is scored);
* the training of :mod:`fullband.training.labelled` (the loss only at the printed values, rows padded, never
  packed) through the synthetic experiments' machinery (:mod:`fullband.experiments.synthetic`: the same random
  Llama backbones, built in code, finished runs reused only for the same options, data and initial weights, the
  equal-FLOPs controls); the backbones take :data:`POSITIONS` positions (the synthetic ones' 256 would not hold
  programs of 100 statements): :func:`init_backbone` raises the limit in the config of the model
  :func:`fullband.experiments.synthetic.init_backbone` saved (RoPE: no weight depends on it);
* the scoring of ``fullband eval labelled`` (:func:`fullband.eval.labelled.score_rows`): plain arms in ``standard``
  mode, FBT arms in ``standard``, ``K=2`` (two teacher-forced passes), ``exact`` (the token-by-token recurrence) and
  ``soft`` / ``fused`` with a prompt that holds no printed value (:func:`prompt_tokens`: the first statement of a
  ``published`` program, always an assignment; the opening assignments of a ``fullband`` one, ``x = 7 ;`` per
  variable), so every mode scores every printed value.

Arms (equal tokens: the same steps on the same programs, except the two controls):

* ``baseline-L`` / ``baseline-2L`` / ``baseline-4L``: plain, L / 2L / 4L layers;
* ``fbt-L-glu-x2``: L layers, the pure GLU entry, trained on the exact recurrence at linear cost (``--exact-states
  --grad-passes 2``: the row's states token by token without gradient, then 2 teacher-forced passes with it),
  feedback from the first step (no prefix mixing, no deep steps);
* ``baseline-L-flops``: plain, L layers, trained for the first FBT arm's training FLOPs (counted from its run's
  metrics, a pass without gradient at its forward: :func:`fullband.eval.flops.training_flops`) on fresh programs,
  as many as make it read each one as often as baseline-L reads its own (a stream of their own, none a test program);
* ``baseline-L-epochs``: as many steps, re-reading exactly baseline-L's programs (``--unique-batches`` = ``--steps``);
* not in the default set (``--arms``): ``fbt-L-glu-fb`` (full backpropagation through the token-by-token
  recurrence, blocks of 8 recomputed).

LRs (``--lrs 1e-3,2e-3,4e-3``): every arm trains at each LR and keeps, per seed, the one whose model scores its
validation programs best in the arm's headline mode (``exact`` for FBT, ``standard`` for plain; a tie: the smaller);
the controls match the chosen FBT run's FLOPs and are chosen the same way; the test programs are scored only at the
chosen LR. Without ``--lrs`` one LR, ``--lr``, whose runs are ``OUT/seed{N}/runs/{arm}/`` (the other LRs' are
``runs/lr{LR}/{arm}/``: a search added to a finished experiment trains only the new LRs). Every run evaluates its
held-out target loss on 256 of the validation programs ten times (:data:`EVAL`): the learning curves.

Every arm trains with the stability guard's spike skip off (``--spike-factor 0``; a non-finite step is still
skipped): the exact-states FBT arm has one-step loss spikes that the next step undoes, which skipping makes
permanent (:data:`GUARD`).

Seeds (``--seeds 0,1``): each seed is a whole experiment in ``OUT/seed{N}/`` (its programs, initial backbones and
runs); a later invocation with more seeds trains only the new ones. Runs that outlive a process: every run writes a
checkpoint every ``--save-every`` steps (default 250) with what it reads, and the same command run again after its
process ended mid-run (killed, out of time) continues that run from its last checkpoint, bit for bit (weights,
losses and results equal an uninterrupted run's: tests/test_programs_experiment.py kills one and compares); finished
runs are reused. Writes ``results.json`` (per-program results in ``per_seed``; the LR search in ``lr_search``; the
learning curves in ``curves``), ``report.md``, ``programs.png`` (accuracy against length) and ``programs-curves.png``
(the learning curves) into ``--out``.

The default is sized for a 2-core CPU: 20 statements (rows of ~88 tokens, at most ~125), d64 L2, 2,000 steps x 32
programs (each training program read 6.4 times); one seed's default arms train in about half an hour at 1 thread
(measured per step at load 1.7-3.4, before the validation split:
baseline-L 0.05-0.07 s, 2L 0.11-0.13 s, 4L 0.22 s, fbt-L-glu-x2 0.29 s, the controls 0.05-0.06 s for ~2.5x the
steps), longer under more load. On a GPU, 100 statements (the paper's length; rows of ~445 tokens, at most ~530;
200-statement tests ~890, at most ~1,000, inside the 2,048 positions; the LRs chosen on the validation programs
from three around the CPU default's, untried at this size)::

    fullband experiment programs --device cuda --statements 100 --test-statements 100,200 \\
        --layers 4 --hidden 256 --heads 4 --steps 20000 --batch-size 128 --lrs 5e-4,1e-3,2e-3 \\
        --save-every 1000 --seeds 0,1,2 --out runs/experiments/programs-100

(the FT paper's shapes: its Feedback Transformer 4 layers d256, its Transformer 8 layers: ``baseline-2L``).
``--dry-run [--plan-gpu h100] [--json]`` prints what such an experiment would cost, per arm and in all
(:mod:`fullband.experiments.programs_plan`: each arm's ``fullband train --dry-run`` plan of the configuration it would
train; the exact-states arm's token-by-token pass at an assumed, not measured, time per layer and step): for the
command above 54 runs, 3.2 EFLOP, 17.6 h on one H100 at 40% MFU, of which the FBT arm is 1.7 h a run, nearly all of
it its 10.24M dependent token steps at the assumed 0.15 ms per layer and step.
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

from ..eval.flops import flop_parameters, inference_flops, training_flops
from ..eval.labelled import PROMPT_MODES, read_test_rows, score_rows
from ..eval.program_tasks import GRAMMARS, PUBLISHED_VARIABLES, VALUES, check_options
from ..eval.scoring import load_any_model
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.labelled import LabelledRecipe
from ..utils.io import atomic_write_json, read_jsonl
from . import synthetic
from .common import apply_quick, pick_arms, refuse_changed_runs, write_outputs
from .programs_data import POSITIONS, SeedData, program_tokenizer
from .programs_plan import format_programs_plan, plan_programs
from .programs_report import accuracy, analyse, plot, plot_curves, report, tables
from .synthetic import (CONTROL_ARMS, EPOCHS_ARM, FLOPS_ARM, Arm, arm_config, control_reference, mode_cost,
                        run_flops, train_arm, train_controls)

LONG = dict(feedback_start=0.0, deep_fraction=0.0, prefix_mix=0.0)  # the recurrence from the first step
# the stability guard skips no finite loss spike (non-finite steps are still skipped), in every arm: a step of the
# exact-states FBT arm can spike and the next undo it (7.38 then 2.32 at steps 84 / 85 of a 20-statement pilot),
# but a skipped step leaves the weights where the spike is, so every later step is skipped too and the run stops
GUARD = dict(spike_factor=0.0)
ARM_NAMES = ("baseline-L", "baseline-2L", "baseline-4L", "fbt-L-glu-x2", FLOPS_ARM, EPOCHS_ARM, "fbt-L-glu-fb")
DEFAULT_ARMS = ARM_NAMES[:6]
PLAIN_MODES = (("standard", "standard", 1),)
FBT_MODES = PLAIN_MODES + (("K=2", "passes", 2), ("exact", "exact", None), ("soft", "soft", None),
                           ("fused", "fused", None))
DEFAULTS = dict(out=os.path.join("runs", "experiments", "programs"), grammar="published", vars=3, statements=20,
                test_statements=None, rows=10_000, val_rows=1000, test_rows=1000, layers=2, hidden=64, heads=4,
                steps=2000, batch_size=32, lr=2e-3, lrs=None, seeds="0", save_every=250)  # the published split
QUICK = dict(statements=6, rows=48, val_rows=8, test_rows=8, layers=1, hidden=32, heads=2, steps=6, batch_size=8)
EVAL = dict(eval_rows=256)  # the periodic held-out loss (the learning curves): 256 validation programs
TAG = "programs"


def make_arms() -> dict[str, Arm]:
    x2 = dict(num_passes=2, exact_states=True, grad_passes=2, fusion="glu", **LONG)
    arms = [Arm("baseline-L", "plain, L layers", 1, dict(num_passes=1)),
            Arm("baseline-2L", "plain, 2L layers", 2, dict(num_passes=1)),
            Arm("baseline-4L", "plain, 4L layers", 4, dict(num_passes=1)),
            Arm("fbt-L-glu-x2", "L layers, pure GLU, exact states + 2 gradient passes on every step from the first "
                "(--exact-states --grad-passes 2: the exact recurrence at linear cost)", 1, x2),
            Arm(FLOPS_ARM, "plain, L layers, trained for the first FBT arm's training FLOPs on fresh programs (each "
                "read as often as baseline-L reads its own)", 1, dict(num_passes=1)),
            Arm(EPOCHS_ARM, "plain, L layers, trained for the first FBT arm's training FLOPs re-reading exactly "
                "baseline-L's programs (--unique-batches --steps), its own full LR schedule", 1, dict(num_passes=1)),
            Arm("fbt-L-glu-fb", "L layers, pure GLU, full backpropagation through the token-by-token recurrence on "
                "every step (--full-backprop --backprop-chunk 8)", 1,
                dict(num_passes=2, full_backprop=True, backprop_chunk=8, fusion="glu", **LONG))]
    return {a.name: dataclasses.replace(a, settings=a.settings | GUARD | EVAL) for a in arms}


# ---------------------------------------------------------------------------------------------- training


def init_backbone(args, tokenizer, depth: int) -> str:
    """:func:`fullband.experiments.synthetic.init_backbone`'s model (same path, same weights), its position limit
    raised to :data:`POSITIONS` in its ``config.json`` (once, before any run starts from it)."""
    path = synthetic.init_backbone(args, tokenizer, depth)
    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("max_position_embeddings") != POSITIONS:
        atomic_write_json(file, config | {"max_position_embeddings": POSITIONS})
    return path


def searched(arm: Arm, lr: float, default: float) -> Arm:
    """``arm`` at peak LR ``lr``: at ``--lr`` (``default``) its run is ``runs/{arm}`` (the layout of a run without a
    search, so adding ``--lrs`` to a finished experiment trains only the other LRs), at another LR of ``--lrs``
    ``runs/lr{lr}/{arm}``."""
    return arm if lr == default else dataclasses.replace(arm, name=f"lr{lr:g}/{arm.name}")


def with_lr(args, lr: float):
    return argparse.Namespace(**(vars(args) | {"lr": lr}))


def headline(model) -> tuple:
    """The mode an arm is chosen and judged in: ``exact`` for FBT (the recurrence it trains on), ``standard``
    for a plain model."""
    return FBT_MODES[2] if has_feedback(model) else PLAIN_MODES[0]


def val_accuracy(cfg, val_rows: list, device: str) -> float:
    """Accuracy on the printed values of the validation programs, the finished run's model in its
    :func:`headline` mode."""
    model = load_any_model(cfg.out, device=device)[0].eval()
    _, mode, k = headline(model)
    return accuracy([r["correct"] for r in score_rows(model, val_rows, mode, k or 2, 0, 1, batch_size=256)])


def train_all(args, arms: dict, names: list[str], data: SeedData, val_rows: list, device: str, say) -> tuple:
    """Train (or reuse) every arm of one seed at every LR of ``args.lrs``, each arm's LR chosen on the validation
    programs (its :func:`headline` accuracy; a tie: the smaller LR); ``({name: (cfg, seconds, FLOPs)} at the chosen
    LR, {name: its training rows}, {name: {"lr": chosen, "val_accuracy": {lr: accuracy}}})``. The controls match
    the chosen FBT run's FLOPs. A run the stability guard stopped is a one-line error naming the arm, its run
    directory (the seed) and the step (:class:`fullband.utils.errors.TrainingStopped`); the finished runs are kept
    and reused, the stopped one resumed from its last good step, by the next invocation."""
    out, corpora, chosen = {}, {}, {}

    def pick(name: str, tried: dict) -> None:
        accs = {lr: val_accuracy(t[0], val_rows, device) for lr, t in tried.items()}
        best = max(sorted(accs), key=lambda lr: accs[lr])  # the first maximum in LR order: ties take the smaller
        out[name], chosen[name] = tried[best], {"lr": best, "val_accuracy": {f"{lr:g}": v for lr, v in accs.items()},
                                                "seconds": sum(t[1] or 0.0 for t in tried.values())}

    for name in (n for n in names if n not in CONTROL_ARMS):
        tried = {}
        for lr in args.lrs:
            cfg, elapsed = train_arm(with_lr(args, lr), searched(arms[name], lr, args.lr), data.train, say,
                                     LabelledRecipe, TAG)
            tried[lr] = (cfg, elapsed, run_flops(cfg))
        pick(name, tried)
        corpora[name] = data.train
    controls = [n for n in names if n in CONTROL_ARMS]
    if controls:
        ref, tried = control_reference(names), {n: {} for n in controls}

        def fresh(a, steps):
            corpora[FLOPS_ARM] = data.fresh(a, steps)  # the same corpus at every LR
            return corpora[FLOPS_ARM]

        for lr in args.lrs:
            at = {n: searched(arm, lr, args.lr) for n, arm in arms.items()}
            trained = {ref: out[ref]}
            train_controls(with_lr(args, lr), at, names, trained, data.train, fresh, say, LabelledRecipe, TAG)
            for n in controls:
                tried[n][lr] = trained[at[n].name]
        for n in controls:
            pick(n, tried[n])
        if EPOCHS_ARM in controls:
            corpora[EPOCHS_ARM] = data.train
    return out, corpora, chosen


def curves(cfg, points: int = 40) -> dict:
    """A run's learning curves from its ``metrics.jsonl``: the training objective, the mean over windows of
    steps (at most ``points``), as ``[[last step, loss]]``, and every periodic evaluation on the validation programs
    (``[[step, held-out target loss standard, fed back (exact) or None]]``); a step logged twice (a resumed run)
    counts once, its last record."""
    train, val = {}, {}
    for r in read_jsonl(os.path.join(cfg.out, "metrics.jsonl")):
        if r.get("split") == "train" and r.get("loss") is not None:
            train[r["step"]] = r["loss"]
        elif r.get("split") == "val":
            val[r["step"]] = [r["step"], round(r["val_loss"], 5),
                              None if r.get("val_loss_passes") is None else round(r["val_loss_passes"], 5)]
    steps = sorted(train)
    w = max(1, math.ceil(len(steps) / points))
    windows = [steps[i:i + w] for i in range(0, len(steps), w)]
    return {"train": [[win[-1], round(sum(train[t] for t in win) / len(win), 5)] for win in windows],
            "val": [val[t] for t in sorted(val)]}


def k_exact_flops(model, cfg) -> float:
    """The training FLOPs the run's steps would cost as K = T + 1 passes, every one with gradient (T the longest
    training row's inputs: the K-pass forward is then exact at every printed value)."""
    records = [{"split": "train", "num_passes": cfg.seq_len - 1}] * cfg.steps
    return training_flops(records, cfg.batch_size * cfg.seq_len, cfg.seq_len, flop_parameters(model))["flops"]


# ---------------------------------------------------------------------------------------------- scoring


def modes_of(model) -> tuple:
    return FBT_MODES if has_feedback(model) else PLAIN_MODES


def score_arm(model, tests: dict, prompt: int) -> dict:
    """``{mode: {"n": [per program: [0/1 per printed value]]}}`` (``n`` the test programs' statements) through
    ``fullband eval labelled``'s scorer; the prompt modes take the first ``prompt`` inputs as the prompt."""
    return {key: {str(n): [r["correct"] for r in score_rows(model, rows, mode, k or 2, prompt if mode in PROMPT_MODES
                                                            else 0, 1, batch_size=256)]
                  for n, rows in tests.items()}
            for key, mode, k in modes_of(model)}


def inference_costs(model, ref_fp: dict, tests: dict, prompt: int) -> dict:
    """``{mode: {"n": forward FLOPs of a test row x the L-layer model's standard pass}}`` at the mean row length of
    each test length (:func:`fullband.experiments.synthetic.mode_cost`; the prompt modes with their prompt)."""
    fp, out = flop_parameters(model), {}
    for key, mode, k in modes_of(model):
        out[key] = {}
        for n, rows in tests.items():
            T = round(sum(len(r["ids"]) for r in rows) / len(rows))
            if mode in PROMPT_MODES:
                out[key][str(n)] = (inference_flops(mode, fp, T, prompt)["flops"]
                                    / inference_flops("standard", ref_fp, T)["flops"])
            else:
                out[key][str(n)] = mode_cost(fp, ref_fp, T, mode, k or 1)
    return out


# ---------------------------------------------------------------------------------------------- command


def comma_ints(text, flag: str, example: str, least: int = 0) -> list[int]:
    """Distinct integers >= ``least`` of a comma-separated ``flag`` value; a one-line ``ValueError`` otherwise."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. {example}; got {text!r}") from None
    if not values or min(values) < least or len(set(values)) != len(values):
        raise ValueError(f"{flag} needs distinct integers >= {least}, got {text!r}")
    return values


def check_args(args) -> list[int]:
    """Every option checked before anything is drawn or written (one-line ``ValueError``s); fills in ``lrs`` (the
    LRs to search; ``[--lr]`` without ``--lrs``) and ``test_lengths``; returns the seeds (``--seeds``, or ``--seed
    N``: one)."""
    for name in ("steps", "batch_size", "test_rows", "layers", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        raise ValueError(f"--hidden {args.hidden} must be --heads {args.heads} times an even head width (RoPE)")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    args.lrs = comma_floats(args.lrs, "--lrs") if args.lrs else [args.lr]
    if args.val_rows < (1 if len(args.lrs) > 1 else 0):
        raise ValueError(f"--lrs {','.join(f'{x:g}' for x in args.lrs)} chooses on the validation programs: "
                         f"--val-rows must be >= 1, got {args.val_rows}")
    if args.grammar not in GRAMMARS:
        raise ValueError(f"--grammar must be one of {', '.join(GRAMMARS)}, got {args.grammar!r}")
    least = first_print(args.grammar, args.vars)
    if args.grammar == "fullband":
        check_options(args.vars, args.statements)
    elif not 1 <= args.vars <= len(PUBLISHED_VARIABLES) or args.statements < least:
        raise ValueError(f"--vars must be in 1..{len(PUBLISHED_VARIABLES)} and --statements >= {least}, got "
                         f"{args.vars} and {args.statements}")
    if args.rows < 1 or args.val_rows < 0:
        raise ValueError(f"--rows must be >= 1 and --val-rows >= 0, got {args.rows} and {args.val_rows}")
    text = args.test_statements or f"{args.statements},{2 * args.statements}"
    lengths = comma_ints(text, "--test-statements", "20,40", least)
    if args.statements not in lengths:
        raise ValueError(f"--test-statements {text}: the training length --statements {args.statements} must be "
                         "among them")
    args.test_lengths = sorted(lengths)
    if args.seeds is not None and args.seed is not None:
        raise ValueError("give --seeds or --seed, not both (--seed N is --seeds N)")
    return comma_ints(args.seeds if args.seeds is not None else args.seed if args.seed is not None
                      else DEFAULTS["seeds"], "--seeds", "0,1")


def comma_floats(text, flag: str) -> list[float]:
    """Distinct positive numbers of a comma-separated ``flag`` value, ascending; a one-line ``ValueError``
    otherwise."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, e.g. 1e-3,2e-3,4e-3; got {text!r}") from None
    if not values or min(values) <= 0 or not all(map(math.isfinite, values)) or len(set(values)) != len(values):
        raise ValueError(f"{flag} needs distinct numbers > 0, got {text!r}")
    return sorted(values)


def first_print(grammar: str, num_vars: int) -> int:
    """The fewest statements a program of ``grammar`` needs (``fullband``: one assignment per variable, then a
    print; ``published``: an assignment, then a print)."""
    return num_vars + 1 if grammar == "fullband" else 2


def prompt_tokens(grammar: str, num_vars: int) -> int:
    """The prompt of the ``soft`` / ``fused`` modes: inputs before any printed value can be asked for --
    ``fullband``: the opening assignments (``x = 7 ;`` per variable); ``published``: its first statement, which is
    always an assignment (nothing else can be drawn before a variable is assigned)."""
    return 4 * num_vars if grammar == "fullband" else 4


def seed_args(args, seed: int):
    """One seed's options: that seed, in ``OUT/seed{N}/``."""
    return argparse.Namespace(**(vars(args) | {"seed": seed, "out": os.path.join(args.out, f"seed{seed}")}))


def run_programs(args) -> dict:
    """The experiment (``args``: the command's options)."""
    hf_logging.disable_progress_bar()
    apply_quick(args, DEFAULTS, QUICK)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    seeds = check_args(args)
    arms = make_arms()
    names = pick_arms(args.arms, arms, list(DEFAULT_ARMS))
    control_reference(names)  # controls without an FBT arm: refused before anything trains
    args.seeds, args.seed = ",".join(map(str, seeds)), None
    t0, load0 = time.perf_counter(), load_average()
    tokenizer = program_tokenizer(args.vars, args.grammar)
    if getattr(args, "dry_run", False):  # the GPU plan: the first seed's programs drawn, nothing written or trained
        a = argparse.Namespace(**(vars(seed_args(args, seeds[0])) | {"seed_list": seeds}))
        plan = plan_programs(a, arms, names, SeedData(a, tokenizer), init_backbone, args.plan_gpu, args.plan_mfu)
        print(json.dumps(plan, indent=2) if args.json else format_programs_plan(plan, a), end="")
        return plan
    runs = {s: seed_args(args, s) for s in seeds}
    data = {s: SeedData(a, tokenizer) for s, a in runs.items()}  # every refusal of the programs: nothing written yet
    device = str(resolve_device(args.device))
    for s, a in runs.items():  # before anything trains: a finished run of other options or data is refused
        for depth in sorted({arms[n].depth for n in names}):
            init_backbone(a, tokenizer, depth)
        refuse_changed_runs([arm_config(with_lr(a, lr), searched(arms[n], lr, args.lr), data[s].train)
                             for n in names if n not in CONTROL_ARMS for lr in args.lrs],
                            data[s].train, args.overwrite)
    prompt = prompt_tokens(args.grammar, args.vars)
    res = {"arms": names, "arm_descriptions": {n: arms[n].description for n in names}, "seeds": seeds,
           "settings": {k: getattr(args, k) for k in DEFAULTS if k not in ("out", "seeds")} | {
               "test_statements": args.test_lengths, "quick": bool(args.quick), "prompt_tokens": prompt,
               "lrs": args.lrs,
               "positions": POSITIONS, "seq_len": data[seeds[0]].train.train_rows.shape[1]},
           "chance": 1.0 / len(VALUES), "runs": {}, "per_seed": {}, "held_out": {}, "lr_search": {},
           "curves": {}}
    ref_fp = flop_parameters(load_any_model(init_backbone(runs[seeds[0]], tokenizer, 1))[0])
    for s, a in runs.items():
        data[s].write()
        val_rows = read_test_rows(data[s].path("val"), tokenizer)
        trained, trained_on, chosen = train_all(a, arms, names, data[s], val_rows, device, say)
        tests = {n: read_test_rows(data[s].path(n), tokenizer) for n in args.test_lengths}
        res["per_seed"][str(s)], res["held_out"][str(s)] = {}, {}
        res["lr_search"][str(s)] = chosen
        res["curves"][str(s)] = {name: curves(trained[name][0]) for name in names}
        for name in names:
            cfg, elapsed, flops = trained[name]
            checked = data[s].check(trained_on[name], name)  # never score a program an arm trained on
            res["held_out"][str(s)][name] = {"training_rows_checked": checked, "test_programs": len(data[s].keys),
                                             "validation_programs": len(data[s].val)}
            model = load_any_model(cfg.out, device=device)[0].eval()
            t = time.perf_counter()
            say(f"{TAG}: scoring {name} (seed {s})")
            res["per_seed"][str(s)][name] = {"train_seconds": elapsed, "steps": cfg.steps, "train_flops": flops,
                                             "correct": score_arm(model, tests, prompt),
                                             "eval_seconds": time.perf_counter() - t}
            if name not in res["runs"]:  # per arm: the first seed's model (the same shapes in every seed)
                res["runs"][name] = {"layers": args.layers * arms[name].depth,
                                     "parameters": sum(p.numel() for p in model.parameters()),
                                     "unique_batches": cfg.unique_batches, "rows": len(trained_on[name].train),
                                     "inference_flops": inference_costs(model, ref_fp, tests, prompt)}
                if has_feedback(model):
                    res["runs"][name]["train_flops_k_exact"] = k_exact_flops(model, cfg)
    for name in names:
        per = [res["per_seed"][str(s)][name] for s in seeds]
        res["runs"][name] |= {"steps": per[0]["steps"], "train_flops": sum(r["train_flops"] for r in per) / len(per),
                              "train_seconds": sum(r["train_seconds"] or 0.0 for r in per)}
    res |= analyse(res)
    res["seconds"], res["load_average"] = time.perf_counter() - t0, [load0, load_average()]
    res["threads"], res["torch"], res["platform"] = torch.get_num_threads(), torch.__version__, platform.platform()
    os.makedirs(args.out, exist_ok=True)
    text = tables(res)
    res["plot"] = plot(res, os.path.join(args.out, "programs.png"))
    res["curves_plot"] = plot_curves(res, os.path.join(args.out, "programs-curves.png"))
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("per_seed",),
                  lead=f"{len(seeds)} seed(s), ")
    return res
