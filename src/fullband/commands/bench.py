"""``fullband bench``: throughput benchmarks, one sub-command each.

Owns the ``bench`` command and the argument parsers of its sub-commands; each benchmark lives in its own module:

* ``bench decode``: :func:`fullband.commands.bench_decode.benchmark_decode` (decode tokens/s per mode, the lean
  loop against HF ``generate()``);
* ``bench train``: :func:`fullband.commands.bench_train.benchmark_train` (a training step at K = 1, K = 2, the
  levers and the exact recurrence);
* ``bench token``: :func:`fullband.commands.bench_token.benchmark_token` (the token-by-token pass alone, each way
  of running it, and the exact prefill against the soft one);
* ``bench gpu``: :func:`fullband.commands.bench_gpu.benchmark_gpu` (the prepared accelerator check);
* ``bench serve``: :mod:`fullband.serving.benchmark` (vLLM);
* ``bench llamacpp``: :mod:`fullband.serving.llamacpp_bench` (the llama.cpp engine: agreement with ``generate()``,
  decode tokens/s against plain llama.cpp).
"""

from __future__ import annotations

import argparse
import json

import torch

from ..model.generation import MODES
from ..model.lean import TOKEN_STEPS
from ..serving.benchmark import add_bench_parser as _add_serve  # `bench serve` (vLLM), implemented there
from ..serving.llamacpp_bench import add_bench_parser as _add_llamacpp_parser
from ..serving.llamacpp_bench import benchmark_llamacpp, markdown_tables as format_llamacpp
from ..utils.errors import UsageError
from .bench_decode import benchmark_decode, parse_size, print_report
from .bench_gpu import SHAPES as GPU_SHAPES
from .bench_gpu import __doc__ as bench_gpu_doc
from .bench_gpu import benchmark_gpu, format_gpu
from .bench_token import __doc__ as bench_token_doc
from .bench_token import benchmark_token, format_token
from .bench_train import benchmark_train, format_benchmark
from ..utils.argtypes import NONNEG_INT, POSITIVE_INT

DECODE_DESCRIPTION = (
    "Tokens/s of the decode modes (standard, soft, fused, exact) for our lean loop and Hugging Face generate(), "
    "on the same randomly initialised backbone, the same prompts and the same number of new tokens; prints the "
    "ratios, the FLOP-bound overhead of feedback (extra MACs / total MACs per token) and the KV-cache bytes per "
    "mode. Goals: soft/standard >= 0.98 at d768 L12 batch 1 and >= 0.95 at the tiny size; lean loop >= HF "
    "generate() in standard mode; KV-cache bytes identical across modes. A quick run: --sizes tiny "
    "--batch-sizes 1 --new-tokens 16 --repeats 2.")


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            return [kind(x) for x in items]
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def _token_step(text: str) -> str:
    if text not in TOKEN_STEPS:
        raise ValueError(f"unknown token step {text!r}: choose from {', '.join(TOKEN_STEPS)}")
    return text


def _run_decode(args) -> int:
    if args.new_tokens < 1 or args.prompt_len < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
        raise UsageError("--new-tokens, --prompt-len, --repeats and --batch-sizes must be >= 1")
    bad = sorted(set(args.modes) - set(MODES))
    if bad:
        raise UsageError(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    bad = sorted(set(args.loops) - {"lean", "hf"})
    if bad:
        raise UsageError(f"unknown loop(s) {bad}: choose lean and/or hf")
    for spec in args.sizes:
        parse_size(spec)
    report = benchmark_decode(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _add_decode(sub) -> None:
    p = sub.add_parser("decode", help="decode tokens/s per mode, lean loop vs HF generate()",
                       description=DECODE_DESCRIPTION,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--sizes", type=_csv(str), default=["tiny", "small"],
                   help="comma list: tiny (d256 L4), small (d768 L12, GPT-2 small) or d<width>l<layers>")
    p.add_argument("--family", choices=("gpt2", "llama"), default="gpt2", help="backbone architecture")
    p.add_argument("--vocab", type=POSITIVE_INT, default=None, help="vocabulary size (default: gpt2 50257, llama 32000)")
    p.add_argument("--batch-sizes", type=_csv(int), default=[1, 16])
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--prompt-len", type=POSITIVE_INT, default=32)
    p.add_argument("--prefill-passes", type=POSITIVE_INT, default=1, help="Jacobi passes of the 'fused' mode")
    p.add_argument("--modes", type=_csv(str), default=list(MODES))
    p.add_argument("--loops", type=_csv(str), default=["lean", "hf"], help="lean (our loop) and/or hf (generate())")
    p.add_argument("--cache", choices=("auto", "static", "dynamic"), default="auto",
                   help="KV cache of the lean loop")
    p.add_argument("--repeats", type=POSITIVE_INT, default=5,
                   help="timed rounds after one warm-up round; the runs of a round are interleaved and the best "
                        "round counts")
    p.add_argument("--threads", type=NONNEG_INT, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="what tokens/s are measured in: wall-clock, or this process's CPU time (immune to other "
                        "processes on a shared machine; only meaningful single-threaded on CPU); auto = cpu when "
                        "--threads 1 on CPU")
    p.set_defaults(func=_run_decode)


def _add_train(sub) -> None:
    """``bench train``: step time and tokens/s of a training step at K = 1, K = 2 and K = 2 with a stop-gradient
    state (:func:`fullband.commands.bench_train.benchmark_train`). Goal (a benchmark, not a timed test):
    K=2 / K=1 <= 2.1."""

    p = sub.add_parser("train", help="training step time and tokens/s for K=1, K=2, K=2 with stop-gradient state",
                       description=_add_train.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--preset", default="tiny", help="model size preset (tiny, small, gpt2-small)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16, help="rows per step")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=256, help="tokens per row")
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=4096, help="vocabulary size of the random model")
    p.add_argument("--steps", type=POSITIVE_INT, default=5, help="timed steps per case (median reported)")
    p.add_argument("--warmup", type=NONNEG_INT, default=2, help="untimed steps per case first")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 autocast on a GPU that supports it, else fp32")
    p.add_argument("--threads", type=NONNEG_INT, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--compile", action="store_true", help="also K1_compile and K2_compile (fullband train --compile)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="also K2_ac (fullband train --activation-checkpointing)")
    p.add_argument("--loss-chunk", type=NONNEG_INT, default=0, metavar="N",
                   help="also K2_chunk, the loss N positions at a time (fullband train --loss-chunk N)")
    p.add_argument("--memory", action="store_true",
                   help="measure each case's peak memory of a step (Linux) instead of its time")
    p.add_argument("--exact", type=NONNEG_INT, default=0, metavar="N",
                   help="also exact_gN: the exact states (token by token, no gradient) then N gradient passes "
                        "(fullband train --exact-states --grad-passes N), with its training FLOPs per step vs K1")
    p.add_argument("--exact-reference", action="store_true",
                   help="with --exact N: also KT1_gN, K = seq-len + 1 teacher-forced passes with --grad-passes N "
                        "(the O(T^2) form it replaces; slow at long rows); with --full-backprop also KT1_full, "
                        "K = seq-len + 1 passes all with gradient")
    p.add_argument("--token-steps", type=_csv(_token_step), default=["auto"], metavar="LIST",
                   help="with --exact N: one exact_gN row per way of running the token pass, e.g. off,lean,compiled "
                        "(before and after side by side; auto: the row exact_gN)")
    p.add_argument("--full-backprop", type=NONNEG_INT, action="append", default=None, metavar="C",
                   help="also full_cC: full backpropagation through the token-by-token recurrence in blocks of C "
                        "tokens (fullband train --full-backprop --backprop-chunk C; 0: no recomputation); repeatable")
    p.set_defaults(func=_report_command(benchmark_train, format_benchmark))


def _report_command(benchmark, fmt):
    """A ``bench`` sub-command's function: ``--threads`` applied, the benchmark run, its report printed as JSON
    (``--json``) or through ``fmt``."""
    def run(args) -> int:
        if getattr(args, "threads", 0):
            torch.set_num_threads(args.threads)
        report = benchmark(args)
        print(json.dumps(report, indent=2) if args.json else fmt(report))
        return 0
    return run


def _add_token(sub) -> None:
    p = sub.add_parser("token", help="the token-by-token pass alone per token step, and exact vs soft prefill",
                       description=bench_token_doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--presets", type=_csv(str), default=["micro"], help="comma list of model size presets")
    p.add_argument("--seq-lens", type=_csv(int), default=[512], help="comma list of row lengths")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16, help="rows of the token pass")
    p.add_argument("--vocab-size", type=POSITIVE_INT, default=4096, help="vocabulary size of the random model")
    p.add_argument("--token-steps", type=_csv(_token_step), default=["off", "lean", "compiled"],
                   help="the ways of running the token pass to time (auto is skipped: it is one of them)")
    p.add_argument("--prompt-len", type=POSITIVE_INT, default=512, help="prompt of the prefill rows (batch 1)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="timed runs of each (the best counts)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=NONNEG_INT, default=0, help="CPU threads (0 = torch default)")
    p.set_defaults(func=_report_command(benchmark_token, format_token))


def _add_gpu(sub) -> None:
    p = sub.add_parser("gpu", help="the prepared accelerator check: exactness, training MFU, decode tokens/s",
                       description=bench_gpu_doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--size", choices=tuple(GPU_SHAPES), default="full",
                   help="full: the GPU check's shapes; micro: the same code at a few thousand parameters (CI, CPU)")
    p.add_argument("--out", default=None, help="also write the report here (JSON, rewritten after each section)")
    p.set_defaults(func=_report_command(benchmark_gpu, format_gpu))


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput benchmarks (decode, ...)",
                       description="Throughput benchmarks. `fullband bench decode --help` for decoding.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_decode(bench_sub)
    add_train = globals().get("_add_train")
    if add_train is not None:
        add_train(bench_sub)

    _add_token(bench_sub)
    _add_gpu(bench_sub)
    _add_llamacpp_parser(bench_sub).set_defaults(func=_report_command(benchmark_llamacpp, format_llamacpp))
    _add_serve(bench_sub)

    def _help(args) -> int:
        p.print_help()
        return 0

    p.set_defaults(func=_help)
