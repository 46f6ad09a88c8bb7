"""``fullband experiment``: the paper's questions, asked at a size a CPU can answer. This module registers them:

* ``data-efficiency`` (:mod:`fullband.experiments.data_efficiency`): baselines at several token budgets vs FBT at
  1x -- the effective token multiplier and the matched-compute comparison;
* ``reasoning`` (:mod:`fullband.experiments.reasoning`): baseline, FBT and two equal-FLOPs baselines on synthetic
  problems written with traces of mixed verbosity -- accuracy and trace length per decode mode and verbosity,
  >= 2 seeds, paired statistics;
* ``recipe`` (:mod:`fullband.experiments.recipe`): the feedback recipe grid -- every mode, equal tokens and equal
  FLOPs, >= 2 seeds;
* ``depth`` (:mod:`fullband.experiments.depth`): k-hop pointer chasing and iterated composition -- does FBT(L) reach
  baseline(2L)?
* ``state`` (:mod:`fullband.experiments.state`): running-state tasks with a label at every position (S3 / S5 word
  problem, parity, variable tracking) -- FBT trained with long recurrences vs baselines of 1, 2 and 4x depth, at T,
  2T, 4T;
* ``programs`` (:mod:`fullband.experiments.programs`): the Feedback Transformer's algorithmic task (programs over
  3 or 5 variables, scored on the printed values) -- FBT trained on the exact recurrence at linear cost vs plain
  models of 1, 2 and 4x depth and the equal-FLOPs controls, at the training length and beyond;

Each writes ``results.json`` and ``report.md`` into ``--out`` and prints its tables; trained models stay in
``OUT/runs/`` (``OUT/seed*/`` for the recipe grid, ``OUT/seed*/runs/`` for the state and programs experiments).

This module owns their command line only (options, defaults, help texts); what each experiment trains, measures
and reports is its module's in :mod:`fullband.experiments`.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..eval.program_tasks import GRAMMARS
from ..experiments import data_efficiency, depth, programs, reasoning, recipe, state
from ..experiments.common import RECIPE
from ..training.config import TrainConfig
from ..training.plan import GPU_PEAK_BF16
from ..utils.argtypes import NONNEG_FLOAT, NONNEG_INT, POSITIVE_FLOAT, POSITIVE_FRACTION, POSITIVE_INT


def add_overwrite_argument(p) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="retrain a finished run whose options differ from this invocation's (by default such a "
                        "run is kept and the experiment stops with an error naming the differences)")


def add_recipe_arguments(p) -> None:
    defaults = TrainConfig()
    g = p.add_argument_group("FBT recipe (defaults: fullband train's)")
    for flag, field, typ in RECIPE:
        meta = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}[field]
        shown = getattr(defaults, field)
        g.add_argument(flag, dest=field, type=meta["arg"] if typ in (int, float) else typ, default=None,
                       help=f"{meta['help']} (default: {shown if shown is not None else 'the preset’s'})")
    g.add_argument("--detach-state", action="store_true", help="stop gradients through the fed-back state")
    g.add_argument("--set", dest="settings", action="append", metavar="NAME=VALUE", default=None,
                   help="any other `fullband train` option for every run (repeatable), e.g. --set grad_clip=0.5")


def add_common_arguments(p, defaults: dict) -> None:
    p.add_argument("--out", default=defaults["out"], help="output directory (default: %(default)s)")
    add_overwrite_argument(p)
    p.add_argument("--preset", default=defaults["preset"],
                   help="model size preset (micro, tiny, small, gpt2-small) (default: %(default)s)")
    p.add_argument("--steps", type=POSITIVE_INT, default=defaults["steps"],
                   help="optimizer steps per model (data-efficiency: of the FBT run, the 1.0x budget) "
                        "(default: %(default)s)")
    p.add_argument("--tokens", type=POSITIVE_INT, default=None,
                   help="training tokens per model (data-efficiency: of the FBT run) instead of --steps (rounded "
                        "up to whole steps)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=defaults["batch_size"],
                   help="rows per step (default: %(default)s)")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=defaults["seq_len"], help="tokens per row (default: %(default)s)")
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=defaults["vocab_size"],
                   help="BPE vocabulary size (default: %(default)s)")
    p.add_argument("--seed", type=NONNEG_INT, default=0,
                   help="seed of init, split, data order (shared by every run) (default: %(default)s)")
    p.add_argument("--no-share-prefix", action="store_true",
                   help="train the FBT run from scratch instead of branching it off the 1.0x baseline at the "
                        "feedback start (the two are bit-identical until then)")
    if "flops_baseline" in defaults:  # an experiment that trains the baseline-flops control
        p.add_argument("--no-flops-baseline", action="store_true",
                       help="skip baseline-flops (the plain model for the FBT run's training FLOPs, reading further)")
    if "epochs_baseline" in defaults:  # an experiment that trains the baseline-epochs control
        p.add_argument("--no-epochs-baseline", action="store_true",
                       help="skip baseline-epochs (the plain model for the FBT run's training FLOPs on exactly its "
                            "unique rows, re-read epoch after epoch)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", action="store_true", help="print only the tables")


def add_model_arguments(r, defaults: dict) -> None:
    """The options of the synthetic-task experiments' models and runs (``depth``, ``state``): ``--out``,
    ``--overwrite``, ``--layers``, ``--hidden``, ``--heads``, ``--steps``, ``--batch-size``, ``--lr``; defaults from
    ``defaults``."""
    r.add_argument("--out", default=defaults["out"], help="output directory (default: %(default)s)")
    add_overwrite_argument(r)
    r.add_argument("--layers", type=POSITIVE_INT, default=defaults["layers"], help="L (default: %(default)s)")
    r.add_argument("--hidden", type=POSITIVE_INT, default=defaults["hidden"], help="model width (default: %(default)s)")
    r.add_argument("--heads", type=POSITIVE_INT, default=defaults["heads"], help="attention heads (default: %(default)s)")
    r.add_argument("--steps", type=POSITIVE_INT, default=defaults["steps"], help="steps per arm (default: %(default)s)")
    r.add_argument("--batch-size", type=POSITIVE_INT, default=defaults["batch_size"],
                   help="rows per step (default: %(default)s)")
    r.add_argument("--lr", type=POSITIVE_FLOAT, default=defaults["lr"], help="peak LR (default: %(default)s)")


def add_run_arguments(r, defaults: dict, kept: str) -> None:
    """The last options of the synthetic-task experiments (``depth``, ``state``, ``programs``): ``--seed`` (and
    ``--seeds`` where ``defaults`` has seeds), ``--device``, ``--save-every``, ``--quick``, ``--json`` (``kept``: what
    results.json keeps, e.g. per-row lists)."""
    if "seeds" in defaults:
        r.add_argument("--seeds", default=None,
                       help="comma-separated training seeds, each a run of its own in OUT/seed{N}/ (a later "
                            f"invocation with more seeds trains only the new ones) (default: {defaults['seeds']})")
        r.add_argument("--seed", type=NONNEG_INT, default=None, help="one seed: the same as --seeds N")
    else:
        r.add_argument("--seed", type=NONNEG_INT, default=defaults["seed"], help="seed (default: %(default)s)")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda")
    r.add_argument("--save-every", type=NONNEG_INT, default=defaults.get("save_every", 0), metavar="N",
                   help="checkpoint each run every N steps (0: only where the stability guard stops it): a process "
                        "that ends mid-run (killed, out of time) is continued from there, bit for bit, when the same "
                        "command runs again (default: %(default)s)")
    r.add_argument("--debug-kill-at-step", type=POSITIVE_INT, default=None, help=argparse.SUPPRESS)  # tests
    r.add_argument("--quick", action="store_true", help="a smoke-test size (seconds)")
    r.add_argument("--json", action="store_true", help=f"print the results as JSON ({kept} lists in results.json)")


def add_recipe_parser(ex) -> None:
    """Register ``fullband experiment recipe`` on the ``experiment`` sub-parsers."""
    r = ex.add_parser("recipe", help="the feedback recipe grid: switch-on, fusion entry, LR schedule, K; every mode, "
                                     "equal tokens and equal FLOPs, >= 2 seeds",
                      description=recipe.__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--out", default=recipe.DEFAULTS["out"],
                   help=f"output directory (default: {recipe.DEFAULTS['out']})")
    add_overwrite_argument(r)
    r.add_argument("--preset", default=recipe.DEFAULTS["preset"], help="backbone size preset (default: tiny; small / "
                                                                "gpt2-small with --device cuda)")
    r.add_argument("--trunk-steps", type=POSITIVE_INT, default=recipe.DEFAULTS["trunk_steps"], help="plain trunk steps per seed")
    r.add_argument("--branch-steps", type=POSITIVE_INT, default=recipe.DEFAULTS["branch_steps"], help="steps of every arm")
    r.add_argument("--batch-size", type=POSITIVE_INT, default=recipe.DEFAULTS["batch_size"], help="rows per step")
    r.add_argument("--seq-len", type=POSITIVE_INT, default=recipe.DEFAULTS["seq_len"], help="tokens per row")
    r.add_argument("--vocab-size", type=POSITIVE_INT, default=recipe.DEFAULTS["vocab_size"], help="BPE entries")
    r.add_argument("--lr", type=POSITIVE_FLOAT, default=None, help="peak LR (default: the preset's)")
    r.add_argument("--seeds", default=recipe.DEFAULTS["seeds"], help="comma-separated seeds (default: 0,1)")
    r.add_argument("--arms", default=None,
                   help="comma-separated arms (default: the branched grid but concat-warm; each arm's baselines are "
                        "added); one of " + ", ".join(recipe.ARM_BY_NAME))
    r.add_argument("--flops-multiplier", type=POSITIVE_FLOAT, default=recipe.DEFAULTS["flops_multiplier"],
                   help="steps of the FLOP-matched baselines of the branched arms (baseline-flops, reading further; "
                        "baseline-epochs, re-reading the branch's batches) as a multiple of --branch-steps (their "
                        "FLOPs bound the equal-FLOPs comparisons; an arm costlier than that is reported out of range)")
    r.add_argument("--scratch-flops-multiplier", type=POSITIVE_FLOAT, default=recipe.DEFAULTS["scratch_flops_multiplier"],
                   help="steps of the FLOP-matched baselines of the arms from scratch (baseline-scratch-flops, "
                        "baseline-tied-flops and their -epochs twins) as a multiple of --trunk-steps + --branch-steps (default 3.1: above "
                        "K=3 on every step, 3 passes + 2 fusions)")
    r.add_argument("--eval-rows", type=POSITIVE_INT, default=recipe.DEFAULTS["eval_rows"], help="held-out rows scored")
    r.add_argument("--prompt-tokens", type=NONNEG_INT, default=recipe.DEFAULTS["prompt_tokens"],
                   help="prompt length before the scored continuation of each row")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda")
    r.add_argument("--quick", action="store_true", help="a smoke-test size (micro preset, a few steps)")
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.set_defaults(func=lambda args: (recipe.run_recipe(args), 0)[1])


def add_depth_parser(ex) -> None:
    """Register ``fullband experiment depth`` on the ``experiment`` sub-parsers."""
    r = ex.add_parser("depth", help="k-hop pointer chasing / iterated composition: does FBT(L) reach baseline(2L)? "
                                    "accuracy per k and decode mode",
                      description=depth.__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(r, depth.DEFAULTS)
    r.add_argument("--tasks", default=depth.DEFAULTS["tasks"], help="comma-separated: pointer, compose, modsum "
                                                              "(default: %(default)s)")
    r.add_argument("--max-k", type=POSITIVE_INT, default=depth.DEFAULTS["max_k"], help="largest k (default: %(default)s)")
    r.add_argument("--max-think", type=NONNEG_INT, default=depth.DEFAULTS["max_think"],
                   help="most think positions in training; tested at 0 and at this (default: %(default)s)")
    r.add_argument("--test-per-cell", type=POSITIVE_INT, default=depth.DEFAULTS["test_per_cell"],
                   help="test problems per (task, k, think) (default: %(default)s)")
    r.add_argument("--pointer-cycle", action="store_true",
                   help="pointer chasing over a single n-cycle (the start symbol is never the answer for k < n)")
    r.add_argument("--arms", default=None,
                   help="comma-separated arms (default: all): " + ", ".join(depth.ARM_BY_NAME))
    add_run_arguments(r, depth.DEFAULTS, "per-example")
    r.set_defaults(func=lambda args: (depth.run_depth(args), 0)[1])


def add_state_parser(ex) -> None:
    """Register ``fullband experiment state`` on the ``experiment`` sub-parsers."""
    r = ex.add_parser("state", help="running-state tasks (S3/S5 word problem, parity, variable tracking) with dense "
                                    "labels: FBT trained with long recurrences vs baselines of 1, 2, 4x depth",
                      description=state.__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(r, state.DEFAULTS)
    r.add_argument("--tasks", default=state.DEFAULTS["tasks"],
                   help="comma-separated: s3, s5, parity, vars (default: %(default)s)")
    r.add_argument("--length", type=POSITIVE_INT, default=state.DEFAULTS["length"],
                   help="T, inputs per training row; tested at T, 2T, 4T (default: %(default)s)")
    r.add_argument("--test-rows", type=POSITIVE_INT, default=state.DEFAULTS["test_rows"],
                   help="test rows per task and length (default: %(default)s)")
    r.add_argument("--pass-tol", type=NONNEG_FLOAT, default=state.DEFAULTS["pass_tol"],
                   help="the early-stop tolerance of the fbt-L-glu-tol arm and the cost table (default: %(default)s)")
    r.add_argument("--arms", default=None,
                   help=f"comma-separated arms (default: {','.join(state.DEFAULT_ARMS)}); also "
                        + ", ".join(state.ARM_NAMES[len(state.DEFAULT_ARMS):]))
    r.add_argument("--no-cost", action="store_true", help="skip the cost table (step time and memory per K)")
    state.add_arguments(r)
    add_run_arguments(r, state.DEFAULTS, "per-row")
    r.set_defaults(func=lambda args: (state.run_state(args), 0)[1])


def add_programs_parser(ex) -> None:
    """Register ``fullband experiment programs`` on the ``experiment`` sub-parsers."""
    d = programs.DEFAULTS
    r = ex.add_parser("programs", help="the Feedback Transformer's algorithmic task (programs over 3 or 5 variables, "
                                       "accuracy on printed values): FBT vs plain models of 1, 2, 4x depth and the "
                                       "equal-FLOPs controls",
                      description=programs.__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(r, d)
    r.add_argument("--grammar", choices=GRAMMARS, default=d["grammar"],
                   help="published: the task as Fan et al. published it with its generator (<, > against a number "
                        "or another variable, no wrap-around, each variable assigned once, the printed value never an "
                        "input); fullband: the package's earlier variant (== against a number, wrap-around, the printed "
                        "value fed as the next input) (default: %(default)s)")
    r.add_argument("--vars", type=POSITIVE_INT, default=d["vars"], help="variables, 1..5 (the paper: 3 and 5) (default: "
                                                               "%(default)s)")
    r.add_argument("--statements", type=POSITIVE_INT, default=d["statements"], metavar="N",
                   help="statements per training program, the opening assignments included (default: %(default)s)")
    r.add_argument("--test-statements", default=d["test_statements"], metavar="N,..",
                   help="comma-separated statements per test program, N among them (default: N,2N: length "
                        "generalisation)")
    r.add_argument("--rows", type=POSITIVE_INT, default=d["rows"],
                   help="training programs per seed (default: %(default)s, as published)")
    r.add_argument("--val-rows", type=NONNEG_INT, default=d["val_rows"],
                   help="validation programs per seed, of the training length, none a test or training program: "
                        "the runs' periodic held-out loss (the learning curves) and the LR choice of --lrs "
                        "(default: %(default)s, as published)")
    r.add_argument("--test-rows", type=POSITIVE_INT, default=d["test_rows"],
                   help="test programs per length and seed (default: %(default)s, as published)")
    r.add_argument("--lrs", default=d["lrs"], metavar="LR,..",
                   help="comma-separated peak LRs: every arm trains at each (runs in OUT/seed{N}/runs/lr{LR}/) and "
                        "keeps the one its validation programs score best (FBT in exact mode, plain in standard; "
                        "a tie: the smaller), per seed; the controls match the chosen FBT run's FLOPs (default: "
                        "--lr alone, no search)")
    r.add_argument("--arms", default=None,
                   help=f"comma-separated arms (default: {','.join(programs.DEFAULT_ARMS)}); also "
                        + ", ".join(programs.ARM_NAMES[len(programs.DEFAULT_ARMS):]))
    plan = r.add_argument_group("plan (--dry-run: what the experiment would cost on a GPU, per arm and in all; draws "
                                "the first seed's programs, trains and writes nothing)")
    plan.add_argument("--dry-run", action="store_true", help="print the plan (with --json: as JSON) and exit")
    plan.add_argument("--plan-gpu", default="h100", choices=sorted(GPU_PEAK_BF16), help="GPU of the plan (default: "
                                                                                          "%(default)s)")
    plan.add_argument("--plan-mfu", type=POSITIVE_FRACTION, default=0.4, metavar="X",
                      help="model-FLOP utilisation assumed by the plan (default: %(default)s)")
    add_run_arguments(r, d, "per-program")
    r.set_defaults(func=lambda args: (programs.run_programs(args), 0)[1])


def add_reasoning_parser(ex) -> None:
    r = ex.add_parser("reasoning", help="baseline vs FBT on synthetic problems with traces of mixed verbosity: "
                                        "accuracy and trace length per mode, equal tokens and equal FLOPs",
                      description=reasoning.__doc__.split("\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(r, reasoning.RS_DEFAULTS)
    r.add_argument("--task", default=reasoning.RS_DEFAULTS["task"],
                   choices=["arithmetic", "state", "permutation", "s3"],
                   help="synthetic task (default: arithmetic; s3: the running product of 6-10 elements of S3, the "
                        "trace writing the running state)")
    r.add_argument("--task-option", action="append", metavar="NAME=VALUE", default=None,
                   help="generator option, e.g. num_ops=2,4 or max_operand=9 (repeatable); arithmetic defaults to "
                        f"{reasoning.TASK_DEFAULTS['arithmetic']}, s3 to {reasoning.TASK_DEFAULTS['s3']}")
    r.add_argument("--train-problems", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["train_problems"],
                   help="training problems (default: %(default)s)")
    r.add_argument("--test-problems", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["test_problems"],
                   help="held-out problems decoded (default: %(default)s)")
    r.add_argument("--num-seeds", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["num_seeds"],
                   help="training seeds --seed, --seed+1, ... (default: %(default)s)")
    r.add_argument("--verbosity-mix", default=reasoning.RS_DEFAULTS["verbosity_mix"],
                   help="weights of the training verbosities (default: %(default)s)")
    r.add_argument("--styles", default=reasoning.RS_DEFAULTS["styles"],
                   help="how to decode: free (the model chooses) and/or forced full, partial, direct "
                        "(default: %(default)s)")
    r.add_argument("--no-cot", action="store_true", help="train on direct answers only (then --styles free)")
    r.add_argument("--fbt-modes", default=reasoning.RS_DEFAULTS["fbt_modes"],
                   help="FBT decode modes (default: %(default)s)")
    r.add_argument("--no-flops-baseline", action="store_true", help="skip the equal-FLOPs baseline")
    r.add_argument("--no-epochs-baseline", action="store_true",
                   help="skip baseline-epochs (the equal-unique-tokens-and-FLOPs baseline: FBT's rows re-read)")
    r.add_argument("--fbt-recipe", default=reasoning.RS_DEFAULTS["fbt_recipe"], choices=["default", "exact"],
                   help="FBT's training: default (`fullband train`'s recipe, K <= 3 passes) or exact (the whole "
                        "recurrence at linear cost on every step: exact states then 2 gradient passes; recipe flags "
                        "and --set still win) (default: %(default)s)")
    r.add_argument("--pause-tokens", type=NONNEG_INT, default=reasoning.RS_DEFAULTS["pause_tokens"], metavar="N",
                   help="the pause-token control (baseline-pause, trained for FBT's FLOPs): N filler tokens after "
                        "every prompt; default: the held-out prompts' mean length (what fused mode's extra prompt "
                        "pass costs); 0: no pause control")
    r.add_argument("--internalize-stages", type=NONNEG_INT, default=reasoning.RS_DEFAULTS["internalize_stages"],
                   metavar="S", help="the stepwise-internalization control (baseline-internalized, FBT's FLOPs "
                                     "over S + 1 chained stages, stage j trained with the first j/S of each "
                                     "trace's steps removed); 0: none (default: %(default)s)")
    r.add_argument("--max-new-tokens", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["max_new_tokens"],
                   help="longest completion (default: %(default)s)")
    r.add_argument("--gen-batch-size", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["gen_batch_size"],
                   help="problems decoded together (default: %(default)s)")
    r.add_argument("--bootstrap", type=POSITIVE_INT, default=reasoning.RS_DEFAULTS["bootstrap"],
                   help="bootstrap resamples (default: %(default)s)")
    r.add_argument("--quick", action="store_true", help="a smoke-test size (seconds)")
    r.add_argument("--json", action="store_true", help="print the results as JSON (per-problem records in "
                                                       "results.json)")
    add_recipe_arguments(r)
    r.set_defaults(func=lambda args: (reasoning.run_reasoning_experiment(args), 0)[1])


def add_data_efficiency_parser(ex) -> None:
    """Register ``fullband experiment data-efficiency`` on the ``experiment`` sub-parsers."""
    defaults = data_efficiency.DE_DEFAULTS
    d = ex.add_parser("data-efficiency", help="baselines at several token budgets vs FBT at 1x: effective token "
                                              "multiplier and matched-compute comparison",
                      description=data_efficiency.__doc__.split("\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(d, defaults)
    d.add_argument("--data", default=defaults["data"],
                   help="training text, as `fullband train --data` (default: the embedded corpus)")
    d.add_argument("--multipliers", default=defaults["multipliers"],
                   help="baseline token budgets as multiples of the FBT run's (must include 1) (default: "
                        f"{defaults['multipliers']})")
    d.add_argument("--eval-rows", type=POSITIVE_INT, default=defaults["eval_rows"],
                   help=f"held-out rows evaluated, the same for every run (default: {defaults['eval_rows']})")
    add_recipe_arguments(d)
    d.set_defaults(func=lambda args: (data_efficiency.run_data_efficiency(args), 0)[1])


# ============================================================================================== CLI


def add_parser(sub) -> None:
    p = sub.add_parser("experiment", help="experiments: recipe (the feedback recipe grid), data-efficiency, reasoning, "
                                          "depth, state, programs",
                       description=__doc__.split("\n\n")[0])
    ex = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    add_data_efficiency_parser(ex)
    add_reasoning_parser(ex)
    add_recipe_parser(ex)
    add_depth_parser(ex)
    add_state_parser(ex)
    add_programs_parser(ex)
