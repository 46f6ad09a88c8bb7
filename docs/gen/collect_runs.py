"""Run several ``fullband ... --json`` benchmark commands one after another and keep their reports in one
``results.json``, for ``results_tables.py --import`` (one generated page from a set of runs, e.g. ``bench train``
at several row lengths).

Usage::

    python docs/gen/collect_runs.py --out DIR -- "fullband bench train --json --seq-len 16" "fullband bench ..."

Each command is split with :func:`shlex.split` and run with the environment as given (no shell); its stdout must be
one JSON report (``--json`` where the command has the option). ``DIR/results.json`` holds ``{"reports": [{"command", "report"}, ...], "load_average": [start,
end], "threads", "seeds", "seconds", "provenance"}`` (the provenance's command is this script's command line, so
the import records every inner command). A command that fails or prints no JSON stops the collection with a
one-line error (exit 2) and nothing is written; the file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from fullband.training.device import load_average
from fullband.utils.provenance import note_start, provenance


def collect(commands: list[str], progress=print, argv: list[str] | None = None) -> dict:
    """The reports of ``commands`` (each a ``fullband ... --json`` command line), run in turn; ``argv``: the
    command line recorded in the provenance (default: this script's, as run)."""
    note_start()
    t0, load0 = time.perf_counter(), load_average()
    reports = []
    for i, command in enumerate(commands, 1):
        words = shlex.split(command)
        progress(f"[{i}/{len(commands)}] {command}")
        done = subprocess.run(words, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise RuntimeError(f"command {i} exited {done.returncode}: {tail}")
        try:
            report = json.loads(done.stdout)
        except json.JSONDecodeError as err:
            raise RuntimeError(f"command {i} printed no JSON report (its --json option missing?): {err}") from None
        reports.append({"command": command, "report": report})
    threads = sorted({r["report"].get("threads") for r in reports if r["report"].get("threads") is not None})
    seeds = sorted({r["report"]["seed"] for r in reports if "seed" in r["report"]})
    return {"reports": reports, "load_average": [load0, load_average()],
            "threads": threads[0] if len(threads) == 1 else threads, "seeds": seeds,
            "seconds": time.perf_counter() - t0, "provenance": provenance(argv)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for results.json (created)")
    ap.add_argument("commands", nargs="+", help="the commands, each one quoted argument")
    args = ap.parse_args(argv)
    try:
        res = collect(args.commands, progress=lambda m: print(m, file=sys.stderr, flush=True),
                      argv=["python", "docs/gen/collect_runs.py", *(sys.argv[1:] if argv is None else argv)])
        os.makedirs(args.out, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=args.out, prefix=".results-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        os.replace(tmp, os.path.join(args.out, "results.json"))
    except (ValueError, RuntimeError, OSError) as err:
        print(f"collect_runs: error: {err}", file=sys.stderr)
        return 2
    print(os.path.join(args.out, "results.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
