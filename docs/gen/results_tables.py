"""Renders the result tables of the docs site from committed results files, and imports a run's results.

For each ``docs/results/<name>/`` holding ``results.json`` + ``meta.json`` it writes
``docs/results/generated/<name>.md``: a provenance line (command, commit, seeds, load, threads, date), a STALE
admonition when a source path listed in ``meta.json`` changed since the commit that produced the run, and the tables,
rendered by the experiment's own report code (:data:`RENDERERS`; nothing here formats a table). It also rewrites
the README's quickstart block between ``<!-- quickstart-table:start -->`` and ``<!-- quickstart-table:end -->``
from ``docs/results/quickstart/`` (a README without the markers is left alone).

    python docs/gen/results_tables.py                 # (re)write every generated file and the README block
    python docs/gen/results_tables.py --check         # exit 1 when any of them is out of date
    python docs/gen/results_tables.py --import /tmp/state-fix --name state \\
        --command "fullband experiment state --seeds 0 --out /tmp/state-fix" --commit 6745986 [--commit-note ...]
        (--command / --commit default to the results' own ``provenance`` where it records one)

STALE: ``git diff --name-only <meta.commit> -- <meta.sources>`` against the working tree (so a commit that changes
a source and regenerates the tables in one go gets the banner it will have once committed; in a clean clone the
working tree is HEAD), plus any source the commit did not have; the banner names no files (so it does not change
with every later commit), ``--stale NAME`` lists them. ``--import`` copies results.json trimmed of its
per-row / per-example lists (:data:`TRIM`, what no table reads), the run's PNGs, and writes meta.json, with
the producing modules as ``sources`` (:func:`default_sources`).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from fullband.commands import bench_decode, bench_token, bench_train, data_bench
from fullband.experiments import (data_efficiency, depth, programs_report, quickstart, quickstart_state,
                                  reasoning_report, recipe_report, run_summaries, state_probes, state_report)
from fullband.serving import benchmark as serve_bench
from fullband.serving import llamacpp_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
RESULTS = os.path.join(DOCS, "results")
GENERATED = os.path.join(RESULTS, "generated")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- quickstart-table:start -->", "<!-- quickstart-table:end -->"
RUNS_BLOCK = re.compile(r"(<!-- runs-table:([\w.,-]+):start -->\n)(.*?)(<!-- runs-table:\2:end -->)", re.S)
MAX_BYTES = 200_000  # a committed results.json larger than this is refused


class Refused(Exception):
    """A one-line error a user can fix (exit 2, nothing written)."""


# ---- renderers: the experiment's own table code, called on the (trimmed) results dict


def _render_state(res: dict) -> str:
    return state_report.tables(res)


def _render_programs(res: dict) -> str:
    return programs_report.tables(res)


def _render_quickstart_state(res: dict) -> str:
    return ("**The quickstart's table** (`fullband.experiments.quickstart_state.compact_table`)\n\n"
            + quickstart_state.compact_table(res) + "\n\n**The full state report's tables**\n\n"
            + state_report.tables(res))


def _render_quickstart(res: dict) -> str:
    """The held-out loss tables and the targets (the running-state part: its own run, ``quickstart-state``)."""
    return "\n\n".join([quickstart._table(res["table"]), quickstart._table(res["decode_table"]),
                        quickstart._targets_text(res["targets"])])


def _render_depth(res: dict) -> str:
    return depth.tables(res)


def _render_data_efficiency(res: dict) -> str:
    return data_efficiency.data_efficiency_tables(res)


def _render_reasoning(res: dict) -> str:
    return reasoning_report.tables(res, full=True)


def _render_recipe(res: dict) -> str:
    return recipe_report.tables(res)


def _render_state_probes(res: dict) -> str:
    """One-arm probes of the state experiment gathered by ``docs/gen/collect_runs.py --results``."""
    return state_probes.probe_table(res)


def _render_bench_serve(res: dict) -> str:
    return serve_bench.markdown_tables(res)


def _render_bench_decode(res: dict) -> str:
    """Several ``fullband bench decode`` reports collected by ``docs/gen/collect_runs.py``."""
    return bench_decode.markdown_reports(res)


def _render_data_bench(res: dict) -> str:
    """Several ``fullband data bench`` results collected by ``docs/gen/collect_runs.py``."""
    return data_bench.markdown_reports(res)


def _render_bench_token(res: dict) -> str:
    """Several ``fullband bench token`` reports collected by ``docs/gen/collect_runs.py``."""
    return bench_token.markdown_reports(res)


def _render_bench_llamacpp(res: dict) -> str:
    """Several ``fullband bench llamacpp`` reports collected by ``docs/gen/collect_runs.py``."""
    return llamacpp_bench.markdown_reports(res)


def _render_bench_train(res: dict) -> str:
    """Several ``fullband bench train`` reports collected by ``docs/gen/collect_runs.py``."""
    return bench_train.markdown_reports(res)


# renderer -> (function, the module(s) whose import closure produced the numbers, results keys no table reads);
# bench-serve's numbers also come from the model and scheduler vLLM imports in its engine process
RENDERERS = {
    "bench-serve": (_render_bench_serve, ("fullband.serving.benchmark", "fullband.serving.vllm_model",
                                          "fullband.serving.scheduling", "fullband.serving.plugin"), ()),
    "bench-decode": (_render_bench_decode, "fullband.commands.bench_decode", ()),
    "bench-train": (_render_bench_train, "fullband.commands.bench_train", ()),
    "bench-token": (_render_bench_token, "fullband.commands.bench_token", ()),
    "bench-llamacpp": (_render_bench_llamacpp, "fullband.serving.llamacpp_bench", ()),
    # data bench's numbers come from the `data prepare` and `train` subprocesses it measures
    "data-bench": (_render_data_bench, ("fullband.commands.data_bench", "fullband.data.prepare",
                                        "fullband.commands.train"), ()),
    "depth": (_render_depth, "fullband.experiments.depth", ("runs", "test")),
    "data-efficiency": (_render_data_efficiency, "fullband.experiments.data_efficiency", ()),
    "reasoning": (_render_reasoning, "fullband.experiments.reasoning", ("runs",)),
    "recipe": (_render_recipe, "fullband.experiments.recipe", ("per_seed",)),
    "state": (_render_state, "fullband.experiments.state", ("per_seed",)),
    "state-probes": (_render_state_probes, "fullband.experiments.state", ()),
    "programs": (_render_programs, "fullband.experiments.programs", ("per_seed",)),
    "quickstart-state": (_render_quickstart_state, "fullband.experiments.quickstart_state", ("per_seed",)),
    "quickstart": (_render_quickstart, "fullband.experiments.quickstart", ("samples", "running_state.rows",
                                                                          "running_state.interventions")),
}
TRIM = {name: spec[2] for name, spec in RENDERERS.items()}

# modules of the import closure that cannot change a single-process run's numbers: checkpoint files, torchrun /
# FSDP plumbing, metrics logging, prepared-data shards, the device picker; utils/ except the statistics
PLUMBING = {"training/checkpoint.py", "training/distributed.py", "training/sharded.py", "training/metrics.py",
            "training/device.py", "model/sharding.py", "data/shards.py", "training/__init__.py",
            "experiments/__init__.py", "serving/commands.py", "serving/__init__.py"}
SOURCE_DIRS = ("experiments/", "eval/", "model/", "training/", "data/", "serving/", "utils/stats.py",
               "commands/bench_train.py", "commands/bench_decode.py", "commands/data_bench.py")


# ---- git


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)


def resolve_commit(commit: str) -> str:
    r = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if r.returncode != 0:
        raise Refused(f"--commit {commit}: not a commit of this repository")
    return r.stdout.strip()


def changed_sources(meta: dict) -> list[str]:
    """The paths of ``meta['sources']`` that differ between ``meta['commit']`` and the working tree."""
    r = _git("diff", "--name-only", meta["commit"], "--", *meta["sources"])
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        raise Refused(f"git diff {meta['commit'][:12]} failed ({why}): the staleness check needs the full history "
                      "(not a shallow clone)")
    changed = {p for p in r.stdout.splitlines() if p}
    # a source the commit did not have but the tree has (git diff leaves out untracked files): changed too, so the
    # answer is the same before and after that file is committed
    at_commit = _git("ls-tree", "-r", "--name-only", meta["commit"], "--", *meta["sources"])
    had = set(at_commit.stdout.splitlines())
    changed |= {p for p in meta["sources"] if p not in had and os.path.exists(os.path.join(ROOT, p))}
    return sorted(changed)


def is_stale(meta: dict, previous: str | None = None) -> bool:
    """Whether the run's sources changed since its commit. Where this checkout cannot tell (no git, or a history
    without that commit: an exported tree or a shallow clone) and a committed page ``previous`` exists, its banner
    is kept as it is (said on stderr), so ``--check`` still compares the tables; without one the error stands."""
    try:
        return bool(changed_sources(meta))
    except Refused as err:
        if previous is None:
            raise
        print(f"results_tables: {err}; keeping the committed page's STALE state", file=sys.stderr)
        return "STALE" in previous


# ---- sources: the producing modules


def _module_path(module: str) -> str | None:
    base = os.path.join(ROOT, "src", *module.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(p):
            return p
    return None


def default_sources(module: str | tuple[str, ...]) -> list[str]:
    """The fullband modules ``module`` (one or several) imports, transitively (read with :mod:`ast`, nothing
    imported), that compute numbers: under experiments/, eval/, model/, training/, data/, serving/ and
    utils/stats.py, and the benchmark modules in :data:`SOURCE_DIRS`, less :data:`PLUMBING`."""
    seen, todo = set(), [module] if isinstance(module, str) else list(module)
    while todo:
        mod = todo.pop()
        path = _module_path(mod)
        if path is None or path in seen:
            continue
        seen.add(path)
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] == "fullband":
                    todo += [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "fullband"]
    src = os.path.join(ROOT, "src", "fullband")
    rel = sorted(os.path.relpath(p, src).replace(os.sep, "/") for p in seen)
    return [f"src/fullband/{p}" for p in rel if p.startswith(SOURCE_DIRS) and p not in PLUMBING]


# ---- rendering


def _fmt_load(load) -> str:
    if isinstance(load, (list, tuple)) and len(load) == 2:
        return f"{load[0]} at the start, {load[1]} at the end"
    return str(load)


def provenance(meta: dict, note: bool = True) -> str:
    seeds = ", ".join(map(str, meta.get("seeds") or [])) or "-"
    secs = f"; {meta['seconds']:.0f}s wall" if isinstance(meta.get("seconds"), (int, float)) else ""
    return (f"Produced by `{meta['command']}` at commit `{meta['commit'][:12]}`; seeds {seeds}; 1-minute load "
            f"average {_fmt_load(meta.get('load_average'))}; {meta.get('threads', '?')} thread(s){secs}; "
            + (f"CPU {meta['cpu']}; " if meta.get("cpu") else "") +
            f"{meta['date']}." + (f" Commit: {meta['commit_note']}." if note and meta.get("commit_note") else ""))


def load_run(name: str) -> tuple[dict, dict]:
    d = os.path.join(RESULTS, name)
    with open(os.path.join(d, "results.json"), encoding="utf-8") as f:
        res = json.load(f)
    with open(os.path.join(d, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("renderer") not in RENDERERS:
        raise Refused(f"docs/results/{name}/meta.json: renderer {meta.get('renderer')!r} is not one of "
                      f"{', '.join(RENDERERS)}")
    return res, meta


def render_page(name: str, res: dict, meta: dict, previous: str | None = None) -> str:
    """The generated Markdown of one run: provenance, a STALE admonition where its sources changed, the tables."""
    lines = [f"<!-- GENERATED by docs/gen/results_tables.py from docs/results/{name}/; do not edit by hand. -->", "",
             provenance(meta), ""]
    if is_stale(meta, previous):
        lines += [f'!!! warning "STALE: the code that produced these tables changed since commit '
                  f'{meta["commit"][:12]}"', "",
                  f"    `python docs/gen/results_tables.py --stale {name}` lists the changed files (of the run's "
                  f"`sources` in `docs/results/{name}/meta.json`). Re-run the command above and import its output "
                  f"(`python docs/gen/results_tables.py --import OUT --name {name} ...`).", ""]
    lines.append(RENDERERS[meta["renderer"]][0](res).rstrip())
    return "\n".join(lines) + "\n"


def readme_block(res: dict, meta: dict, previous: str | None = None) -> str:
    """What lies between the README's quickstart markers: provenance, STALE note, the held-out loss table
    (``quickstart._table``) and the running-state table the quickstart prints."""
    lines = ["<!-- GENERATED by docs/gen/results_tables.py from docs/results/quickstart/; do not edit by hand. -->",
             "", provenance(meta, note=False) + " (more in docs/results/quickstart/meta.json)", ""]
    if is_stale(meta, previous):
        lines += [f"> **STALE**: the code that produced this table changed since commit {meta['commit'][:12]} "
                  "(`python docs/gen/results_tables.py --stale quickstart` lists the files).", ""]
    lines.append(quickstart._table(res["table"]))
    if res.get("running_state"):
        lines += ["", res["running_state"]["table"]]
    return "\n".join(lines)


def runs() -> list[str]:
    if not os.path.isdir(RESULTS):
        return []
    return sorted(n for n in os.listdir(RESULTS) if n != "generated"
                  and os.path.isfile(os.path.join(RESULTS, n, "results.json"))
                  and os.path.isfile(os.path.join(RESULTS, n, "meta.json")))


def expected() -> dict[str, str | None]:
    """Every file this script owns -> its content (``None``: should not exist)."""
    out: dict[str, str | None] = {}
    names = runs()
    for name in names:
        res, meta = load_run(name)
        path = os.path.join(GENERATED, f"{name}.md")
        out[path] = render_page(name, res, meta, _read(path))
    if os.path.isdir(GENERATED):  # a page whose run was removed
        for f in os.listdir(GENERATED):
            path = os.path.join(GENERATED, f)
            if f.endswith(".md") and path not in out:
                out[path] = None
    if os.path.exists(README):
        text = original = open(README, encoding="utf-8").read()
        if "quickstart" in names and START in text and END in text and text.index(START) < text.index(END):
            res, meta = load_run("quickstart")
            head, rest = text.split(START, 1)
            block, tail = rest.split(END, 1)
            text = f"{head}{START}\n{readme_block(res, meta, block)}\n{END}{tail}"
        text = _runs_blocks(text, "docs/results/generated")
        if text != original or START in text:
            out[README] = text
    for path in sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)):
        if os.path.dirname(path) != GENERATED:
            text = open(path, encoding="utf-8").read()
            if RUNS_BLOCK.search(text):
                out[path] = _runs_blocks(text, os.path.relpath(GENERATED, os.path.dirname(path)))
    return out


def _runs_blocks(text: str, pages: str) -> str:
    """``text`` with every ``runs-table`` block regenerated (``pages``: the generated pages' directory, relative to
    the file, for the lines' links)."""
    return RUNS_BLOCK.sub(lambda m: m.group(1) + runs_block(m.group(2).split(","), pages) + m.group(4), text)


def runs_block(names: list[str], pages: str = "docs/results/generated") -> str:
    """A README summary table of several committed runs of one experiment (``<!-- runs-table:A,B:start -->`` ...
    ``<!-- runs-table:A,B:end -->``): one line per run from :data:`fullband.experiments.run_summaries.SUMMARIES`,
    each naming its commit and marked STALE where its sources changed since."""
    runs = [(name, *load_run(name)) for name in names]
    kinds = {meta["renderer"] for _, _, meta in runs}
    if len(kinds) != 1 or next(iter(kinds)) not in run_summaries.SUMMARIES:
        raise Refused(f"runs-table {','.join(names)}: the runs must share one renderer with a summary line "
                      f"({', '.join(run_summaries.SUMMARIES)}), got {', '.join(sorted(kinds))}")
    header, row = run_summaries.SUMMARIES[kinds.pop()]
    lines = [f"<!-- GENERATED by docs/gen/results_tables.py from docs/results/{{{','.join(names)}}}/; do not edit "
             "by hand. -->", "", header()]
    for name, res, meta in runs:
        page = _read(os.path.join(GENERATED, f"{name}.md"))
        lines.append(row(name, res, meta, is_stale(meta, page), f"{pages}/{name}.md"))
    return "\n".join(lines) + "\n"


def _read(path: str) -> str | None:
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".gen-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def out_of_date() -> list[str]:
    stale = []
    for path, text in expected().items():
        current = _read(path)
        if current != text:
            stale.append(os.path.relpath(path, ROOT))
    return stale


def write_all() -> list[str]:
    written = []
    for path, text in expected().items():
        current = _read(path)
        if current == text:
            continue
        if text is None:
            os.remove(path)
        else:
            _write_atomic(path, text)
        written.append(os.path.relpath(path, ROOT))
    return written


# ---- import


def trim(res: dict, keys) -> dict:
    """``res`` less ``keys`` (``a.b``: key ``b`` of ``res['a']``)."""
    out = json.loads(json.dumps(res))
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        node = out.get(parent) if parent else out
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def _renderer_for(name: str, res: dict, given: str | None) -> str:
    if given:
        return given
    if name in RENDERERS:
        return name
    if "baseline_val_loss" in res:
        return "quickstart"
    if "per_seed" in res and "interventions" in res:
        return "state"
    raise Refused(f"cannot tell which renderer reads this results.json: pass --renderer ({', '.join(RENDERERS)})")


def _parse_load(text: str | None) -> list[float] | None:
    """``--load START,END`` (1-minute load averages read at the run's start and end), for results that lack them."""
    if not text:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 2 or min(values) < 0:
        raise Refused(f"--load {text!r}: two load averages START,END, e.g. 0.7,4.0")
    return values


def import_run(src: str, name: str, command: str, commit: str, commit_note: str | None, renderer: str | None,
               load: str | None = None, cpu: str | None = None) -> str:
    path = os.path.join(src, "results.json")
    if not os.path.isfile(path):
        raise Refused(f"--import {src}: no results.json there")
    if not name or "/" in name or name in ("generated", ".", ".."):
        raise Refused(f"--name {name!r}: a plain directory name is needed (not 'generated')")
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    prov = res.get("provenance") if isinstance(res.get("provenance"), dict) else {}
    if prov:  # a results.json that records where it came from (fullband.utils.provenance): the defaults
        argv = prov.get("command")
        command = command or (shlex.join(map(str, argv)) if isinstance(argv, list) else argv)
        commit = commit or prov.get("git_commit")
        if commit_note is None and prov.get("git_dirty") is not None:
            commit_note = ("from results.json's provenance; the checkout's tracked files were "
                           + ("modified" if prov["git_dirty"] else "unmodified"))
            end = prov.get("checkout_at_end")
            if isinstance(end, dict):
                commit_note += (f"; the checkout changed while it ran (at its end: commit "
                                f"{str(end.get('git_commit'))[:12]}, tracked files "
                                + ("modified" if end.get("git_dirty") else "unmodified") + ")")
    if not command or not commit:
        raise Refused("--import needs --command and --commit (this results.json records no provenance)")
    renderer = _renderer_for(name, res, renderer)
    if renderer not in RENDERERS:
        raise Refused(f"--renderer {renderer}: one of {', '.join(RENDERERS)}")
    trimmed = trim(res, TRIM[renderer])
    text = json.dumps(trimmed, separators=(",", ":"), sort_keys=False) + "\n"
    if len(text.encode()) > MAX_BYTES:
        raise Refused(f"the trimmed results.json is {len(text.encode()) // 1000} KB (> {MAX_BYTES // 1000} KB): add "
                      f"the keys no table reads to TRIM[{renderer!r}]")
    RENDERERS[renderer][0](trimmed)  # the tables render from the trimmed file, before anything is written
    seconds = res.get("seconds")
    if isinstance(seconds, dict):
        seconds = seconds.get("total")
    mtime = datetime.datetime.fromtimestamp(os.path.getmtime(path), tz=datetime.timezone.utc)
    date, date_source = mtime.strftime("%Y-%m-%d %H:%M UTC"), "mtime of the run's results.json"
    if prov.get("date"):
        date, date_source = str(prov["date"]), "results.json's provenance"
    if load is None and "load_average_before" in res:  # fullband bench serve: os.getloadavg() before and after
        load = f"{res['load_average_before'][0]:.2f},{res['load_average_after'][0]:.2f}"
    seed = res.get("seed", res.get("settings", {}).get("seed"))  # one-seed experiments (depth) keep it in settings
    seeds = res.get("seeds", [seed] if seed is not None else [])
    meta = {"name": name, "renderer": renderer, "command": command, "commit": resolve_commit(commit),
            "commit_note": commit_note, "seeds": seeds, "load_average": res.get("load_average") or _parse_load(load),
            "threads": res.get("threads"), "seconds": seconds,
            "date": date, "date_source": date_source,
            "torch": res.get("torch") or prov.get("torch"), "platform": res.get("platform") or prov.get("platform"),
            "cpu": cpu or (f"{prov['cpu']} ({prov.get('cpu_capability')})" if prov.get("cpu") else None),
            "trimmed": list(TRIM[renderer]), "sources": default_sources(RENDERERS[renderer][1])}
    os.makedirs(RESULTS, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=RESULTS, prefix=f".import-{name}-")
    os.chmod(tmp, 0o755)
    try:
        with open(os.path.join(tmp, "results.json"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
        for png in sorted(os.listdir(src)):
            if png.endswith(".png"):
                shutil.copy2(os.path.join(src, png), os.path.join(tmp, png))
        dest = os.path.join(RESULTS, name)
        old = None
        if os.path.exists(dest):
            old = dest + ".old"
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.relpath(os.path.join(RESULTS, name), ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a generated file or the README block is out of date")
    ap.add_argument("--stale", metavar="NAME",
                    help="print the source files of docs/results/NAME changed since its commit")
    ap.add_argument("--import", dest="import_dir", metavar="DIR", help="a run's output directory (its results.json)")
    ap.add_argument("--name", help="--import: the name under docs/results/")
    ap.add_argument("--command", help="--import: the exact command that produced the run")
    ap.add_argument("--commit", help="--import: the commit the run was produced at")
    ap.add_argument("--commit-note", default=None, help="--import: how the commit was determined")
    ap.add_argument("--load", default=None, metavar="START,END",
                    help="--import: the 1-minute load average at the run's start and end, where results.json lacks it")
    ap.add_argument("--cpu", default=None, metavar="MODEL",
                    help="--import: the CPU model and torch's kernel ISA (e.g. 'AMD EPYC (AVX512)'), where results.json "
                         "lacks it")
    ap.add_argument("--renderer", choices=sorted(RENDERERS), default=None,
                    help="--import: which report code renders it (default: from --name or the results' keys)")
    args = ap.parse_args(argv)
    try:
        if args.stale:
            print("\n".join(changed_sources(load_run(args.stale)[1])) or f"{args.stale}: not stale")
            return 0
        if args.import_dir:
            if not args.name:
                raise Refused("--import needs --name")
            where = import_run(args.import_dir, args.name, args.command, args.commit, args.commit_note, args.renderer,
                               args.load, args.cpu)
            print(f"imported {where}")
        if args.check:
            stale = out_of_date()
            if stale:
                print(f"out of date: {', '.join(stale)}: run python docs/gen/results_tables.py", file=sys.stderr)
                return 1
            return 0
        for path in write_all():
            print(f"wrote {path}")
        return 0
    except (Refused, OSError, json.JSONDecodeError, KeyError) as err:
        print(f"results_tables: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
