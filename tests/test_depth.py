"""The depth experiment: its task generators (answers re-derived by an independent solver, filler that carries no
information, the row format and the answer-only labels) and ``fullband experiment depth --quick`` end to end, with
its table recomputed from the saved per-example results."""

from __future__ import annotations

import json
import random

import pytest
import torch
from reference import scoring_flops

from fullband import cli
from fullband.eval.depth_tasks import (
    EQUALS,
    IGNORE,
    THINK,
    answer_labels,
    depth_tokenizer,
    encode_rows,
    make_depth_problems,
    pointer_problem,
    row_length,
)

# ---------------------------------------------------------------------------------------------- an independent solver


def _s3_table(m: int = 3):
    """Elements of S_m by index, rebuilt here by lexicographic enumeration (not with the module's helper)."""
    out = [[]]
    for _ in range(m):
        out = [p + [x] for p in out for x in range(m) if x not in p]
    return out


def solve(words: tuple[str, ...]) -> str:
    """The answer of a question read only from its words (think tokens ignored)."""
    words = [w for w in words if w not in (THINK, EQUALS)]
    if words[0] == "C":
        table = _s3_table()
        state = list(range(3))
        for w in words[1:]:
            g = table[int(w[1:])]
            state = [g[state[x]] for x in range(3)]  # apply the running state, then g
        return f"g{table.index(state)}"
    if words[0] == "M":
        return f"r{sum(int(w[1:]) for w in words[1:]) % 7}"
    q = words.index("Q")
    succ = {}
    for e in words[:q]:
        a, b = e.split(">")
        assert a not in succ, "an edge list must give each symbol one successor"
        succ[a] = b
    x, hops = words[q + 1][1:], int(words[q + 2][1:])
    for _ in range(hops):
        x = succ[x]
    return f"s{x}"


@pytest.mark.parametrize("task", ["pointer", "compose", "modsum"])
def test_generator_answers_match_an_independent_solver(task):
    problems = make_depth_problems([task], 400, seed=3, max_k=5, max_think=3)
    assert {p.k for p in problems} == {1, 2, 3, 4, 5} and {p.think for p in problems} == {0, 1, 2, 3}
    for p in problems:
        assert solve(p.words) == p.answer, p
        assert p.words[-1] == EQUALS and p.words.count(THINK) == p.think
    # the solver can tell a wrong answer: answers are not all the same, and k matters
    assert len({p.answer for p in problems}) >= 5
    if task == "pointer":
        moved = [p for p in problems if p.k == 1 and p.facts[0][p.facts[1]] != p.facts[1]]
        assert moved and all(solve(p.words) != f"s{p.facts[1]}" for p in moved)


def test_single_cycle_pointer_has_no_copy_shortcut():
    problems = make_depth_problems(["pointer"], 300, seed=4, max_k=5, single_cycle=True)
    for p in problems:
        assert solve(p.words) == p.answer
        assert p.answer != f"s{p.facts[1]}"  # k < n: never back at the start
        perm, x, seen = p.facts[0], 0, set()
        for _ in range(6):
            seen.add(x)
            x = perm[x]
        assert len(seen) == 6  # one 6-cycle
    # the default (any permutation) does return to the start sometimes: that is the shortcut the option removes
    plain = make_depth_problems(["pointer"], 300, seed=4, max_k=5)
    assert any(p.answer == f"s{p.facts[1]}" for p in plain)


def test_pointer_edges_are_a_permutation_with_single_tokens():
    tok = depth_tokenizer()
    p = pointer_problem(random.Random(0), k=3, think=2)
    edges = p.words[:6]
    assert sorted(e.split(">")[0] for e in edges) == [str(i) for i in range(6)]
    assert sorted(e.split(">")[1] for e in edges) == [str(i) for i in range(6)]
    ids = tok(" ".join(p.words), add_special_tokens=False)["input_ids"]
    assert len(ids) == len(p.words) and tok.pad_token_id not in ids  # every word one known token


def test_think_tokens_carry_no_information():
    tok = depth_tokenizer()
    for task in ("pointer", "compose", "modsum"):
        plain = make_depth_problems([task], 200, seed=5, max_k=4, thinks=[0])
        padded = make_depth_problems([task], 200, seed=5, max_k=4, thinks=[4])
        for a, b in zip(plain, padded):
            # the same problem; the filler is inserted before '=' and nothing else changes
            assert a.answer == b.answer and a.k == b.k
            assert tuple(w for w in b.words if w != THINK) == a.words
            assert b.words[-6:] == (THINK,) * 4 + (EQUALS,) or b.words[-5:] == (THINK,) * 4 + (EQUALS,)
        seq = row_length(4, 4, [task])
        rows, pos = encode_rows(tok, padded, seq)
        think_id = tok.convert_tokens_to_ids(THINK)
        for r, p in zip(rows, pos):
            assert (r[p - 5:p - 1] == think_id).all()  # one fixed id in every filler position
        # the think count is drawn independently of the answer: the answer distribution is the same at 0 and 4
        assert [p.answer for p in plain] == [p.answer for p in padded]


def test_rows_and_answer_only_labels():
    tok = depth_tokenizer()
    problems = make_depth_problems(["pointer", "compose"], 50, seed=1, max_k=3, max_think=2)
    seq = row_length(3, 2, ["pointer", "compose"])
    rows, pos = encode_rows(tok, problems, seq)
    labels = answer_labels(rows, tok.convert_tokens_to_ids(EQUALS))
    assert ((labels != IGNORE).sum(1) == 1).all()
    for i, p in enumerate(problems):
        assert tok.convert_ids_to_tokens(int(rows[i, pos[i]])) == p.answer
        assert tok.convert_ids_to_tokens(int(rows[i, pos[i] - 1])) == EQUALS
        assert int(labels[i, pos[i]]) == int(rows[i, pos[i]])
        assert rows[i, 0] == tok.bos_token_id and rows[i, pos[i] + 1] == tok.eos_token_id
    with pytest.raises(ValueError):
        encode_rows(tok, problems, 5)
    with pytest.raises(ValueError):
        make_depth_problems(["nope"], 3, 0, 2)


# ---------------------------------------------------------------------------------------------- the experiment


def test_depth_experiment_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "depth"
    assert cli.main(["experiment", "depth", "--quick", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((out / "results.json").read_text())
    assert printed["table"] == res["table"]
    assert (out / "depth.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    test = res["test"]
    controls = ["baseline-L-flops", "baseline-L-epochs"]
    assert res["arms"] == ["baseline-L", "fbt-L", "fbt-L-glu", "fbt-L-k3", "baseline-2L"] + controls
    assert {t["think"] for t in test} == {0, res["settings"]["max_think"]}
    assert res["runs"]["baseline-2L"]["layers"] == 2 * res["runs"]["baseline-L"]["layers"]
    # equal tokens, but for the equal-FLOPs controls: the fewest plain steps that reach fbt-L's training FLOPs,
    # baseline-L-epochs re-reading exactly baseline-L's problems (the same training data), otherwise as baseline-L
    runs = res["runs"]
    assert len({r["tokens"] for a, r in runs.items() if a not in controls}) == 1
    per_step = runs["baseline-L"]["train_flops"] / runs["baseline-L"]["steps"]
    cfg = {a: json.loads((out / "runs" / a / "run_config.json").read_text()) for a in res["arms"]}
    data = {a: json.loads((out / "runs" / a / "summary.json").read_text())["data_sha256"] for a in res["arms"]}
    for control in controls:
        steps = runs[control]["steps"]
        assert (steps - 1) * per_step < runs["fbt-L"]["train_flops"] <= steps * per_step
    assert cfg["baseline-L-epochs"]["unique_batches"] == cfg["baseline-L"]["steps"] == res["settings"]["steps"]
    assert cfg["baseline-L-flops"]["unique_batches"] == 0
    assert data["baseline-L-epochs"] == data["baseline-L"] != data["baseline-L-flops"]
    same = ("out", "steps", "unique_batches")
    assert ({k: v for k, v in cfg["baseline-L-epochs"].items() if k not in same}
            == {k: v for k, v in cfg["baseline-L"].items() if k not in same})
    # inference FLOPs per token x the L-layer standard pass, against a count from the saved weights' parameters
    seq_len = res["settings"]["seq_len"]
    for row in res["table"]:
        if "/" in row["mode"]:
            continue
        mode = "passes" if row["mode"].startswith("K=") else row["mode"]
        k = int(row["mode"][2:]) if mode == "passes" else 1
        want = (scoring_flops(out / "runs" / row["arm"], seq_len, mode, k)
                / scoring_flops(out / "runs" / "baseline-L", seq_len, "standard"))
        assert row["inference_flops"] == pytest.approx(want, rel=1e-12)
        if row["mode"] == "standard" and row["arm"] != "baseline-2L":
            assert row["inference_flops"] == 1.0
    # the FBT arms are also compared with both controls, the baselines not
    assert all("delta_epochs" in r and "delta_flops" in r for r in res["table"] if r["arm"].startswith("fbt")
               and "/" not in r["mode"])
    assert not any("delta_epochs" in r for r in res["table"] if not r["arm"].startswith("fbt"))
    # plain models have the standard mode only; FBT arms every mode and the interventions
    assert list(res["runs"]["baseline-L"]["correct"]) == ["standard"]
    assert set(res["runs"]["fbt-L"]["correct"]) >= {"standard", "K=2", "K=3", "exact", "exact/zero",
                                                      "exact/other-row", "exact/zero-at-answer",
                                                      "exact/other-row-at-answer"}
    # every table number is the mean of the saved per-example results of its cell
    for row in res["table"]:
        correct = res["runs"][row["arm"]]["correct"][row["mode"]]
        assert len(correct) == len(test)
        for k, ci in row["acc"].items():
            cell = [c for c, t in zip(correct, test)
                    if (t["task"], t["think"], t["k"]) == (row["task"], row["think"], int(k))]
            assert len(cell) == res["settings"]["test_per_cell"]
            assert ci["estimate"] == pytest.approx(sum(cell) / len(cell))
            assert ci["low"] <= ci["estimate"] <= ci["high"]
        if "/" not in row["mode"]:
            cells = " | ".join(f"{row['acc'][k]['estimate']:.2f}" for k in sorted(row["acc"], key=int))
            line = next(ln for ln in report.splitlines()
                        if ln.startswith(f"| {row['arm']} | {row['mode']} | {row['think']} |")
                        and row["task"] in report.split(ln)[0].rsplit("**", 2)[-2])
            assert [c.split(" [")[0].strip() for c in line.split("|")[4:4 + len(row["acc"])]] == cells.split(" | ")
        deep = [i for i, t in enumerate(test) if (t["task"], t["think"]) == (row["task"], row["think"]) and t["k"] >= 2]
        for key, ref in (("delta_L", "baseline-L"), ("delta_epochs", "baseline-L-epochs")):
            if key in row:
                ref_c = res["runs"][ref]["correct"]["standard"]
                assert row[key]["estimate"] == pytest.approx(sum(correct[i] - ref_c[i] for i in deep) / len(deep))
    lo, hi = 0, res["settings"]["max_think"]
    assert res["think_effect"]
    for row in res["think_effect"]:
        correct = res["runs"][row["arm"]]["correct"][row["mode"]]
        for think, acc in zip((lo, hi), row["acc"]):
            cell = [c for c, t in zip(correct, test) if (t["task"], t["think"]) == (row["task"], think) and t["k"] >= 2]
            assert acc == pytest.approx(sum(cell) / len(cell))
        assert row["delta"]["estimate"] == pytest.approx(row["acc"][1] - row["acc"][0])
    # the think and no-think test questions are the same problems
    assert res["pointer_no_copy"]
    for row in res["pointer_no_copy"]:
        correct = res["runs"][row["arm"]]["correct"][row["mode"]]
        for k, acc in row["acc"].items():
            cell = [c for c, t in zip(correct, test) if t["task"] == "pointer" and t["think"] == row["think"]
                    and t["k"] == int(k) and t["answer"] != t["question"].split(" Q ")[1].split()[0]]
            assert len(cell) == row["n"][k] and acc == pytest.approx(sum(cell) / len(cell))

    def questions(task, think):
        return [(t["question"].replace(" .", ""), t["answer"]) for t in test
                if (t["task"], t["think"]) == (task, think)]

    for task in {t["task"] for t in test}:
        assert questions(task, lo) == questions(task, hi)
    for row in res["interventions"]:
        correct = res["runs"][row["arm"]]["correct"]
        deep = [i for i, t in enumerate(test) if (t["task"], t["think"]) == (row["task"], row["think"]) and t["k"] >= 2]
        assert row["exact"] == pytest.approx(sum(correct["exact"][i] for i in deep) / len(deep))
        # the zeroing interventions only where a zero state leaves the token (not on the pure GLU arm)
        assert ("zero" in row["delta"]) == (row["arm"] != "fbt-L-glu")
        assert {"other-row", "other-row-at-answer"} <= set(row["delta"])
        for name, d in row["delta"].items():
            assert d["estimate"] == pytest.approx(
                sum(correct[f"exact/{name}"][i] - correct["exact"][i] for i in deep) / len(deep))


def test_depth_reuses_a_run_only_for_the_same_problems(tmp_path, capsys):
    out = str(tmp_path / "r")
    args = ["experiment", "depth", "--quick", "--out", out, "--arms", "baseline-L"]
    assert cli.main(args) == 0
    assert "depth: training baseline-L" in capsys.readouterr().err
    assert cli.main(args) == 0
    assert "depth: training" not in capsys.readouterr().err  # reused
    # other problems with the same row length and training options: not reused, and kept unless --overwrite
    assert cli.main(args + ["--tasks", "pointer"]) == 2
    assert "the training data" in capsys.readouterr().err
    assert cli.main(args + ["--tasks", "pointer", "--overwrite"]) == 0
    assert "depth: training baseline-L" in capsys.readouterr().err


def test_depth_exact_mode_matches_a_reference_recurrence(tmp_path):
    """The experiment's exact-mode answers, plain and under each intervention, equal those of a recurrence written
    from the equations (tests/reference.py: the fusion from raw weights, the backbone re-run from scratch at every
    position; not the model's recurrent_forward). A quick run leaves the residual fusion's output gain at ~0.02,
    where zeroing the state changes no answer and such a check cannot fail; the gain is therefore scaled up 20x, so
    that each intervention flips some answers. Bugs caught: answers read at the wrong position, a hook applied at
    the wrong step, to the wrong rows or not at all."""
    import reference as ref

    from fullband.experiments.depth import answers_correct, intervention_hook
    from fullband.eval.scoring import load_any_model

    out = tmp_path / "d"
    assert cli.main(["experiment", "depth", "--quick", "--out", str(out), "--arms", "fbt-L", "--json"]) == 0
    model = load_any_model(str(out / "runs" / "fbt-L"))[0].eval()
    with torch.no_grad():
        model.feedback.out_norm.weight.mul_(20.0)
    tok = depth_tokenizer()
    problems = make_depth_problems(["pointer", "compose"], 40, seed=9, max_k=3, max_think=2)
    rows, pos = encode_rows(tok, problems, row_length(3, 2, ["pointer", "compose"]))
    idx = torch.arange(rows.shape[0])
    # the answer slots hold the reference's own plain predictions (a quick run may answer none right, where
    # correctness could not change under any intervention): "correct" then means "predicts what the plain
    # recurrence predicts", so every answer an intervention moves is a flip (the logits at pos - 1 do not read the
    # token at pos: causal)
    rows[idx, pos] = ref.recurrence_logits(model, rows)[idx, pos - 1].argmax(-1)

    def reference_answers(hook=None):
        logits = ref.recurrence_logits(model, rows, state_hook=hook)
        return (logits[idx, pos - 1].argmax(-1) == rows[idx, pos]).long().tolist()

    hooks = {  # each intervention written out here, for the state fused at position t
        "zero": lambda t, prev: torch.zeros_like(prev),
        "other-row": lambda t, prev: prev.roll(1, dims=0),
        "zero-at-answer": lambda t, prev: prev * (pos - 1 != t).to(prev.dtype).view(-1, 1, 1),
        "other-row-at-answer": lambda t, prev: torch.where((pos - 1 == t).view(-1, 1, 1), prev.roll(1, dims=0), prev),
    }
    plain = reference_answers()
    assert answers_correct(model, rows, pos, "exact", batch=7) == plain
    for name, hook in hooks.items():
        expected = reference_answers(hook)
        assert expected != plain, name  # the intervention matters here, so a dropped one is caught
        assert answers_correct(model, rows, pos, "exact", state_hook=intervention_hook(name)) == expected, name


def test_depth_zeroes_the_state_only_where_that_leaves_the_token():
    """On the pure GLU entry a zero state zeroes the whole fused input (the token too): no state intervention, so
    the zeroing interventions are not run there; the residual entry keeps the token and runs all of them."""
    from conftest import tiny_model
    from fullband.experiments.depth import INTERVENTIONS, interventions_for

    assert interventions_for(tiny_model(fusion="residual")) == list(INTERVENTIONS)
    assert interventions_for(tiny_model(fusion="glu")) == ["other-row", "other-row-at-answer"]
