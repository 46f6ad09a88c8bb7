"""Reasoning tasks, math-verify grading, trace length, paired statistics and ``fullband reason``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fullband.cli import main as cli_main
from fullband.eval import problems as P
from fullband.eval import reasoning as R
from fullband.utils.stats import (
    bootstrap_ci,
    compare_paired,
    discordant_counts,
    mcnemar_exact,
)

# ----------------------------------------------------------------------------- problems


def test_arithmetic_worked_example():
    value, steps = P.solve_arithmetic([3, 4, 2, 5], ["+", "*", "-"])
    assert (value, steps) == (6, ["4*2=8", "3+8=11", "11-5=6"])
    p = P.Problem("x", "arithmetic", "3+4*2-5=?", "6", "; ".join(steps) + ".")
    assert P.format_example(p) == "Q: 3+4*2-5=?\nA: 4*2=8; 3+8=11; 11-5=6. #### 6"
    assert P.format_example(p, cot=False) == "Q: 3+4*2-5=?\nA: #### 6"


def test_partial_traces_are_right_and_shorter():
    for p in P.arithmetic_problems(200, seed=5, num_ops=(1, 5), ops="+-*"):
        full = p.solution.rstrip(".").split("; ")
        part = p.partial.rstrip(".").split("; ")
        for step in part:  # every written step is a true equation, products before sums
            lhs, value = step.split("=")
            assert eval(lhs) == int(value), (p, step)  # noqa: S307 - digits and + - * only
        assert part[-1].split("=")[1] == p.answer and full[-1].split("=")[1] == p.answer
        n_sums = sum(1 for s in full if "*" not in s)
        assert len(part) == len(full) - n_sums + math.ceil(n_sums / 2)
        assert [s for s in full if "*" in s] == [s for s in part if "*" in s]
    for p in P.state_problems(50, seed=1) + P.permutation_problems(50, seed=1):
        full, part = p.solution.rstrip(".").split("; "), p.partial.rstrip(".").split("; ")
        assert part == [s for j, s in enumerate(full) if j % 2 == 1 or j == len(full) - 1]
    p = P.arithmetic_problems(1, seed=0, num_ops=(4, 4), ops="+-")[0]
    assert P.format_target(p, verbosity="direct") == P.format_target(p, cot=False) == f" #### {p.answer}"
    assert P.format_target(p, verbosity="partial") == f" {p.partial} #### {p.answer}"
    assert P.format_target(p) == P.format_target(p, verbosity="full") == f" {p.solution} #### {p.answer}"
    with pytest.raises(ValueError, match="verbosity"):
        P.format_target(p, verbosity="terse")


def test_arithmetic_problems_are_right_and_seeded():
    probs = P.arithmetic_problems(50, seed=3, num_ops=(1, 4))
    assert probs == P.arithmetic_problems(50, seed=3, num_ops=(1, 4))
    assert probs != P.arithmetic_problems(50, seed=4, num_ops=(1, 4))
    for p in probs:
        expr = p.question.removesuffix("=?")
        assert int(p.answer) == eval(expr)  # generated digits and + - * only
        assert p.solution.endswith(f"={p.answer}.")
        assert len(p.solution.split("; ")) == p.meta["num_ops"]


def test_state_problems_are_right():
    for p in P.state_problems(40, seed=1, num_vars=3, num_steps=(2, 6)):
        init, rest = p.question.split(". ", 1)
        stmts, query = rest.rsplit(". What is ", 1)
        env = {}
        for a in init.split(", "):
            exec(a, {}, env)
        for s in stmts.split("; "):
            exec(s, {}, env)
        assert str(env[query.rstrip("?")]) == p.answer
        assert len(p.solution.split("; ")) == p.meta["steps"]


def test_permutation_problems_are_right():
    for p in P.permutation_problems(40, seed=2, num_items=5):
        head, rest = p.question.split(". ", 1)
        boxes = head.split(" hold ")[1].split()
        swaps, item = rest.split(". Which box holds ")
        for s in swaps.lower().split("; "):
            _, x, y = s.split()
            x, y = int(x) - 1, int(y) - 1
            boxes[x], boxes[y] = boxes[y], boxes[x]
        assert boxes.index(item.rstrip("?")) + 1 == int(p.answer)
        assert p.solution.split("; ")[-1].rstrip(".") == " ".join(boxes)


def test_read_gsm8k(tmp_path):
    path = tmp_path / "gsm.jsonl"
    recs = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
            {"question": "A big one?", "answer": "It is 1000+200=1200.\n#### 1,200"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    probs = P.read_gsm8k(str(path))
    assert [p.answer for p in probs] == ["72", "1200"]
    assert probs[0].solution == "In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72."
    assert P.format_target(probs[0]).endswith("72.\n#### 72")
    assert len(P.read_gsm8k(str(path), limit=1)) == 1
    assert P.make_problems("gsm8k", 5, data=str(path)) == probs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="####"):
        P.read_gsm8k(str(bad))
    with pytest.raises(FileNotFoundError):
        P.read_gsm8k(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="--data"):
        P.make_problems("gsm8k", 5)


def test_prompt_with_shots():
    shots = P.arithmetic_problems(2, seed=9)
    p = P.arithmetic_problems(1, seed=0)[0]
    prompt = P.format_prompt(p, shots)
    parts = prompt.split("\n\n")
    assert parts[0] == P.format_example(shots[0]) and parts[2] == f"Q: {p.question}\nA:"


# ----------------------------------------------------------------------------- grading


@pytest.mark.parametrize("pred, gold, ok", [
    ("6", "6", True), ("7", "6", False), ("1,200", "1200", True), ("-3", "-3", True), ("6.0", "6", True),
    ("$18", "18", True), ("1/2", "0.5", True), ("", "6", False), (None, "6", False), ("-6", "6", False),
])
def test_grade_known_answers(pred, gold, ok):
    assert R.grade(pred, gold) is ok


def test_extract_answer_strict_and_flexible():
    assert R.extract_answer(" 4*2=8; 3+8=11; 11-5=6. #### 6\nQ: next") == ("6", "6")
    assert R.extract_answer(" 4*2=8; 3+8=11\n\n#### 12") == (None, "11")  # stops at the blank line
    assert R.extract_answer(" no digits here") == (None, None)
    assert R.is_correct(" 2+2=4. #### 4", "4") and not R.is_correct(" 2+2=4. #### 5", "4")
    assert R.is_correct(" so it is 4", "4", flexible=True) and not R.is_correct(" so it is 4", "4")


def test_stop_index():
    assert R.stop_index(" 1+1=2. #### 2") is None  # the answer line is still open
    assert R.stop_index(" 1+1=2. #### 2\nQ: 3") == len(" 1+1=2. #### 2")
    assert R.stop_index(" steps\n\nmore") == len(" steps")


# ----------------------------------------------------------------------------- trace length


def test_trace_length_counts_tokens_before_the_marker():
    text = "4*2=8; 3+8=11. #### 11"
    ids = [ord(c) for c in text]  # one token per character

    def decode(t):
        return "".join(map(chr, t))

    assert R.trace_length(ids, decode) == text.index("####") == 15
    assert R.trace_length([ord(c) for c in "#### 11"], decode) == 0  # answer only
    assert R.trace_length([ord(c) for c in "4*2=8"], decode) == 5  # no marker: everything
    eos = 0
    assert R.trace_length([ord(c) for c in "4*2=8"] + [eos, 50, 51], decode, eos_token_id=eos) == 5
    # multi-character tokens: a token holding the first marker character is not trace
    pieces = ["4*2", "=8;", " #", "###", " 8"]
    vocab = {i: s for i, s in enumerate(pieces)}
    assert R.trace_length(list(vocab), lambda t: "".join(vocab[i] for i in t)) == 2


def test_trace_length_with_a_bpe_tokenizer():
    from fullband.data.corpus import train_tokenizer

    tok = train_tokenizer(["4*2=8; 3+8=11. #### 11"] * 20, vocab_size=300)
    steps = tok.encode(" 4*2=8; 3+8=11.", add_special_tokens=False)
    answer = tok.encode(" #### 11", add_special_tokens=False)
    assert R.trace_length(steps + answer, tok) == len(steps)


# ----------------------------------------------------------------------------- statistics


def test_mcnemar_textbook_example():
    # Fagerland, Lydersen & Laake (2013), BMC Med Res Methodol 13:91: 1 vs 7 discordant pairs, exact p = 0.070
    assert mcnemar_exact(1, 7) == pytest.approx(2 * (1 + 8) / 2**8) == pytest.approx(0.0703125)
    assert mcnemar_exact(7, 1) == mcnemar_exact(1, 7)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 2**10)
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 3)


def test_mcnemar_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(3, 12), (121, 59), (40, 41), (0, 3), (250, 300)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-9)


def test_bootstrap_ci():
    diffs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    ci = bootstrap_ci(diffs, seed=0, n_resamples=2000)
    assert ci.estimate == 3.5 and ci.low < 3.5 < ci.high
    assert bootstrap_ci(diffs, seed=0, n_resamples=2000) == ci  # seeded
    assert bootstrap_ci([2.0] * 5, seed=1) [1:3] == (2.0, 2.0)
    wide = bootstrap_ci(diffs, seed=0, n_resamples=2000, confidence=0.99)
    assert wide.low <= ci.low and wide.high >= ci.high
    g = torch.Generator().manual_seed(0)
    many = (torch.randn(400, generator=g) + 1.0).tolist()
    ci = bootstrap_ci(many, seed=3)
    assert ci.low < 1.0 < ci.high and ci.high - ci.low < 0.5
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_compare_paired():
    a = [True, True, False, True, False]
    b = [True, False, False, False, True]
    assert discordant_counts(a, b) == (2, 1)
    out = compare_paired(a, b, [10, 12, 3, 8, 5], [9, 9, 3, 8, 6], n_resamples=500)
    assert out["b"] == 2 and out["c"] == 1 and out["mcnemar_p"] == pytest.approx(1.0)
    assert out["accuracy_difference"] == pytest.approx(0.2)
    assert out["length_difference"]["estimate"] == pytest.approx((1 + 3 + 0 + 0 - 1) / 5)
    assert out["length_difference_both_correct"]["estimate"] == pytest.approx(1.0)  # only problem 0
    with pytest.raises(ValueError):
        discordant_counts([True], [True, False])


def test_reasoning_experiment_compares_per_problem_over_seeds():
    """The experiment's comparison over seeds that decode the same problems (the hand-worked example of
    ``tests/test_stats.py``): A right on problems 0, 1, 2 in seed 0 and 0, 1 in seed 1, B on none: per-problem
    differences (2, 2, 1), sign-flip p = 2/8 = 0.25 (pooling both seeds' 5 vs 0 pairs would say 0.0625), McNemar
    per seed 0.25 and 0.5. Bugs caught: the seeds' records concatenated into one McNemar test, per-seed counts
    mixed up, records of different problems paired."""
    from fullband.experiments.reasoning import compare

    def run(correct, trace):
        return {"records": [{"id": f"p{i}", "correct": bool(c), "trace_tokens": t}
                            for i, (c, t) in enumerate(zip(correct, trace))]}

    a = [run([1, 1, 1], [10, 12, 8]), run([1, 1, 0], [10, 12, 8])]
    b = [run([0, 0, 0], [11, 11, 11]), run([0, 0, 0], [11, 11, 11])]
    c = compare(a, b, seed=0, n_resamples=500)
    assert (c["problems"], c["seeds"], c["p"]) == (3, 2, 0.25)
    assert (c["a_only_per_seed"], c["b_only_per_seed"], c["mcnemar_p_per_seed"]) == ([3, 2], [0, 0], [0.25, 0.5])
    assert c["accuracy"]["estimate"] == pytest.approx((1 + 2 / 3) / 2)
    assert c["trace"]["estimate"] == pytest.approx(-1.0) and c["trace_both_correct"] is None  # B is never right
    shuffled = [a[0], {"records": list(reversed(a[1]["records"]))}]
    with pytest.raises(ValueError):  # the seeds must list the same problems in the same order
        compare(shuffled, b, seed=0, n_resamples=10)


# ----------------------------------------------------------------------------- evaluation


def test_evaluate_reasoning_grades_and_counts(model_dir, monkeypatch):
    from fullband.eval.scoring import load_any_model

    model, tok = load_any_model(model_dir, device="cpu")
    problems = P.arithmetic_problems(4, seed=0)

    def perfect(model, tokenizer, prompts, mode, max_new_tokens, batch_size, prefill_passes=1):
        out = []
        for k, p in enumerate(problems):  # right answers except problem 1; problem 3 has no marker
            text = P.format_target(p) if k != 1 else " 1+1=2. #### 999"
            if k == 3:
                text = f" the answer is {p.answer}"
            out.append(tokenizer.encode(text + "\n", add_special_tokens=False))
        return out

    monkeypatch.setattr(R, "generate_completions", perfect)
    records = R.evaluate_reasoning(model, tok, problems, "soft")
    assert [r["correct"] for r in records] == [True, False, True, False]
    assert [r["correct_flexible"] for r in records] == [True, False, True, True]
    assert [r["marker_found"] for r in records] == [True, True, True, False]
    body = tok.encode(P.format_target(problems[0]) + "\n", add_special_tokens=False)
    n = records[0]["trace_tokens"]  # the tokens before the one that starts the marker
    assert n >= len(problems[0].solution) // 4
    assert "#" not in tok.decode(body[:n]) and tok.decode(body[:n + 1]).endswith("#")
    assert records[3]["trace_tokens"] == records[3]["generated_tokens"]
    s = R.summarize(records)
    assert s["accuracy"] == 0.5 and s["accuracy_flexible"] == 0.75 and s["marker_rate"] == 0.75


def test_forced_verbosity(model_dir, monkeypatch):
    from fullband.eval.scoring import load_any_model

    model, tok = load_any_model(model_dir, device="cpu")
    problems = P.arithmetic_problems(6, seed=2, num_ops=(3, 4), ops="+-")
    bos = tok("x")["input_ids"][0]
    for p in problems:
        openings = R.style_openings(tok, p)
        prompt = tok(P.format_prompt(p), add_special_tokens=False)["input_ids"]
        for v in P.VERBOSITIES:  # each verbosity's answer starts with its own opening and with no other
            answer = tok(P.format_example(p, True, v), add_special_tokens=False)["input_ids"][len(prompt):]
            assert answer[: len(openings[v])] == openings[v]
            assert R.chosen_verbosity(openings, answer) == v
        assert " ####".startswith(tok.decode(openings["direct"])) and len(openings["direct"]) >= 1
        assert R.chosen_verbosity(openings, tok(" nonsense", add_special_tokens=False)["input_ids"]) == "other"
    seen = {}

    def rest_of_target(model, tokenizer, prompts, mode, max_new_tokens, batch_size, prefill_passes=1):
        seen["prompts"] = prompts
        out = []
        for p, ids in zip(problems, prompts):  # the rest of the forced verbosity's answer, as the model would write it
            full = tokenizer(P.format_example(p, True, seen["v"]) + "\n", add_special_tokens=False)["input_ids"]
            out.append(full[len(ids) - 1:])
        return out

    monkeypatch.setattr(R, "generate_completions", rest_of_target)
    for v in P.VERBOSITIES:
        seen["v"] = v
        records = R.evaluate_reasoning(model, tok, problems, "soft", verbosity=v)
        for p, ids, r in zip(problems, seen["prompts"], records):
            prompt = tok(P.format_prompt(p), add_special_tokens=False)["input_ids"]
            assert ids == [bos] + prompt + R.style_openings(tok, p)[v]  # the opening follows the prompt
            assert r["completion"] == P.format_target(p, True, v) and r["correct"] and r["verbosity"] == v
            written = tok(P.format_target(p, True, v) + "\n", add_special_tokens=False)["input_ids"]
            assert r["generated_tokens"] == len(written)  # the opening counts as written
            assert r["trace_tokens"] == R.trace_length(written[:-1], tok)
            assert r["trace_tokens"] <= 1 if v == "direct" else r["trace_tokens"] >= 4  # " ####" may be " " + "####"
    with pytest.raises(ValueError, match="forced verbosity"):
        R.evaluate_reasoning(model, tok, problems, "soft", verbosity="terse")


def test_real_decoding_in_every_mode(model_dir, plain_dir):
    from fullband.eval.scoring import load_any_model

    model, tok = load_any_model(model_dir, device="cpu")
    problems = P.arithmetic_problems(3, seed=0)
    assert R.available_modes(model) == ("standard", "soft", "fused", "exact")
    assert R.default_modes(model) == ["standard", model.config.default_feedback_mode] == ["standard", "fused"]
    prompts = [P.format_prompt(p, (), True) for p in problems]
    for mode in R.available_modes(model):
        records = R.evaluate_reasoning(model, tok, problems, mode, max_new_tokens=6, batch_size=2)
        completions = R.generate_completions(model, tok, prompts, mode, max_new_tokens=6, batch_size=2)
        assert len(records) == 3
        for p, prompt, r, toks in zip(problems, prompts, records, completions):
            assert 0 <= r["trace_tokens"] <= r["generated_tokens"] <= 6
            assert r["correct"] == R.grade(r["answer"], p.answer) and r["marker_found"] == (r["answer"] is not None)
            # batched, left-padded, stopped decoding = the same prompt decoded alone by HF generate() in that mode
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                alone = model.generate(ids, feedback_mode=mode, max_new_tokens=6, do_sample=False,
                                       pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
            assert toks == alone[:len(toks)] and len(toks) >= 1, (mode, toks, alone)
        # token-id prompts (a forced opening) decode like the same ids alone
        forced = [tok(t)["input_ids"] + R.style_openings(tok, p)["partial"] for t, p in zip(prompts, problems)]
        for ids, toks in zip(forced, R.generate_completions(model, tok, forced, mode, max_new_tokens=4, batch_size=3)):
            with torch.no_grad():
                alone = model.generate(torch.tensor([ids]), feedback_mode=mode, max_new_tokens=4, do_sample=False,
                                       pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            assert toks == alone[:len(toks)] and len(toks) >= 1, (mode, toks, alone)
    plain, ptok = load_any_model(plain_dir, device="cpu")
    assert R.available_modes(plain) == ("standard",)
    with pytest.raises(ValueError, match="not available"):
        R.generate_completions(plain, ptok, ["Q: 1+1=?\nA:"], "exact")
    # a plain model decodes exactly like the fullband model in standard mode (same backbone weights)
    same = [r["completion"] for r in R.evaluate_reasoning(plain, ptok, problems, "standard", max_new_tokens=6)]
    ref = [r["completion"] for r in R.evaluate_reasoning(model, tok, problems, "standard", max_new_tokens=6)]
    assert same == ref


def test_reason_command(model_dir, plain_dir, tmp_path, capsys):
    out = tmp_path / "r"
    code = cli_main(["reason", "--model", model_dir, "--compare", plain_dir, "--task", "state", "--num", "3",
                     "--modes", "standard,soft", "--max-new-tokens", "5", "--shots", "1", "--device", "cpu",
                     "--out", str(out)])
    assert code == 0
    report = json.loads((out / "reason.json").read_text())
    names = [r["name"] for r in report["runs"]]
    assert len(names) == 3 and names[0].endswith("/standard") and names[1].endswith("/soft")
    pairs = [(c["a"], c["b"]) for c in report["comparisons"]]
    assert (names[0], names[1]) in pairs and (names[0], names[2]) in pairs
    for c in report["comparisons"]:
        assert 0.0 <= c["mcnemar_p"] <= 1.0 and not math.isnan(c["length_difference"]["estimate"])
    assert any("soft" in n for n in report["notes"])  # the plain model has no soft mode
    md = (out / "reason.md").read_text()
    assert "McNemar" in md and "| run |" in md
    assert cli_main(["reason", "--model", model_dir, "--task", "gsm8k", "--num", "2"]) == 2
    assert "--data" in capsys.readouterr().err
