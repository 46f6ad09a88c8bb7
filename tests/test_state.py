"""Long recurrences and the state experiment: the running-state generators and their dense labels against hand-computed
states, truncated gradients (``grad_passes``) against autograd through the last N passes written from the equations,
K = T passes against the exact recurrence, the early stop against the relative changes computed by hand, the curriculum
in K and the FLOP count of passes without gradient, the new ``fullband train`` flags, and ``fullband experiment state
--quick`` end to end."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F
from reference import feedback_mask, fuse, recurrence_logits, scoring_flops

from fullband import cli
from fullband.eval.depth_tasks import permutations_of
from fullband.eval.flops import training_flops
from fullband.eval.scoring import load_any_model
from fullband.eval.state_tasks import (
    LabelTable,
    dense_labels,
    encode_state_rows,
    exact_passes,
    make_state_problems,
    state_tokenizer,
)
from fullband.experiments.state import held_out, training_corpus
from fullband.training.config import TrainConfig
from fullband.training.schedule import FeedbackSchedule
from fullband.utils.stats import bootstrap_ci_within_seeds

from conftest import random_ids, tiny_model

# ---------------------------------------------------------------------------------------------- tasks


def labels_of(rows_words: list[str]) -> list[str]:
    """Dense labels of one hand-written stream, as words (the label slots 2..T+1)."""
    tok = state_tokenizer()
    inv = {i: w for w, i in tok.get_vocab().items()}
    rows = torch.tensor([[tok.bos_token_id] + [tok.convert_tokens_to_ids(w) for w in rows_words]
                         + [tok.eos_token_id]])
    lab = dense_labels(rows, LabelTable(tok))[0]
    assert (lab[:2] == -100).all()
    return [inv[int(i)] for i in lab[2:]]


def test_s3_running_product_by_hand():
    # g1 = (0,2,1), g2 = (1,0,2), g3 = (1,2,0); "a then b" is x -> b[a[x]]
    assert permutations_of(3)[1:4] == [(0, 2, 1), (1, 0, 2), (1, 2, 0)]
    assert labels_of(["g3", "g3", "g3"]) == ["g3", "g4", "g0"]  # a 3-cycle: g3^2 = (2,0,1) = g4, g3^3 = e
    assert labels_of(["g1", "g2"]) == ["g1", "g3"]  # g1 then g2: 0->1, 1->2, 2->0 = (1,2,0)
    assert labels_of(["g2", "g1"]) == ["g2", "g4"]  # g2 then g1: (2,0,1): the order matters
    assert labels_of(["g0", "g5", "g5"]) == ["g0", "g5", "g0"]  # identity, then a transposition twice


def test_s5_running_product_by_hand():
    group = permutations_of(5)
    c = group.index((1, 2, 3, 4, 0))  # x -> x + 1 mod 5
    c2 = group.index((2, 3, 4, 0, 1))
    c4 = group.index((4, 0, 1, 2, 3))
    assert labels_of([f"p{c}"] * 5) == [f"p{c}", f"p{c2}", f"p{group.index((3, 4, 0, 1, 2))}", f"p{c4}", "p0"]


def test_parity_and_variables_by_hand():
    assert labels_of(["b1", "b0", "b1", "b1", "b0"]) == ["b1", "b1", "b0", "b1", "b1"]
    # x: 1, 2; y = x = 2; z: 1; x = z = 1; y: 3
    assert labels_of(["x+", "x+", "y=x", "z+", "x=z", "y+"]) == ["v1", "v2", "v2", "v1", "v1", "v3"]
    assert labels_of(["x+"] * 6) == ["v1", "v2", "v3", "v4", "v0", "v1"]  # mod 5


def test_generators_agree_with_the_labels_and_are_seeded():
    tok = state_tokenizer()
    inv = {i: w for w, i in tok.get_vocab().items()}
    problems = make_state_problems(["s3", "s5", "parity", "vars"], 40, seed=3, length=9)
    assert [p.task for p in problems[:4]] == ["s3", "s5", "parity", "vars"]
    rows = encode_state_rows(tok, problems)
    assert rows.shape == (40, 11) and (rows[:, 0] == tok.bos_token_id).all() and (rows[:, -1] == tok.eos_token_id).all()
    labels = dense_labels(rows, LabelTable(tok))
    for p, lab in zip(problems, labels):
        assert tuple(inv[int(i)] for i in lab[2:]) == p.outputs
        assert tuple(inv[int(i)] for i in rows[problems.index(p)][1:-1]) == p.inputs
    assert make_state_problems(["s3"], 5, 3, 9) == make_state_problems(["s3"], 5, 3, 9)
    assert make_state_problems(["s3"], 5, 3, 9) != make_state_problems(["s3"], 5, 4, 9)
    assert exact_passes(10) == 11
    with pytest.raises(ValueError):
        make_state_problems(["s4"], 2, 0, 3)
    with pytest.raises(ValueError):
        encode_state_rows(tok, make_state_problems(["s3"], 1, 0, 3) + make_state_problems(["s3"], 1, 0, 4))


# ---------------------------------------------------------------------------------------------- truncated gradients


def reference_loss(model, ids, num_passes: int, grad_passes: int, weight: float = 1.0) -> torch.Tensor:
    """``L_1 + λ mean(L_2..L_K)`` with passes 1..K-N under ``torch.no_grad`` (constants) and autograd through the
    last N only, written from the equations (raw fusion weights, the backbone on ``inputs_embeds``)."""
    e = model.backbone.get_input_embeddings().weight[ids]
    mask = feedback_mask(ids, model.config.doc_start_token_id).unsqueeze(-1)
    losses, h = [], None
    for k in range(num_passes):
        with torch.set_grad_enabled(k >= num_passes - grad_passes):
            if h is None:
                u = e
            else:
                prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
                u = torch.where(mask, fuse(model, prev, e), e)
            out = model.backbone(inputs_embeds=u, output_hidden_states=True, use_cache=False)
            h = out.hidden_states[-1]
            losses.append(F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    return losses[0] + weight * torch.stack(losses[1:]).mean()


@pytest.mark.parametrize("grad_passes", [1, 2, 4])
def test_grad_passes_gradients_equal_the_truncated_reference(grad_passes):
    model = tiny_model("llama", fusion="glu", jitter=0.0).train()
    ids = random_ids(3, 9, seed=5)
    K = 4
    params = [p for p in model.parameters() if p.requires_grad]
    # score_all_passes: the passes without gradient scored too (their losses detached), the reference's full value
    out = model(ids, labels=ids, num_passes=K, grad_passes=grad_passes, score_all_passes=True)
    got = torch.autograd.grad(out.loss, params, allow_unused=True)
    ref_loss = reference_loss(model, ids, K, grad_passes)
    want = torch.autograd.grad(ref_loss, params, allow_unused=True)
    assert float(out.loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert out.grad_passes_run == grad_passes and out.passes_run == K
    # the loss value is the full objective's; only its gradient is truncated
    full = model(ids, labels=ids, num_passes=K)
    assert float(out.loss.detach()) == pytest.approx(float(full.loss.detach()), rel=1e-6)
    full_grads = torch.autograd.grad(full.loss, params, allow_unused=True)
    differs = any(g is not None and f is not None and not torch.allclose(g, f, atol=1e-7)
                  for g, f in zip(got, full_grads))
    assert differs == (grad_passes < K)


def test_grad_passes_one_gives_the_early_passes_no_gradient():
    """With N = 1 the gradient is that of the last pass alone, fed a constant state: the embedding rows of tokens are
    reached only through that pass, and pass 1's loss (L_1) contributes nothing."""
    model = tiny_model("llama", fusion="glu", jitter=0.0).train()
    ids = random_ids(2, 7, seed=1)
    K = 3
    with torch.no_grad():
        h = model(ids, num_passes=K - 1).last_hidden_state
    e = model.backbone.get_input_embeddings().weight[ids]
    prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    u = torch.where(feedback_mask(ids, model.config.doc_start_token_id).unsqueeze(-1), fuse(model, prev, e), e)
    logits = model.backbone(inputs_embeds=u, use_cache=False).logits
    last = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(last / (K - 1), params, allow_unused=True)  # λ mean(L_2..L_K): weight 1/(K-1)
    got = torch.autograd.grad(model(ids, labels=ids, num_passes=K, grad_passes=1).loss, params, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_bad_long_recurrence_arguments():
    model = tiny_model("llama", fusion="glu")
    ids = random_ids(1, 5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="grad_passes"):
            model(ids, num_passes=2, grad_passes=bad)
    with pytest.raises(ValueError, match="pass_tol"):
        model(ids, num_passes=2, pass_tol=-0.1)


# ---------------------------------------------------------------------------------------------- K = T, early stop


@pytest.mark.parametrize("fusion", ["glu", "residual"])
def test_k_equal_t_training_forward_is_the_exact_recurrence(fusion):
    model = tiny_model("llama", fusion=fusion, jitter=0.0)
    if fusion == "residual":  # move the gain off 0, so the fed-back state matters
        torch.nn.init.constant_(model.feedback.out_norm.weight, 0.5)
    ids = random_ids(2, 8, seed=2)
    T = ids.shape[1]
    model.train()  # the training forward (jitter 0), gradients on
    got = model(ids, labels=ids, num_passes=T).logits.detach()
    model.eval()
    torch.testing.assert_close(got, model.recurrent_forward(ids).logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, recurrence_logits(model, ids), rtol=1e-4, atol=1e-5)
    # one pass fewer is exact only before the last position
    short = model(ids, num_passes=T - 1).logits
    torch.testing.assert_close(short[:, :-1], got[:, :-1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(short[:, -1], got[:, -1], atol=1e-4)


def rel_change(a, b) -> float:
    return float((b - a).abs().max() / a.abs().max())


@torch.no_grad()
def test_early_stop_triggers_only_when_the_tolerance_is_met():
    model = tiny_model("llama", fusion="glu")
    ids = random_ids(2, 6, seed=4)
    K = 10
    hs = [model(ids, num_passes=k).last_hidden_state for k in range(1, K + 1)]
    changes = [rel_change(a, b) for a, b in zip(hs, hs[1:])]
    out = model(ids, labels=ids, num_passes=K, pass_tol=0.0)  # never met: every pass runs
    assert out.passes_run == K and out.pass_changes == pytest.approx(changes, rel=1e-4, abs=1e-7)
    # K = T + 1 passes reach the fixed point exactly: the change after pass T + 1 is 0
    assert changes[6 - 1] < 1e-6 and min(changes[:6 - 1]) > 1e-4
    # a tolerance just above a new running minimum of the changes: the first change below it is that one
    j = next(i for i in range(1, len(changes)) if changes[i] * 1.001 < min(changes[:i]))
    tol = changes[j] * 1.0005
    assert all(c >= tol for c in changes[:j]) and changes[j] < tol
    stopped = model(ids, labels=ids, num_passes=K, pass_tol=tol)
    assert stopped.passes_run == j + 2  # pass j + 2 (1-based) is the first whose change is below tol
    torch.testing.assert_close(stopped.logits, model(ids, num_passes=j + 2).logits)
    full = model(ids, labels=ids, num_passes=j + 2)
    # K entries: the skipped passes report the loss of the pass the passes stopped at
    assert stopped.pass_losses.shape == (K,)
    torch.testing.assert_close(stopped.pass_losses[:j + 2], full.pass_losses)
    assert torch.all(stopped.pass_losses[j + 2:] == full.pass_losses[-1])
    # a tolerance just below the smallest change never stops
    assert model(ids, num_passes=K, pass_tol=min(changes) * 0.999).passes_run == K


@torch.no_grad()
def test_early_stop_in_the_no_gradient_passes_still_runs_the_gradient_passes():
    model = tiny_model("llama", fusion="glu")
    ids = random_ids(2, 6, seed=4)
    K, N = 12, 2  # converges after pass 7 (T + 1), then the last N passes run from the fixed point
    out = model(ids, labels=ids, num_passes=K, grad_passes=N, pass_tol=1e-6)
    assert out.passes_run == 7 + N
    torch.testing.assert_close(out.logits, model.recurrent_forward(ids).logits, rtol=1e-4, atol=1e-5)
    assert out.pass_losses.shape == (K,)


def test_early_stop_cannot_fill_a_cache():
    from transformers import DynamicCache

    model = tiny_model("llama", fusion="glu")
    with pytest.raises(ValueError, match="cache"):
        model(random_ids(1, 4), num_passes=2, pass_tol=0.1, cache=DynamicCache(), use_cache=True)


# ---------------------------------------------------------------------------------------------- schedule, FLOPs, flags


def test_curriculum_in_k_by_hand():
    s = FeedbackSchedule(start_fraction=0.0, num_passes=5, deep_fraction=0.0, curriculum=0.5)
    assert [s.passes_at(i, 8) for i in range(8)] == [2, 3, 4, 5, 5, 5, 5, 5]
    s = FeedbackSchedule(start_fraction=0.5, num_passes=3, deep_fraction=0.0, curriculum=1.0)
    assert [s.passes_at(i, 20) for i in range(20)] == [1] * 10 + [2] * 5 + [3] * 5
    s = FeedbackSchedule(start_fraction=0.0, num_passes=4, deep_fraction=0.0)
    assert [s.passes_at(i, 4) for i in range(4)] == [4] * 4
    with pytest.raises(ValueError):
        FeedbackSchedule(curriculum=1.5)
    assert TrainConfig(pass_curriculum=0.5, num_passes=5).schedule().curriculum == 0.5


def test_flops_of_passes_without_gradient_by_hand():
    fp = {"matmul_params": 100, "head_params": 20, "fusion_params": 10, "layers": 1, "hidden": 4}
    per_pass = 6 * 100 + 6 * 1 * 8 * 4  # 792 per token: 6N + 6 L T d at T = 8
    free_pass = 2 * (100 - 20) + 2 * 1 * 8 * 4  # 224: a forward without the LM head (not scored, no logits)
    full = training_flops([{"num_passes": 11}], 2, 8, fp)
    assert full["flops"] == 2 * (11 * per_pass + 10 * 60)
    # 11 passes, the last 2 with gradient: 9 forwards without the head + 2 full passes; pass 1 is not fused
    part = training_flops([{"num_passes": 11, "passes_run": 11, "grad_passes_run": 2}], 2, 8, fp)
    assert part["flops"] == pytest.approx(2 * (2 * per_pass + 9 * free_pass + 2 * 60 + 8 * 20))
    # an early stop after 5 passes, all with gradient
    stop = training_flops([{"num_passes": 11, "passes_run": 5, "grad_passes_run": 5}], 2, 8, fp)
    assert stop["flops"] == 2 * (5 * per_pass + 4 * 60)


def test_train_flags_and_validation(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--grad-passes", "--pass-tol", "--pass-curriculum"):
        assert flag in text
    for bad in (dict(grad_passes=-1), dict(pass_tol=-0.5), dict(pass_curriculum=2.0)):
        with pytest.raises(ValueError):
            TrainConfig(out="x", **bad).validate()
    assert TrainConfig(grad_passes=2, pass_tol=0.01).pass_options() == {"grad_passes": 2, "pass_tol": 0.01}
    assert TrainConfig().pass_options() == {"grad_passes": None, "pass_tol": None}


# ---------------------------------------------------------------------------------------------- the experiment


def hand_flops_per_token(layers: int, d: int, vocab: int, seq: int, passes: int = 1, grad: int | None = None) -> float:
    """Training FLOPs per token of one step of the state experiment's Llama (``layers``, width ``d``, MLP ``2d``,
    as many KV heads as heads, untied head), written from its shape: 6 FLOPs per matmul weight and token per pass with
    gradient (forward 2, backward 4) plus ``6·L·T·d`` attention; a pass without gradient its forward only, 2 per
    weight and ``2·L·T·d``, without the LM head (it is not scored: no logits); the GLU fusion (W_G, W_U: 2d², the
    output norm's gain d) on passes 2..K, 6 per weight with gradient, 2 without. The weights: per layer q, k, v, o
    4d², MLP 3·d·2d, two norm gains 2d; the final norm d; the LM head V·d (the input embedding is a lookup)."""
    head = vocab * d
    weights = layers * (4 * d * d + 6 * d * d + 2 * d) + d + head
    pass_ = 6 * weights + 6 * layers * seq * d
    free_pass = 2 * (weights - head) + 2 * layers * seq * d
    fusion = 2 * d * d + d
    grad = passes if grad is None else grad
    fused_grad = min(grad, passes - 1)
    return (grad * pass_ + (passes - grad) * free_pass + fused_grad * 6 * fusion
            + (passes - 1 - fused_grad) * 2 * fusion)


def test_state_experiment_quick_end_to_end(tmp_path, capsys):
    """``fullband experiment state --quick`` end to end, every number checked against a computation of its own that
    shares nothing with the experiment's (bugs each part catches in brackets):

    * the exact-mode results of both FBT arms: recomputed from the saved models with the token-by-token recurrence
      and the generator's own labels (scoring another mode or misaligned labels; a table that is not the mean of
      the per-row results);
    * no test row is a training row of any arm (the old T = 10 parity column was training accuracy);
    * the interventions: mean and shuffle on every FBT arm, zero only on the residual entry (zero on the pure GLU
      zeroes the whole input); their per-row results recomputed with hooks written here;
    * training FLOPs of every arm with a fixed step count from the model's shape (a wrong ``run_flops``), and the
      equal-FLOPs controls' steps: the fewest plain steps that reach fbt-L's hand-counted FLOPs;
    * the cost table's FLOP ratios from the same hand count, and activation memory growing with K;
    * inference FLOPs against a count from the saved weights (tests/reference.py)."""
    out = tmp_path / "state"
    arms = ("baseline-L,baseline-2L,baseline-4L,fbt-L,fbt-L-glu,baseline-L-flops,baseline-L-epochs,fbt-L-glu-g2,"
            "fbt-L-glu-tol")
    assert cli.main(["experiment", "state", "--quick", "--out", str(out), "--json", "--arms", arms]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads((out / "results.json").read_text())
    assert printed["table"] == res["table"]
    assert res["seeds"] == [0] and list(res["per_seed"]) == ["0"]  # --seeds defaults to one seed, 0
    s = res["settings"]
    T, K, n_test = s["length"], s["num_passes"], s["test_rows"]
    lengths = [T, 2 * T, 4 * T]
    assert s["lengths"] == lengths and K == T + 1
    tasks = s["tasks"].split(",")
    assert res["arms"] == arms.split(",")
    tok = state_tokenizer()
    vocab = tok.get_vocab()
    run = lambda arm: out / "seed0" / "runs" / arm  # noqa: E731
    seed0 = res["per_seed"]["0"]
    # the test rows, drawn here from the documented seeds; the training rows of baseline-L (and of the FBT arms)
    a = argparse.Namespace(**(s | {"tasks_list": tasks, "seed": 0, "random_positions": False}))
    held = held_out(a, tok)
    train = {tuple(r) for r in training_corpus(a, tok, s["steps"], 0, held).train_rows.tolist()}
    problems = {}
    for j, task in enumerate(tasks):
        for m in (1, 2, 4):
            problems[(task, T * m)] = make_state_problems([task], n_test, 1_000_003 * (1 + m) + 101 * j, T * m)
            rows = encode_state_rows(tok, problems[(task, T * m)])
            assert not {tuple(r) for r in rows.tolist()} & train
    for arm in ("fbt-L", "fbt-L-glu"):
        model = load_any_model(str(run(arm)))[0].eval()
        for (task, n), probs in problems.items():
            rows = encode_state_rows(tok, probs)
            labels = torch.tensor([[vocab[w] for w in p.outputs] for p in probs])
            clean = model.recurrent_forward(rows)
            hit = (clean.logits[:, 1:-1].argmax(-1) == labels).double()
            got = seed0[arm]["correct"]["exact"][f"{task}/{n}"]
            assert got["pos"] == pytest.approx(hit.mean(1).tolist()) and got["last"] == hit[:, -1].long().tolist()
            assert got["by_position"] == pytest.approx(hit.mean(0).tolist())
            h = clean.last_hidden_state
            hooks = {"mean": lambda t, prev: h.mean(0, keepdim=True)[:, t - 1:t].expand_as(prev),
                     "shuffle": lambda t, prev: torch.roll(h, 1, dims=0)[:, t - 1:t]}  # row i: row i-1's state
            if arm == "fbt-L":
                hooks["zero"] = lambda t, prev: torch.zeros_like(prev)
            assert sorted(k for k in seed0[arm]["correct"] if "/" in k) == sorted(f"exact/{k}" for k in hooks)
            for name, hook in hooks.items():
                hit = (model.recurrent_forward(rows, state_hook=hook).logits[:, 1:-1].argmax(-1) == labels).double()
                assert seed0[arm]["correct"][f"exact/{name}"][f"{task}/{n}"]["pos"] == pytest.approx(
                    hit.mean(1).tolist()), (arm, name, task, n)
    for row in res["table"]:
        v = seed0[row["arm"]]["correct"][row["mode"]][f"{row['task']}/{row['length']}"]
        assert len(v["pos"]) == n_test and row["pos"]["estimate"] == pytest.approx(sum(v["pos"]) / n_test)
        assert row["last"]["estimate"] == pytest.approx(sum(v["last"]) / n_test)
    cells = {(r["arm"], r["mode"], r["task"], r["length"]) for r in res["table"]}
    for arm in res["arms"]:
        modes = ["standard", "K=2", "exact"] if arm.startswith("fbt") else ["standard"]
        assert cells >= {(arm, mode, t, n) for mode in modes for t in tasks for n in lengths}
    for r in res["interventions"]:
        exact = seed0[r["arm"]]["correct"]["exact"][f"{r['task']}/{r['length']}"]["pos"]
        inter = seed0[r["arm"]]["correct"][f"exact/{r['intervention']}"][f"{r['task']}/{r['length']}"]["pos"]
        assert r["delta"]["estimate"] == pytest.approx(sum(x - y for x, y in zip(inter, exact)) / n_test)
    # training FLOPs from the shape (seq = T + 2; quick: L = 1, d = 32), not from the package's FLOP helpers
    runs = res["runs"]
    L, d, V, seq = s["layers"], s["hidden"], len(tok), T + 2
    tokens = s["steps"] * s["batch_size"] * seq
    want = {"baseline-L": tokens * hand_flops_per_token(L, d, V, seq),
            "baseline-2L": tokens * hand_flops_per_token(2 * L, d, V, seq),
            "baseline-4L": tokens * hand_flops_per_token(4 * L, d, V, seq),
            "fbt-L": tokens * hand_flops_per_token(L, d, V, seq, K),
            "fbt-L-glu": tokens * hand_flops_per_token(L, d, V, seq, K),
            "fbt-L-glu-g2": tokens * hand_flops_per_token(L, d, V, seq, K, grad=2)}
    for arm, flops in want.items():
        assert runs[arm]["train_flops"] == pytest.approx(flops, rel=1e-9), arm
        assert runs[arm]["steps"] == s["steps"]
    plain_step = s["batch_size"] * seq * hand_flops_per_token(L, d, V, seq)
    control_steps = math.ceil(want["fbt-L"] / plain_step)
    assert control_steps > s["steps"]
    for control in ("baseline-L-flops", "baseline-L-epochs"):
        assert runs[control]["steps"] == control_steps
        assert runs[control]["train_flops"] == pytest.approx(control_steps * plain_step, rel=1e-9)
    assert runs["fbt-L-glu-tol"]["train_flops"] <= want["fbt-L-glu"] * (1 + 1e-9)
    assert "| baseline-L-epochs | standard | s3 | baseline-L |" in (out / "report.md").read_text()
    cost = {(c["num_passes"], c["grad_passes"], c["pass_tol"]): c for c in res["cost"]}
    assert {(1, 1, None), (2, 2, None), (K, K, None), (K, 2, None), (K, 1, None)} <= set(cost)
    for (k, g, tol), c in cost.items():
        if tol is None:  # FLOPs of one step of the cost table's rows (S3, T + 2 tokens) by hand, over a plain step
            assert c["flops_ratio"] == pytest.approx(hand_flops_per_token(L, d, V, seq, k, grad=g)
                                                     / hand_flops_per_token(L, d, V, seq), rel=1e-9)
    full = [cost[(k, k, None)]["saved_mib"] for k in sorted({k for k, g, t in cost if g == k and t is None})]
    assert full == sorted(full) and full[0] < full[-1]  # autograd saves more with every pass it backpropagates
    assert cost[(K, 1, None)]["saved_mib"] < cost[(K, 2, None)]["saved_mib"] < cost[(K, K, None)]["saved_mib"]
    report = (out / "report.md").read_text()
    assert "| fbt-L | exact |" in report and "resamples its test rows, not seeds" in report
    assert (out / "state.png").stat().st_size > 0
    # inference FLOPs per token, x the L-layer model's standard pass on the same rows: against a count written from
    # the saved weights' parameter counts (tests/reference.py); the standard pass of every L-layer model exactly 1
    for r in res["table"]:
        n = r["length"] + 2  # the rows scored: BOS, the inputs, EOS
        mode = {"standard": "standard", "K=2": "passes", "exact": "exact"}[r["mode"]]
        want_inf = scoring_flops(run(r["arm"]), n, mode) / scoring_flops(run("baseline-L"), n, "standard")
        assert r["inference_flops"] == pytest.approx(want_inf, rel=1e-12), (r["arm"], r["mode"], n)
        if r["mode"] == "standard" and runs[r["arm"]]["layers"] == s["layers"]:
            assert r["inference_flops"] == 1.0


def test_state_seeds_reuse_a_moved_seed_and_aggregate_per_seed(tmp_path, capsys):
    """``--seeds 0,1`` after a ``--seed 0`` run moved to another --out: seed 0 is reused there (not one of its
    files rewritten), only seed 1 trains; every table number is the mean over seeds of the per-seed means of the
    per-row results in results.json, its CI resamples rows within each seed; and baseline-L-epochs is plain, as
    many steps as baseline-L-flops (the fewest plain steps reaching fbt-L's training FLOPs), re-reading exactly
    baseline-L's rows (--unique-batches = --steps, the same training data), with baseline-L's other options."""
    arms = "baseline-L,fbt-L,baseline-L-flops,baseline-L-epochs"
    cmd = ["experiment", "state", "--quick", "--no-cost", "--arms", arms]
    first, out = tmp_path / "first", tmp_path / "state"
    assert cli.main(cmd + ["--out", str(first), "--seed", "0"]) == 0
    single = json.loads((first / "results.json").read_text())
    out.mkdir()
    (first / "seed0").rename(out / "seed0")  # a finished seed moved elsewhere, as a run of the old layout would be
    stamps = {p: p.stat().st_mtime_ns for p in (out / "seed0").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main(cmd + ["--out", str(out), "--seeds", "0,1"]) == 0
    trained = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("state: training")]
    assert len(trained) == 4  # the four arms of seed 1 only
    assert {p: p.stat().st_mtime_ns for p in (out / "seed0").rglob("*") if p.is_file()} == stamps
    assert sorted(p.name for p in (out / "seed1" / "runs").iterdir()) == sorted(arms.split(","))
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0, 1] and res["settings"]["seeds"] == "0,1"
    per = res["per_seed"]
    assert per["0"] == {a: {**r, "train_seconds": per["0"][a]["train_seconds"],
                            "eval_seconds": per["0"][a]["eval_seconds"]} for a, r in single["per_seed"]["0"].items()}
    assert per["0"]["baseline-L"]["correct"] != per["1"]["baseline-L"]["correct"]  # other rows, other weights

    def mean(x):
        return sum(x) / len(x)

    for row in res["table"]:
        cell = f"{row['task']}/{row['length']}"
        rows = [per[s][row["arm"]]["correct"][row["mode"]][cell]["pos"] for s in ("0", "1")]
        assert row["per_seed"]["pos"] == pytest.approx([mean(r) for r in rows])
        assert row["pos"]["estimate"] == pytest.approx(mean([mean(r) for r in rows]))
        assert row["pos"]["low"] <= row["pos"]["estimate"] <= row["pos"]["high"]
        ci = bootstrap_ci_within_seeds(rows, seed=0, n_resamples=2000)  # rows resampled within each seed
        assert (row["pos"]["low"], row["pos"]["high"]) == pytest.approx((ci["low"], ci["high"]))
        last = [per[s][row["arm"]]["correct"][row["mode"]][cell]["last"] for s in ("0", "1")]
        assert row["last"]["estimate"] == pytest.approx(mean([mean(r) for r in last]))
    assert {d["vs"] for d in res["deltas"] if d["arm"] == "fbt-L"} == {"baseline-L", "baseline-L-flops",
                                                                      "baseline-L-epochs"}
    assert {d["vs"] for d in res["deltas"] if d["arm"] == "baseline-L-epochs"} == {"baseline-L"}
    for d in res["deltas"]:
        cell = f"{d['task']}/{d['length']}"
        diffs = [mean([a - b for a, b in zip(per[s][d["arm"]]["correct"][d["mode"]][cell]["pos"],
                                             per[s][d["vs"]]["correct"]["standard"][cell]["pos"])]) for s in ("0", "1")]
        assert d["delta"]["estimate"] == pytest.approx(mean(diffs))
    for s in ("0", "1"):
        runs = out / f"seed{s}" / "runs"
        cfg = {a: json.loads((runs / a / "run_config.json").read_text()) for a in arms.split(",")}
        data = {a: json.loads((runs / a / "summary.json").read_text())["data_sha256"] for a in arms.split(",")}
        epochs, flops, base = cfg["baseline-L-epochs"], cfg["baseline-L-flops"], cfg["baseline-L"]
        assert epochs["unique_batches"] == base["steps"] == 6 and flops["unique_batches"] == 0
        # FLOPs from the model's shape (quick: L = 1, d = 32, rows of T + 2 = 6), not from run_flops on both sides
        st = res["settings"]
        seq, tokens = st["length"] + 2, st["batch_size"] * (st["length"] + 2)
        per_step = tokens * hand_flops_per_token(st["layers"], st["hidden"], len(state_tokenizer()), seq)
        fbt = base["steps"] * tokens * hand_flops_per_token(st["layers"], st["hidden"], len(state_tokenizer()), seq,
                                                            st["num_passes"])
        assert per[s]["fbt-L"]["train_flops"] == pytest.approx(fbt, rel=1e-9)
        assert per[s]["baseline-L"]["train_flops"] == pytest.approx(base["steps"] * per_step, rel=1e-9)
        assert epochs["steps"] == flops["steps"] == math.ceil(fbt / per_step)
        assert (epochs["steps"] - 1) * per_step < fbt <= epochs["steps"] * per_step
        assert data["baseline-L-epochs"] == data["baseline-L"] != data["baseline-L-flops"]
        assert epochs["num_passes"] == 1
        same = ("out", "steps", "unique_batches")
        assert {k: v for k, v in epochs.items() if k not in same} == {k: v for k, v in base.items() if k not in same}
    report = (out / "report.md").read_text()
    assert "mean of 2 seeds" in report and "| fbt-L | exact | s3 | baseline-L-epochs |" in report


def test_state_seed_and_control_options_are_checked(tmp_path, capsys):
    """One-line errors, exit 2, nothing written: both --seeds and --seed, a repeated, non-integer or negative seed,
    an equal-FLOPs control without an FBT arm to match, a --length whose 4T test rows exceed the backbone's positions
    (refused before anything trains: it once failed at scoring after 53 minutes of training)."""
    for bad, says in ((["--seeds", "0", "--seed", "1"], "--seed"), (["--seeds", "0,0"], "--seeds"),
                      (["--seeds", "a"], "--seeds"), (["--seeds", "-1"], "--seeds"),
                      (["--arms", "baseline-L,baseline-L-epochs"], "needs an FBT arm"),
                      (["--length", "64"], "4T test rows are 258 tokens")):
        assert cli.main(["experiment", "state", "--quick", "--out", str(tmp_path / "x"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]
    assert not (tmp_path / "x").exists()


def test_the_linear_cost_arm_trains_the_exact_states_and_its_control_is_matched_by_hand(tmp_path):
    """``fbt-L-glu-x2`` (``--exact-states --grad-passes 2``): every step runs the token-by-token pass and 2 gradient
    passes (logged so), its training FLOPs are the count written here from the model's shape (the token pass: a
    forward without the LM head and a fused token, 2 per fusion weight; then 2 fused passes with gradient), the
    FLOP-matched plain control gets the fewest steps that reach them."""
    out = tmp_path / "x2"
    arms = "baseline-L,fbt-L-glu-x2,baseline-L-flops"
    assert cli.main(["experiment", "state", "--quick", "--no-cost", "--out", str(out), "--json", "--arms", arms]) == 0
    res = json.loads((out / "results.json").read_text())
    s = res["settings"]
    recs = [json.loads(line) for line in open(out / "seed0" / "runs" / "fbt-L-glu-x2" / "metrics.jsonl")]
    train = [r for r in recs if r.get("split") == "train"]
    assert len(train) == s["steps"] and all(r["exact_states"] and len(r["pass_losses"]) == 2 for r in train)
    L, d, V, seq = s["layers"], s["hidden"], len(state_tokenizer()), s["length"] + 2
    head = V * d
    weights = L * (4 * d * d + 6 * d * d + 2 * d) + d + head
    fusion = 2 * d * d + d
    per_pass = 6 * weights + 6 * L * seq * d
    token_pass = 2 * (weights - head) + 2 * L * seq * d + 2 * fusion
    tokens = s["steps"] * s["batch_size"] * seq
    want = tokens * (token_pass + 2 * (per_pass + 6 * fusion))
    runs = res["runs"]
    assert runs["fbt-L-glu-x2"]["train_flops"] == pytest.approx(want, rel=1e-9)
    plain_step = s["batch_size"] * seq * per_pass
    assert runs["baseline-L-flops"]["steps"] == math.ceil(want / plain_step)
    model = load_any_model(str(out / "seed0" / "runs" / "fbt-L-glu-x2"))[0].eval()
    assert model.config.fusion == "glu"


def test_the_full_backprop_arm_trains_through_the_recurrence_and_its_control_is_matched_by_hand(tmp_path):
    """``fbt-L-glu-fb`` (``--full-backprop --backprop-chunk 8``): every step runs the recurrence once with gradient
    (one pass loss, logged so), its training FLOPs are the count written here from the model's shape (one fused
    pass with gradient, plus its forward recomputed in the backward: a fused forward with the LM head), and the
    FLOP-matched plain control gets the fewest steps that reach them."""
    out = tmp_path / "fb"
    arms = "baseline-L,fbt-L-glu-fb,baseline-L-flops"
    assert cli.main(["experiment", "state", "--quick", "--no-cost", "--out", str(out), "--json", "--arms", arms]) == 0
    res = json.loads((out / "results.json").read_text())
    s = res["settings"]
    recs = [json.loads(line) for line in open(out / "seed0" / "runs" / "fbt-L-glu-fb" / "metrics.jsonl")]
    train = [r for r in recs if r.get("split") == "train"]
    assert len(train) == s["steps"] and all(r["full_backprop"] and len(r["pass_losses"]) == 1 for r in train)
    L, d, V, seq = s["layers"], s["hidden"], len(state_tokenizer()), s["length"] + 2
    weights = L * (4 * d * d + 6 * d * d + 2 * d) + d + V * d
    fusion = 2 * d * d + d
    per_pass = 6 * weights + 6 * L * seq * d
    recompute = 2 * weights + 2 * L * seq * d + 2 * fusion
    want = s["steps"] * s["batch_size"] * seq * (per_pass + 6 * fusion + recompute)
    runs = res["runs"]
    assert runs["fbt-L-glu-fb"]["train_flops"] == pytest.approx(want, rel=1e-9)
    assert runs["baseline-L-flops"]["steps"] == math.ceil(want / (s["batch_size"] * seq * per_pass))
    assert load_any_model(str(out / "seed0" / "runs" / "fbt-L-glu-fb"))[0].config.fusion == "glu"
