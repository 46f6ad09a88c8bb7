"""Train the runs of a ``fullband experiment reasoning`` command in several processes at one thread each, ahead of
the command itself, which then finds them finished and reuses them (finished runs of the same configuration, data
and initial model are reused: :func:`fullband.experiments.common.train_or_reuse`).

Usage::

    python docs/gen/pretrain_reasoning.py --jobs 2 -- --fbt-recipe exact --num-seeds 3 --out DIR
    OMP_NUM_THREADS=1 fullband experiment reasoning --fbt-recipe exact --num-seeds 3 --out DIR

The arguments after ``--`` are the experiment's own; the script builds the same problems, documents and run
configurations with the experiment's functions and trains each run with the experiment's training functions, so a
run trained here is the run the command would train at one thread (the same bytes: training is deterministic at a
fixed thread count on one machine). It trains nothing the command would not, and decodes nothing. Units of work:
each run on its own where it shares no steps with another (``--fbt-recipe exact``: feedback from the first step, so
the baseline, FBT and ``baseline-flops`` share none), the baseline/FBT/``baseline-flops`` trio where they do (one
job, as :func:`~fullband.experiments.common.train_pair` trains them), and the internalization stages as one chain
(each starts from the previous one). The longest first, on ``--jobs`` processes.

Why a script and not an option of the experiment: on a machine with more cores than one run uses well (2 cores here,
a tiny model), a 3-seed run with every control trains about 12 runs a seed; the experiment's module is left as it
is so that the pages it produced stay current.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fullband.cli import build_parser
from fullband.experiments import reasoning as rs
from fullband.experiments.common import apply_quick, steps_for, train_or_reuse, train_pair
from fullband.experiments.reasoning_report import BASELINE, EPOCHS, FBT, FLOPS, INTERN, PAUSE_ARM
from fullband.training.pretrain import refuse_changed_runs
from fullband.utils.jobs import run_jobs


def _weight(cfg) -> float:
    """A run's rough cost in plain steps: an exact-states step about 3.5 plain ones (``fullband bench train``), a
    K-pass step K."""
    fed = cfg.num_passes > 1 and cfg.feedback_start < 1.0  # a plain run keeps the FBT run's other options
    return cfg.steps * ((3.5 if cfg.exact_states else cfg.num_passes) if fed else 1)


def jobs_of(args, cfgs: dict, corpora: dict) -> list[tuple[float, str, tuple]]:
    """One seed's units of work: ``(cost, what, job)``; ``job`` is ``("pair", base, fbt, flops, corpus, share)`` or
    ``("chain", [(cfg, corpus, name), ...])``."""
    corpus = corpora[BASELINE]
    fbt = cfgs[FBT]
    start = fbt.schedule().start_step(fbt.steps)
    share = not args.no_share_prefix and 0 < start < fbt.steps
    out = []
    if share:  # the trio shares steps: one job, trained as the experiment trains it
        trio = [cfgs[BASELINE], fbt] + ([cfgs[FLOPS]] if FLOPS in cfgs else [])
        out.append((sum(_weight(c) for c in trio), "baseline+FBT+flops",
                    ("pair", cfgs[BASELINE], fbt, cfgs.get(FLOPS), corpus, True)))
    else:
        for label in (BASELINE, FBT, FLOPS):
            if label in cfgs:
                out.append((_weight(cfgs[label]), label, ("chain", [(cfgs[label], corpus, label)])))
    for label in (EPOCHS, PAUSE_ARM):
        if label in cfgs:
            out.append((_weight(cfgs[label]), label, ("chain", [(cfgs[label], corpora.get(label, corpus), label)])))
    stages = [label for label in cfgs if label.startswith(INTERN)]
    if stages:
        chain = [(cfgs[label], corpora[label], label) for label in stages]
        out.append((sum(_weight(c) for c, _, _ in chain), INTERN, ("chain", chain)))
    return out


def run_job(job: tuple) -> float:
    """Train one unit of work in this (worker) process; its seconds."""
    t = time.perf_counter()
    if job[0] == "pair":
        _, base, fbt, flops, corpus, share = job
        train_pair(base, fbt, corpus, share=share, longer_cfg=flops)
    else:
        for cfg, corpus, name in job[1]:
            train_or_reuse(cfg, corpus, name=name)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="processes, one thread each (default: 2)")
    own = p.parse_args(argv[:split])
    if own.jobs < 1:
        print(f"pretrain_reasoning: error: --jobs must be >= 1, got {own.jobs}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(["experiment", "reasoning", *argv[split + 1:]])
    try:
        apply_quick(args, rs.RS_DEFAULTS, rs.RS_QUICK)
        steps = steps_for(args)
        mix = rs.parse_mix(args.verbosity_mix)
        options = {**rs.TASK_DEFAULTS.get(args.task, {}), **rs.parse_task_options(args.task_option)}
        _, _, _, _, train_file, tokenizer, corpora, pause = rs.build_data(args, options, mix, print)
        seeds = [args.seed + i for i in range(args.num_seeds)]
        configs = {seed: rs.seed_configs(args, seed, steps, train_file, pause, len(tokenizer)) for seed in seeds}
        for label in dict.fromkeys(x for cfgs in configs.values() for x in cfgs):
            refuse_changed_runs([cfgs[label] for cfgs in configs.values() if label in cfgs],
                                corpora.get(label, corpora[BASELINE]), args.overwrite)
    except ValueError as err:
        print(f"pretrain_reasoning: error: {err}", file=sys.stderr)
        return 2
    work = sorted(((w, f"seed {s} {what}", job) for s in seeds for w, what, job in jobs_of(args, configs[s], corpora)),
                  key=lambda x: -x[0])
    print(f"pretrain_reasoning: {len(work)} jobs on {own.jobs} processes: " + ", ".join(f"{w[1]} ({w[0]:,.0f})" for w in work))
    # one-thread spawned processes, the costliest first (fullband.utils.jobs: what the quickstart trains with too);
    # --jobs 1: here, at one thread as well
    torch.set_num_threads(1)
    run_jobs([(w, what, run_job, (job,)) for w, what, job in work], own.jobs,
             lambda line: print(f"pretrain_reasoning: {line}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
