"""``fullband data``: the command line of prepared data (:mod:`fullband.data.prepare`).

Owns the ``data`` command group: ``data prepare SRC --out DIR`` (a thin wrapper: flags -> :func:`prepare`, the
one-line result or ``--json``) and ``data bench`` (registered from :mod:`fullband.commands.data_bench`).
"""

from __future__ import annotations

import argparse
import json

from ..data.labelled import is_labelled_file
from ..data.prepare import prepare
from . import labelled
from .data_bench import add_bench_parser


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare data of any size into memory-mapped token shards (`data prepare`)",
                       description="Prepared data: `fullband data prepare SRC --out DIR` tokenizes a corpus once into "
                                   "token shards that `fullband train --data DIR` memory-maps.")
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
    q.add_argument("--vocab-size", type=int, default=4096, metavar="N",
                   help="size of a BPE trained here (default: 4096)")
    q.add_argument("--tokenizer-sample-mb", type=float, default=64.0, metavar="X",
                   help="MB of training text the BPE is trained on, from the start (default: 64)")
    q.add_argument("--val-fraction", type=float, default=0.1, metavar="X",
                   help="expected fraction of documents held out, chosen per document by a hash (default: 0.1)")
    q.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the split (default: 0)")
    q.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default: 1)")
    q.add_argument("--shard-mb", type=float, default=32.0, metavar="X",
                   help="MB of text per shard: the unit of work, of memory per worker and of resuming (default: 32)")
    q.add_argument("--piece-mb", type=float, default=1.0, metavar="X",
                   help="MB of one document read and tokenized at once: a longer document (a whole .txt file is "
                        "one) is streamed in pieces cut at a space or newline between words (default: 1)")
    q.add_argument("--overwrite", action="store_true", help="replace prepared data of other settings in DIR")
    q.add_argument("--labelled", action="store_true",
                   help="SRC is a .jsonl of labelled rows (detected when its first row has 'input' and 'target'): "
                        "write token and target ids per row, the word-level vocabulary and a manifest (--val-fraction "
                        "and --seed split per row). " + labelled.FORMAT_HELP)
    q.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    q.add_argument("--json", action="store_true", help="print the manifest and this run's throughput as JSON")
    q.add_argument("--stop-after-shards", type=int, default=None, help=argparse.SUPPRESS)  # tests: a killed run
    q.set_defaults(func=run_prepare)
    add_bench_parser(group)


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
