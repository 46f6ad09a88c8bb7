"""The state experiment's evidence: interventions that remove the fed-back state alone (the token stays, another
row's state really is another row's on every batch size), test and validation rows no arm trained on (drawn apart
and refused when not), the plain arms' LR chosen on validation rows, and the randomized-position control (position
ids that reach the model unpacked; why a constant offset would be no control under RoPE)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fullband import cli
from fullband.eval.scoring import load_any_model
from fullband.eval.state_tasks import (
    LabelTable,
    dense_labels,
    encode_state_rows,
    make_state_problems,
    problem_key,
    state_tokenizer,
)
from fullband.experiments import state, state_data
from fullband.training.config import TrainConfig
from fullband.training.pretrain import rows_fingerprint

from conftest import random_ids, tiny_model


def state_args(argv: list[str]) -> argparse.Namespace:
    """``fullband experiment state`` options as the CLI parses them (:func:`state.add_arguments` among them)."""
    return cli.build_parser().parse_args(["experiment", "state", *argv])


def residual_model():
    model = tiny_model("llama", fusion="residual", jitter=0.0)
    torch.nn.init.constant_(model.feedback.out_norm.weight, 0.5)  # move the gain off 0: the state matters
    return model


# ---------------------------------------------------------------------------------------------- interventions


def test_a_zero_state_on_the_pure_glu_removes_the_token_too_so_it_is_not_run_there():
    """The bug: on the GLU entry u = norm(W_U·0 ⊙ gate) = 0 for every token, so "state zeroed" scored a model with
    no input at all. On the residual entry u = e + norm(0) = e: the token, without the state."""
    glu, res = tiny_model("llama", fusion="glu"), residual_model()
    ids = torch.arange(3, 40)
    zero = torch.zeros(len(ids), glu.backbone.config.hidden_size)
    e = glu.get_input_embeddings()(ids)
    assert torch.count_nonzero(glu.fuse(zero, ids, e)) == 0  # every token: the same (zero) input
    er = res.get_input_embeddings()(ids)
    torch.testing.assert_close(res.fuse(zero, ids, er), er)  # the token embedding itself
    assert not state.zero_keeps_token(glu) and state.zero_keeps_token(res)
    assert state.interventions_for(glu) == ["mean", "shuffle"]
    assert state.interventions_for(res) == ["mean", "shuffle", "zero"]


@pytest.mark.parametrize("fusion", ["glu", "residual"])
def test_every_intervention_keeps_the_token(fusion):
    """Two different tokens at the same position, fed the same intervened state, enter the backbone differently
    (the intervened input still carries the token) -- and so do the recurrence's own inputs of two rows that differ
    in one token, under every intervention the experiment runs for that fusion."""
    model = tiny_model("llama", fusion="glu") if fusion == "glu" else residual_model()
    rows = random_ids(4, 9, seed=3)
    rows[1] = rows[0]
    rows[1, 5] = rows[0, 5] + 1 if rows[0, 5] + 1 < model.get_input_embeddings().num_embeddings else 3
    states = state.exact_states(model, rows)
    for name in state.interventions_for(model):
        hook = state.intervention_hook(name, states, torch.arange(4))
        s = hook(5, states[:, 4:5])[:1].expand(2, 1, -1)  # the state row 0 gets at step 5, given to both tokens
        tok = torch.stack([rows[0, 5], rows[1, 5]]).view(2, 1)
        u = model.fuse(s, tok, model.get_input_embeddings()(tok))
        assert not torch.allclose(u[0], u[1], atol=1e-6), name
        if name != "shuffle":  # same state for both rows (shuffle gives each row its own partner's)
            same = state.intervention_hook(name, states, torch.arange(2))
            inputs = model.recurrent_forward(rows[:2], state_hook=same).inputs_embeds
            assert not torch.allclose(inputs[0, 5], inputs[1, 5], atol=1e-6), name
            torch.testing.assert_close(inputs[0, :5], inputs[1, :5])  # before the differing token: the same


def test_the_mean_intervention_is_the_mean_state_at_that_step_by_hand():
    model = tiny_model("llama", fusion="glu")
    rows = random_ids(5, 7, seed=1)
    h = model.recurrent_forward(rows).last_hidden_state
    hook = state.intervention_hook("mean", state.exact_states(model, rows, batch=2), torch.arange(5))
    for t in range(1, 7):
        want = sum(h[b, t - 1] for b in range(5)) / 5  # step t is fed h_{t-1}: its mean over the five rows
        torch.testing.assert_close(hook(t, torch.zeros(5, 1, h.shape[-1])), want.expand(5, 1, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hook(1, h[:, :1]), h[:, :1])  # step 1: every row feeds its BOS state, unchanged


@pytest.mark.parametrize("chunk", [1, 2, 3, 256])
def test_shuffle_gives_every_row_another_rows_state_on_every_batch_size(chunk):
    """The old hook, ``prev.roll(1, dims=0)`` inside each scoring batch, changed nothing on a one-row batch (the
    last batch of a set, or a whole set scored one row at a time). Now row i takes row i-1's state of the whole
    set, whatever the batch: at every step after the first (the BOS state, the same in every row) every row is fed
    a state other than its own."""
    model = tiny_model("llama", fusion="glu")
    rows = random_ids(5, 8, seed=2)
    own = state.exact_states(model, rows)
    for i in range(0, 5, chunk):
        index = torch.arange(i, min(i + chunk, 5))
        hook = state.intervention_hook("shuffle", own, index)
        for t in range(1, 8):
            fed = hook(t, own[index, t - 1:t])
            torch.testing.assert_close(fed, own[(index - 1) % 5, t - 1:t])
            if t == 1:  # step 1 feeds the BOS state, the same in every row: another row's is the same
                torch.testing.assert_close(fed, own[index, :1])
                continue
            assert ((fed - own[index, t - 1:t]).abs().amax(-1) > 1e-4).all(), (chunk, t)
    # through the experiment's scorer (called positionally: the old per_row took the hook name and the batch
    # there too): every state its hook feeds differs from the state the row would have fed itself
    tok = state_tokenizer()
    srows = encode_state_rows(tok, make_state_problems(["s3"], 5, 0, 6))  # S3's ids are inside the tiny vocabulary
    srows[:, 1] = torch.tensor([tok.convert_tokens_to_ids(f"g{i}") for i in range(5)])  # no two rows share a prefix
    fed, original = [], model.recurrent_forward

    def spy(r, *a, state_hook=None, **k):
        if state_hook is None:
            return original(r, *a, **k)

        def hook(t, prev):
            new = state_hook(t, prev)
            if t > 1:  # step 1: every row's BOS state
                fed.append((prev.clone(), new.clone()))
            return new
        return original(r, *a, state_hook=hook, **k)

    model.recurrent_forward = spy
    state.per_row(model, srows, LabelTable(tok), "exact", 1, "shuffle", chunk)
    assert len(fed) == 6 * math.ceil(5 / chunk)
    assert all(((new - prev).abs().amax(-1) > 1e-4).all() for prev, new in fed), chunk


def test_shuffle_on_one_row_fails_loudly(tmp_path, capsys):
    model = tiny_model("llama", fusion="glu")
    rows = random_ids(1, 6)
    with pytest.raises(ValueError, match="another row"):
        state.intervention_hook("shuffle", state.exact_states(model, rows), torch.arange(1))
    # the experiment refuses one test row before anything trains (one line, exit 2, nothing written)
    assert cli.main(["experiment", "state", "--quick", "--test-rows", "1", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--test-rows" in err[0] and not (tmp_path / "x").exists()


def test_evaluate_arm_runs_no_zero_intervention_on_the_glu_entry():
    """The experiment's evaluation of a GLU model: exact/mean and exact/shuffle, no exact/zero (it scored -1.00:
    a model with no input); a residual model also gets exact/zero, where it removes the state alone."""
    tok = state_tokenizer()
    sets = {("s3", 4): encode_state_rows(tok, make_state_problems(["s3"], 6, 0, 4))}  # ids inside the tiny vocabulary
    table = LabelTable(tok)
    for model, want in ((tiny_model("llama", fusion="glu"), ["exact/mean", "exact/shuffle"]),
                        (residual_model(), ["exact/mean", "exact/shuffle", "exact/zero"])):
        res = state.evaluate_arm(model, sets, table, "cpu")
        assert [k for k in res if k.startswith("exact/")] == want


# ---------------------------------------------------------------------------------------------- held-out rows


def small_args(**kw) -> argparse.Namespace:
    values = dict(tasks_list=["parity"], length=3, test_rows=4, batch_size=4, seed=0, random_positions=False)
    return argparse.Namespace(**(values | kw))


def test_no_training_row_is_a_test_or_validation_row():
    """Parity at T = 3 has 8 strings: drawn without exclusion, 48 training rows hold every test row (the old
    experiment scored training rows at T = 10 too: 1,024 parity strings, 200 test rows, ~9,600 training rows)."""
    tok = state_tokenizer()
    args = small_args()
    held = state.held_out(args, tok)
    test = {tuple(r) for rows in held.test.values() for r in rows.tolist()}
    val = {tuple(r) for rows in held.val.values() for r in rows.tolist()}
    assert not test & val
    corpus = state.training_corpus(args, tok, 12, 5, held)
    train = {tuple(r) for r in corpus.train_rows.tolist()}
    assert corpus.train_rows.shape == (48, 5) and not train & (test | val) and held.overlap(corpus.train_rows) == 0
    unguarded = {tuple(r) for r in encode_state_rows(tok, make_state_problems(["parity"], 48, 5, 3)).tolist()}
    assert unguarded & test  # what the draws give without the exclusion: the test would have been training rows


def test_the_experiment_refuses_to_score_a_row_it_trained_on(monkeypatch):
    tok = state_tokenizer()
    args = small_args()
    held = state.held_out(args, tok)
    leaked = torch.cat([encode_state_rows(tok, make_state_problems(["parity"], 4, 9, 3)), held.test[("parity", 3)][:1]])
    with pytest.raises(RuntimeError, match="refuses to score"):
        held.refuse(leaked, "baseline-L")
    # a draw that ignored the exclusion is caught by the token-row check, before anything trains
    real = state_data.make_state_problems
    monkeypatch.setattr(state_data, "make_state_problems",
                        lambda *a, exclude=frozenset(), **k: real(*a, **k))
    with pytest.raises(RuntimeError, match="held-out"):
        state.training_corpus(args, tok, 12, 5, state.held_out(args, tok))


def test_a_task_the_held_out_rows_cover_is_a_one_line_error():
    exclude = {problem_key(p) for p in make_state_problems(["parity"], 200, 0, 2)}  # all 4 strings of length 2
    assert len(exclude) == 4
    with pytest.raises(ValueError, match="held-out rows cover"):
        make_state_problems(["parity"], 3, 1, 2, exclude=exclude)


# ---------------------------------------------------------------------------------------------- LR sweep


def test_plain_lrs_are_checked():
    for bad in ("a", "0", "1e-3,1e-3", "-1e-3"):
        with pytest.raises(ValueError, match="--plain-lrs"):
            state.parse_lrs(argparse.Namespace(plain_lrs=bad))
    assert state.parse_lrs(argparse.Namespace(plain_lrs="1e-3, 3e-3")) == [1e-3, 3e-3]


def test_the_plain_arms_lr_is_chosen_on_validation_rows(tmp_path):
    """--plain-lrs: baseline-L and baseline-2L trained at each LR (runs/{arm}-lr{lr}); each reported at the LR
    whose model scores best on the validation rows, recomputed here from the saved models on rows drawn by hand
    (the validation seeds), never the test rows; the table's numbers are that model's."""
    out = tmp_path / "s"
    args = state_args(["--quick", "--no-cost", "--json", "--out", str(out), "--arms", "baseline-L,baseline-2L",
                       "--plain-lrs", "1e-3,1e-2", "--tasks", "parity,s3"])
    res = state.run_state(args)
    tok = state_tokenizer()
    table = LabelTable(tok)
    runs = out / "seed0" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["baseline-2L-lr0.001", "baseline-2L-lr0.01",
                                                       "baseline-L-lr0.001", "baseline-L-lr0.01"]
    s = res["settings"]
    for arm in ("baseline-L", "baseline-2L"):
        val = {}
        for lr in ("0.001", "0.01"):
            model = load_any_model(str(runs / f"{arm}-lr{lr}"))[0].eval()
            keys = {problem_key(p) for j, t in enumerate(["parity", "s3"]) for m in (1, 2, 4)  # every test row
                    for p in make_state_problems([t], s["test_rows"], 1_000_003 * (1 + m) + 101 * j, s["length"] * m)}
            accs = []
            for j, task in enumerate(["parity", "s3"]):  # the validation rows: their own seeds, no test row
                probs = make_state_problems([task], s["test_rows"], 7_000_003 + 101 * j, s["length"], exclude=keys)
                keys |= {problem_key(p) for p in probs}
                rows = encode_state_rows(tok, probs)
                with torch.no_grad():
                    hit = model(input_ids=rows).logits[:, 1:-1].argmax(-1) == dense_labels(rows, table)[:, 2:]
                accs.append(hit.double().mean().item())
            val[lr] = sum(accs) / len(accs)
        sweep = res["lr_sweep"]["0"][arm]
        assert sweep["val"] == pytest.approx(val)
        best = max(val, key=val.get)
        assert sweep["lr"] == float(best) and res["per_seed"]["0"][arm]["lr"] == float(best)
        # the table is the chosen run's: its test accuracy recomputed from that model
        model = load_any_model(str(runs / f"{arm}-lr{best}"))[0].eval()
        rows = encode_state_rows(tok, make_state_problems(["parity"], s["test_rows"], 1_000_003 * 2, s["length"]))
        with torch.no_grad():
            hit = model(input_ids=rows).logits[:, 1:-1].argmax(-1) == dense_labels(rows, table)[:, 2:]
        row = next(r for r in res["table"] if (r["arm"], r["task"], r["length"]) == (arm, "parity", s["length"]))
        assert row["pos"]["estimate"] == pytest.approx(hit.double().mean().item())
    assert "LR sweep of the plain arms" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------- positions


def test_a_constant_position_offset_is_no_control_under_rope():
    """Why --random-positions draws gapped positions: shifting every position of a row by the same offset leaves a
    RoPE model's logits unchanged (attention sees relative distances only), so it would test nothing."""
    model = tiny_model("llama", fusion="glu")
    ids = random_ids(2, 10, seed=4)
    base = model(ids, position_ids=torch.arange(10).expand(2, -1), attention_mask=torch.ones_like(ids)).logits
    moved = model(ids, position_ids=torch.arange(10).expand(2, -1) + 37, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(moved, base, rtol=1e-4, atol=1e-4)


def test_random_positions_reach_the_model_and_cover_the_longest_test_row():
    """The recipe's micro-batches carry gapped position ids (0 first, strictly increasing, below 4T + 2, a fresh
    draw per row and step, the same for the same step) with an all-ones attention mask and, on FBT steps, a
    feedback mask open at every position but BOS (gapped ids are not read as packed samples' starts); attention
    still reaches across the gaps. The corpus fingerprint includes the positions: a run is not reused across."""
    tok = state_tokenizer()
    args = small_args(tasks_list=["s3"], length=6, random_positions=True)
    held = state.held_out(args, tok)
    corpus = state.training_corpus(args, tok, 4, 1, held)
    assert corpus.position_range == 26 and state.position_range(small_args(length=6)) == 0
    contiguous = state.training_corpus(small_args(tasks_list=["s3"], length=6), tok, 4, 1, held)
    assert contiguous.fingerprint == rows_fingerprint(contiguous.train_rows, contiguous.val_rows)
    assert corpus.fingerprint != contiguous.fingerprint
    cfg = TrainConfig(out="unused", steps=4, batch_size=4, seq_len=8, seed=3, num_passes=1)
    recipe = state.StateRecipe(cfg, corpus, "x")
    recipe.train_rows, recipe.val_rows, recipe.tokenizer, recipe.doc_id = corpus.train_rows, corpus.val_rows, tok, 0
    env = argparse.Namespace(world_size=1, rank=0, device=torch.device("cpu"))
    mb = recipe.batch(2, 1, torch.Generator().manual_seed(0), env).micro[0]
    pos = mb["position_ids"]
    assert pos.shape == (4, 8) and (pos[:, 0] == 0).all() and (pos[:, 1:] > pos[:, :-1]).all()
    assert int(pos.max()) < 26 and len({tuple(p) for p in pos.tolist()}) == 4 and int(pos[:, -1].min()) > 7
    assert torch.equal(recipe.batch(2, 1, torch.Generator(), env).micro[0]["position_ids"], pos)
    assert not torch.equal(recipe.batch(3, 1, torch.Generator(), env).micro[0]["position_ids"], pos)
    torch.testing.assert_close(mb["labels"], dense_labels(mb["input_ids"], LabelTable(tok)))
    model = tiny_model("llama", fusion="glu")
    ids = random_ids(1, 8, seed=1)
    p = torch.tensor([[0, 3, 4, 9, 10, 15, 20, 25]])
    other = ids.clone()
    other[0, 1] = ids[0, 1] % 40 + 3
    kw = dict(position_ids=p, attention_mask=torch.ones_like(ids))
    assert not torch.allclose(model(ids, **kw).logits[0, -1], model(other, **kw).logits[0, -1], atol=1e-6)
    # an FBT step's micro-batch: fused at every position but BOS (no gap read as a packed sample's start)
    fbt = state.StateRecipe(TrainConfig(out="unused", steps=4, batch_size=4, seq_len=8, seed=3, num_passes=3,
                                        prefix_mix=0.0), corpus, "y")
    fbt.train_rows, fbt.val_rows, fbt.tokenizer, fbt.doc_id = corpus.train_rows, corpus.val_rows, tok, tok.bos_token_id
    mb = fbt.batch(1, 3, torch.Generator().manual_seed(0), env).micro[0]
    assert mb["feedback_mask"][:, 1:].all() and not mb["feedback_mask"][:, 0].any()
    assert (mb["position_ids"][:, 1:] - mb["position_ids"][:, :-1] > 1).any()  # gapped
