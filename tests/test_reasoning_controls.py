"""The reasoning experiment's s3 task, its two literature controls (pause tokens, stepwise internalization) and the
accuracy-against-trace frontier, each checked against a reference written from its definition."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from fullband.cli import main as cli_main
from fullband.data.corpus import train_tokenizer
from fullband.eval import problems as P
from fullband.eval.flops import flop_parameters, training_flops
from fullband.eval.scoring import load_any_model
from fullband.eval.reasoning import style_openings
from fullband.experiments import reasoning_controls as C
from fullband.training.pretrain import model_fingerprint
from fullband.utils.io import read_jsonl

# ----------------------------------------------------------------------------- the s3 task


def test_s3_problems_are_the_running_product():
    """Element k (1..6) is the k-th permutation of (0, 1, 2) in lexicographic order; the product applies the first
    element first (as maps: x -> b(a(x))). Bugs caught: the other composition order, an off-by-one numbering, a
    trace that skips a step, a partial step whose value is not the running product there."""
    elems = list(itertools.permutations(range(3)))
    for p in P.s3_problems(60, seed=5, num_steps=(2, 9)):
        xs = [int(t) for t in p.question.removeprefix("S3 product ").removesuffix("=?").split()]
        running, acc = [], elems[xs[0] - 1]
        for x in xs[1:]:
            g = elems[x - 1]
            acc = tuple(g[acc[i]] for i in range(3))
            running.append(elems.index(acc) + 1)
        assert p.answer == str(running[-1])
        steps = p.solution.rstrip(".").split("; ")
        assert steps == [f"{a}*{x}={r}" for a, x, r in zip([xs[0]] + running[:-1], xs[1:], running)]
        parts = p.partial.rstrip(".").split("; ")
        assert len(parts) == math.ceil((len(xs) - 1) / 2) and parts[-1].endswith(f"={p.answer}")
        done = 1  # the elements the partial trace has multiplied so far
        for part in parts:
            lhs, value = part.split("=")
            factors = lhs.split("*")
            done += len(factors) - 1
            assert int(value) == running[done - 2] and len(factors) - 1 <= 2
    assert P.s3_problems(5, 1) == P.make_problems("s3", 5, 1) != P.s3_problems(5, 2)
    with pytest.raises(ValueError, match="num_steps"):
        P.s3_problems(3, num_steps=(1, 3))


def test_dropping_trace_steps():
    p = P.Problem("x", "arithmetic", "3+4*2-5=?", "6", "4*2=8; 3+8=11; 11-5=6.", partial="4*2=8; 3+8-5=6.")
    assert P.trace_text(p, "full", 1 / 3) == "3+8=11; 11-5=6."
    assert P.trace_text(p, "full", 0.5) == "11-5=6."  # 1.5 steps: half up
    assert P.trace_text(p, "partial", 0.5) == "3+8-5=6."
    assert P.format_target(p, True, "full", 1.0) == " #### 6" == P.format_target(p, True, "direct", 0.5)
    assert P.format_example(p, True, "full", pause=3, drop=2 / 3) == "Q: 3+4*2-5=?\nA:___ 11-5=6. #### 6"
    with pytest.raises(ValueError, match="drop"):
        P.trace_text(p, "full", 1.5)


# ----------------------------------------------------------------------------- pause tokens


def test_pause_fillers_are_one_token_each_and_leave_the_openings():
    """n fillers after the prompt are n tokens of their own, the answer's tokens after them are those without
    fillers (so forced openings and chosen verbosities mean the same), and the default count is the prompts' mean
    token count with BOS."""
    probs = P.s3_problems(40, seed=0)
    texts = [P.format_example(p, True, v) for p in probs for v in P.VERBOSITIES]
    tok = train_tokenizer(texts, 300)
    n = C.pause_count(None, tok, probs, texts)
    assert n == round(sum(len(tok(P.format_prompt(p))["input_ids"]) for p in probs) / len(probs))
    for p in probs[:10]:
        plain = tok(P.format_prompt(p), add_special_tokens=False)["input_ids"]
        paused = tok(P.format_prompt(p, pause=n), add_special_tokens=False)["input_ids"]
        assert paused[: len(plain)] == plain and tok.convert_ids_to_tokens(paused[len(plain):]) == ["_"] * n
        assert style_openings(tok, p, pause=n) == style_openings(tok, p)
    assert C.pause_count(4, tok, probs, texts) == 4
    with pytest.raises(ValueError, match="pause filler"):
        C.pause_count(None, tok, probs, texts + ["a_b"])


# ----------------------------------------------------------------------------- the frontier


def test_frontier_trace():
    pts = [(0.0, 0.2), (10.0, 0.5), (20.0, 0.9), (30.0, 0.8), (5.0, 0.1)]  # (5, 0.1) and (30, 0.8) dominated
    assert C.frontier_trace(pts, 0.7) == (pytest.approx(15.0), "interpolated")
    assert C.frontier_trace(pts, 0.5) == (pytest.approx(10.0), "interpolated")
    assert C.frontier_trace(pts, 0.15) == (0.0, "at most")
    assert C.frontier_trace(pts, 0.95) == (None, "never")


def _runs(model, mode, style, correct, trace):
    return [{"seed": s, "model": model, "mode": mode, "style": style,
             "records": [{"correct": c, "trace_tokens": t} for c, t in zip(correct[s], trace[s])]} for s in (0, 1)]


def test_trace_savings_by_hand():
    """FBT (2 seeds x 4 problems) right on 5 of 8 with mean trace 6; the baseline's frontier: direct (0 tokens,
    2 of 8 right), full (16 tokens, 6 of 8) -> FBT's accuracy 0.625 needs 0 + 16 * (0.625 - 0.25) / 0.5 = 12
    tokens: saving 1 - 6/12 = 0.5; the pause model never gets there: saving 1."""
    runs = (_runs("FBT", "soft", "free", [[1, 1, 0, 1], [1, 0, 1, 0]], [[4, 8, 6, 6], [6, 6, 6, 6]])
            + _runs("baseline", "standard", "full", [[1, 1, 1, 0], [1, 1, 1, 0]], [[16] * 4, [16] * 4])
            + _runs("baseline", "standard", "direct", [[1, 0, 0, 0], [0, 1, 0, 0]], [[0] * 4, [0] * 4])
            + _runs("baseline-pause", "standard", "free", [[0, 0, 0, 1], [0, 0, 0, 0]], [[3] * 4, [3] * 4]))
    (got,) = C.trace_savings(runs, [0, 1], 0, seed=0, n_resamples=200)
    assert (got["accuracy"], got["trace"]) == (0.625, 6.0)
    base, pause = got["against"]["baseline"], got["against"]["baseline-pause"]
    assert (base["needed_trace"], base["how"], base["saving"]) == (pytest.approx(12.0), "interpolated", pytest.approx(0.5))
    assert (pause["needed_trace"], pause["how"], pause["saving"]) == (None, "never", 1.0)
    assert base["low"] <= 0.5 <= base["high"] and -10 <= base["low"] and base["high"] <= 1
    assert got["best_control"] == "baseline" and got["goal_met"] == (base["low"] >= 0.15)


# ----------------------------------------------------------------------------- the experiment


def _run_flops(run) -> float:
    """A finished run's training FLOPs from its logged metrics and its model's parameters."""
    rc = json.loads((run / "run_config.json").read_text())
    fp = flop_parameters(load_any_model(str(run))[0])
    return training_flops(read_jsonl(str(run / "metrics.jsonl")), rc["batch_size"] * rc["seq_len"], rc["seq_len"],
                          fp)["flops"]


def test_exact_recipe_and_the_controls(tmp_path, capsys):
    """--fbt-recipe exact trains FBT with exact states + 2 gradient passes from step 0 (a recipe flag still wins),
    baseline-flops gets FBT's counted training FLOPs in plain steps, the pause control that many on documents whose prompts
    end in the fillers, and the internalization stages chain: stage j starts from stage j - 1's final weights and
    trains on the documents with the first j/S of each trace's steps removed (the last: no trace at all)."""
    out = tmp_path / "rs"
    argv = ["experiment", "reasoning", "--quick", "--task", "s3", "--fbt-recipe", "exact", "--num-seeds", "1",
            "--styles", "free,direct", "--fbt-modes", "soft", "--internalize-stages", "2", "--pause-tokens", "3",
            "--no-epochs-baseline", "--out", str(out), "--quiet", "--no-progress"]
    assert cli_main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    steps, flops_steps = res["training"]["steps"], res["training"]["flops_steps"]
    assert flops_steps > steps * 7 / 3  # the fusion's FLOPs counted on top of 2 + 1/3 passes' worth
    # every equal-FLOPs control has FBT's training FLOPs as its metrics count them, and less than one step more
    fbt_flops = _run_flops(out / "seed0" / "fbt")
    plain_step = _run_flops(out / "seed0" / "baseline") / steps
    for ctl in ("baseline-flops", "baseline-pause"):
        assert fbt_flops <= _run_flops(out / "seed0" / ctl) < fbt_flops + plain_step, ctl
    cfg = {r: json.loads((out / "seed0" / r / "run_config.json").read_text())
           for r in ("fbt", "baseline-pause", "internalize0", "internalize1", "internalize2")}
    assert (cfg["fbt"]["exact_states"], cfg["fbt"]["grad_passes"], cfg["fbt"]["num_passes"],
            cfg["fbt"]["feedback_start"]) == (True, 2, 2, 0.0)
    assert cfg["baseline-pause"]["steps"] == flops_steps and cfg["baseline-pause"]["num_passes"] == 1
    each = cfg["internalize0"]["steps"]
    assert each == math.ceil(flops_steps / 3) and cfg["internalize0"]["init_from"] is None
    for j in (1, 2):
        prev = out / "seed0" / f"internalize{j - 1}"
        assert cfg[f"internalize{j}"]["init_from"] == str(prev) and cfg[f"internalize{j}"]["steps"] == each
        summary = json.loads((out / "seed0" / f"internalize{j}" / "summary.json").read_text())
        assert summary["init_sha256"] == model_fingerprint(str(prev))
    data = out / "data"
    problems = {p.id: p for p in P.s3_problems(res["config"]["train_problems"], 0)}
    base = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    for name, pause, drop in (("train-pause", 3, 0.0), ("train-internalize0", 0, 0.0),
                              ("train-internalize1", 0, 0.5), ("train-internalize2", 0, 1.0)):
        docs = [json.loads(x) for x in (data / f"{name}.jsonl").read_text().splitlines()]
        assert [d["name"] for d in docs] == [d["name"] for d in base]
        for d, b in zip(docs, base):
            p = problems[d["name"]]
            verbosity = next(v for v in P.VERBOSITIES if b["text"] == P.format_example(p, True, v))
            assert d["text"] == P.format_example(p, True, verbosity, pause=pause, drop=drop)
    assert all("\nA: ####" in json.loads(x)["text"] for x in (data / "train-internalize2.jsonl").read_text().splitlines())
    keys = {(r["model"], r["mode"], r["style"]) for r in res["table"]}
    assert ("baseline-pause", "standard", "direct") in keys and ("baseline-internalized@1", "standard", "free") in keys
    assert ("baseline-internalized", "standard", "direct") not in keys
    pause_runs = [r for r in res["runs"] if r["model"] == "baseline-pause"]
    assert pause_runs and all(r["pause"] == 3 for r in pause_runs)
    assert {s["fbt"] for s in res["trace_savings"]} == {"FBT/soft"}
    assert set(res["trace_savings"][0]["against"]) == {"baseline", "baseline-flops", "baseline-pause",
                                                       "baseline-internalized"}
    assert (out / res["plot"]).stat().st_size > 1000
    # a recipe flag given on the command line wins over the exact recipe's
    assert cli_main(argv[:-4] + ["--out", str(tmp_path / "rs3"), "--num-passes", "3", "--quiet", "--no-progress",
                                 "--internalize-stages", "0", "--pause-tokens", "0"]) == 0
    assert json.loads((tmp_path / "rs3" / "seed0" / "fbt" / "run_config.json").read_text())["num_passes"] == 3
    capsys.readouterr()
    assert cli_main(argv[:-4] + ["--out", str(tmp_path / "bad"), "--internalize-stages", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
