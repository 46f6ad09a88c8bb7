"""``fullband analyze``: the command line of :mod:`fullband.analysis` (load-bearing test, probes, logit lens,
gates; markdown + PNG + JSON report)."""

from __future__ import annotations

import os

from ..analysis.report import DEFAULT_OUT, AnalyzeOptions, run_analysis
from ..utils.argtypes import NONNEG_INT, POSITIVE_INT, int_at_least


def run(args) -> int:
    opts = AnalyzeOptions(model=args.model, baseline=args.baseline, data=args.data, tokenizer=args.tokenizer,
                          seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size,
                          num_passes=args.num_passes, probe_samples=args.probe_samples, seed=args.seed, out=args.out)
    results = run_analysis(opts)
    lb = results["load_bearing"]["recurrence_damage"]
    print(f"wrote {os.path.join(opts.out, 'report.md')} — damage (nats, exact recurrence): "
          + ", ".join(f"{k} {v:+.4f}" for k, v in lb.items()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze", help="what the fed-back state carries: load-bearing test, layer probes, logit lens, gates",
        description="Analyze a fullband model on held-out text (optionally next to a baseline) and write a markdown "
                    "report with PNG plots and a JSON of all numbers.")
    p.add_argument("--model", required=True, help="fullband model directory (save_pretrained output + tokenizer)")
    p.add_argument("--baseline", help="baseline model directory: a plain Hugging Face causal LM or a fullband model")
    p.add_argument("--data", help="held-out text: file, folder, .jsonl or datasets directory, all of whose documents "
                                  "are used (default: the embedded corpus's validation documents)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory's)")
    p.add_argument("--seq-len", type=int_at_least(2), default=128, help="row length in tokens (default 128)")
    p.add_argument("--max-tokens", type=POSITIVE_INT, default=8192, help="tokens analyzed, in rows spread over the text (default 8192)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=32, help="rows per forward (default 32)")
    p.add_argument("--num-passes", type=NONNEG_INT, default=2,
                   help="K of the K-pass load-bearing measurements (default 2; 0 or 1 skips them)")
    p.add_argument("--probe-samples", type=POSITIVE_INT, default=4000, help="positions used by the probes (default 4000)")
    p.add_argument("--seed", type=NONNEG_INT, default=0, help="seed of the shuffles and samples (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default {DEFAULT_OUT})")
    p.set_defaults(func=run)
