"""Run several ``fullband ... --json`` benchmark commands one after another and keep their reports in one
``results.json``, for ``results_tables.py --import`` (one generated page from a set of runs, e.g. ``bench train``
at several row lengths).

Usage::

    python docs/gen/collect_runs.py --out DIR -- "fullband bench train --json --seq-len 16" "fullband bench ..."
    python docs/gen/collect_runs.py --out DIR --results RUN1 RUN2 ... --keep settings,table,arms,seeds,provenance

The second form runs nothing: it gathers runs that already finished (each ``RUN/results.json``, e.g. one-arm probes
of ``fullband experiment state``), each report cut to the ``--keep`` keys, its command read from its provenance.

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


def gather(dirs: list[str], keep: list[str], argv: list[str] | None = None) -> dict:
    """The finished runs ``dirs`` (each with a ``results.json`` that records its ``provenance``), each cut to
    ``keep``; the collection's load average is the range of the runs' own, its threads theirs."""
    reports, loads, threads = [], [], set()
    for d in dirs:
        path = os.path.join(d, "results.json")
        if not os.path.isfile(path):
            raise ValueError(f"--results {d}: no results.json there")
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        prov = res.get("provenance") or {}
        if not isinstance(prov.get("command"), list):
            raise ValueError(f"--results {d}: its results.json records no provenance command")
        missing = [k for k in keep if k not in res]
        if missing:
            raise ValueError(f"--results {d}: no {', '.join(missing)} in its results.json (--keep)")
        reports.append({"command": shlex.join(map(str, prov["command"])), "report": {k: res[k] for k in keep}})
        loads += list(res.get("load_average") or [])
        threads |= {res.get("threads")} - {None}
    seeds = sorted({s for r in reports for s in r["report"].get("seeds", [])})
    threads = sorted(threads)
    return {"reports": reports, "load_average": [min(loads), max(loads)] if loads else None,
            "threads": threads[0] if len(threads) == 1 else threads, "seeds": seeds, "seconds": None,
            "provenance": provenance(argv)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for results.json (created)")
    ap.add_argument("commands", nargs="*", help="the commands, each one quoted argument")
    ap.add_argument("--results", nargs="+", metavar="RUN", help="gather these finished runs instead of running commands")
    ap.add_argument("--keep", default="settings,table,arms,seeds",
                    help="--results: the keys of each results.json kept (comma-separated)")
    args = ap.parse_args(argv)
    if bool(args.commands) == bool(args.results):
        ap.error("give either commands or --results RUN ..., not both and not neither")
    me = ["python", "docs/gen/collect_runs.py", *(sys.argv[1:] if argv is None else argv)]
    try:
        if args.results:
            res = gather(args.results, [k for k in args.keep.split(",") if k], argv=me)
        else:
            res = collect(args.commands, progress=lambda m: print(m, file=sys.stderr, flush=True), argv=me)
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
