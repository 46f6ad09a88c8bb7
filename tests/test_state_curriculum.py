"""The state experiment's curriculum in length (``--length-curriculum F --curriculum-start N``): the labelled length
per step written out by hand, the recipe's labels against the generators' own running states (not the package's
label code), the run identity (a curriculum run is never reused for one without), and the option checks and report
through the command line."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fullband import cli
from fullband.eval.state_tasks import make_state_problems, state_tokenizer
from fullband.experiments import state
from fullband.training.config import TrainConfig


def test_curriculum_length_by_hand():
    # T = 20 from 4 over the first half of 10 steps: 4 + floor(17 * s / 5) for s < 5, then 20
    assert [state.curriculum_length(s, 10, 20, (4, 0.5)) for s in range(10)] == [4, 7, 10, 14, 17] + [20] * 5
    assert [state.curriculum_length(s, 4, 6, (6, 1.0)) for s in range(4)] == [6] * 4  # starts at T: no curriculum
    assert [state.curriculum_length(s, 3, 9, ()) for s in range(3)] == [9] * 3
    # T = 5 from 1 over all 8 steps: 1 + floor(5 s / 8)
    assert [state.curriculum_length(s, 8, 5, (1, 1.0)) for s in range(8)] == [1, 1, 2, 2, 3, 4, 4, 5]


def args_for(**kw) -> argparse.Namespace:
    values = dict(tasks_list=["s3", "parity"], length=6, test_rows=4, batch_size=4, seed=0, random_positions=False,
                  length_curriculum=0.5, curriculum_start=2)
    return argparse.Namespace(**(values | kw))


def recipe_for(corpus, tok, steps: int) -> state.StateRecipe:
    cfg = TrainConfig(out="unused", steps=steps, batch_size=4, seq_len=8, seed=3, num_passes=1)
    recipe = state.StateRecipe(cfg, corpus, "x")
    recipe.train_rows, recipe.val_rows, recipe.tokenizer, recipe.doc_id = corpus.train_rows, corpus.val_rows, tok, 0
    return recipe


def test_the_curriculum_labels_only_the_first_n_inputs_with_their_running_states():
    """At step s the labels of inputs 1..n(s) are the running states the generator wrote for them, every later label
    (and BOS's) is ignored; from the end of the ramp on every input is labelled. A corpus with a curriculum is another
    run's data (fingerprint): a run without one is never reused for it."""
    tok = state_tokenizer()
    vocab = tok.get_vocab()
    args = args_for()
    held = state.held_out(args, tok)
    corpus = state.training_corpus(args, tok, 4, 1, held)
    assert corpus.curriculum == (2, 0.5)
    plain = state.training_corpus(args_for(length_curriculum=None), tok, 4, 1, held)
    assert plain.curriculum == () and torch.equal(plain.train_rows, corpus.train_rows)
    assert plain.fingerprint != corpus.fingerprint
    assert corpus.fingerprint != state.training_corpus(args_for(curriculum_start=3), tok, 4, 1, held).fingerprint
    # the generator's own problems, in the corpus's order: their outputs are the labels to expect
    problems = make_state_problems(args.tasks_list, 4 * 4, 1, 6, exclude=held.keys)
    truth = {tuple([tok.bos_token_id] + [vocab[w] for w in p.inputs] + [tok.eos_token_id]): p.outputs
             for p in problems}
    env = argparse.Namespace(world_size=1, rank=0, device=torch.device("cpu"))
    recipe = recipe_for(corpus, tok, steps=8)  # ramp: 4 steps, n = 2 + floor(5 s / 4)
    for step, n in [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (7, 6)]:
        mb = recipe.batch(step, 1, torch.Generator().manual_seed(0), env).micro[0]
        for ids, labels in zip(mb["input_ids"].tolist(), mb["labels"].tolist()):
            outputs = truth[tuple(ids)]
            want = [-100, -100] + [vocab[w] for w in outputs[:n]] + [-100] * (6 - n)
            assert labels == want, (step, n)
    plain_recipe = recipe_for(plain, tok, steps=8)
    mb = plain_recipe.batch(0, 1, torch.Generator().manual_seed(0), env).micro[0]
    assert all((torch.tensor(lab[2:]) >= 0).all() for lab in mb["labels"].tolist())  # no curriculum: all labelled


def run(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(argv)
    cap = capsys.readouterr()
    return code, cap.out + cap.err


@pytest.mark.parametrize("extra, message", [
    (["--length-curriculum", "0"], "argument --length-curriculum: must be a number in (0, 1]"),
    (["--length-curriculum", "1.5"], "argument --length-curriculum: must be a number in (0, 1]"),
    (["--length-curriculum", "0.5", "--curriculum-start", "9"], "--curriculum-start must be in 1..--length (4)"),
    (["--length-curriculum", "0.5", "--curriculum-start", "0"], "argument --curriculum-start: must be an integer >= 1"),
])
def test_bad_curriculum_options_are_one_line_errors(tmp_path, capsys, extra, message):
    out = tmp_path / "st"
    code, text = run(["experiment", "state", "--quick", "--out", str(out), "--json", *extra], capsys)
    assert code == 2 and message in text and len(text.strip().splitlines()) == 1
    assert not out.exists()


def test_a_curriculum_run_is_its_own_run_and_says_so(tmp_path, capsys):
    """Through the command: a finished run without the curriculum is not reused for one with it (refused, kept, then
    trained again under --overwrite: its weights differ), the settings record it and the tables say it."""
    out = tmp_path / "st"
    common = ["experiment", "state", "--quick", "--tasks", "s3,parity", "--arms", "baseline-L,fbt-L-glu-x2",
              "--no-cost", "--out", str(out), "--json"]
    code, _ = run(common, capsys)
    assert code == 0
    weights = (out / "seed0" / "runs" / "fbt-L-glu-x2" / "model.safetensors").read_bytes()
    code, text = run(common + ["--length-curriculum", "0.5", "--curriculum-start", "2"], capsys)
    assert code == 2 and "--overwrite" in text and len(text.strip().splitlines()) == 1  # the finished run differs
    assert (out / "seed0" / "runs" / "fbt-L-glu-x2" / "model.safetensors").read_bytes() == weights
    code, _ = run(common + ["--length-curriculum", "0.5", "--curriculum-start", "2", "--overwrite"], capsys)
    assert code == 0
    assert (out / "seed0" / "runs" / "fbt-L-glu-x2" / "model.safetensors").read_bytes() != weights
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["length_curriculum"] == 0.5 and res["settings"]["curriculum_start"] == 2
    report = (out / "report.md").read_text()
    assert ("trained at T = 4 with a length curriculum: labelled length 2 at the first step, growing linearly to T "
            "over the first 0.5 of each arm's steps") in report
