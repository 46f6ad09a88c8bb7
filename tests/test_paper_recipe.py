"""The paper's own recipe: a per-batch mix of pass counts (``--pass-mix``), tied input/output embeddings
(``--tie-embeddings``), the dry-run plan of a mixed run, and the recipe experiment's arms from scratch.

Pass mix: checked by its properties, not against a re-implementation: only the mix's K, frequencies within a
binomial bound over 10k steps, the same K for a step however (and by whom) it is recomputed, the same choices in a
resumed run. Tying: one tensor, its gradient the sum of the embedding's and the head's in an untied copy, saved
once, tied again on loading (also after --resume), the fusion and the gate still equal to the raw-weights reference
of ``tests/reference.py`` before and after an optimizer step; an --init-from model's tying cannot be changed."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import reference as ref
import torch
from conftest import random_ids
from safetensors.torch import load_file
from test_recipe import train_args, train_records
from transformers import AutoModelForCausalLM

from fullband import cli
from fullband.model.modeling import FullBandwidthForCausalLM, load_model
from fullband.training.checkpoint import model_fingerprint
from fullband.training.config import TrainConfig
from fullband.training.hf_trainer import PassSchedule
from fullband.training.optimizer import build_optimizer
from fullband.training.plan import make_plan
from fullband.training.presets import backbone_config
from fullband.training.schedule import FeedbackSchedule, parse_pass_mix
from fullband.utils.errors import UsageError

PAPER = "1:0.75,2:0.22,3:0.03"
MIX = dict(num_passes=3, deep_fraction=0.0, pass_mix=PAPER)


# ----------------------------------------------------------------------------------------------- the pass mix


@pytest.mark.parametrize("seed", [0, 7])
def test_pass_mix_frequencies_are_within_a_binomial_bound(seed):
    """10,000 steps from step 0: only K in {1, 2, 3}, and each count within 5 standard deviations of n·p (a fair
    draw fails this with probability < 1e-5; a mix drawn from the wrong end of the CDF, one that ignores an entry or
    one stuck on a value fails it by tens of deviations)."""
    n = 10_000
    sched = TrainConfig(out="x", steps=n, seed=seed, feedback_start=0.0, **MIX).schedule()
    ks = [sched.passes_at(s, n) for s in range(n)]
    assert set(ks) <= {1, 2, 3}
    for k, p in ((1, 0.75), (2, 0.22), (3, 0.03)):
        assert abs(ks.count(k) - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (k, ks.count(k))
    assert sched.histogram(n) == {k: ks.count(k) for k in (1, 2, 3)}
    # consecutive steps are not correlated: K=2 after K=2 about as often as 0.22 (not a run-length artefact)
    after = [b for a, b in zip(ks, ks[1:]) if a == 2]
    assert abs(after.count(2) / len(after) - 0.22) <= 5 * math.sqrt(0.22 * 0.78 / len(after))


def test_pass_mix_is_a_function_of_the_seed_and_the_step_alone():
    """The same K for every step however it is recomputed: another schedule object, the HF trainers'
    ``PassSchedule`` built from the same options, steps asked in reverse or in a random order, a run of another
    length (the draw does not depend on the total); another seed draws another sequence; the steps before
    --feedback-start are plain."""
    n = 400
    cfg = TrainConfig(out="x", steps=n, seed=3, feedback_start=0.25, **MIX)
    a = [cfg.schedule().passes_at(s, n) for s in range(n)]
    b = FeedbackSchedule(start_fraction=0.25, num_passes=3, deep_fraction=0.0, pass_mix=parse_pass_mix(PAPER), seed=3)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    assert {s: b.passes_at(s, n) for s in order} == dict(enumerate(a))
    assert [b.passes_at(s, n) for s in reversed(range(n))] == a[::-1]
    hf = PassSchedule.from_train_config(cfg)
    assert [hf.passes_at(s, n) for s in range(n)] == a
    longer = dataclasses.replace(cfg, steps=800).schedule()  # feedback from step 200 there, from 100 here
    assert [longer.passes_at(s, 800) for s in range(200, n)] == a[200:]
    assert a[:100] == [1] * 100 and len(set(a[100:])) == 3
    other = [dataclasses.replace(cfg, seed=4).schedule().passes_at(s, n) for s in range(n)]
    assert other[100:] != a[100:]
    # the mix written in another order is the same mix
    assert parse_pass_mix("3:0.03,1:0.75,2:0.22") == parse_pass_mix(PAPER) == ((1, 0.75), (2, 0.22), (3, 0.03))


@pytest.mark.parametrize("text, words", [
    ("1:0.75,2:x", "'2:x'"), ("1:0.75;2:0.25", "'1:0.75;2:0.25'"), ("3", "'3'"), ("1:0.5,2:0.4", "sum to 0.9"),
    ("1:0.5,1:0.5", "1:0.5"), ("2:1.5", "2:1.5"), ("0:0.5,2:0.5", "0:0.5"), ("1:1", "K >= 2"), ("2:nan", "'2:nan'"),
])
def test_bad_pass_mixes_are_one_line_errors_naming_the_entry(text, words, data, tmp_path, capsys):
    with pytest.raises(UsageError, match=None) as err:
        parse_pass_mix(text)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert cli.main(train_args(data, tmp_path / "r", "--pass-mix", text, "--num-passes", "3",
                               "--deep-fraction", "0")) == 2
    msg = capsys.readouterr().err
    assert msg.count("\n") == 1 and words in msg
    assert not (tmp_path / "r").exists()


def test_pass_mix_refuses_what_would_also_choose_k(data, tmp_path, capsys):
    """--deep-fraction > 0, a curriculum, or --num-passes other than the mix's largest K: refused before anything
    is written. --num-passes 1 is a plain baseline, with no mix (as with the deep steps)."""
    for extra, words in ((("--num-passes", "3"), "--deep-fraction 0"),
                         (("--deep-fraction", "0"), "largest K of --pass-mix (3)"),
                         (("--num-passes", "3", "--deep-fraction", "0", "--pass-curriculum", "0.5"), "--pass-curriculum")):
        capsys.readouterr()
        assert cli.main(train_args(data, tmp_path / "r", "--pass-mix", PAPER, *extra)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "r").exists()
    plain = TrainConfig(out="x", steps=50, feedback_start=0.0, pass_mix=PAPER, num_passes=1)
    assert plain.schedule().histogram(50) == {1: 50} and not plain.feedback_ever


def test_a_mixed_run_and_its_resumed_twin_take_the_schedules_passes(data, tmp_path):
    """The K logged at each step is the schedule's draw; a run stopped after step 5 and resumed makes the same
    choices and, bitwise, the same losses; the fusion is not touched on the K=1 steps (no gradient, no decay)."""
    mix = ("--pass-mix", PAPER, "--num-passes", "3", "--deep-fraction", "0", "--feedback-start", "0", "--seed", "2")
    full = tmp_path / "full"
    assert cli.main(train_args(data, full, *mix, steps=12)) == 0
    want = TrainConfig(out="x", steps=12, seed=2, feedback_start=0.0, **MIX).schedule()
    recs = train_records(full)
    assert [r["num_passes"] for r in recs] == [want.passes_at(s, 12) for s in range(12)]
    assert len({r["num_passes"] for r in recs}) >= 2  # this seed's 12 steps hold plain and fed-back ones
    part = tmp_path / "part"
    assert cli.main(train_args(data, part, *mix, "--save-every", "5", "--stop-after", "5", steps=12)) == 0
    assert cli.main(train_args(data, part, *mix, "--resume", steps=12)) == 0
    assert [(r["num_passes"], r["loss"]) for r in train_records(part)] == [(r["num_passes"], r["loss"]) for r in recs]


# ----------------------------------------------------------------------------------------------- tied embeddings


def micro(tied: bool, fusion: str = "glu", seed: int = 0) -> FullBandwidthForCausalLM:
    torch.manual_seed(seed)
    backbone = AutoModelForCausalLM.from_config(backbone_config("micro", 97, bos_token_id=1, eos_token_id=2,
                                                                pad_token_id=0, tie_word_embeddings=tied))
    return FullBandwidthForCausalLM.from_backbone(backbone, fusion=fusion, jitter=0.0)


def test_tied_embeddings_are_one_tensor_whose_gradient_is_both_uses():
    """The tied model's head is its embedding tensor; its gradient equals the embedding's plus the head's gradient
    in an untied copy with the same values (the K=2 loss uses it three ways: token embeddings, the gate of the
    fusion, the logits)."""
    tied = micro(True)
    emb = tied.get_input_embeddings().weight
    assert tied.get_output_embeddings().weight is emb
    assert sum(p is emb for p in tied.parameters()) == 1
    untied = micro(False)
    state = tied.state_dict()
    state["backbone.lm_head.weight"] = state["backbone.model.embed_tokens.weight"].clone()
    untied.load_state_dict(state)
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    ids = random_ids(2, 12, seed=4)
    for m in (tied, untied):
        m.train()
        m(ids, labels=ids, num_passes=2).loss.backward()
    with torch.no_grad():
        assert float(tied(ids, labels=ids, num_passes=2).loss) == pytest.approx(
            float(untied(ids, labels=ids, num_passes=2).loss), rel=1e-6)
    both = untied.get_input_embeddings().weight.grad + untied.get_output_embeddings().weight.grad
    torch.testing.assert_close(emb.grad, both, rtol=1e-5, atol=1e-7)
    assert untied.get_input_embeddings().weight.grad.abs().sum() > 0  # the embedding side does get a gradient


def test_tied_model_matches_the_raw_weights_reference_before_and_after_a_step():
    """K-pass forward, exact recurrence and the call-scoped gate table of a tied GLU model against the reference from
    raw weights (tests/reference.py), then again after one fused-AdamW step (which moves the shared tensor: a gate
    or fusion computed from a stale copy of the embeddings would be off)."""
    model = micro(True)
    ids = random_ids(2, 10, seed=6)
    cfg = TrainConfig(out="x", lr=1e-2)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    for step in range(2):
        model.eval()
        with torch.no_grad():
            want = ref.k_pass_logits(model, ids, 2)
            torch.testing.assert_close(model(ids, num_passes=2).logits, want, atol=2e-5, rtol=1e-5)
            with model.frozen_gate_table():
                torch.testing.assert_close(model(ids, num_passes=2).logits, want, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(model.recurrent_forward(ids).logits, ref.recurrence_logits(model, ids),
                                       atol=2e-5, rtol=1e-5)
        if step == 0:
            before = model.get_input_embeddings().weight.detach().clone()
            model.train()
            model(ids, labels=ids, num_passes=2).loss.backward()
            opt.step()
            opt.zero_grad()
            assert not torch.equal(model.get_input_embeddings().weight, before)
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_tie_embeddings_trains_saves_once_resumes_and_reloads_tied(data, tmp_path, capsys):
    """`fullband train --tie-embeddings`: the saved weights hold the shared tensor once (no lm_head entry), the
    reloaded model is tied again, as is a run stopped, checkpointed and resumed (bitwise the same losses); saving the
    reloaded model again gives the same fingerprint. --init-from keeps a checkpoint's tying: asking for the other
    one is a one-line error, asking for the same one is fine."""
    out = tmp_path / "tied"
    fb = ("--tie-embeddings", "--fusion", "glu", "--feedback-start", "0.5", "--deep-fraction", "0")
    assert cli.main(train_args(data, out, *fb)) == 0
    weights = load_file(str(out / "model.safetensors"))
    assert not any(k.endswith("lm_head.weight") for k in weights) and "backbone.model.embed_tokens.weight" in weights
    model = load_model(str(out))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert json.loads((out / "config.json").read_text())["text_config"]["tie_word_embeddings"] is True
    again = tmp_path / "again"
    model.save_pretrained(again)
    assert load_file(str(again / "model.safetensors")).keys() == weights.keys()
    part = tmp_path / "part"
    assert cli.main(train_args(data, part, *fb, "--save-every", "3", "--stop-after", "3")) == 0
    ckpt = load_file(str(part / "checkpoints" / "step-0000003" / "model.safetensors"))
    assert not any(k.endswith("lm_head.weight") for k in ckpt)
    assert cli.main(train_args(data, part, *fb, "--resume")) == 0
    assert [r["loss"] for r in train_records(part)] == [r["loss"] for r in train_records(out)]
    resumed = load_model(str(part))
    assert resumed.get_output_embeddings().weight is resumed.get_input_embeddings().weight
    assert model_fingerprint(str(part)) == model_fingerprint(str(out))  # the same weights, saved the same way
    # --init-from: the checkpoint's tying stays
    capsys.readouterr()
    assert cli.main(train_args(data, tmp_path / "no", "--init-from", str(out), "--no-tie-embeddings", steps=2)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tied" in err and "--no-tie-embeddings" in err
    assert not (tmp_path / "no").exists()
    assert cli.main(train_args(data, tmp_path / "yes", "--init-from", str(out), "--tie-embeddings", steps=2)) == 0
    plain = tmp_path / "plain"
    assert cli.main(train_args(data, plain, "--num-passes", "1", steps=2)) == 0
    assert "lm_head.weight" in load_file(str(plain / "model.safetensors"))  # micro is untied by default
    capsys.readouterr()
    assert cli.main(train_args(data, tmp_path / "t", "--init-from", str(plain), "--tie-embeddings", steps=2)) == 2
    assert "untied" in capsys.readouterr().err
    assert cli.main(["train", "--dry-run", "--init-from", str(plain), "--tie-embeddings"]) == 2


# ----------------------------------------------------------------------------------------------- the plan


def test_plan_of_a_pass_mix_is_hand_arithmetic():
    """Micro preset, vocabulary 300, T = 32, 4 rows: per token and pass 6·N + 6·L·T·d = 633,216 with N = 101,440
    matmul weights (tests/test_plan.py works it out; tying removes the input table, which is not a matmul, and keeps
    the head: the same N), fusion 8,256 weights costing 6·8,256 = 49,536 per fused pass. A step of K passes costs
    128·(K·633,216 + (K−1)·49,536); the run is the sum over the steps the schedule gives each K."""
    for tied in (False, True):
        cfg = TrainConfig(out="x", preset="micro", steps=1000, seq_len=32, batch_size=4, vocab_size=300,
                          feedback_start=0.2, fusion="glu", tie_embeddings=tied, **MIX)
        plan = make_plan(cfg, gpu="h100")
        hist = plan["passes_histogram"]
        assert set(hist) == {1, 2, 3} and sum(hist.values()) == 1000 and hist[1] >= 200  # the first 200 are plain
        assert plan["model"]["tied_embeddings"] is tied
        assert plan["model"]["backbone_params"] == 120_640 - (19_200 if tied else 0)  # V·d once fewer
        for k in (1, 2, 3):
            assert plan["flops_per_step"][k] == 128 * (k * 633_216 + (k - 1) * 49_536)
        assert plan["total_flops"] == sum(n * 128 * (k * 633_216 + (k - 1) * 49_536) for k, n in hist.items())


# ----------------------------------------------------------------------------------------------- the experiment


# every recipe setting of the lead's runs at the default size (runs/experiments/recipe-paper must be reused): written
# out here, not read from the grid, so a change to any of them fails
_SCRATCH_350 = dict(steps=350, seed=0, preset="tiny", batch_size=16, seq_len=128, vocab_size=4096, lr=0.003,
                    lr_schedule="wsd", warmup_fraction=0.05, decay_fraction=0.2, min_lr_ratio=0.1,
                    feedback_start=0.0, deep_passes=4, fusion_lr_mult=1.0, fusion_warmup=0.0, clip_per_group=False,
                    feedback_ramp=0.0, fusion_only=0.0, prefix_mix=0.25, jitter=0.02, feedback_weight=1.0,
                    init_from=None, data_offset=0, unique_batches=0, eval_rows=8, eval_every=0, save_every=0)
LEAD_ARMS = {
    "baseline-tied": dict(_SCRATCH_350, fusion="glu", num_passes=1, deep_fraction=0.1, pass_mix=None,
                          tie_embeddings=True, z_loss=1e-4),
    "paper": dict(_SCRATCH_350, fusion="glu", num_passes=3, deep_fraction=0.0, pass_mix=PAPER, tie_embeddings=True,
                  z_loss=1e-4),
    "paper-k3": dict(_SCRATCH_350, fusion="glu", num_passes=3, deep_fraction=0.0, pass_mix=None, tie_embeddings=True,
                     z_loss=1e-4),
    "residual-k3-all": dict(_SCRATCH_350, fusion="residual", num_passes=3, deep_fraction=0.0, pass_mix=None,
                            tie_embeddings=False, z_loss=0.0),
    "baseline-scratch": dict(_SCRATCH_350, fusion="glu", num_passes=1, deep_fraction=0.1, pass_mix=None,
                             tie_embeddings=False, z_loss=0.0),
}
LEAD_ARMS["baseline-tied-flops"] = dict(LEAD_ARMS["baseline-tied"], steps=1085)  # ceil(350 x 3.1)
LEAD_ARMS["baseline-scratch-flops"] = dict(LEAD_ARMS["baseline-scratch"], steps=1085)


def _plan(*argv):
    import argparse

    from fullband.commands.experiments import add_recipe_parser
    from fullband.experiments import recipe

    parser = argparse.ArgumentParser()
    add_recipe_parser(parser.add_subparsers())
    args = parser.parse_args(["recipe", "--out", "R", "--no-progress", *argv])
    recipe.apply_quick(args, recipe.DEFAULTS, recipe.QUICK)
    return recipe.seed_plan(args, 0, recipe.complete_arms(args.arms.split(",")))


def test_recipe_arm_configs_and_the_epochs_controls_at_the_default_size():
    """The lead's arms keep every setting (so their finished runs are reused), and each gets its equal-unique-
    tokens-and-FLOPs control: the -flops twin's settings, steps and schedule, re-reading exactly the base arm's
    batches (--unique-batches its steps, from its --data-offset); the branched baseline-epochs re-reads the branch's
    batches after the trunk, from the trunk's model."""
    trunk, cfgs = _plan("--arms", "baseline-tied,paper,paper-k3,residual-k3-all")
    assert list(cfgs) == ["baseline-scratch", "baseline-tied", "paper", "paper-k3", "residual-k3-all",
                          "baseline-scratch-flops", "baseline-tied-flops", "baseline-scratch-epochs",
                          "baseline-tied-epochs"]
    for name, want in LEAD_ARMS.items():
        got = dataclasses.asdict(cfgs[name])
        assert {k: got[k] for k in want} == want, name
        assert got["out"] == f"R/seed0/{name}"
    for base in ("baseline-tied", "baseline-scratch"):
        epochs, flops = dataclasses.asdict(cfgs[base + "-epochs"]), dataclasses.asdict(cfgs[base + "-flops"])
        assert (epochs["steps"], epochs["unique_batches"], epochs["data_offset"]) == (1085, 350, 0)
        assert {k: v for k, v in epochs.items() if k not in ("out", "unique_batches")} == {
            k: v for k, v in flops.items() if k not in ("out", "unique_batches")}
    _, branched = _plan("--arms", "glu-wsd")
    assert list(branched) == ["baseline", "glu-wsd", "baseline-flops", "baseline-epochs"]
    e, f, b = (dataclasses.asdict(branched[n]) for n in ("baseline-epochs", "baseline-flops", "baseline"))
    assert (e["steps"], e["unique_batches"], e["data_offset"], e["init_from"]) == (230, 100, 250, "R/seed0/trunk")
    assert (b["steps"], b["unique_batches"], b["data_offset"]) == (100, 0, 250) and f["unique_batches"] == 0
    for k in ("lr", "lr_schedule", "warmup_fraction", "decay_fraction", "min_lr_ratio", "num_passes", "seed",
              "feedback_start", "z_loss", "tie_embeddings"):
        assert e[k] == f[k] == b[k], k
    assert {k: v for k, v in e.items() if k not in ("out", "unique_batches")} == {
        k: v for k, v in f.items() if k not in ("out", "unique_batches")}


def _hand_relative(mode: str, model_dir, T: int, P: int) -> float:
    """Forward FLOPs of scoring a T-token row in ``mode`` over standard's, from the saved model's parameter counts:
    matmul weights N (every backbone weight but an untied input table), head V x d, fusion F; a token through the
    body 2 (N - V d), a position's logits 2 V d, a (query, key) pair 4 L d, a fusion 2 F."""
    weights = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    L, d, V = text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]
    backbone = {k: v.numel() for k, v in weights.items() if k.startswith("backbone.")}
    tied = not any(k.endswith("lm_head.weight") for k in backbone)
    N = sum(backbone.values()) - (0 if tied else V * d)
    F = sum(v.numel() for k, v in weights.items() if not k.startswith("backbone."))
    body, head, pair, fuse = 2 * (N - V * d), 2 * V * d, 4 * L * d, 2 * F
    tri = lambda n: n * (n + 1) / 2  # noqa: E731  (causal pairs of n queries from position 0)
    standard = T * body + T * head + tri(T) * pair
    C = T - P
    steps = (C - 1) * (body + head + fuse) + ((C - 1) * P + tri(C - 1)) * pair
    flops = {"standard": standard, "K=2": 2 * T * body + (T + 1) * head + 2 * tri(T) * pair + T * fuse,
             "K=3": 3 * T * body + (T + 2) * head + 3 * tri(T) * pair + 2 * T * fuse,
             "exact": standard + (T - 1) * fuse,
             "soft": P * body + head + tri(P) * pair + steps,
             "fused": 2 * P * body + 2 * head + 2 * tri(P) * pair + P * fuse + steps}[mode]
    return flops / standard


def _record_rows(monkeypatch) -> dict:
    """The token rows every training step feeds the model, per run directory name (as the trainer reads them)."""
    import collections

    from fullband.training import pretrain

    seen = collections.defaultdict(list)
    original = pretrain.PretrainRecipe.batch

    def batch(self, step, num_passes, generator, env):
        out = original(self, step, num_passes, generator, env)
        seen[os.path.basename(self.cfg.out)] += [tuple(r) for mb in out.micro for r in mb["input_ids"].tolist()]
        return out

    monkeypatch.setattr(pretrain.PretrainRecipe, "batch", batch)
    return seen


def test_recipe_branched_epochs_control_rereads_the_branch_batches_quick(tmp_path, monkeypatch):
    """`--arms baseline`: the trunk (3 steps), the branch (2 steps from the trunk, batches 3..4), baseline-flops and
    baseline-epochs (5 steps each, from the trunk): baseline-epochs reads, per epoch of 8 rows, exactly the branch's
    rows (none of the trunk's), in a fresh order; baseline-flops reads further."""
    import collections

    seen = _record_rows(monkeypatch)
    out = tmp_path / "recipe"
    assert cli.main(["experiment", "recipe", "--quick", "--out", str(out), "--no-progress", "--json", "--seeds", "0",
                     "--arms", "baseline", "--trunk-steps", "3", "--branch-steps", "2", "--eval-rows", "2"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["arms"] == ["baseline", "baseline-flops", "baseline-epochs"] and res["unique_batches"] == {
        "baseline-epochs": 2}
    branch, reads, trunk = seen["baseline"], seen["baseline-epochs"], seen["trunk"]
    assert (len(trunk), len(branch), len(reads), len(seen["baseline-flops"])) == (12, 8, 20, 20)
    for e in range(2):
        assert collections.Counter(reads[8 * e:8 * (e + 1)]) == collections.Counter(branch)
    assert set(reads[16:]) <= set(branch) and reads[:8] != branch and not set(branch) & set(trunk)
    assert seen["baseline-flops"][:8] == branch and not set(seen["baseline-flops"]) <= set(branch)
    saved = json.loads((out / "seed0" / "baseline-epochs" / "run_config.json").read_text())
    assert (saved["init_from"], saved["data_offset"], saved["unique_batches"], saved["steps"]) == (
        str(out / "seed0" / "trunk"), 3, 2, 5)
    row = {r["mode"]: r for r in res["table"] if r["arm"] == "baseline"}["standard"]
    assert row["epochs_reference"] == "baseline-epochs" and row["inference_flops"] == 1.0


def test_recipe_paper_arms_from_scratch_quick(tmp_path, monkeypatch):
    """`fullband experiment recipe --arms paper,residual-k3-all`: no trunk (both train from scratch), their
    baselines of the same steps and tying and both FLOP-matched ones added, each run as long as its arm says, the
    passes the pass mix draws, tied runs saved tied, the -epochs runs re-reading exactly their base's rows every
    epoch, the equal-FLOPs and equal-unique-tokens-and-FLOPs differences by hand from each family's baselines, and
    every mode's inference FLOPs by hand from the saved models' parameter counts."""
    import collections

    seen = _record_rows(monkeypatch)
    out = tmp_path / "recipe"
    argv = ["experiment", "recipe", "--quick", "--out", str(out), "--no-progress", "--json", "--seeds", "0",
            "--arms", "paper,residual-k3-all", "--trunk-steps", "2", "--branch-steps", "2", "--eval-rows", "2"]
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["arms"] == ["baseline-scratch", "baseline-tied", "paper", "residual-k3-all", "baseline-scratch-flops",
                           "baseline-tied-flops", "baseline-scratch-epochs", "baseline-tied-epochs"]
    root = out / "seed0"
    assert not (root / "trunk").exists()
    steps = {"baseline-scratch": 4, "baseline-tied": 4, "paper": 4, "residual-k3-all": 4,
             "baseline-scratch-flops": 13, "baseline-tied-flops": 13,  # ceil(4 x 3.1)
             "baseline-scratch-epochs": 13, "baseline-tied-epochs": 13}
    for arm, n in steps.items():
        recs = train_records(root / arm)
        assert len(recs) == n, arm
        saved = json.loads((root / arm / "run_config.json").read_text())
        assert saved["init_from"] is None and saved["data_offset"] == 0
        assert saved["unique_batches"] == (4 if arm.endswith("-epochs") else 0)
        has_head = any(k.endswith("lm_head.weight") for k in load_file(str(root / arm / "model.safetensors")))
        assert has_head == (arm.startswith("baseline-scratch") or arm == "residual-k3-all"), arm
    for base in ("baseline-scratch", "baseline-tied"):  # 16 rows an epoch: exactly the base's, in a fresh order
        mine, reads = seen[base], seen[base + "-epochs"]
        assert len(mine) == 16 and len(reads) == 52
        for e in range(3):
            assert collections.Counter(reads[16 * e:16 * (e + 1)]) == collections.Counter(mine)
            assert reads[16 * e:16 * (e + 1)] != mine
        assert set(reads[48:]) <= set(mine) and not set(seen[base + "-flops"]) <= set(mine)
        a, b = (json.loads((root / n / "run_config.json").read_text()) for n in (base + "-epochs", base + "-flops"))
        assert {k: v for k, v in a.items() if k not in ("out", "unique_batches")} == {
            k: v for k, v in b.items() if k not in ("out", "unique_batches")}
        assert [r["lr"] for r in train_records(root / (base + "-epochs"))] == [
            r["lr"] for r in train_records(root / (base + "-flops"))]  # the same full schedule
    paper = TrainConfig(out="x", steps=4, seed=0, feedback_start=0.0, **MIX).schedule()
    assert [r["num_passes"] for r in train_records(root / "paper")] == [paper.passes_at(s, 4) for s in range(4)]
    assert [r["num_passes"] for r in train_records(root / "residual-k3-all")] == [3] * 4
    rows = {(r["arm"], r["mode"]): r for r in res["table"]}
    assert not any(a.endswith(("-flops", "-epochs")) for a, _ in rows)  # controls, no rows of their own
    run = res["per_seed"][0]["runs"]

    def interpolated_delta(arm, mode, base, control):
        lo, hi, me = run[base], run[control], run[arm]
        w = (math.log(me["flops"]) - math.log(lo["flops"])) / (math.log(hi["flops"]) - math.log(lo["flops"]))
        assert 0 <= w <= 1
        d = [m - (a + w * (b - a)) for m, a, b in
             zip(me["losses"][mode], lo["losses"]["standard"], hi["losses"]["standard"])]
        return sum(d) / len(d)

    for arm, base in (("paper", "baseline-tied"), ("residual-k3-all", "baseline-scratch")):
        for mode in ("fused", "K=3"):
            got = rows[(arm, mode)]
            assert got["reference"] == base and got["flops_reference"] == base + "-flops"
            assert got["epochs_reference"] == base + "-epochs"
            assert got["delta_flops"]["estimate"] == pytest.approx(interpolated_delta(arm, mode, base, base + "-flops"))
            assert got["delta_epochs"]["estimate"] == pytest.approx(
                interpolated_delta(arm, mode, base, base + "-epochs"))
            tok = [m - a for m, a in zip(run[arm]["losses"][mode], run[base]["losses"]["standard"])]
            assert got["delta_tokens"]["estimate"] == pytest.approx(sum(tok) / len(tok))
        assert run[base + "-epochs"]["losses"]["standard"] != pytest.approx(run[base + "-flops"]["losses"]["standard"])
    # inference FLOPs vs standard, by hand from the parameter counts (32-token rows, an 8-token prompt)
    assert res["per_seed"][0]["row_tokens"] == 32 and res["settings"]["prompt_tokens"] == 8
    for arm in ("paper", "residual-k3-all"):
        for mode in ("standard", "K=2", "K=3", "exact", "soft", "fused"):
            assert rows[(arm, mode)]["inference_flops"] == pytest.approx(_hand_relative(mode, root / arm, 32, 8),
                                                                         rel=1e-12), (arm, mode)
        # K passes, logits once (the micro preset's 300 x 64 head is much of a pass): between 1x and Kx
        assert 1 < rows[(arm, "K=2")]["inference_flops"] < 2 < rows[(arm, "K=3")]["inference_flops"] < 3
    assert rows[("paper", "standard")]["inference_flops"] == 1.0
    assert rows[("baseline-tied", "standard")]["inference_flops"] == 1.0
    text = (out / "report.md").read_text()
    assert "inference FLOPs vs standard" in text and "Δ vs equal unique tokens & FLOPs" in text
    row = next(line for line in text.splitlines() if line.startswith("| paper | K=3 |"))
    assert f"| {rows[('paper', 'K=3')]['inference_flops']:.3f} |" in row
    # tying drops the input table, which is no matmul, and keeps the head: the same training FLOPs
    assert run["baseline-tied"]["flops"] == run["baseline-scratch"]["flops"]
    # K = 3 on every step: the run's FLOPs are 3 passes and 2 fusions a step, below the FLOP-matched baseline's
    assert run["baseline-scratch"]["flops"] * 3 < run["residual-k3-all"]["flops"] < run["baseline-scratch-flops"]["flops"]
