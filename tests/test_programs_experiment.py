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
import torch
from safetensors import safe_open

from fullband import cli
from fullband.eval.program_tasks import Program
from fullband.data.labelled import IGNORE
from fullband.eval.labelled import read_test_rows
from fullband.eval.scoring import load_any_model
from fullband.experiments import programs, programs_data
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
        assert checked[arm]["validation_programs"] == res["settings"]["val_rows"]

    # the goal line from the numbers above
    at_n = {(a, m): acc(per[a]["correct"][m]["6"]) for a in res["arms"] for m in per[a]["correct"]}
    met = (at_n[("fbt-L-glu-x2", "exact")] >= 0.99 and all(at_n[(p, "standard")] <= 0.5 for p in plain)
           and fbt[0] / plain_step[0] <= 3)
    assert f"**{'met' if met else 'not met'}**" in report.split("**Goal**")[1]


def test_quick_run_trains_on_make_programs_files(quick, tmp_path):
    """Seed 0's training and validation programs are ``fullband data make-programs``'s train.jsonl and val.jsonl of
    the same options and seed (the run's data fingerprint), its test programs at N that command's test.jsonl."""
    out, _ = quick
    s = load(out)["settings"]
    code, _, err = run(["data", "make-programs", "--vars", "3", "--statements", str(s["statements"]), "--rows",
                        str(s["rows"]), "--val-rows", str(s["val_rows"]), "--test-rows", str(s["test_rows"]),
                        "--seed", "0", "--out", str(tmp_path)])
    assert code == 0, err
    for name in ("test.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_text() == open(os.path.join(out, "seed0", "data", name)).read()

    def read(name):
        return [Program(tuple(r["input"].split()), tuple(None if t == "_" else t for t in r["target"].split()))
                for r in map(json.loads, (tmp_path / name).read_text().splitlines())]

    data = programs_data.program_data(read("train.jsonl"), programs_data.program_tokenizer(3), "make-programs",
                                      val=read("val.jsonl"))
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


@pytest.mark.parametrize("held", ["test", "val"])
def test_a_test_or_validation_program_in_training_is_refused(monkeypatch, tmp_path, held):
    real = programs_data.draw_programs

    def leaky(seed, split, count, num_vars, statements, exclude=frozenset(), grammar="published"):
        drawn = real(seed, split, count, num_vars, statements, exclude, grammar)
        if split == "train":
            drawn[3] = real(seed, held, 1, num_vars, statements, grammar=grammar)[0]
        return drawn

    monkeypatch.setattr(programs_data, "draw_programs", leaky)
    out = tmp_path / "exp"
    code, _, err = run([*QUICK, "--out", str(out)])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "1 of its 48 training programs are test or validation programs" in err and not out.exists()


def test_a_validation_program_that_is_a_test_program_is_refused(monkeypatch, tmp_path):
    real = programs_data.draw_programs

    def leaky(seed, split, count, num_vars, statements, exclude=frozenset(), grammar="published"):
        drawn = real(seed, split, count, num_vars, statements, exclude, grammar)
        if split == "val":
            drawn[0] = real(seed, "test", 1, num_vars, statements, grammar=grammar)[0]
        return drawn

    monkeypatch.setattr(programs_data, "draw_programs", leaky)
    out = tmp_path / "exp"
    code, _, err = run([*QUICK, "--out", str(out)])
    assert code == 2 and "a validation program is a test program" in err and not out.exists()


def test_a_test_program_among_the_fresh_ones_is_refused_before_scoring(monkeypatch, tmp_path):
    real = programs_data.draw_programs

    def leaky(seed, split, count, num_vars, statements, exclude=frozenset(), grammar="published"):
        drawn = real(seed, split, count, num_vars, statements, exclude, grammar)
        if split == "fresh":
            drawn[-1] = real(seed, "test-12", 1, num_vars, 12, grammar=grammar)[0]
        return drawn

    monkeypatch.setattr(programs_data, "draw_programs", leaky)
    out = tmp_path / "exp"
    code, _, err = run([*QUICK, "--out", str(out), "--arms", "baseline-L,fbt-L-glu-x2,baseline-L-flops"])
    assert code == 2 and "error: the fresh programs: 1 of its" in err.strip().splitlines()[-1]
    assert not (out / "results.json").exists() and not (out / "seed0" / "runs" / "baseline-L-flops").exists()


def test_held_out_check_reads_the_rows_themselves(tmp_path):
    """:meth:`SeedData.check` (before an arm is scored) decodes the corpus it is given, whatever built it."""
    ns = dict(programs.DEFAULTS | programs.QUICK, out=str(tmp_path), seed=0, rows=48, test_lengths=[6, 12])
    data = programs_data.SeedData(argparse.Namespace(**ns), programs_data.program_tokenizer(3))
    for held in (data.tests[12][2], data.val[1]):
        leak = programs_data.program_data([*programs_data.draw_programs(5, "x", 4, 3, 6), held],
                                          programs_data.program_tokenizer(3), "a corpus")
        with pytest.raises(ValueError, match="^baseline-L: 1 of its 5 training programs are test or validation"):
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
    (["--lrs", "1e-3,x"], "--lrs takes comma-separated numbers"),
    (["--lrs", "1e-3,1e-3"], "--lrs needs distinct numbers > 0"),
    (["--lrs", "0,1e-3"], "--lrs needs distinct numbers > 0"),
    (["--lrs", "1e-3,2e-3", "--val-rows", "0"], "--val-rows must be >= 1"),
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


# ---------------------------------------------------------------------------------------------- validation, LRs


def by_hand_held_out_loss(run_dir: str, rows: list[dict]) -> float:
    """Mean NLL at the targets of ``rows`` under a plain model's own forward, row by row, unpadded."""
    model = load_any_model(run_dir)[0].eval()
    nll = count = 0.0
    for r in rows:
        with torch.no_grad():
            logits = model(torch.tensor([r["ids"]])).logits[0, :-1]
        labels = torch.tensor(r["labels"][1:])
        keep = labels != IGNORE
        nll += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
        count += keep.sum().item()
    return nll / count


def test_learning_curves_are_the_runs_own_evaluations(quick):
    """``curves``: every periodic evaluation on the validation programs and the training objective per step (the
    quick runs are shorter than the 40 windows, so one step each); the last held-out loss of baseline-L recomputed
    from its saved model on every validation program."""
    out, _ = quick
    res = load(out)
    for arm in res["arms"]:
        c = res["curves"]["0"][arm]
        recs = [json.loads(line) for line in open(os.path.join(out, "seed0", "runs", arm, "metrics.jsonl"))]
        val = [r for r in recs if r.get("split") == "val"]
        assert len(val) >= 2 and c["val"][-1][0] == res["runs"][arm]["steps"]
        assert c["val"] == [[r["step"], round(r["val_loss"], 5), round(r["val_loss_passes"], 5)
                             if "val_loss_passes" in r else None] for r in val]
        assert (c["val"][-1][2] is not None) == arm.startswith("fbt")  # FBT: the exact recurrence's loss too
        assert c["train"] == [[r["step"], round(r["loss"], 5)] for r in recs if r.get("split") == "train"]
    rows = read_test_rows(os.path.join(out, "seed0", "data", "val.jsonl"), programs_data.program_tokenizer(3))
    assert len(rows) == res["settings"]["val_rows"]
    assert res["curves"]["0"]["baseline-L"]["val"][-1][1] == pytest.approx(
        by_hand_held_out_loss(os.path.join(out, "seed0", "runs", "baseline-L"), rows), abs=2e-5)
    assert os.path.exists(os.path.join(out, "programs-curves.png"))


def labelled_accuracy(run_dir: str, data: str, mode: str) -> float:
    code, stdout, err = run(["eval", "labelled", run_dir, "--data", data, "--modes", mode, "--resamples", "10",
                             "--device", "cpu", "--json"])
    assert code == 0, err
    overall = json.loads(stdout)["results"][0]["overall"]
    return overall["correct"] / overall["targets"]


def test_lr_search_keeps_what_the_validation_programs_score_best(tmp_path):
    """A finished one-LR experiment, then ``--lrs`` with a second LR: only the new LR's runs train (the --lr runs
    are reused), each arm keeps the LR whose run ``fullband eval labelled`` scores best on the validation programs
    (FBT exact, plain standard; a tie: the smaller), the test results are the kept run's, and the controls match
    the kept FBT run's FLOPs."""
    out, arms = str(tmp_path / "exp"), ["baseline-L", "fbt-L-glu-x2", "baseline-L-flops"]
    base = [*QUICK, "--out", out, "--arms", ",".join(arms), "--statements", "4", "--test-statements", "4"]
    code, _, err = run(base)
    assert code == 0, err
    first = load(out)
    assert first["settings"]["lrs"] == [2e-3] and first["lr_search"]["0"]["baseline-L"]["lr"] == 2e-3
    code, _, err = run([*base, "--lrs", "8e-3,2e-3"])
    assert code == 0, err
    assert sorted(re.findall(r"programs: training (\S+)", err)) == sorted(f"lr0.008/{a}" for a in arms)
    res = load(out)
    assert res["settings"]["lrs"] == [2e-3, 8e-3]
    runs_dir, data = os.path.join(out, "seed0", "runs"), os.path.join(out, "seed0", "data")
    kept = {}
    for arm in arms:
        dirs = {2e-3: os.path.join(runs_dir, arm), 8e-3: os.path.join(runs_dir, "lr0.008", arm)}
        mode = "exact" if arm.startswith("fbt") else "standard"
        accs = {lr: labelled_accuracy(d, os.path.join(data, "val.jsonl"), mode) for lr, d in dirs.items()}
        c = res["lr_search"]["0"][arm]
        assert c["val_accuracy"] == pytest.approx({f"{lr:g}": a for lr, a in accs.items()}, abs=1e-12)
        assert c["lr"] == (8e-3 if accs[8e-3] > accs[2e-3] else 2e-3)
        kept[arm] = dirs[c["lr"]]
        with open(os.path.join(kept[arm], "run_config.json")) as f:
            assert json.load(f)["lr"] == c["lr"]
        test = acc(res["per_seed"]["0"][arm]["correct"][mode]["4"])
        assert test == pytest.approx(labelled_accuracy(kept[arm], os.path.join(data, "test.jsonl"), mode))
    fbt, plain = hand_flops(kept["fbt-L-glu-x2"]), hand_flops(kept["baseline-L"])
    p = plain[1]
    per_step = p["B"] * p["T"] * (6 * p["N"] + 6 * p["L"] * p["T"] * p["d"])
    assert res["runs"]["baseline-L-flops"]["steps"] == math.ceil(fbt[0] / per_step)
    report = open(os.path.join(out, "report.md")).read()
    rows = table(report, "| arm | seed | LR 0.002 | LR 0.008 |")
    assert [r[0] for r in rows] == arms
    for arm, _, a2, a8, _ in rows:
        c = res["lr_search"]["0"][arm]
        assert (a2, a8) == tuple(f"{c['val_accuracy'][k]:.3f}" + ("*" if c["lr"] == float(k) else "")
                                 for k in ("0.002", "0.008"))


def test_dry_run_plans_what_the_run_then_counts(quick, tmp_path):
    """``--dry-run``: per arm the FLOPs and steps the quick run's own finished runs counted (the controls sized from
    the FBT arm's planned FLOPs as a run sizes them from its finished one), the whole experiment as arms x seeds x
    LRs, and nothing written to --out."""
    out, _ = quick
    res = load(out)
    plan_out = tmp_path / "plan"
    code, stdout, err = run([*QUICK, "--out", str(plan_out), "--dry-run", "--json", "--seeds", "0,1,2",
                             "--lrs", "1e-3,2e-3"])
    assert code == 0, err
    plan = json.loads(stdout)
    assert not plan_out.exists()
    assert list(plan["arms"]) == res["arms"] and plan["runs_per_arm"] == 6
    for arm, row in plan["arms"].items():
        counted = hand_flops(os.path.join(out, "seed0", "runs", arm))
        assert row["steps"] == counted[1]["steps"] == res["runs"][arm]["steps"], arm
        assert row["total_flops"] == pytest.approx(counted[0], rel=1e-9), arm
    assert plan["flops"] == pytest.approx(6 * sum(r["total_flops"] for r in plan["arms"].values()), rel=1e-12)
    assert plan["arms"]["fbt-L-glu-x2"]["token_steps"] == res["settings"]["steps"] * plan["seq_len"]
    code, stdout, _ = run([*QUICK, "--out", str(plan_out), "--dry-run"])
    assert code == 0 and "| fbt-L-glu-x2 | 1 |" in stdout and "Whole experiment: 6 arms x 1 seed(s) x 1 LR(s)" in stdout
