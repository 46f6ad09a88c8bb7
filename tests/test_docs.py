"""The documentation site: the generated CLI reference and result tables are current, the STALE banner marks a run
whose producing code changed, every tutorial command runs at a tiny size, and ``mkdocs build --strict`` passes.

Tutorial pages (docs/guides/*.md, see mkdocs.yml): every fenced ``bash`` block is followed by ``<!-- tiny: CMD -->``
lines (or ``<!-- tiny: skip: REASON -->``); each tiny command has the program and sub-command of a command of its
block (pairwise when there are as many as commands), and runs from the repository root with ``$TMP`` one fresh
directory per page, in page order (``bash``, ``OMP_NUM_THREADS=1``, the Hugging Face hub offline, a timeout each).
The Python API page's ``python`` blocks run in page order on a tiny Llama.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from fullband.utils.provenance import first_difference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = os.path.join(ROOT, "docs", "gen")
GUIDES = sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))
TINY = re.compile(r"^<!--\s*tiny:\s*(.*?)\s*-->\s*$")
TINY_TIMEOUT = 300  # seconds per tiny command


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_gen_{name}", os.path.join(GEN, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*cmd, **kw):
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, **kw)


# ---- (a) the CLI reference


def test_cli_reference_is_current():
    r = _run(sys.executable, os.path.join(GEN, "cli_reference.py"), "--check")
    assert r.returncode == 0, r.stderr


def test_cli_reference_ignores_the_terminal_width(monkeypatch):
    cli = _load("cli_reference")
    monkeypatch.setenv("COLUMNS", "37")
    narrow = cli.render()
    monkeypatch.setenv("COLUMNS", "250")
    assert cli.render() == narrow == open(cli.TARGET, encoding="utf-8").read()


def test_cli_reference_has_every_command_and_option():
    from fullband.cli import build_parser

    text = open(os.path.join(ROOT, "docs", "reference", "cli.md"), encoding="utf-8").read()
    todo, seen = [build_parser()], 0
    while todo:
        parser = todo.pop()
        seen += 1
        assert f"`{parser.prog}`" in text, parser.prog
        section = text.split(f"`{parser.prog}`\n", 1)[1]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
            elif action.option_strings and action.help is not argparse.SUPPRESS:
                assert action.option_strings[-1] in section, (parser.prog, action.option_strings)
    assert seen > 20  # fullband and its sub-commands and nested sub-commands


def test_cli_reference_check_fails_on_a_changed_file(tmp_path, monkeypatch, capsys):
    cli = _load("cli_reference")
    target = tmp_path / "cli.md"
    target.write_text(cli.render().replace("fullband train", "fullband trian", 1))
    monkeypatch.setattr(cli, "TARGET", str(target))
    assert cli.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli.main([]) == 0 and cli.main(["--check"]) == 0


# ---- (b) the result tables and the README block


def test_results_tables_are_current():
    r = _run(sys.executable, os.path.join(GEN, "results_tables.py"), "--check")
    assert r.returncode == 0, r.stderr


def test_committed_results_are_small_and_complete():
    rt = _load("results_tables")
    names = rt.runs()
    assert {"state", "quickstart-state"} <= set(names)
    for name in names:
        size = os.path.getsize(os.path.join(rt.RESULTS, name, "results.json"))
        assert size < rt.MAX_BYTES, (name, size)
        meta = json.load(open(os.path.join(rt.RESULTS, name, "meta.json")))
        for key in ("command", "commit", "seeds", "load_average", "threads", "date", "sources", "renderer"):
            assert meta.get(key) not in (None, "", []), (name, key)
        assert all(os.path.exists(os.path.join(ROOT, p)) for p in meta["sources"]), name


def _fake_tree(tmp_path, monkeypatch, rt, readme: str | None):
    """docs/results/state of the repository copied into a tmp tree; the script pointed at it."""
    results = tmp_path / "docs" / "results"
    shutil.copytree(os.path.join(rt.RESULTS, "state"), results / "state")
    if readme is not None:
        (tmp_path / "README.md").write_text(readme)
    monkeypatch.setattr(rt, "DOCS", str(tmp_path / "docs"))
    monkeypatch.setattr(rt, "RESULTS", str(results))
    monkeypatch.setattr(rt, "GENERATED", str(results / "generated"))
    monkeypatch.setattr(rt, "README", str(tmp_path / "README.md"))
    return results


def test_results_check_fails_until_written(tmp_path, monkeypatch):
    rt = _load("results_tables")
    results = _fake_tree(tmp_path, monkeypatch, rt, None)
    missing = rt.out_of_date()  # nothing generated yet
    assert len(missing) == 1 and missing[0].endswith("generated/state.md")
    assert rt.main(["--check"]) == 1
    assert rt.main([]) == 0 and rt.out_of_date() == [] and rt.main(["--check"]) == 0
    page = (results / "generated" / "state.md").read_text()
    line = page.splitlines()[2]
    assert line.startswith("Produced by `") and "fullband experiment state" in line.split("`")[1] and "| arm | mode |" in page
    assert page == open(os.path.join(ROOT, "docs", "results", "generated", "state.md")).read()
    (results / "generated" / "state.md").write_text(page.replace("| arm |", "| arms |"))  # a hand edit
    assert rt.main(["--check"]) == 1
    (results / "generated" / "orphan.md").write_text("a page without its run\n")
    rt.main([])
    assert not (results / "generated" / "orphan.md").exists()


def test_readme_block_is_rewritten_between_the_markers(tmp_path, monkeypatch):
    rt = _load("results_tables")
    src = os.path.join(ROOT, "docs", "results", "quickstart")
    if not os.path.isdir(src):
        pytest.skip("no docs/results/quickstart committed yet")
    readme = "# x\n\nbefore\n" + rt.START + "\nold table\n" + rt.END + "\nafter\n"
    results = _fake_tree(tmp_path, monkeypatch, rt, readme)
    shutil.copytree(src, results / "quickstart")
    assert rt.main(["--check"]) == 1
    assert rt.main([]) == 0 and rt.main(["--check"]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# x\n\nbefore\n" + rt.START + "\n") and readme.endswith("\n" + rt.END + "\nafter\n")
    assert "old table" not in readme and "| model | mode (whole rows" in readme
    res = json.load(open(os.path.join(src, "results.json")))
    assert f"| baseline | standard | {res['baseline_val_loss']:.4f} |" in readme  # the number of the results file


def test_readme_runs_table_has_one_line_per_run_from_its_results(tmp_path, monkeypatch):
    """A ``runs-table`` block lists the named runs in its order, each line read from that run's own results.json
    (the exact-mode comparison and the multipliers) with its commit; runs of a renderer without a summary line, or
    of two renderers, are refused in one line."""
    rt = _load("results_tables")
    src = os.path.join(ROOT, "docs", "results", "data-efficiency")
    names = ["de-a", "de-b"]
    block = lambda body: f"<!-- runs-table:{','.join(names)}:start -->\n{body}<!-- runs-table:{','.join(names)}:end -->"
    results = _fake_tree(tmp_path, monkeypatch, rt, "# x\n\n" + block("old\n") + "\nafter\n")
    shutil.copytree(src, results / "de-a")
    shutil.copytree(src, results / "de-b")
    res = json.load(open(results / "de-b" / "results.json"))
    c = res["comparisons"][res["headline_mode"]]
    c["fbt_loss"] += 1.0  # run b: another loss, so the lines must come from each run's own file
    (results / "de-b" / "results.json").write_text(json.dumps(res))
    assert rt.main(["--check"]) == 1 and rt.main([]) == 0 and rt.main(["--check"]) == 0
    readme = (tmp_path / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| [de-")]
    assert [r.split("]")[0] for r in rows] == ["| [de-a", "| [de-b"] and readme.endswith("end -->\nafter\n")
    assert f"| {c['fbt_loss'] - 1.0:.4f} |" in rows[0] and f"| {c['fbt_loss']:.4f} |" in rows[1]
    assert f"{c['delta_flops']:+.4f} [{c['delta_flops_ci']['low']:+.4f}" in rows[1]
    commit = json.load(open(results / "de-a" / "meta.json"))["commit"][:7]
    assert f"`{commit}`" in rows[0] and "old" not in readme
    names[1] = "state"  # another renderer in the same block: refused, nothing written
    (tmp_path / "README.md").write_text("# x\n\n" + block("old\n"))
    assert rt.main([]) == 2 and (tmp_path / "README.md").read_text() == "# x\n\n" + block("old\n")


def test_readme_without_markers_is_left_alone(tmp_path, monkeypatch):
    rt = _load("results_tables")
    results = _fake_tree(tmp_path, monkeypatch, rt, "# no markers\n")
    shutil.copytree(results / "state", results / "quickstart")
    meta = json.load(open(results / "quickstart" / "meta.json"))
    (results / "quickstart" / "meta.json").write_text(json.dumps(meta | {"renderer": "state"}))
    assert rt.main([]) == 0
    assert (tmp_path / "README.md").read_text() == "# no markers\n"


def test_import_trims_and_writes_meta(tmp_path, monkeypatch):
    if _run("git", "rev-parse", "--verify", "HEAD").returncode != 0:
        pytest.skip("not a git checkout (--import records a commit of this repository)")
    rt = _load("results_tables")
    results = _fake_tree(tmp_path, monkeypatch, rt, None)
    run = tmp_path / "run"
    run.mkdir()
    res = json.load(open(results / "state" / "results.json")) | {"per_seed": {"0": {"rows": list(range(5000))}}}
    (run / "results.json").write_text(json.dumps(res))
    (run / "state.png").write_bytes(b"\x89PNG")
    code = rt.main(["--import", str(run), "--name", "again", "--command", "fullband experiment state --seeds 0",
                    "--commit", "HEAD"])
    assert code == 0
    kept = json.load(open(results / "again" / "results.json"))
    assert "per_seed" not in kept and kept["table"] == res["table"]
    meta = json.load(open(results / "again" / "meta.json"))
    assert meta["renderer"] == "state" and meta["seeds"] == res["seeds"] and len(meta["commit"]) == 40
    assert "src/fullband/experiments/state.py" in meta["sources"] and (results / "again" / "state.png").exists()
    # a results.json that records its provenance: --command / --commit default to it
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    res["provenance"] = {"command": ["fullband", "experiment", "state", "--out", "a b"], "git_commit": head,
                         "git_dirty": True, "date": "2026-12-02T01:00:00+00:00", "cpu": "Some CPU",
                         "cpu_capability": "AVX2"}
    (run / "results.json").write_text(json.dumps(res))
    assert rt.main(["--import", str(run), "--name", "prov"]) == 0
    meta = json.load(open(results / "prov" / "meta.json"))
    assert meta["command"] == "fullband experiment state --out 'a b'" and meta["commit"] == head
    assert meta["date"] == "2026-12-02T01:00:00+00:00" and "modified" in meta["commit_note"]
    assert meta["cpu"] == "Some CPU (AVX2)" and "; CPU Some CPU (AVX2); " in rt.provenance(meta)
    assert rt.main(["--import", str(run), "--name", "prov", "--cpu", "Other (AVX512)"]) == 0  # the flag wins
    assert json.load(open(results / "prov" / "meta.json"))["cpu"] == "Other (AVX512)"
    del res["provenance"]
    (run / "results.json").write_text(json.dumps(res))
    assert rt.main(["--import", str(run), "--name", "z"]) == 2 and not (results / "z").exists()
    # refused: one line, exit 2, nothing written
    assert rt.main(["--import", str(tmp_path / "nowhere"), "--name", "x", "--command", "c", "--commit", "HEAD"]) == 2
    assert rt.main(["--import", str(run), "--name", "y", "--command", "c", "--commit", "0" * 40]) == 2
    assert not (results / "x").exists() and not (results / "y").exists()


def test_staleness_unknown_keeps_the_committed_banner(monkeypatch):
    """Where git cannot say (an exported tree, a shallow clone without the run's commit), the committed page's banner
    is kept, so --check compares the tables; with no committed page the error stands."""
    rt = _load("results_tables")

    def no_history(meta):
        raise rt.Refused("git diff failed (bad object)")

    monkeypatch.setattr(rt, "changed_sources", no_history)
    assert rt.is_stale({}, "x STALE y") is True and rt.is_stale({}, "fresh") is False
    with pytest.raises(rt.Refused):
        rt.is_stale({})


# ---- (c) the STALE banner, on a throwaway git repository


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_bench_serve_sources_follow_the_served_model():
    """bench-serve's numbers come from the model and scheduler vLLM imports in its engine process, not from the
    benchmark's own import closure: its sources (and so its STALE banner) include them, never the serve command."""
    rt = _load("results_tables")
    sources = rt.default_sources(rt.RENDERERS["bench-serve"][1])
    assert {"src/fullband/serving/benchmark.py", "src/fullband/serving/vllm_model.py",
            "src/fullband/serving/scheduling.py", "src/fullband/serving/config.py",
            "src/fullband/model/modeling.py"} <= set(sources)
    assert "src/fullband/serving/commands.py" not in sources
    # the benchmark module alone does not reach the served model: the renderer's several modules are what does
    assert "src/fullband/serving/vllm_model.py" not in rt.default_sources("fullband.serving.benchmark")
    for name in rt.runs():
        meta = json.load(open(os.path.join(rt.RESULTS, name, "meta.json")))
        if meta["renderer"] == "bench-serve":
            assert "src/fullband/serving/vllm_model.py" in meta["sources"], name


def test_stale_banner_marks_a_changed_source_only(tmp_path, monkeypatch):
    rt = _load("results_tables")
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "producer.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("a\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "run")
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.setattr(rt, "ROOT", str(repo))
    res = json.load(open(os.path.join(ROOT, "docs", "results", "state", "results.json")))
    meta = {"command": "c", "commit": commit, "seeds": [0], "load_average": [1.0, 1.0], "threads": 1, "date": "d",
            "renderer": "state", "sources": ["src/producer.py", "src/added.py"]}
    assert "STALE" not in rt.render_page("x", res, meta)
    (repo / "notes.txt").write_text("b\n")  # a change elsewhere
    _git(repo, "commit", "-q", "-am", "elsewhere")
    assert "STALE" not in rt.render_page("x", res, meta)
    (repo / "src" / "producer.py").write_text("x = 2\n")  # uncommitted change of a source: marked already
    page = rt.render_page("x", res, meta)
    assert '!!! warning "STALE' in page and rt.changed_sources(meta) == ["src/producer.py"]
    _git(repo, "commit", "-q", "-am", "producer changed")
    assert rt.render_page("x", res, meta) == page  # the same once committed
    (repo / "src" / "producer.py").write_text("x = 1\n")
    _git(repo, "commit", "-q", "-am", "producer back")
    assert "STALE" not in rt.render_page("x", res, meta)
    (repo / "src" / "added.py").write_text("y = 1\n")  # a source the commit did not have, untracked
    assert "STALE" in rt.render_page("x", res, meta) and rt.changed_sources(meta) == ["src/added.py"]
    meta["commit"] = "f" * 40
    with pytest.raises(rt.Refused):
        rt.render_page("x", res, meta)


# ---- (d) the tutorial commands


def _commands(block: list[str]) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    out, cur = [], ""
    for line in block:
        s = line.rstrip()
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        out.append((cur + s).strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def program_and_subcommand(command: str) -> tuple[str, str | None]:
    """The program (after ``VAR=value`` assignments) and its first argument that is not an option."""
    try:
        words = shlex.split(command.split("|")[0])
    except ValueError:
        words = command.split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if "-m" in words[:-1]:  # `python -m X` / `torchrun ... -m X`: the module is the program (its options before)
        words = words[words.index("-m") + 1:]
    if not words:
        return "", None
    return words[0], next((w for w in words[1:] if not w.startswith("-")), None)


def tutorial_steps(path: str) -> list[tuple[int, str | None, str]]:
    """``(line, tiny command or None for a skip, the shown command)`` per tiny line of a guide page, in page order;
    a bash block without tiny lines, or a tiny command whose program / sub-command is none of its block's, fails
    with the page and the line."""
    lines = open(path, encoding="utf-8").read().splitlines()
    rel, steps, i = os.path.relpath(path, ROOT), [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*bash\b", lines[i])
        if not fence:
            i += 1
            continue
        start, marker = i + 1, fence.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(marker):
            j += 1
        shown = _commands(lines[i + 1:j])
        k = j + 1
        tinies = []
        while k < len(lines) and (m := TINY.match(lines[k].strip())):
            tinies.append((k + 1, m.group(1)))
            k += 1
        if not tinies:
            pytest.fail(f"{rel}:{start}: a bash block without a `<!-- tiny: ... -->` line after it")
        if not shown:
            pytest.fail(f"{rel}:{start}: an empty bash block")
        for n, (line, tiny) in enumerate(tinies):
            if re.match(r"^skip\s*:", tiny):
                if not tiny.split(":", 1)[1].strip():
                    pytest.fail(f"{rel}:{line}: `tiny: skip:` without a reason")
                steps.append((line, None, shown[0]))
                continue
            candidates = [shown[n]] if len(tinies) == len(shown) else shown
            if program_and_subcommand(tiny) not in [program_and_subcommand(c) for c in candidates]:
                pytest.fail(f"{rel}:{line}: tiny command {program_and_subcommand(tiny)} is not the program and "
                            f"sub-command of the block's command(s) {[program_and_subcommand(c) for c in candidates]}")
            steps.append((line, tiny, candidates[0]))
        i = k
    return steps


def test_tutorial_parser_catches_missing_and_mismatched_tiny_lines(tmp_path):
    good = tmp_path / "good.md"
    good.write_text("x\n```bash\nOMP_NUM_THREADS=1 fullband train \\\n  --steps 9\nfullband eval --model m\n```\n"
                    "<!-- tiny: fullband train --steps 1 -->\n<!-- tiny: fullband eval --model \"$TMP/m\" -->\n"
                    "```bash\ntorchrun x\n```\n<!-- tiny: skip: needs 2 GPUs -->\n```text\nnot run\n```\n"
                    "```bash\ntorchrun --nproc_per_node 8 -m fullband.cli train --steps 9\n```\n"
                    "<!-- tiny: torchrun --nproc_per_node 2 -m fullband.cli train --steps 1 -->\n")
    assert [(s[0], s[1]) for s in tutorial_steps(str(good))] == [
        (7, "fullband train --steps 1"), (8, 'fullband eval --model "$TMP/m"'), (12, None),
        (19, "torchrun --nproc_per_node 2 -m fullband.cli train --steps 1")]
    missing = tmp_path / "missing.md"
    missing.write_text("a\n\n```bash\nfullband train\n```\n\nprose\n")
    with pytest.raises(pytest.fail.Exception, match=r"missing.md:3: a bash block without"):
        tutorial_steps(str(missing))
    other = tmp_path / "other.md"
    other.write_text("```bash\nfullband train --steps 9\n```\n<!-- tiny: fullband eval --steps 1 -->\n")
    with pytest.raises(pytest.fail.Exception, match=r"other.md:4: tiny command"):
        tutorial_steps(str(other))


@pytest.mark.parametrize("page", GUIDES or [pytest.param(None, marks=pytest.mark.skip(reason="no docs/guides/*.md"))],
                         ids=lambda p: os.path.basename(p) if p else "none")
def test_tutorial_commands_run(page, tmp_path):
    steps = tutorial_steps(page)
    # no network in tests: the Hugging Face hub and datasets offline (lm-eval's tasks are shipped files)
    env = dict(os.environ, TMP=str(tmp_path), OMP_NUM_THREADS="1", NO_COLOR="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    ran = 0
    for line, tiny, _ in steps:
        if tiny is None:
            continue
        try:
            r = subprocess.run(tiny, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=TINY_TIMEOUT, executable="/bin/bash")
        except subprocess.TimeoutExpired:
            pytest.fail(f"{os.path.relpath(page, ROOT)}:{line}: timed out after {TINY_TIMEOUT}s: {tiny}")
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
            pytest.fail(f"{os.path.relpath(page, ROOT)}:{line}: exit {r.returncode}: {tiny}\n" + "\n".join(tail))
        ran += 1
    if not ran:
        pytest.skip(f"{os.path.basename(page)}: no command to run (no bash block, or every one `tiny: skip`)")


# ---- (e) the site


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip('mkdocs / mkdocstrings-python not installed (pip install -e ".[docs]")')
    r = _run(sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site"),
             env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


# ---- (f) the Python API page's examples


def test_python_api_examples_run(tmp_path, monkeypatch):
    """Every ``python`` block of docs/guides/python-api.md runs, in page order in one namespace, on a tiny Llama saved
    where the page says ``path/to/local/llama``; the names the page leaves to the reader (``input_ids``,
    ``training_args``, ``ds``) are given tiny values first, and the page's own checks are asserted after it ran."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from conftest import Rows

    page = open(os.path.join(ROOT, "docs", "guides", "python-api.md"), encoding="utf-8").read()
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    assert len(blocks) >= 3, "python-api.md lost its examples"
    torch.manual_seed(0)
    llama = str(tmp_path / "llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
                     ).save_pretrained(llama)
    ids = torch.randint(1, 64, (4, 12))
    monkeypatch.chdir(tmp_path)  # the page saves "fbt" into the working directory
    namespace = {"input_ids": ids[:1], "ds": Rows(ids),
                 "training_args": TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2,
                                                    per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                                    save_strategy="no", logging_steps=1)}
    for block in blocks:
        exec(compile(block.replace("path/to/local/llama", llama), "python-api.md", "exec"), namespace)
    assert namespace["out"].loss is not None and len(namespace["out"].pass_losses) == 2
    assert namespace["exact"].logits.shape[:2] == ids[:1].shape
    assert namespace["ids"].shape[1] == ids.shape[1] + 64  # generate(): the prompt + max_new_tokens (no EOS set)
    assert namespace["trainer"].state.global_step == 2


# ---- (d) several benchmark runs in one results file (docs/gen/collect_runs.py)


def test_collected_bench_train_runs_render_their_own_rows(tmp_path):
    """collect_runs runs each command (stdout: its JSON report), keeps them in order under their commands, and the
    bench-train renderer's summary row of a (preset, T) reads the exact-states case of that timed report (not the
    K = T + 1 case beside it) and the peak memory of the --memory report of the same shape; the benchmark modules
    count among the page's sources (an edit to them stamps the page STALE)."""
    cr, rt = _load("collect_runs"), _load("results_tables")
    base = "fullband bench train --json --threads 1 --preset micro --batch-size 2 --steps 1 --warmup 0 --exact 2"
    cmds = [f"{base} --seq-len 8 --exact-reference", f"{base} --seq-len 8 --memory",
            f"{base} --seq-len 12 --token-steps off,lean"]
    assert cr.main(["--out", str(tmp_path), *cmds]) == 0
    res = json.load(open(tmp_path / "results.json"))
    assert [e["command"] for e in res["reports"]] == cmds and res["seeds"] == [0] and res["threads"] == 1
    assert res["provenance"]["command"][0] == "python" and res["provenance"]["command"][-3:] == cmds
    timed, mem, short = (e["report"] for e in res["reports"])
    assert mem["memory"] and "step_s" not in mem["results"]["K1"] and short["seq_len"] == 12
    text = rt.RENDERERS["bench-train"][0](res)
    row = next(line for line in text.splitlines() if line.startswith("| micro | 8 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ex, ref = timed["results"]["exact_g2"], timed["results"]["KT1_g2"]
    assert cells[2:7] == ["auto", f"{ex['flops_vs_K1']:.2f}", f"{ref['flops_vs_K1']:.2f}", f"{ex['cpu_vs_K1']:.2f}",
                          f"{ref['cpu_vs_K1']:.2f}"]
    assert cells[7] == " / ".join(f"{mem['results'][k]['peak_step_bytes'] / 2**20:,.0f}" for k in ("K1", "K2", "exact_g2"))
    rows12 = [line for line in text.splitlines() if line.startswith("| micro | 12 |")]
    assert [r.split("|")[3].strip() for r in rows12] == ["off", "lean"]  # one row per way of running the token pass
    for r, step in zip(rows12, ("off", "lean")):
        assert "not run" in r and r.split("|")[8].strip() == "-"  # no K = T + 1 case, no memory report
        assert r.split("|")[6].strip() == f"{short['results']['exact_g2_' + step]['cpu_vs_K1']:.2f}"
    assert all(f"`{c}`" in text for c in cmds)
    assert "src/fullband/commands/bench_train.py" in rt.default_sources(rt.RENDERERS["bench-train"][1])
    assert "src/fullband/commands/bench_decode.py" in rt.default_sources(rt.RENDERERS["bench-decode"][1])
    assert "src/fullband/serving/benchmark.py" not in rt.default_sources(rt.RENDERERS["bench-decode"][1])


def test_collect_runs_refuses_and_writes_nothing(tmp_path, capsys):
    """A command that prints no JSON (--json left out), or one that fails, stops the collection with a one-line error (exit 2) naming
    the command, and no results.json is written (not even the reports of the commands before it)."""
    cr = _load("collect_runs")
    ok = "fullband bench train --json --threads 1 --preset micro --batch-size 2 --seq-len 4 --steps 1 --warmup 0"
    assert cr.main(["--out", str(tmp_path), ok.replace(" --json", "")]) == 2
    assert "command 1 printed no JSON report (its --json option missing?)" in capsys.readouterr().err
    assert cr.main(["--out", str(tmp_path), ok, f"{ok} --loss-chunk -1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]  # less progress lines
    assert len(err) == 1 and "command 2 exited 2" in err[0] and "--loss-chunk" in err[0], err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("recipe", ["exact", "default"])
def test_pretrained_reasoning_runs_are_the_command_s_own(recipe, tmp_path):
    """pretrain_reasoning trains a reasoning command's runs in 2 processes (each run on its own for the exact recipe,
    the baseline/FBT/baseline-flops trio as one job where they share steps); the command then retrains nothing
    (train_seconds 0) and gives the results.json that the command alone gives in a fresh directory, bit for bit
    (less timings and provenance), both at 1 thread."""
    argv = ["--quick", "--fbt-recipe", recipe, "--no-progress", "--quiet", "--out", "exp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for where, pre in (("a", True), ("b", False)):
        os.makedirs(tmp_path / where)
        if pre:
            done = subprocess.run([sys.executable, os.path.join(GEN, "pretrain_reasoning.py"), "--jobs", "2", "--",
                                   *argv], cwd=tmp_path / where, capture_output=True, text=True, env=env)
            assert done.returncode == 0, done.stderr
            assert "jobs on 2 processes" in done.stdout and done.stdout.count(": done (") == (
                12 if recipe == "exact" else 8), done.stdout
        done = subprocess.run([sys.executable, "-m", "fullband.cli", "experiment", "reasoning", *argv],
                              cwd=tmp_path / where, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        results.append(json.load(open(tmp_path / where / "exp" / "results.json")))
    assert results[0]["train_seconds"] == 0.0 and results[1]["train_seconds"] > 0
    assert first_difference(*results) is None, first_difference(*results)


def test_gathered_state_probes_render_each_probe_s_own_numbers(tmp_path, capsys):
    """collect_runs --results gathers finished one-arm state probes (nothing run), each cut to --keep, its command
    from its own provenance; the state-probes renderer prints, per probe and task, that probe's exact-mode
    per-position accuracy at every length, with its LR and curriculum. A run without provenance, or one lacking a
    kept key, is refused in one line and nothing is written."""
    cr, rt = _load("collect_runs"), _load("results_tables")
    runs = []
    for name, extra in (("a", []), ("b", ["--lr", "5e-4", "--length-curriculum", "0.5", "--curriculum-start", "4"])):
        out = tmp_path / name
        done = _run(sys.executable, "-m", "fullband.cli", "experiment", "state", "--quick", "--arms", "fbt-L-glu-x2",
                    "--tasks", "parity,s3", "--no-cost", "--seeds", "0", *extra, "--out", str(out),
                    env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=TINY_TIMEOUT)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.load(open(out / "results.json")))
    gathered = tmp_path / "gathered"
    keep = "settings,table,arms,seeds,provenance"
    assert cr.main(["--out", str(gathered), "--keep", keep, "--results", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    res = json.load(open(gathered / "results.json"))
    assert [sorted(e["report"]) for e in res["reports"]] == [sorted(keep.split(","))] * 2
    assert all(e["command"] == shlex.join(r["provenance"]["command"]) for e, r in zip(res["reports"], runs))
    text = rt.RENDERERS["state-probes"][0](res)
    lines = [line for line in text.splitlines() if line.startswith("| fbt-L-glu-x2 |")]
    assert len(lines) == 4  # 2 probes x 2 tasks, in the probes' order
    for line, (run, task) in zip(lines, [(runs[0], "parity"), (runs[0], "s3"), (runs[1], "parity"), (runs[1], "s3")]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        lengths = run["settings"]["lengths"]
        want = {r["length"]: r["pos"]["estimate"] for r in run["table"]
                if r["arm"] == "fbt-L-glu-x2" and r["task"] == task and r["mode"] == "exact"}
        assert cells[6:8] == [task, "exact"] and cells[8:] == [f"{want[n]:.2f}" for n in lengths]
        assert cells[1] == f"{run['settings']['lr']:g}"
    assert "| none |" in lines[0] and f"4 -> {runs[1]['settings']['length']} over the first 0.5" in lines[2]
    # refusals: a key the run lacks; a results.json without provenance -- one line each, nothing written
    bad = tmp_path / "bad"
    assert cr.main(["--out", str(bad), "--keep", "settings,nope", "--results", str(tmp_path / "a")]) == 2
    assert "no nope in its results.json" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "results.json").write_text(json.dumps({"settings": {}}))
    assert cr.main(["--out", str(bad), "--keep", "settings", "--results", str(bare)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no provenance command" in err[0]
    assert not bad.exists()


# ---- (e) experiment pages: every result table generated

# tables on an experiment page that hold no measured numbers (what an arm is), by their header row
DESCRIPTIVE_TABLES = {"| arm | what | equal-token reference | equal-FLOPs reference |"}


def test_experiment_pages_hold_no_hand_copied_result_tables():
    """Every table of measured numbers on an experiment page comes in through a generated page (``--8<--
    "results/generated/NAME.md"``, rendered from docs/results/NAME/results.json by docs/gen/results_tables.py) or a
    generated ``runs-table`` block (one line per run, from the same files); a
    Markdown table written into the page itself is allowed only where it describes, with no numbers
    (DESCRIPTIVE_TABLES)."""
    found = []
    rt = _load("results_tables")
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "experiments", "*.md"))):
        text = rt.RUNS_BLOCK.sub("", open(path, encoding="utf-8").read())  # generated runs tables: allowed
        lines = text.splitlines()
        for i, line in enumerate(lines):
            starts = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            if starts and line.strip() not in DESCRIPTIVE_TABLES:
                found.append(f"{os.path.relpath(path, ROOT)}:{i + 1}: {line[:80]}")
        for include in re.findall(r'^\s*--8<-- "results/generated/([\w.-]+)\.md"', "\n".join(lines), re.M):
            assert os.path.isfile(os.path.join(ROOT, "docs", "results", include, "results.json")), include
    assert not found, "hand-written tables on experiment pages:\n" + "\n".join(found)


INTERVAL = re.compile(r"([−+-]?\d+(?:\.\d+)?)\s*\|?\s*,?\s*(?:95% CI\s*)?\[([−+-]?\d+(?:\.\d+)?)[x×]?,\s*([−+-]?\d+(?:\.\d+)?)[x×]?\]")
GENERATED_LINK = re.compile(r"results/generated/([\w.-]+)\.md")


def _figures_with_intervals(text: str) -> list[tuple[str, list[str], set[str]]]:
    """``(paragraph start, the interval's numbers, the generated pages the paragraph names)`` for every
    ``x [low, high]`` in ``text`` (paragraphs: blocks between blank lines; a table row is its own paragraph)."""
    out = []
    for para in re.split(r"\n\s*\n|\n(?=\|)", text):
        names = set(GENERATED_LINK.findall(para))
        for m in INTERVAL.finditer(para):
            out.append((para.strip()[:70], [g.replace("−", "-") for g in m.groups()], names))
    return out


def test_guides_and_readme_back_every_interval_with_a_generated_page():
    """A figure with an interval in the README or a guide sits in a generated block (the README's quickstart and
    runs-table blocks) or in a paragraph that names the generated page it comes from
    (``docs/results/generated/NAME.md``, rendered from a committed results.json), and that page prints the same
    numbers: a figure from a run whose files were not kept has no page to name, so it cannot stand there."""
    rt = _load("results_tables")
    paths = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))]
    bad = []
    for path in paths:
        text = open(path, encoding="utf-8").read()
        text = rt.RUNS_BLOCK.sub("", text)
        if rt.START in text:
            text = text[:text.index(rt.START)] + text[text.index(rt.END):]
        for where, numbers, names in _figures_with_intervals(text):
            pages = [n for n in names if os.path.isfile(os.path.join(ROOT, "docs", "results", n, "results.json"))]
            printed = " ".join(open(os.path.join(ROOT, "docs", "results", "generated", f"{n}.md"),
                                    encoding="utf-8").read() for n in pages)
            if not pages or any(x.lstrip("+") not in printed for x in numbers):
                bad.append(f"{os.path.relpath(path, ROOT)}: {numbers} in '{where}' (pages named: {sorted(names)})")
    assert not bad, "intervals with no generated page behind them:\n" + "\n".join(bad)


def test_the_interval_check_finds_what_it_should():
    """The check above on made-up text: an interval whose paragraph names no page, or a page that does not print
    it, is found; one in a paragraph naming its page is parsed with the page's name."""
    found = _figures_with_intervals("gain 7.21, 95% CI [5.47, 9.61] (serve guide)\n\nΔ −0.013 [−0.020, −0.007] "
                                    "([page](docs/results/generated/quickstart.md))\n| 0.981 | [0.969, 1.009] |")
    assert [(n, sorted(p)) for _, n, p in found] == [(["7.21", "5.47", "9.61"], []),
                                                    (["-0.013", "-0.020", "-0.007"], ["quickstart"]),
                                                    (["0.981", "0.969", "1.009"], [])]
