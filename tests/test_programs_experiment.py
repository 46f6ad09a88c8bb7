"""``fullband experiment programs`` (the Feedback Transformer's algorithmic task) end to end at its quick size: every
number of its tables recomputed here from the per-program results and the saved models' shapes (not through the
package's statistics or FLOP helpers), the held-out check (a test program slipped into training is refused),
run reuse across invocations and seeds, and the one-line refusals of bad options."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
from safetensors import safe_open

from fullband import cli
from fullband.eval.program_tasks import Program
from fullband.experiments import programs
from fullband.training import pretrain
from fullband.utils.provenance import first_difference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["experiment", "programs", "--quick"]
FBT_MODES = ["standard", "K=2", "exact", "soft", "fused"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def load(out) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def table(text: str, header: str) -> list[list[str]]:
    """The body rows (cells) of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def acc(rows: list[list[int]]) -> float:
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)


def mtimes(out) -> dict:
    return {p: os.path.getmtime(os.path.join(out, p, "model.safetensors"))
            for p in (os.path.join(s, "runs", a) for s in os.listdir(out) if s.startswith("seed")
                      for a in os.listdir(os.path.join(out, s, "runs")))}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("programs") / "exp")
    code, stdout, err = run([*QUICK, "--out", out, "--json"])
    assert code == 0, err
    return out, json.loads(stdout)


# ---------------------------------------------------------------------------------------------- shapes by hand


def shapes(run_dir: str) -> dict:
    """N (matrix weights of the backbone but the untied input embedding), N_head, N_fusion, L, d from the tensors
    saved in the run's model.safetensors (names and shapes only)."""
    n = {"N": 0, "N_head": 0, "N_fusion": 0, "L": 0, "d": 0}
    with safe_open(os.path.join(run_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            size = math.prod(f.get_slice(k).get_shape())
            if k.startswith("feedback."):
                n["N_fusion"] += size
            elif not k.endswith("embed_tokens.weight"):
                n["N"] += size
            if k.endswith("lm_head.weight"):
                n["N_head"], n["d"] = size, f.get_slice(k).get_shape()[1]
            m = re.search(r"layers\.(\d+)\.", k)
            if m:
                n["L"] = max(n["L"], int(m.group(1)) + 1)
    return n


def hand_flops(run_dir: str) -> tuple[float, dict]:
    """Training FLOPs of a finished run by hand: per token of batch x seq_len, a pass with gradient 6N + 6LTd (+ 6
    N_fusion when fused); the exact-states pass (no gradient, no LM head, fused) 2(N - N_head) + 2LTd + 2 N_fusion,
    then 2 fused gradient passes."""
    with open(os.path.join(run_dir, "run_config.json")) as f:
        cfg = json.load(f)
    s = shapes(run_dir)
    T, B = cfg["seq_len"], cfg["batch_size"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = sum(1 for line in f if json.loads(line).get("split", "train") == "train")
    grad = 6 * s["N"] + 6 * s["L"] * T * s["d"]
    if cfg["exact_states"]:
        per_token = 2 * (s["N"] - s["N_head"]) + 2 * s["L"] * T * s["d"] + 2 * s["N_fusion"] \
            + 2 * (grad + 6 * s["N_fusion"])
    else:
        assert cfg["num_passes"] == 1
        per_token = grad
    return steps * B * T * per_token, dict(s, T=T, B=B, steps=steps)


# ---------------------------------------------------------------------------------------------- end to end


def test_quick_run_tables_recomputed_from_the_programs(quick):
    out, printed = quick
    res = load(out)
    assert printed["arms"] == list(programs.DEFAULT_ARMS) and "per_seed" not in printed
    per = res["per_seed"]["0"]
    for arm in res["arms"]:
        assert list(per[arm]["correct"]) == (FBT_MODES if arm.startswith("fbt") else ["standard"])
    lengths = res["settings"]["test_statements"]
    assert lengths == [6, 12] and res["settings"]["statements"] == 6
    report = open(os.path.join(out, "report.md")).read()

    # accuracy: correct printed values / printed values, from the per-program lists
    rows = table(report, "| arm | mode | N=6 (trained) | N=12 |")
    assert [(r[0], r[1]) for r in rows] == [(a, m) for a in res["arms"] for m in per[a]["correct"]]
    for arm, mode, *cells, _ in rows:
        for n, cell in zip(lengths, cells):
            progs = per[arm]["correct"][mode][str(n)]
            assert len(progs) == res["settings"]["test_rows"] and all(progs)
            a = acc(progs)
            assert cell.split()[0] == f"{a:.2f}", (arm, mode, n)
            low, high = map(float, re.search(r"\[(\S+), (\S+)\]", cell).groups())
            assert low <= float(f"{a:.2f}") + 0.005 and high >= float(f"{a:.2f}") - 0.005

    # every mode scores every printed value: the prompt (opening assignments) ends before the first print
    for n in lengths:
        counts = {m: [len(p) for p in per["fbt-L-glu-x2"]["correct"][m][str(n)]] for m in FBT_MODES}
        assert len({tuple(c) for c in counts.values()}) == 1
        with open(os.path.join(out, "seed0", "data", "test.jsonl" if n == 6 else f"test-{n}.jsonl")) as f:
            targets = [sum(t != "_" for t in json.loads(line)["target"].split()) for line in f]
        assert counts["exact"] == targets

    # paired differences: FBT (each mode) minus each plain arm and both controls, on the same programs
    plain = [a for a in res["arms"] if not a.startswith("fbt")]
    deltas = table(report, "| arm | mode | vs | N=6 | N=12 |")
    assert [(r[1], r[2]) for r in deltas] == [(m, p) for m in FBT_MODES for p in plain]
    for arm, mode, vs, *cells in deltas:
        for n, cell in zip(lengths, cells):
            d = acc(per[arm]["correct"][mode][str(n)]) - acc(per[vs]["correct"]["standard"][str(n)])
            assert cell.split()[0] == f"{d:+.2f}", (mode, vs, n)

    # training FLOPs by hand; the equal-FLOPs controls' steps from them
    runs_dir = os.path.join(out, "seed0", "runs")
    flops = {a: hand_flops(os.path.join(runs_dir, a)) for a in res["arms"]}
    fbt, plain_step = flops["fbt-L-glu-x2"], flops["baseline-L"]
    p = plain_step[1]
    per_step = p["B"] * p["T"] * (6 * p["N"] + 6 * p["L"] * p["T"] * p["d"])
    matched = max(res["settings"]["steps"], math.ceil(fbt[0] / per_step))
    assert matched > res["settings"]["steps"]
    for control in ("baseline-L-flops", "baseline-L-epochs"):
        assert flops[control][1]["steps"] == matched == res["runs"][control]["steps"]
    with open(os.path.join(runs_dir, "baseline-L-epochs", "run_config.json")) as f:
        assert json.load(f)["unique_batches"] == res["settings"]["steps"]
    k = fbt[1]["T"] - 1  # K = T + 1 for rows of T = seq_len - 2 inputs, every pass with gradient, K - 1 fused
    k_flops = fbt[1]["steps"] * fbt[1]["B"] * fbt[1]["T"] * (
        k * (6 * fbt[1]["N"] + 6 * fbt[1]["L"] * fbt[1]["T"] * fbt[1]["d"]) + (k - 1) * 6 * fbt[1]["N_fusion"])
    cost = {r[0]: r for r in table(report, "| arm | layers | parameters | steps |")}
    for arm in res["arms"]:
        assert cost[arm][6] == f"{flops[arm][0] / plain_step[0]:.2f}x", arm
        assert res["runs"][arm]["train_flops"] == pytest.approx(flops[arm][0], rel=1e-9)
        assert int(cost[arm][3].replace(",", "")) == flops[arm][1]["steps"]
    assert cost["fbt-L-glu-x2"][7] == f"{k_flops / plain_step[0]:.2f}x"

    # inference FLOPs by hand (standard: body + head at every position + causal attention; exact: + T - 1 fusions)
    def standard(s, T):
        return T * 2 * (s["N"] - s["N_head"]) + T * 2 * s["N_head"] + T * (T + 1) / 2 * 4 * s["L"] * s["d"]

    for n in lengths:
        with open(os.path.join(out, "seed0", "data", "test.jsonl" if n == 6 else f"test-{n}.jsonl")) as f:
            lens = [len(json.loads(line)["input"].split()) + 2 for line in f]
        T = round(sum(lens) / len(lens))
        ref = standard(plain_step[1], T)
        for arm in ("baseline-2L", "baseline-4L"):
            assert res["runs"][arm]["inference_flops"]["standard"][str(n)] == pytest.approx(
                standard(flops[arm][1], T) / ref, rel=1e-12)
        assert res["runs"]["fbt-L-glu-x2"]["inference_flops"]["exact"][str(n)] == pytest.approx(
            (standard(fbt[1], T) + (T - 1) * 2 * fbt[1]["N_fusion"]) / ref, rel=1e-12)

    # held out: every training program of every arm checked, the fresh ones included
    checked = res["held_out"]["0"]
    rows_per = res["settings"]["rows"]
    assert rows_per == res["settings"]["steps"] * res["settings"]["batch_size"]
    for arm in res["arms"]:
        want = math.ceil(rows_per * matched / res["settings"]["steps"]) if arm == "baseline-L-flops" else rows_per
        assert checked[arm]["training_rows_checked"] == want == res["runs"][arm]["rows"], arm
        assert checked[arm]["test_programs"] == 2 * res["settings"]["test_rows"]

    # the goal line from the numbers above
    at_n = {(a, m): acc(per[a]["correct"][m]["6"]) for a in res["arms"] for m in per[a]["correct"]}
    met = (at_n[("fbt-L-glu-x2", "exact")] >= 0.99 and all(at_n[(p, "standard")] <= 0.5 for p in plain)
           and fbt[0] / plain_step[0] <= 3)
    assert f"**{'met' if met else 'not met'}**" in report.split("**Goal**")[1]


def test_quick_run_trains_on_make_programs_files(quick, tmp_path):
    """Seed 0's training programs are ``fullband data make-programs``'s train.jsonl of the same options and seed (the
    run's data fingerprint), its test programs at N that command's test.jsonl."""
    out, _ = quick
    s = load(out)["settings"]
    code, _, err = run(["data", "make-programs", "--vars", "3", "--statements", str(s["statements"]), "--rows",
                        str(s["rows"]), "--test-rows", str(s["test_rows"]), "--seed", "0", "--out", str(tmp_path)])
    assert code == 0, err
    assert (tmp_path / "test.jsonl").read_text() == open(os.path.join(out, "seed0", "data", "test.jsonl")).read()
    progs = []
    for line in (tmp_path / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        progs.append(Program(tuple(r["input"].split()), tuple(None if t == "_" else t for t in r["target"].split())))
    data = programs.program_data(progs, programs.program_tokenizer(3), "make-programs")
    with open(os.path.join(out, "seed0", "runs", "baseline-L", "summary.json")) as f:
        assert json.load(f)["data_sha256"] == data.fingerprint


def test_second_invocation_reuses_and_more_seeds_train_only_the_new(quick, tmp_path):
    out, _ = quick
    before, first = mtimes(out), load(out)
    code, _, err = run([*QUICK, "--out", out])
    assert code == 0, err
    assert "training" not in err and mtimes(out) == before
    assert first_difference(first, load(out)) is None

    code, stdout, err = run([*QUICK, "--out", out, "--seeds", "0,1"])
    assert code == 0, err
    trained = re.findall(r"programs: training (\S+)", err)
    assert sorted(trained) == sorted(programs.DEFAULT_ARMS)  # once each: seed 1's
    after = mtimes(out)
    assert {p: t for p, t in after.items() if p.startswith("seed0")} == before
    assert {p.split(os.sep)[0] for p in after} == {"seed0", "seed1"}
    res = load(out)
    assert res["seeds"] == [0, 1]
    assert first_difference(first["per_seed"]["0"], res["per_seed"]["0"]) is None
    rows = table(stdout, "| arm | mode | N=6 (trained) | N=12 |")
    for arm, mode, *cells, _ in rows:  # the mean over seeds and the per-seed range
        for n, cell in zip(res["settings"]["test_statements"], cells):
            accs = [acc(res["per_seed"][s][arm]["correct"][mode][str(n)]) for s in ("0", "1")]
            assert cell.split()[0] == f"{sum(accs) / 2:.2f}"
            assert cell.endswith(f"{{{min(accs):.2f}..{max(accs):.2f}}}")
    # a two-level interval: the seeds, then the programs within each drawn seed, said so, with the 2-seed caveat
    assert {(r["accuracy"]["resamples"], r["accuracy"]["seeds"]) for r in res["table"]} == {
        ("seeds, then rows within each drawn seed", 2)}
    assert ("mean of 2 seeds; the 95% CI resamples the seeds, then the test programs within each drawn seed (with 2 "
            "seeds it cannot hold the seed variance)") in stdout


def test_the_docs_renderer_reads_the_trimmed_results(quick):
    """``docs/gen/results_tables.py``'s ``programs`` renderer: the tables from results.json without its per-program
    lists (what an import commits), the same text the run wrote; the run's sources include this experiment's
    modules and what trains and scores it."""
    out, _ = quick
    spec = importlib.util.spec_from_file_location("docs_gen_results_tables",
                                                  os.path.join(ROOT, "docs", "gen", "results_tables.py"))
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    render, module, trimmed = rt.RENDERERS["programs"]
    text = render(rt.trim(load(out), trimmed))
    assert "per_seed" in trimmed and text in open(os.path.join(out, "report.md")).read()
    sources = rt.default_sources(module)
    for path in ("experiments/programs.py", "experiments/programs_report.py", "experiments/synthetic.py",
                 "training/labelled.py", "eval/labelled.py", "eval/program_tasks.py"):
        assert f"src/fullband/{path}" in sources
    assert not any("state" in p for p in sources)  # the state experiment's edits do not stale this page


# ---------------------------------------------------------------------------------------------- refusals


def test_a_test_program_in_training_is_refused(monkeypatch, tmp_path):
    real = programs.draw_programs

    def leaky(seed, split, count, num_vars, statements, exclude=frozenset(), grammar="published"):
        drawn = real(seed, split, count, num_vars, statements, exclude, grammar)
        if split == "train":
            drawn[3] = real(seed, "test", 1, num_vars, statements, grammar=grammar)[0]
        return drawn

    monkeypatch.setattr(programs, "draw_programs", leaky)
    out = tmp_path / "exp"
    code, _, err = run([*QUICK, "--out", str(out)])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "1 of its 48 training programs are test programs" in err and not out.exists()


def test_a_test_program_among_the_fresh_ones_is_refused_before_scoring(monkeypatch, tmp_path):
    real = programs.draw_programs

    def leaky(seed, split, count, num_vars, statements, exclude=frozenset(), grammar="published"):
        drawn = real(seed, split, count, num_vars, statements, exclude, grammar)
        if split == "fresh":
            drawn[-1] = real(seed, "test-12", 1, num_vars, 12, grammar=grammar)[0]
        return drawn

    monkeypatch.setattr(programs, "draw_programs", leaky)
    out = tmp_path / "exp"
    code, _, err = run([*QUICK, "--out", str(out), "--arms", "baseline-L,fbt-L-glu-x2,baseline-L-flops"])
    assert code == 2 and "error: the fresh programs: 1 of its" in err.strip().splitlines()[-1]
    assert not (out / "results.json").exists() and not (out / "seed0" / "runs" / "baseline-L-flops").exists()


def test_held_out_check_reads_the_rows_themselves(tmp_path):
    """:meth:`SeedData.check` (before an arm is scored) decodes the corpus it is given, whatever built it."""
    ns = dict(programs.DEFAULTS | programs.QUICK, out=str(tmp_path), seed=0, rows=48, test_lengths=[6, 12])
    data = programs.SeedData(argparse.Namespace(**ns), programs.program_tokenizer(3))
    leak = programs.program_data([*programs.draw_programs(5, "x", 4, 3, 6), data.tests[12][2]],
                                 programs.program_tokenizer(3), "a corpus")
    with pytest.raises(ValueError, match="^baseline-L: 1 of its 5 training programs are test programs"):
        data.check(leak, "baseline-L")
    assert data.check(data.train, "baseline-L") == 48 and not os.listdir(tmp_path)


@pytest.mark.parametrize("extra, message", [
    (["--vars", "6"], "--vars must be in 1..5"),
    (["--test-statements", "6,600"], "past the backbones' 2048 positions"),
    (["--test-statements", "12"], "the training length --statements 6 must be among them"),
    (["--test-statements", "6,1"], "--test-statements needs distinct integers >= 2"),
    (["--grammar", "fullband", "--test-statements", "6,3"], "--test-statements needs distinct integers >= 4"),
    (["--test-statements", "6,x"], "--test-statements takes comma-separated integers"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["--hidden", "36", "--heads", "5"], "times an even head width"),
    (["--hidden", "30", "--heads", "2"], "times an even head width"),
    (["--arms", "baseline-L,baseline-L-flops"], "needs an FBT arm"),
    (["--arms", "nope"], "unknown arm"),
    (["--seeds", "0,0"], "--seeds needs distinct integers >= 0"),
    (["--seeds", "a"], "--seeds takes comma-separated integers"),
    (["--seeds", "0", "--seed", "1"], "give --seeds or --seed"),
])
def test_bad_options_one_line_exit_2_nothing_written(extra, message, tmp_path):
    out = tmp_path / "exp"
    code, stdout, err = run([*QUICK, "--out", str(out), *extra])
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_a_killed_run_continues_bit_for_bit_when_the_same_command_runs_again(tmp_path, monkeypatch):
    """A process killed mid-run (SIGKILL at step 3 of the first arm, the exact-states FBT arm, with a checkpoint every
    2 steps), then the same command again: it continues from step 2 and every arm's weights and every program's
    result equal those of a run that was never interrupted."""
    base = [*QUICK, "--arms", "fbt-L-glu-x2,baseline-L", "--save-every", "2", "--seeds", "0"]
    clean, killed = str(tmp_path / "clean"), str(tmp_path / "killed")
    code, _, err = run([*base, "--out", clean])
    assert code == 0, err
    p = subprocess.run([sys.executable, "-m", "fullband.cli", *base, "--out", killed, "--debug-kill-at-step", "3"],
                       env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    fbt = os.path.join(killed, "seed0", "runs", "fbt-L-glu-x2")
    assert os.path.isdir(os.path.join(fbt, "checkpoints")) and not os.path.exists(os.path.join(fbt, "summary.json"))
    real, calls = pretrain.run, []
    monkeypatch.setattr(pretrain, "run", lambda recipe, resume=False, overwrite=False: calls.append(
        (recipe.name, resume)) or real(recipe, resume=resume, overwrite=overwrite))
    code, _, err = run([*base, "--out", killed])
    assert code == 0, err
    assert calls == [("fbt-L-glu-x2", True), ("baseline-L", False)]  # continued, not started over
    for arm in ("fbt-L-glu-x2", "baseline-L"):
        a, b = (os.path.join(d, "seed0", "runs", arm) for d in (clean, killed))
        assert open(os.path.join(a, "model.safetensors"), "rb").read() == open(os.path.join(b, "model.safetensors"),
                                                                                "rb").read()
        losses = [[(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))
                   if r.get("split") == "train"] for d in (a, b)]
        assert losses[0] == losses[1] and len(losses[0]) == 6
    for arm in ("fbt-L-glu-x2", "baseline-L"):
        assert load(clean)["per_seed"]["0"][arm]["correct"] == load(killed)["per_seed"]["0"][arm]["correct"]
