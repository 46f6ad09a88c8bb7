"""What a run's results depend on beyond its command and seeds: the CPU thread count, measured.

Runs each experiment (and the quickstart) at the quick size ``tests/test_reproduce.py`` runs it at (its
``COMMANDS``, read from that file, so the two cannot drift apart; the corpus: ``tests/conftest.py``'s), in fresh directories, once with
``OMP_NUM_THREADS=1`` and once with ``OMP_NUM_THREADS=N`` (``--threads``, default 2), a subprocess each, and compares
the two ``results.json`` files with :func:`fullband.utils.provenance.drift` (timings, load, dates and provenance
skipped): how many numbers differ, by how much at most (absolute and relative, with the paths), and what differs
that is not a number. The same command at one thread count is bitwise equal (the test); this says what another
thread count changes, since matrix products split across threads sum in another order.

usage: python benchmarks/thread_drift.py [--threads N] [--only NAME,...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from fullband.utils.io import atomic_write_text
from fullband.utils.provenance import drift, note_start, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tests_module(name: str):
    spec = importlib.util.spec_from_file_location(f"tests_{name}", os.path.join(ROOT, "tests", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str], where: str, threads: int) -> dict:
    os.makedirs(where)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-m", "fullband.cli", *argv, "--out", "exp"], cwd=where, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} exited {done.returncode}: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    with open(os.path.join(where, "exp", "results.json")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="the thread count compared with 1")
    ap.add_argument("--only", default=None, help="comma list of the commands to run (default: all)")
    ap.add_argument("--out", default=None, help="also write the report (JSON) here")
    args = ap.parse_args(argv)
    note_start()
    commands = _tests_module("test_reproduce").COMMANDS
    names = list(commands) if args.only is None else args.only.split(",")
    unknown = sorted(set(names) - set(commands))
    if unknown:
        print(f"thread_drift: error: unknown command(s) {unknown}: choose from {', '.join(commands)}", file=sys.stderr)
        return 2
    report = {"threads": [1, args.threads], "load_average": [round(os.getloadavg()[0], 2)], "runs": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="thread-drift-") as tmp:
        data = _tests_module("conftest").write_small_corpus(os.path.join(tmp, "docs.jsonl"))
        for name in names:
            cmd = [a.replace("{data}", data) for a in commands[name]]
            print(f"{name}: 1 thread, then {args.threads}", file=sys.stderr, flush=True)
            try:
                one = _run(cmd, os.path.join(tmp, name, "t1"), 1)
                many = _run(cmd, os.path.join(tmp, name, f"t{args.threads}"), args.threads)
            except RuntimeError as err:
                print(f"thread_drift: error: {err}", file=sys.stderr)
                return 2
            one.pop("threads", None), many.pop("threads", None)  # the setting compared, not a result
            report["runs"][name] = {"command": cmd, **drift(one, many)}
    report["load_average"].append(round(os.getloadavg()[0], 2))
    report["seconds"] = time.perf_counter() - t0
    report["provenance"] = provenance(["python", "benchmarks/thread_drift.py", *(sys.argv[1:] if argv is None else argv)])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
