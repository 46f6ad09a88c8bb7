"""``fullband data``: the command line of prepared data (:mod:`fullband.data.prepare`).

Owns the ``data`` command group: ``data prepare SRC --out DIR`` (a thin wrapper: flags -> :func:`prepare`, the
one-line result or ``--json``), ``data make-programs --out DIR`` (the Feedback Transformer's algorithmic task as
labelled jsonl files: flags -> :func:`fullband.eval.program_tasks.write_program_files`) and ``data bench``
(registered from :mod:`fullband.commands.data_bench`).
"""

from __future__ import annotations

import argparse
import json

from ..data.labelled import is_labelled_file
from ..data.prepare import prepare
from ..eval.program_tasks import GRAMMARS, VARIABLES, write_program_files
from . import labelled
from .data_bench import add_bench_parser
from ..utils.argtypes import (FRACTION, NONNEG_INT, OPEN_FRACTION, POSITIVE_FLOAT, POSITIVE_FRACTION, POSITIVE_INT,
                              int_range)


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare data of any size into memory-mapped token shards (`data prepare`)",
                       description="Prepared data: `fullband data prepare SRC --out DIR` tokenizes a corpus once into "
                                   "token shards that `fullband train --data DIR` memory-maps; `fullband data "
                                   "make-programs --out DIR` writes the Feedback Transformer's algorithmic task as "
                                   "labelled jsonl.")
    group = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: p.print_help() or 0)
    q = group.add_parser(
        "prepare", help="tokenize SRC into token shards in DIR (resumable)",
        description="Stream SRC (a text file or folder, .jsonl / .jsonl.gz / .jsonl.zst, .parquet, or a local "
                    "datasets directory), split it by document, tokenize it with --workers processes and write "
                    "uint16 / uint32 token shards, document boundaries and manifest.json into DIR. Running the same "
                    "command again resumes an interrupted prepare.")
    q.add_argument("source", metavar="SRC", help="file, folder or datasets directory to read")
    q.add_argument("--out", required=True, metavar="DIR", help="directory of the prepared data")
    q.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="local HF tokenizer directory (default: train a byte-level BPE on a sample of the training "
                        "documents)")
    q.add_argument("--vocab-size", type=POSITIVE_INT, default=4096, metavar="N",
                   help="size of a BPE trained here (default: 4096)")
    q.add_argument("--tokenizer-sample-mb", type=POSITIVE_FLOAT, default=64.0, metavar="X",
                   help="MB of training text the BPE is trained on, from the start (default: 64)")
    q.add_argument("--val-fraction", type=OPEN_FRACTION, default=0.1, metavar="X",
                   help="expected fraction of documents held out, chosen per document by a hash (default: 0.1)")
    q.add_argument("--seed", type=NONNEG_INT, default=0, metavar="N", help="seed of the split (default: 0)")
    q.add_argument("--workers", type=POSITIVE_INT, default=1, metavar="N", help="tokenizing processes (default: 1)")
    q.add_argument("--shard-mb", type=POSITIVE_FLOAT, default=32.0, metavar="X",
                   help="MB of text per shard: the unit of work, of memory per worker and of resuming (default: 32)")
    q.add_argument("--piece-mb", type=POSITIVE_FLOAT, default=1.0, metavar="X",
                   help="MB of one document read and tokenized at once: a longer document (a whole .txt file is "
                        "one) is streamed in pieces cut at a space or newline between words (default: 1)")
    q.add_argument("--overwrite", action="store_true", help="replace prepared data of other settings in DIR")
    q.add_argument("--labelled", action="store_true",
                   help="SRC is a .jsonl of labelled rows (detected when its first row has 'input' and 'target'): "
                        "write token and target ids per row, the word-level vocabulary and a manifest (--val-fraction "
                        "and --seed split by row content: equal rows share a split). " + labelled.FORMAT_HELP)
    q.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    q.add_argument("--json", action="store_true", help="print the manifest and this run's throughput as JSON")
    q.add_argument("--stop-after-shards", type=POSITIVE_INT, default=None, help=argparse.SUPPRESS)  # tests: a killed run
    q.set_defaults(func=run_prepare)
    add_programs_parser(group)
    add_bench_parser(group)


def add_programs_parser(group) -> None:
    q = group.add_parser(
        "make-programs", help="write the Feedback Transformer's algorithmic task as labelled jsonl (train / test)",
        description="Programs of N statements over --vars variables with values 1..10. --grammar published "
                    "(default: the task as Fan et al. published it with its generator): five statement kinds with "
                    "equal weight, `x = 5 ;` only for a variable not yet assigned, `x ++ ;` / `x -- ;` never leaving "
                    "1..10, `if x < 4 : y ++ ;` / `if x > z : y -- ;` (against a number or another variable), "
                    "`print x ;` whose target (x's value) sits at its `;` and is never an input, `END` last. "
                    "--grammar fullband (the package's earlier variant): assignments `x = 5 ;`, `x ++ ;` / "
                    "`x -- ;` (wrapping: 10 ++ is 1, 1 -- is 10), conditionals "
                    "`if x == 4 : y ++ ;` and prints `print x 4 ;`. Each program opens with one assignment per "
                    "variable and ends with a print; the target is the printed value, at the position of the "
                    "variable after `print` (the value is the next input). Writes DIR/train.jsonl, DIR/test.jsonl "
                    "(no test program is a training program) and DIR/programs.json, all at once or none, for "
                    "`fullband train --data DIR/train.jsonl` and `fullband eval labelled MODEL --data "
                    "DIR/test.jsonl`. Seeded: the same command writes the same files.")
    q.add_argument("--out", required=True, metavar="DIR", help="directory of the files")
    q.add_argument("--grammar", choices=GRAMMARS, default="published",
                   help="published (Fan et al.'s generator) or fullband (the earlier variant) (default: published)")
    q.add_argument("--vars", type=int_range(1, len(VARIABLES)), default=3, metavar="V",
                   help=f"variables, 1..{len(VARIABLES)} (the paper: 3 and 5; default: 3)")
    q.add_argument("--statements", type=POSITIVE_INT, default=100, metavar="N",
                   help="statements per training program, the opening assignments included (default: 100)")
    q.add_argument("--rows", type=POSITIVE_INT, required=True, metavar="N", help="training programs")
    q.add_argument("--test-rows", type=POSITIVE_INT, default=1000, metavar="M", help="held-out programs (default: 1000)")
    q.add_argument("--val-rows", type=NONNEG_INT, default=0, metavar="M",
                   help="validation programs of --statements, in DIR/val.jsonl (none a test program, no training "
                        "program one of them; the published split: --rows 10000 --val-rows 1000 --test-rows 1000; "
                        "default: 0, no file)")
    q.add_argument("--test-statements", type=POSITIVE_INT, default=None, metavar="N",
                   help="statements per test program (default: --statements; more tests beyond the training length)")
    q.add_argument("--print-fraction", type=POSITIVE_FRACTION, default=None, metavar="X",
                   help="--grammar fullband: probability that a statement after the opening assignments is a print; "
                        "the others are =, ++, -- and if with equal probability; the last is always a print "
                        "(default: 0.2)")
    q.add_argument("--if-true", type=FRACTION, default=None, metavar="X",
                   help="--grammar fullband: probability that a conditional's test holds (default: 0.5)")
    q.add_argument("--seed", type=NONNEG_INT, default=0, metavar="N", help="seed of the programs (default: 0)")
    q.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in DIR")
    q.add_argument("--json", action="store_true", help="print DIR/programs.json (settings and counts)")
    q.set_defaults(func=run_make_programs)


def run_make_programs(args) -> int:
    info = write_program_files(args.out, args.vars, args.statements, args.rows, args.test_rows, seed=args.seed,
                               test_statements=args.test_statements, print_fraction=args.print_fraction,
                               if_true=args.if_true, overwrite=args.overwrite, grammar=args.grammar,
                               val_rows=args.val_rows)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    tr, te = info["splits"]["train"], info["splits"]["test"]
    print(f"fullband data make-programs: {tr['rows']:,} training programs of {tr['statements']} statements "
          f"({tr['targets']:,} printed values, longest {tr['max_length']} inputs), {te['rows']:,} test programs of "
          f"{te['statements']} ({te['targets']:,}, longest {te['max_length']}) over {' '.join(info['variables'])}"
          + (f", {info['splits']['val']['rows']:,} validation programs" if "val" in info["splits"] else "")
          + f"; {args.out}/train.jsonl, " + ("val.jsonl, " if "val" in info["splits"] else "")
          + f"test.jsonl (train with --seq-len >= {tr['max_length'] + 2})")
    return 0


def run_prepare(args) -> int:
    if args.labelled or is_labelled_file(args.source):
        return labelled.run_prepare(args)
    result = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     val_fraction=args.val_fraction, seed=args.seed, workers=args.workers, shard_mb=args.shard_mb,
                     tokenizer_sample_mb=args.tokenizer_sample_mb, overwrite=args.overwrite, progress=args.progress,
                     stop_after_shards=args.stop_after_shards, piece_mb=args.piece_mb)
    run = result["run"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if run["status"] != "done":
        print(f"fullband data prepare: stopped after {run['new_shards']} new shards; run the same command to finish")
        return 0
    tr, va = result["splits"]["train"], result["splits"]["val"]
    print(f"fullband data prepare: {result['documents']:,} documents (train {tr['documents']:,}, val "
          f"{va['documents']:,}), {result['tokens']:,} {result['dtype']} tokens in {len(tr['shards'])} shards; this "
          f"run: {run['new_shards']} shards, {run['text_mb']:.1f} MB of text in {run['seconds']:.1f}s "
          f"({run['mb_per_s']:.2f} MB/s, {run['tokens_per_s']:,} tokens/s; per worker "
          f"{run['tokens_per_s_per_worker']:,} tokens/s busy, {run['tokens_per_cpu_s_per_worker']:,} per CPU-second; "
          f"{run['workers']} workers); {args.out}")
    return 0
