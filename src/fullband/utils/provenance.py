"""Where a result came from, and which of its fields a re-run cannot reproduce.

Owns :func:`provenance` (the command line as run, the git commit of the checkout the package lives in and whether
its tracked files were modified, the package and torch versions, the thread count, the CPU model and the vector
instruction set torch's CPU kernels were dispatched for, the date; recorded in every
experiment's ``results.json`` under ``provenance``), :func:`provenance_line` (its one line in a report) and
:data:`UNREPRODUCIBLE_KEYS`: the names of the ``results.json`` keys, at any depth, that hold timings, load, dates,
the platform or provenance. Everything else in a ``results.json`` is a function of the command, its seeds, the code
and the thread count, and a re-run on the same machine reproduces it bit for bit (``tests/test_reproduce.py``).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata

import torch

# keys whose values differ between two runs of one command (wall clock, load, date, machine): skipped wherever they
# occur when two results are compared; an experiment keeps every such value under one of these names
UNREPRODUCIBLE_KEYS = frozenset({"provenance", "seconds", "train_seconds", "decode_seconds", "eval_seconds",
                                 "step_seconds", "load_average", "platform", "cpu_count", "cpu",
                                 "cpu_capability"})


def _git(args: list[str], cwd: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_checkout(path: str | None = None) -> dict:
    """``{"git_commit", "git_dirty"}`` of the git checkout holding ``path`` (default: this package's source);
    both ``None`` when it is not in a git checkout (an installed wheel) or git is missing. ``git_dirty``: whether a
    tracked file differs from that commit (untracked files are not counted)."""
    where = os.path.abspath(path or os.path.dirname(os.path.dirname(__file__)))  # src/fullband
    head = _git(["rev-parse", "HEAD"], where)
    if path is None and _git(["ls-files", "--error-unmatch", "__init__.py"], where) is None:
        head = None  # installed inside some other repository (a venv in a project): not this package's checkout
    if head is None:
        return {"git_commit": None, "git_dirty": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], where)
    return {"git_commit": head.strip(), "git_dirty": None if status is None else bool(status.strip())}


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` where that is missing), ``None`` if neither
    says. Two machines whose CPUs differ can pick different float kernels, so the same command and seed can give
    results that differ in the last bits and, after training, in the printed digits."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def package_version() -> str | None:
    """The installed distribution's version (``None`` when the package runs without being installed)."""
    try:
        return metadata.version("fullband")
    except metadata.PackageNotFoundError:
        return None


_AT_START: dict[str | None, dict] = {}  # source_checkout(path) when the command started (note_start)


def note_start(path: str | None = None) -> None:
    """Take the checkout's commit and dirtiness now (``fullband``'s CLI does before it runs a command): a result's
    provenance then names the code the run started from, not what HEAD or the working tree became while it ran
    (an experiment of an hour outlives commits)."""
    _AT_START[path] = source_checkout(path)


def provenance(argv: list[str] | None = None, path: str | None = None) -> dict:
    """What produced a result: the command line (``argv``, default ``sys.argv`` as run), the package source's git
    commit and dirtiness (:func:`source_checkout`; as they were when the command started, if :func:`note_start`
    was called, with ``checkout_at_end`` added where they changed while it ran), package / torch / Python
    versions, torch's CPU threads, the platform, the CPU model and torch's CPU kernel ISA (``AVX2``, ``AVX512``, ...)
    and the UTC date."""
    now = source_checkout(path)
    start = _AT_START.get(path, now)
    out = {"command": list(sys.argv if argv is None else argv), **start,
           "package_version": package_version(), "torch": torch.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "platform": platform.platform(), "cpu": cpu_model(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if now != start:
        out["checkout_at_end"] = now
    return out


def provenance_line(p: dict) -> str:
    """One report line: ``Produced by `fullband ...` at commit abc1234 (modified), fullband 0.1.0, torch 2.x, N
    thread(s), DATE.``"""
    argv = [str(a) for a in p.get("command") or []]
    shown = shlex.join([os.path.basename(argv[0]), *argv[1:]]) if argv else "?"
    commit = p.get("git_commit")
    where = (f"commit {commit[:12]}" + (" with uncommitted changes" if p.get("git_dirty") else "")) if commit \
        else "no git checkout"
    end = p.get("checkout_at_end")
    if isinstance(end, dict):
        where += (f" (the checkout changed while it ran: at its end commit {str(end.get('git_commit'))[:12]}"
                  + (" with uncommitted changes" if end.get("git_dirty") else "") + ")")
    return (f"Produced by `{shown}` at {where}, fullband {p.get('package_version')}, torch {p.get('torch')}, "
            f"{p.get('threads')} thread(s)" + (f", {p['cpu']} ({p.get('cpu_capability')})" if p.get("cpu") else "")
            + f", {p.get('date')}.")


def without_unreproducible(obj):
    """``obj`` (JSON values) with every :data:`UNREPRODUCIBLE_KEYS` entry removed at any depth."""
    if isinstance(obj, dict):
        return {k: without_unreproducible(v) for k, v in obj.items() if k not in UNREPRODUCIBLE_KEYS}
    if isinstance(obj, list):
        return [without_unreproducible(v) for v in obj]
    return obj


def _differences(a, b, path: str = ""):
    """Every place two JSON values differ, in document order (keys of :data:`UNREPRODUCIBLE_KEYS` skipped): ``(path,
    a, b, None)`` for two values that differ (NaN equals NaN; numbers compared exactly), ``(path, None, None, note)``
    for a key only one side has or lists of different lengths."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in UNREPRODUCIBLE_KEYS:
                continue
            if k not in a or k not in b:
                yield f"{path}/{k}", None, None, f"only in the {'second' if k not in a else 'first'}"
            else:
                yield from _differences(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield path, None, None, f"{len(a)} vs {len(b)} entries"
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                yield from _differences(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) or (a != b and not (isinstance(a, float) and a != a and b != b)):
        yield path or "/", a, b, None


def first_difference(a, b, path: str = "") -> str | None:
    """The path of the first place two JSON values differ (keys of :data:`UNREPRODUCIBLE_KEYS` skipped), with both
    values; ``None`` when they are equal (NaN equals NaN; numbers compared exactly)."""
    for where, x, y, note in _differences(a, b, path):
        return f"{where}: {note}" if note else f"{where}: {x!r} vs {y!r}"
    return None


def _numbers(v) -> int:
    if isinstance(v, bool):
        return 0
    if isinstance(v, (int, float)):
        return 1
    if isinstance(v, dict):
        return sum(_numbers(x) for k, x in v.items() if k not in UNREPRODUCIBLE_KEYS)
    if isinstance(v, list):
        return sum(_numbers(x) for x in v)
    return 0


def drift(a, b, top: int = 5) -> dict:
    """How far two results of one command differ (for runs that are not expected to be bitwise equal, e.g. at
    another thread count): the numbers compared, how many differ, the largest absolute and relative differences
    with their paths, and the differences that are not between two numbers (a changed string, a missing key)."""
    numeric, other = [], []
    for where, x, y, note in _differences(a, b):
        if note is None and _numbers(x) == 1 and _numbers(y) == 1:
            d = abs(x - y)
            numeric.append((where, x, y, d, d / max(abs(x), abs(y), 1e-300)))
        else:
            other.append(f"{where}: {note}" if note else f"{where}: {x!r} vs {y!r}")
    by_rel = sorted(numeric, key=lambda t: -t[4])[:top]
    return {"numbers": _numbers(a), "numbers_differing": len(numeric),
            "max_abs": max((t[3] for t in numeric), default=0.0), "max_rel": max((t[4] for t in numeric), default=0.0),
            "largest_rel": [{"path": w, "a": x, "b": y, "rel": r} for w, x, y, _, r in by_rel],
            "other_differences": other[:top], "other_differing": len(other)}
