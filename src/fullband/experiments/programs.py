"""``fullband experiment programs``: the Feedback Transformer's algorithmic task -- programs of ``=``, ``++``, ``--``,
``if`` and ``print`` statements over 3 or 5 variables with values 1..10, scored on the printed values -- FBT with L
layers against plain models of L, 2L and 4L layers and the equal-FLOPs plain controls.

Owns the experiment: its arms, the programs each seed trains and is tested on, training them through ``fullband
train``'s labelled recipe, scoring every decode mode, the held-out check and the results. The analysis, tables and
report are :mod:`fullband.experiments.programs_report`'s. Built on:

* the task of :mod:`fullband.eval.program_tasks` (the generator of ``fullband data make-programs``), in the
  grammar ``--grammar`` names: ``published`` (the default: Fan et al.'s generator as they published it) or
  ``fullband`` (the package's earlier variant, the one the committed 20-statement results used): seed S trains on
  exactly the programs of ``fullband data make-programs --grammar G --vars V --statements N --rows R --test-rows M
  --seed S`` (``train.jsonl``) and is tested on its ``test.jsonl`` (N statements) plus ``--test-statements`` longer programs
  (each length its own stream, ``test-{n}.jsonl`` in ``OUT/seed{S}/data/``: length generalisation); no training
  program is a test program of any length (drawn apart, then checked on the training rows themselves, by
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

Every arm trains with the stability guard's spike skip off (``--spike-factor 0``; a non-finite step is still
skipped): the exact-states FBT arm has one-step loss spikes that the next step undoes, which skipping makes
permanent (:data:`GUARD`).

Seeds (``--seeds 0,1``): each seed is a whole experiment in ``OUT/seed{N}/`` (its programs, initial backbones and
runs); a later invocation with more seeds trains only the new ones. Runs that outlive a process: every run writes a
checkpoint every ``--save-every`` steps (default 250) with what it reads, and the same command run again after its
process ended mid-run (killed, out of time) continues that run from its last checkpoint, bit for bit (weights,
losses and results equal an uninterrupted run's: tests/test_programs_experiment.py kills one and compares); finished
runs are reused. Writes ``results.json`` (per-program results
in ``per_seed``), ``report.md`` and ``programs.png`` into ``--out``.

The default is sized for a 2-core CPU: 20 statements (rows of ~88 tokens, at most ~125), d64 L2, 2,000 steps x 32
programs; one seed's default arms train in about half an hour at 1 thread (measured per step at load 1.7-3.4:
baseline-L 0.05-0.07 s, 2L 0.11-0.13 s, 4L 0.22 s, fbt-L-glu-x2 0.29 s, the controls 0.05-0.06 s for ~2.5x the
steps), longer under more load. On a GPU, 100 statements (the paper's length; rows of ~445 tokens, at most ~530;
200-statement tests ~890, at most ~1,000, inside the 2,048 positions; the peak LR is the CPU default's, untried at
this size)::

    fullband experiment programs --device cuda --statements 100 --test-statements 100,200 --rows 200000 \\
        --test-rows 1000 --layers 4 --hidden 192 --heads 6 --steps 20000 --batch-size 128 \\
        --seeds 0,1 --out runs/experiments/programs-100

(``fullband train --dry-run --plan-gpu h100`` at d192 L4, batch 128 x 512 tokens: a plain step 0.87 TFLOP, the
exact-states step 2.10 TFLOP plus 10.2M dependent token steps over the run, ~1.7 h for the FBT arm at its
assumed 0.15 ms per layer and token step; the 16-layer plain arm ~3 min at 40% MFU; not run.)
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
from transformers.utils import logging as hf_logging

from ..data.labelled import LabelledData, LabelledRows, encode_row, labelled_tokenizer, row_key
from ..eval.flops import flop_parameters, inference_flops, training_flops
from ..eval.labelled import PROMPT_MODES, read_test_rows, score_rows
from ..eval.program_tasks import (GRAMMARS, HIGH, LOW, MAX_REDRAWS, PUBLISHED_VARIABLES, VALUES, VARIABLES,
                                  check_options, grammar_program, grammar_words, split_rng)
from ..eval.scoring import load_any_model
from ..model.configuration import has_feedback
from ..training.device import load_average
from ..training.distributed import resolve_device
from ..training.labelled import LabelledRecipe
from ..utils.io import atomic_write_json, rewrite_jsonl
from . import synthetic
from .common import apply_quick, pick_arms, refuse_changed_runs, write_outputs
from .programs_report import analyse, plot, report, tables
from .synthetic import (CONTROL_ARMS, EPOCHS_ARM, FLOPS_ARM, Arm, arm_config, control_reference, mode_cost,
                        run_flops, train_arm, train_controls)

POSITIONS = 2048  # the backbones' position limit (the synthetic experiments' 256 would not hold 100 statements)
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
                test_statements=None,
                rows=None, test_rows=200, layers=2, hidden=64, heads=4, steps=2000, batch_size=32, lr=2e-3,
                seeds="0", save_every=250)
QUICK = dict(statements=6, test_rows=8, layers=1, hidden=32, heads=2, steps=6, batch_size=8)
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
    return {a.name: dataclasses.replace(a, settings=a.settings | GUARD) for a in arms}


# ---------------------------------------------------------------------------------------------- programs


def program_tokenizer(num_vars: int, grammar: str = "published"):
    """The one vocabulary of every arm and corpus of a run (the specials, the variables, the operators, the values),
    fixed, not read from the rows: the fresh programs of the FLOPs control must not reorder it."""
    return labelled_tokenizer(grammar_words(grammar, num_vars))


def draw_programs(seed: int, split: str, count: int, num_vars: int, statements: int, exclude=frozenset(),
                  grammar: str = "published") -> list:
    """``count`` programs of the stream ``split`` (:func:`fullband.eval.program_tasks.split_rng`), a program whose key
    is in ``exclude`` drawn again: the ``train`` stream with the test keys excluded is exactly ``fullband data
    make-programs``'s ``train.jsonl``, the ``test`` stream its ``test.jsonl``."""
    rng, out = split_rng(seed, split), []
    for _ in range(count):
        for _ in range(MAX_REDRAWS):
            p = grammar_program(grammar, rng, num_vars, statements)
            if p.key() not in exclude:
                break
        else:
            raise ValueError(f"the test programs cover (almost) every program of {statements} statements: raise "
                             "--statements or lower --test-rows")
        out.append(p)
    return out


class ProgramData(LabelledData):
    """Labelled rows built in memory from programs (one vocabulary: :func:`program_tokenizer`), all of them training
    rows; ``train_rows`` is what :func:`fullband.experiments.synthetic.arm_config` reads of a corpus (its shape:
    rows x ``info["seq_len"]``, the runs' ``--seq-len``), a tensor without storage."""

    @property
    def train_rows(self) -> torch.Tensor:
        return torch.empty(len(self.train), self.info["seq_len"], device="meta")


def program_data(programs: list, tokenizer, what: str, seq_len: int = 0) -> ProgramData:
    """The training rows of ``programs`` (no validation split) with their fingerprint (the vocabulary and every id and
    label: the identity of the data a run reads); ``seq_len``: the longest row's ids, or ``seq_len`` when that is
    more (the FLOPs control's programs take their baseline's, so that both count a step's tokens alike)."""
    vocab = tokenizer.get_vocab()
    ids, labels, offsets = array.array("i"), array.array("i"), array.array("q", [0])
    longest = targets = 0
    for i, p in enumerate(programs):
        x, y = encode_row(p.inputs, p.targets, vocab, f"{what} {i}")
        ids.extend(x)
        labels.extend(y)
        offsets.append(offsets[-1] + len(x))
        longest, targets = max(longest, len(p.inputs)), targets + sum(t is not None for t in p.targets)
    train = LabelledRows(*(np.frombuffer(a, t) for a, t in ((ids, np.int32), (labels, np.int32), (offsets, np.int64))))
    empty = LabelledRows(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int64))
    h = hashlib.sha256(json.dumps(sorted(vocab.items())).encode())
    for a in (train.ids, train.labels, train.offsets):
        h.update(a.tobytes())
    info = {"format": "fullband-programs", "source": what, "vocab_size": len(tokenizer),
            "seq_len": max(seq_len, longest + 2),
            "splits": {"train": {"rows": len(programs), "ids": len(ids), "max_length": longest, "targets": targets},
                       "val": {"rows": 0, "ids": 0, "max_length": 0, "targets": 0}}}
    return ProgramData(tokenizer, train, empty, h.hexdigest(), info)


def row_keys(data: LabelledData) -> list[bytes]:
    """:func:`fullband.data.labelled.row_key` of every training row, read back from its ids (not from the programs
    it was built from)."""
    words = {i: w for w, i in data.tokenizer.get_vocab().items()}
    return [row_key([words[int(t)] for t in data.train.row(i)[0][1:-1]]) for i in range(len(data.train))]


def refuse_held_out(data: LabelledData, test_keys: set, what: str) -> int:
    """A one-line ``ValueError`` when a training row of ``data`` is a test program (nothing is scored on programs an
    arm trained on); else the number of training rows checked."""
    keys = row_keys(data)
    n = sum(k in test_keys for k in keys)
    if n:
        raise ValueError(f"{what}: {n} of its {len(keys)} training programs are test programs; the experiment refuses "
                         "to score programs an arm trained on")
    return len(keys)


def refuse_long(programs: list, what: str) -> None:
    """A one-line ``ValueError`` when a program's row (``<bos>`` + inputs + ``<eos>``) is past :data:`POSITIONS`."""
    longest = max(len(p.inputs) for p in programs) + 2
    if longest > POSITIONS:
        raise ValueError(f"{what}: a program is {longest} tokens (<bos> + inputs + <eos>), past the backbones' "
                         f"{POSITIONS} positions; use fewer statements")


class SeedData:
    """One seed's programs: the test programs of each length (drawn first), the training programs (none of them a
    test program) and, on demand, the FLOPs control's fresh ones. Nothing is written until :meth:`write`."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.tests, self.keys = {}, set()
        for n in args.test_lengths:
            split = "test" if n == args.statements else f"test-{n}"
            self.tests[n] = draw_programs(args.seed, split, args.test_rows, args.vars, n, grammar=args.grammar)
            refuse_long(self.tests[n], f"--test-statements {n}")
            self.keys |= {p.key() for p in self.tests[n]}
        programs = draw_programs(args.seed, "train", args.rows, args.vars, args.statements, self.keys, args.grammar)
        refuse_long(programs, f"--statements {args.statements}")
        self.train = program_data(programs, tokenizer, "training programs")
        self.checked = {id(self.train): refuse_held_out(self.train, self.keys, "the training programs")}

    def fresh(self, a, steps: int) -> ProgramData:
        """The FLOPs control's fresh programs (stream ``fresh``, none a test program), as many as make its ``steps``
        steps read each one as often as baseline-L's ``--steps`` read baseline-L's ``--rows``."""
        count = math.ceil(self.args.rows * steps / self.args.steps)
        programs = draw_programs(self.args.seed, "fresh", count, self.args.vars, self.args.statements, self.keys,
                                 self.args.grammar)
        refuse_long(programs, "the fresh programs")
        data = program_data(programs, self.tokenizer, "fresh programs", self.train.info["seq_len"])
        self.checked[id(data)] = refuse_held_out(data, self.keys, "the fresh programs")
        return data

    def check(self, data: LabelledData, arm: str) -> int:
        """Before ``arm`` is scored: its training rows against every test program (once per corpus)."""
        if id(data) not in self.checked:
            self.checked[id(data)] = refuse_held_out(data, self.keys, arm)
        return self.checked[id(data)]

    def path(self, n: int) -> str:
        name = "test.jsonl" if n == self.args.statements else f"test-{n}.jsonl"
        return os.path.join(self.args.out, "data", name)

    def write(self) -> None:
        """The test programs as labelled jsonl (what ``fullband eval labelled RUN --data FILE`` reads) and
        ``programs.json``: the settings, counts and the ``make-programs`` command of the training programs."""
        a = self.args
        for n, programs in self.tests.items():
            rewrite_jsonl(self.path(n), [p.row() for p in programs])
        tr = self.train.info["splits"]["train"]
        atomic_write_json(os.path.join(a.out, "data", "programs.json"), {
            "grammar": a.grammar, "variables": list((PUBLISHED_VARIABLES if a.grammar == "published" else
                                                     VARIABLES)[:a.vars]), "values": [LOW, HIGH], "seed": a.seed,
            "train": {"rows": tr["rows"], "statements": a.statements, "targets": tr["targets"],
                      "max_length": tr["max_length"],
                      "command": f"fullband data make-programs --grammar {a.grammar} --vars {a.vars} --statements "
                                 f"{a.statements} --rows "
                                 f"{a.rows} --test-rows {a.test_rows} --seed {a.seed} --out DIR (its train.jsonl)"},
            "test": {str(n): {"rows": len(ps), "file": os.path.basename(self.path(n)),
                              "targets": sum(t is not None for p in ps for t in p.targets),
                              "max_length": max(len(p.inputs) for p in ps)} for n, ps in self.tests.items()}})


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


# ---------------------------------------------------------------------------------------------- training


def train_all(args, arms: dict, names: list[str], data: SeedData, say) -> tuple[dict, dict]:
    """Train (or reuse) every arm of one seed; ``({name: (cfg, seconds, FLOPs)}, {name: its training rows})``. A run
    the stability guard stopped is a one-line error naming the arm, its run directory (the seed) and the step
    (:class:`fullband.utils.errors.TrainingStopped`); the finished arms are kept and reused, the stopped one resumed
    from its last good step, by the next invocation."""
    out, corpora = {}, {}
    for name in (n for n in names if n not in CONTROL_ARMS):
        cfg, elapsed = train_arm(args, arms[name], data.train, say, LabelledRecipe, TAG)
        out[name], corpora[name] = (cfg, elapsed, run_flops(cfg)), data.train

    def fresh(a, steps):
        corpora[FLOPS_ARM] = data.fresh(a, steps)
        return corpora[FLOPS_ARM]

    train_controls(args, arms, names, out, data.train, fresh, say, LabelledRecipe, TAG)
    if EPOCHS_ARM in out:
        corpora[EPOCHS_ARM] = data.train
    return out, corpora


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
    """Every option checked before anything is drawn or written (one-line ``ValueError``s); fills in ``rows``
    (``--steps`` x ``--batch-size`` when not given: each program read once by the equal-token arms) and
    ``test_lengths``; returns the seeds (``--seeds``, or ``--seed N``: one)."""
    for name in ("steps", "batch_size", "test_rows", "layers", "hidden", "heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        raise ValueError(f"--hidden {args.hidden} must be --heads {args.heads} times an even head width (RoPE)")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.grammar not in GRAMMARS:
        raise ValueError(f"--grammar must be one of {', '.join(GRAMMARS)}, got {args.grammar!r}")
    least = first_print(args.grammar, args.vars)
    if args.grammar == "fullband":
        check_options(args.vars, args.statements)
    elif not 1 <= args.vars <= len(PUBLISHED_VARIABLES) or args.statements < least:
        raise ValueError(f"--vars must be in 1..{len(PUBLISHED_VARIABLES)} and --statements >= {least}, got "
                         f"{args.vars} and {args.statements}")
    args.rows = args.steps * args.batch_size if args.rows is None else args.rows
    if args.rows < 1:
        raise ValueError(f"--rows must be >= 1, got {args.rows}")
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
    runs = {s: seed_args(args, s) for s in seeds}
    data = {s: SeedData(a, tokenizer) for s, a in runs.items()}  # every refusal of the programs: nothing written yet
    device = str(resolve_device(args.device))
    for s, a in runs.items():  # before anything trains: a finished run of other options or data is refused
        for depth in sorted({arms[n].depth for n in names}):
            init_backbone(a, tokenizer, depth)
        refuse_changed_runs([arm_config(a, arms[n], data[s].train) for n in names if n not in CONTROL_ARMS],
                            data[s].train, args.overwrite)
    prompt = prompt_tokens(args.grammar, args.vars)
    res = {"arms": names, "arm_descriptions": {n: arms[n].description for n in names}, "seeds": seeds,
           "settings": {k: getattr(args, k) for k in DEFAULTS if k not in ("out", "seeds")} | {
               "test_statements": args.test_lengths, "quick": bool(args.quick), "prompt_tokens": prompt,
               "positions": POSITIONS, "seq_len": data[seeds[0]].train.train_rows.shape[1]},
           "chance": 1.0 / len(VALUES), "runs": {}, "per_seed": {}, "held_out": {}}
    ref_fp = flop_parameters(load_any_model(init_backbone(runs[seeds[0]], tokenizer, 1))[0])
    for s, a in runs.items():
        data[s].write()
        trained, trained_on = train_all(a, arms, names, data[s], say)
        tests = {n: read_test_rows(data[s].path(n), tokenizer) for n in args.test_lengths}
        res["per_seed"][str(s)], res["held_out"][str(s)] = {}, {}
        for name in names:
            cfg, elapsed, flops = trained[name]
            checked = data[s].check(trained_on[name], name)  # never score a program an arm trained on
            res["held_out"][str(s)][name] = {"training_rows_checked": checked,
                                             "test_programs": len(data[s].keys)}
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
    write_outputs(args.out, res, report(res, text), text, args.json, omit=("per_seed",),
                  lead=f"{len(seeds)} seed(s), ")
    return res
