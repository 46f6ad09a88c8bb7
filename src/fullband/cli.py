"""The ``fullband`` command line: one sub-command per module, each module owning its options.

Every command module exposes ``add_parser(subparsers)``, which registers its sub-command and sets
``func`` (called with the parsed arguments; returns an exit code). Errors a user can fix (``ValueError``,
``FileNotFoundError``, :class:`UsageError`) print one line and exit with code 2; so does a bad option (argparse,
:class:`Parser`: a numeric option out of the range of its :mod:`fullband.utils.argtypes` type among them), and a run
the stability guard stopped inside a command that needs it finished (:class:`TrainingStopped`: an experiment, the
quickstart).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .utils import provenance
from .utils.errors import TrainingStopped, UsageError

# sub-command modules, in the order `fullband --help` lists them
COMMAND_MODULES = [
    "fullband.commands.info",
    "fullband.commands.train",
    "fullband.commands.data",
    "fullband.commands.quickstart",
    "fullband.commands.sft",
    "fullband.commands.generate",
    "fullband.commands.export",
    "fullband.commands.bench",
    "fullband.commands.eval",
    "fullband.commands.reason",
    "fullband.commands.analyze",
    "fullband.commands.experiments",
    "fullband.serving.commands",
]




class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): ``fullband train: error: argument --batch-size: must
    be an integer >= 1, got '0'``, exit 2; the sub-commands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fullband",
        description="Full-bandwidth transformer: latent feedback on Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"fullband {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 2:  # a bad option: its one line is printed; an exit code as every user error's
            return 2
        raise  # --help, --version
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    provenance.note_start()  # a result's provenance names the commit its run started from
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
        print(f"fullband {args.command}: error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"fullband {args.command}: stopped: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fullband {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
