"""``fullband export``: a saved model in another runtime's format; ``export gguf`` for llama.cpp
(:func:`fullband.serving.gguf_export.export_gguf`)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from transformers.utils import logging as hf_logging

from ..serving.gguf_export import TYPES, export_gguf
from ..serving.gguf_export import __doc__ as gguf_doc


def _run_gguf(args) -> int:
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    manifest = export_gguf(args.model, args.out, args.type)
    print(json.dumps(manifest, indent=2))
    print(f"[exported to {args.out} in {time.perf_counter() - t0:.1f} s; decode it with `fullband generate --engine "
          f"llama.cpp --model {args.out} --prompt ...`]", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a saved model for another runtime (gguf: llama.cpp)",
                       description="Export a saved model for another runtime. `fullband export gguf --help`.")
    export_sub = p.add_subparsers(dest="export_command", metavar="FORMAT")
    g = export_sub.add_parser("gguf", help="a GGUF for llama.cpp, plus the fusion's weights beside it",
                              description=gguf_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model", metavar="RUN", help="model directory (save_pretrained output, e.g. a run's directory)")
    g.add_argument("--out", required=True, help="directory to write (replaced whole if it is an earlier export)")
    g.add_argument("--type", choices=TYPES, default="f32",
                   help="weight type of the matrices: f32 (default), f16, q8_0 (norms stay f32)")
    g.set_defaults(func=_run_gguf)
