"""``fullband quickstart``: its command line (options, defaults, help texts) and the call into
:func:`fullband.experiments.quickstart.run_quickstart`, which owns what it trains, evaluates and reports."""

from __future__ import annotations

import argparse

from ..experiments import quickstart
from ..training.device import tune_cpu_allocator
from ..utils.argtypes import FRACTION, NONNEG_INT, POSITIVE_INT

DEFAULTS = quickstart.DEFAULTS


def add_parser(sub) -> None:
    p = sub.add_parser("quickstart", help="main job: train a baseline and an FBT model, evaluate, write a report",
                       description=quickstart.__doc__.split("\n\n")[0] + " Writes OUT/report.md, OUT/results.json, "
                                   "OUT/curves.png, OUT/baseline/ and OUT/fbt/.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=DEFAULTS["out"], help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="retrain finished runs in OUT whose options or data differ from this invocation's (by "
                        "default they are kept and quickstart stops with an error naming the differences)")
    p.add_argument("--preset", default=DEFAULTS["preset"], help="model size preset (tiny, small, gpt2-small)")
    p.add_argument("--steps", type=POSITIVE_INT, default=DEFAULTS["steps"], help="optimizer steps per model")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=DEFAULTS["batch_size"], help="rows per step")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=DEFAULTS["seq_len"], help="tokens per row")
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=DEFAULTS["vocab_size"], help="BPE vocabulary size")
    p.add_argument("--seed", type=NONNEG_INT, default=DEFAULTS["seed"], help="seed (init, split, data order, sampling)")
    p.add_argument("--feedback-start", type=FRACTION, default=DEFAULTS["feedback_start"],
                   help="fraction of the FBT run trained plain before feedback switches on")
    p.add_argument("--num-passes", type=POSITIVE_INT, default=DEFAULTS["num_passes"], help="K of the FBT feedback steps")
    p.add_argument("--eval-rows", type=POSITIVE_INT, default=DEFAULTS["eval_rows"],
                   help="held-out rows evaluated (the same rows for every model and mode)")
    p.add_argument("--samples", type=NONNEG_INT, default=DEFAULTS["samples"], help="held-out prompts to sample from")
    p.add_argument("--sample-tokens", type=POSITIVE_INT, default=DEFAULTS["sample_tokens"], help="new tokens per sample")
    p.add_argument("--prompt-tokens", type=NONNEG_INT, default=DEFAULTS["prompt_tokens"], help="prompt length in tokens")
    p.add_argument("--score-prompt", type=NONNEG_INT, default=DEFAULTS["score_prompt"],
                   help="prompt tokens before the scored continuation in the decode-mode table (default: a quarter of a row, "
                        "at most 32)")
    p.add_argument("--no-flops-baseline", action="store_true",
                   help="skip the baseline trained for as many FLOPs as the FBT run (no equal-FLOPs comparison)")
    p.add_argument("--no-epochs-baseline", action="store_true",
                   help="skip the baseline trained for as many FLOPs as the FBT run on exactly its unique rows, "
                        "re-read epoch after epoch (no equal-unique-tokens + equal-FLOPs comparison)")
    p.add_argument("--no-state", action="store_true",
                   help="skip the running-state part (S3 and parity with a label at every position: FBT trained "
                        "with the exact recurrence vs plain L- and 2L-layer models, tested at T, 2T and 4T)")
    p.add_argument("--state-steps", type=POSITIVE_INT, default=DEFAULTS["state_steps"],
                   help="training steps of each running-state model")
    p.add_argument("--state-test-rows", type=POSITIVE_INT, default=DEFAULTS["state_test_rows"],
                   help="fresh test rows per running-state task and length")
    p.add_argument("--no-share-prefix", action="store_true",
                   help="train the FBT model from scratch instead of branching it off the baseline at the feedback start")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--jobs", type=POSITIVE_INT, default=None,
                   help="processes that train the independent runs side by side, one thread each (default: the "
                        "cores this process may use, at most the number of runs; 1 on a GPU). Every run trains and "
                        "is scored at one thread, so the numbers do not depend on --jobs or on the core count")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (with --jobs > 1 a line per finished run instead of bars)")
    p.add_argument("--quiet", action="store_true", help="print only the table")
    p.set_defaults(func=run)


def run(args) -> int:
    tune_cpu_allocator()
    quickstart.run_quickstart(args)
    return 0
