"""The controls behind the experiments' comparisons: ``--unique-batches`` (a plain run that re-reads exactly the
rows of an ordinary N-batch run, epoch after epoch, for the FBT run's FLOPs), the count of distinct rows a run
reads, and the inference FLOPs of each scoring mode (:func:`fullband.eval.flops.inference_flops`)."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

from fullband.data.order import batch_rows, distinct_rows_read, pool_batch_rows
from fullband.eval.flops import inference_flops
from fullband.training import pretrain
from fullband.training.config import TrainConfig
from fullband.training.pretrain import train
from fullband.utils.io import read_jsonl


def _reference_order(num_rows: int, seed: int, positions: range) -> list[int]:
    """The in-memory order written from its definition: epoch e is torch.randperm seeded seed * 1_000_003 + e."""
    out = []
    for pos in positions:
        epoch, within = divmod(pos, num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[within]))
    return out


@pytest.mark.parametrize("order", ["randperm", "feistel"])
@pytest.mark.parametrize("offset", [0, 3])
def test_a_pool_epoch_reads_exactly_the_rows_of_the_ordinary_batches(order, offset):
    """Every epoch of the pool (N x batch consecutive reads) is the multiset of rows the ordinary order's batches
    offset .. offset+N-1 read (here across an epoch boundary of the 23 rows: some rows twice), in a fresh order."""
    B, N, num_rows, seed = 4, 5, 23, 7
    ordinary = torch.cat([batch_rows(s, B, num_rows, seed, order) for s in range(offset, offset + N)]).tolist()
    if order == "randperm":
        assert ordinary == _reference_order(num_rows, seed, range(offset * B, (offset + N) * B))
    reads = torch.cat([pool_batch_rows(s, B, num_rows, seed, order, N, offset) for s in range(3 * N)]).tolist()
    epochs = [reads[i * N * B:(i + 1) * N * B] for i in range(3)]
    for e in epochs:
        assert collections.Counter(e) == collections.Counter(ordinary)
    assert len({tuple(e) for e in epochs + [ordinary]}) == 4  # each epoch in its own order
    # a pure function of the step: batch 7 alone is what the sequence has there
    assert pool_batch_rows(7, B, num_rows, seed, order, N, offset).tolist() == reads[7 * B:8 * B]


def test_distinct_rows_read_against_counting_the_reads():
    for order in ("randperm", "feistel"):
        for steps, offset, pool in [(3, 0, 0), (9, 0, 0), (4, 4, 0), (20, 2, 0), (2, 0, 5), (4, 3, 5), (12, 3, 5),
                                    (30, 1, 4), (3, 5, 6)]:
            B, num_rows = 4, 23
            if pool:
                reads = [pool_batch_rows(s, B, num_rows, 1, order, pool, offset) for s in range(steps)]
            else:
                reads = [batch_rows(s + offset, B, num_rows, 1, order) for s in range(steps)]
            truth = len(set(torch.cat(reads).tolist()))
            assert distinct_rows_read(steps, B, num_rows, 1, order, offset, pool) == truth, (order, steps, offset, pool)


# ----------------------------------------------------------------------------------------------- in training


def _cfg(data, out, **kw) -> TrainConfig:
    values = dict(out=str(out), preset="micro", steps=7, seed=0, data=data, vocab_size=300, seq_len=32, batch_size=4,
                  num_passes=1, deep_passes=1, progress=False, tensorboard=False, plot=False, save_every=0)
    values.update(kw)
    return TrainConfig(**values)


@pytest.fixture
def recorded(monkeypatch):
    """The token rows every training step feeds the model, per run directory (the recipe's own batches)."""
    seen: dict[str, list] = collections.defaultdict(list)
    original = pretrain.PretrainRecipe.batch

    def batch(self, step, num_passes, generator, env):
        out = original(self, step, num_passes, generator, env)
        seen[self.cfg.out].append(torch.cat([mb["input_ids"] for mb in out.micro]).tolist())
        return out

    monkeypatch.setattr(pretrain.PretrainRecipe, "batch", batch)
    return seen


def _rows(batches) -> list[tuple]:
    return [tuple(r) for b in batches for r in b]


def _losses(out) -> list:
    return [(r["step"], r["loss"]) for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


@pytest.fixture(scope="module")
def prepared_dir(data, tmp_path_factory):
    from fullband import cli

    out = tmp_path_factory.mktemp("prep") / "p"
    assert cli.main(["data", "prepare", data, "--out", str(out), "--no-progress", "--vocab-size", "300",
                     "--shard-mb", "0.002"]) == 0
    return str(out)


@pytest.mark.parametrize("source", ["in-memory", "prepared"])
def test_unique_batches_rereads_the_rows_of_an_ordinary_run_and_resumes(source, data, prepared_dir, tmp_path,
                                                                        recorded):
    """A 7-step run with --unique-batches 3 reads, per epoch of 12 reads, exactly the rows the ordinary 3-step run
    read (token rows as fed to the model), and nothing else; stopped mid-epoch and resumed it reads and trains
    exactly what the uninterrupted run does."""
    src = data if source == "in-memory" else prepared_dir
    ordinary = train(_cfg(src, tmp_path / "ordinary", steps=3))
    control = train(_cfg(src, tmp_path / "control", unique_batches=3))
    assert ordinary["status"] == control["status"] == "done"
    base = _rows(recorded[str(tmp_path / "ordinary")])
    reads = _rows(recorded[str(tmp_path / "control")])
    assert len(base) == 12 and len(reads) == 28
    assert collections.Counter(reads[:12]) == collections.Counter(base) == collections.Counter(reads[12:24])
    assert set(reads[24:]) <= set(base) and reads[:12] != base and reads[:12] != reads[12:24]
    # a longer ordinary run reads rows the control never sees
    longer = train(_cfg(src, tmp_path / "longer"))
    assert longer["status"] == "done" and not set(_rows(recorded[str(tmp_path / "longer")])) <= set(base)
    # resume in the middle of the second pool epoch (step 4 of 7)
    first = train(_cfg(src, tmp_path / "resumed", unique_batches=3, stop_after=4, save_every=2))
    assert first["status"] == "paused"
    second = train(_cfg(src, tmp_path / "resumed", unique_batches=3), resume=True)
    assert second["status"] == "done"
    assert _rows(recorded[str(tmp_path / "resumed")]) == reads
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "control")


def test_unique_batches_is_an_option_with_a_one_line_error(data, tmp_path, capsys):
    from fullband import cli

    argv = ["train", "--preset", "micro", "--steps", "2", "--out", str(tmp_path / "x"), "--data", data,
            "--unique-batches", "-1", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "argument --unique-batches: must be an integer >= 0" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------- inference FLOPs


FP = {"matmul_params": 1000, "head_params": 200, "fusion_params": 50, "layers": 2, "hidden": 4}


def test_inference_flops_by_hand():
    """T = 5 tokens, prompt P = 2, K = 3: body 2·800 = 1600 per token, head 400 per logit, fusion 100 per fused
    token, attention 4·2·4 = 32 per (query, key) pair (a whole-row pass: 1+2+3+4+5 = 15 pairs)."""
    std = 5 * 1600 + 5 * 400 + 15 * 32  # 10,480
    got = {m: inference_flops(m, FP, 5, 2, num_passes=3) for m in ("standard", "passes", "exact", "soft", "fused")}
    assert got["standard"]["flops"] == std and got["standard"]["relative"] == 1.0
    assert got["standard"]["scored_tokens"] == 3 and got["standard"]["flops_per_token"] == std / 3
    # K = 3: three passes' bodies and attention, logits 5 + 1 + 1, two fused passes of 5 tokens
    assert got["passes"]["flops"] == 3 * 5 * 1600 + 7 * 400 + 3 * 15 * 32 + 10 * 100  # 29,240
    assert got["passes"]["sequential_calls"] == 3
    # exact: standard's FLOPs plus 4 fusions, in 5 calls
    assert got["exact"]["flops"] == std + 4 * 100 and got["exact"]["sequential_calls"] == 5
    # soft: the prompt (2 tokens, 3 pairs, 1 logit), then 2 fused steps at positions 2 and 3 (3 + 4 pairs)
    soft = 2 * 1600 + 400 + 3 * 32 + 2 * (1600 + 400 + 100) + 7 * 32  # 8,120
    assert got["soft"]["flops"] == soft and got["soft"]["sequential_calls"] == 3
    # fused: one more pass over the prompt, fused at both positions, one logit
    assert got["fused"]["flops"] == soft + 2 * 1600 + 400 + 3 * 32 + 2 * 100
    assert got["fused"]["relative"] == pytest.approx(got["fused"]["flops"] / std)
    # whole rows (no prompt): the relative cost is the same ratio; the scored tokens are T - 1
    assert inference_flops("passes", FP, 5, num_passes=3)["relative"] == pytest.approx(29_240 / std)
    assert inference_flops("standard", FP, 5)["scored_tokens"] == 4
    with pytest.raises(ValueError):
        inference_flops("soft", FP, 5, 0)
    with pytest.raises(ValueError):
        inference_flops("beam", FP, 5)


@pytest.mark.parametrize("mode", ["standard", "passes", "exact", "soft", "fused"])
def test_inference_flops_match_what_scoring_runs(mode):
    """Against torch's FlopCounterMode over :func:`fullband.eval.scoring.token_nll` on a tiny Llama with its fusion
    (eager attention), exactly: N counted from the nn.Linear weights (so the count and the formula share nothing);
    a one-token step attends over its cache as the formula counts, a multi-token pass is charged its full n x n
    score matrix by the counter, the causal n(n+1)/2 pairs by the formula (the difference is added by hand). Bugs caught: logits counted at every position of every pass, a pass too many
    or too few, the fusion counted on the plain pass, the continuation's last token given a step of its own. (The
    decode loop's one-time check of its fast path, a 2-token probe per backbone, runs before the count.)"""
    from torch.utils.flop_counter import FlopCounterMode

    from conftest import random_ids, tiny_model

    from fullband.eval.scoring import token_nll

    model = tiny_model("llama").eval()
    model.backbone.config._attn_implementation = "eager"
    T, P, K = 12, 5, 3
    ids = random_ids(2, T)
    token_nll(model, ids, mode, num_passes=K, prompt_length=P)  # once before: the decode loop's one-time probe
    with FlopCounterMode(display=False) as counter:
        token_nll(model, ids, mode, num_passes=K, prompt_length=P)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.bmm", "aten.addmm"}
    linear = lambda m: sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear))  # noqa: E731
    head = model.backbone.get_output_embeddings().weight.numel()
    fp = {"matmul_params": linear(model.backbone), "head_params": head, "fusion_params": linear(model.feedback),
          "layers": model.backbone.config.num_hidden_layers, "hidden": model.backbone.config.hidden_size}
    per_pair = 4 * fp["layers"] * fp["hidden"]
    square = {"standard": T * T - T * (T + 1) / 2, "passes": K * (T * T - T * (T + 1) / 2), "exact": 0,
              "soft": P * P - P * (P + 1) / 2, "fused": 2 * (P * P - P * (P + 1) / 2)}[mode]
    # a batch of 2 rows; the LM head on a [B, 1, d] input is counted as a bmm, so the two are summed
    assert sum(counts.values()) == 2 * (inference_flops(mode, fp, T, P, num_passes=K)["flops"] + square * per_pair)
    if mode in ("standard", "exact"):  # the attention alone: no head in bmm on these paths
        attention = inference_flops(mode, {**fp, "matmul_params": 0, "head_params": 0, "fusion_params": 0}, T, P)
        assert counts["aten.bmm"] == 2 * (attention["flops"] + square * per_pair)
    assert np.isclose(inference_flops(mode, fp, T, P, num_passes=K)["relative"] * inference_flops(
        "standard", fp, T, P)["flops"], inference_flops(mode, fp, T, P, num_passes=K)["flops"])


def assert_flops_matched(control: float, fbt: float, plain_step: float, what: str = "") -> None:
    """An equal-FLOPs control has at least the FBT run's training FLOPs, and less than one plain step more."""
    assert fbt <= control < fbt + plain_step, (what, control / fbt, plain_step / fbt)


PLANS = {  # the pass schedules the experiments size controls for: K mix, truncated, exact states, full backprop
    "k-mix": dict(num_passes=2, deep_passes=3, deep_fraction=0.5),
    "grad-passes": dict(num_passes=4, grad_passes=2, deep_fraction=0.0),
    "exact-states": dict(num_passes=2, grad_passes=2, exact_states=True, deep_fraction=0.0),
    "full-backprop": dict(num_passes=2, full_backprop=True, backprop_chunk=4, deep_fraction=0.0),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_control_steps_count_the_fbt_run_as_its_metrics_do(plan, data, tmp_path):
    """The steps of an equal-FLOPs control are planned before the FBT run trains (:func:`flops_matched_steps`),
    from the records the run will log (:func:`planned_records`) and the model's parameters counted without its
    weights (:func:`planned_flop_parameters`, meta device). Against the real run: its logged records give the same
    FLOPs (``training_flops`` of the metrics, the fusion's FLOPs included: the old plan left them out, so
    exact states + 2 gradient passes were sized 2 + 1/3 plain steps for a step that costs 2.41 at micro and the
    controls got ~3 % less compute than FBT), the planned parameters equal the trained model's, and the control
    of that many plain steps has the FBT run's FLOPs plus less than one step."""
    from fullband.eval.flops import flop_parameters, training_flops
    from fullband.eval.scoring import load_any_model
    from fullband.experiments.common import flops_matched_steps, planned_flop_parameters, planned_records

    cfg = _cfg(data, str(tmp_path / "fbt"), steps=6, feedback_start=0.5, **PLANS[plan])
    summary = train(cfg)
    assert summary["status"] == "done"
    model = load_any_model(cfg.out)[0]
    fp = flop_parameters(model)
    vocab = model.get_input_embeddings().num_embeddings
    assert planned_flop_parameters(cfg, vocab) == fp
    tokens, T = cfg.batch_size * cfg.seq_len, cfg.seq_len
    logged = [r for r in read_jsonl(os.path.join(cfg.out, "metrics.jsonl")) if r.get("split") == "train"]
    ran = training_flops(logged, tokens, T, fp)["flops"]
    assert training_flops(planned_records(cfg), tokens, T, fp)["flops"] == pytest.approx(ran, rel=1e-12)
    assert ran > training_flops([{"num_passes": 1}] * cfg.steps, tokens, T, fp)["flops"]  # feedback steps ran
    steps = flops_matched_steps(cfg, vocab)
    plain_step = training_flops([{"num_passes": 1}], tokens, T, fp)["flops"]
    assert_flops_matched(steps * plain_step, ran, plain_step, plan)
