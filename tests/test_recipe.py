"""The feedback recipe: the token-preserving entry, switch-on levers (lambda ramp, fusion LR warm-up, per-group
clipping, fusion-only phase), the switch-on re-scaling, options that survive --resume, plain baselines, decoding
against a reference written from the equations with raw weights, and the recipe experiment's smoke run (figures
recomputed by hand; a changed option refused, then retrained with --overwrite and the table following it)."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from conftest import BOS, random_ids, tiny_model
from safetensors.torch import load_file

import fullband
from fullband import cli
from fullband.training.hf_trainer import PassSchedule
from fullband.training.optimizer import clip_gradients
from fullband.utils.io import read_jsonl



def train_args(data, out, *extra, steps=6):
    return ["train", "--preset", "micro", "--steps", str(steps), "--out", str(out), "--seed", "0", "--data", data,
            "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--no-tensorboard",
            "--no-plot", *extra]


def train_records(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


# ----------------------------------------------------------------------------------------------- the entry


def test_residual_entry_is_exactly_the_plain_model_at_switch_on():
    model = tiny_model("llama", fusion="residual")
    ids = random_ids(2, 12, seed=3)
    plain = model(ids, num_passes=1).logits
    assert torch.equal(model(ids, num_passes=2).logits, plain)
    torch.testing.assert_close(model.recurrent_forward(ids).logits, plain, atol=1e-5, rtol=1e-5)  # cached kernels
    with torch.no_grad():
        model.feedback.out_norm.weight.fill_(0.5)  # once training moves the gain, the state enters
    assert (model(ids, num_passes=2).logits - plain).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------- a reference from raw weights


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_fuse(model, h, e):
    """Eq. 4 (and the residual entry) from the raw weight tensors: u = g * rms(W_U h * sigmoid(W_G rms(e)))."""
    f, eps = model.feedback, model.config.text_config.rms_norm_eps
    gate = torch.sigmoid(_rms(e, eps) @ f.gate_proj.weight.T)
    u = _rms((h @ f.value_proj.weight.T) * gate, eps) * f.out_norm.weight
    return e + u if model.config.fusion == "residual" else u


def reference_decode(model, prompt, mode, new_tokens):
    """Greedy decoding by recomputing the whole sequence from its input vectors at every step (no KV cache):
    the prompt plain (soft), through one Jacobi pass (fused) or through the recurrence (exact); every generated
    token fused with the final hidden state of the position before it. Returns (tokens, last-step logits)."""
    backbone, embed = model.backbone, model.get_input_embeddings()

    def run(inputs):
        out = backbone(inputs_embeds=inputs.unsqueeze(0), output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0]

    e = embed(prompt)
    fusable = [t > 0 and int(prompt[t]) != BOS for t in range(len(prompt))]
    if mode == "soft":
        inputs = e
    elif mode == "fused":
        _, h = run(e)
        inputs = torch.stack([reference_fuse(model, h[t - 1], e[t]) if fusable[t] else e[t] for t in range(len(prompt))])
    else:  # exact: one position at a time
        rows = [e[0]]
        for t in range(1, len(prompt)):
            _, h = run(torch.stack(rows))
            rows.append(reference_fuse(model, h[-1], e[t]) if fusable[t] else e[t])
        inputs = torch.stack(rows)
    tokens, logits = [], None
    for _ in range(new_tokens):
        logits, h = run(inputs)
        nxt = logits[-1].argmax()
        tokens.append(int(nxt))
        ne = embed(nxt.view(1))[0]
        inputs = torch.cat([inputs, reference_fuse(model, h[-1], ne).unsqueeze(0)])
    return tokens, logits[-1]


@pytest.mark.parametrize("fusion", ["glu", "residual"])
@pytest.mark.parametrize("mode", ["soft", "fused", "exact"])
def test_decoding_matches_a_reference_written_from_raw_weights(fusion, mode):
    model = tiny_model("llama", fusion=fusion)
    if fusion == "residual":
        with torch.no_grad():
            model.feedback.out_norm.weight.fill_(0.7)  # a residual entry that is not the identity yet
    prompt = random_ids(1, 7, seed=11)[0]
    with torch.no_grad():
        want, want_logits = reference_decode(model, prompt, mode, 6)
        out = model.generate(prompt.unsqueeze(0), feedback_mode=mode, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        lean = fullband.model.generation.generate(model, prompt.unsqueeze(0), mode=mode, max_new_tokens=6,
                                            ignore_eos=True)
    assert out.sequences[0, 7:].tolist() == want
    assert lean.new_tokens[0].tolist() == want
    torch.testing.assert_close(out.logits[-1][0], want_logits, atol=2e-5, rtol=1e-4)


def test_the_reference_can_tell_the_modes_apart():
    """The reference itself is not blind: with a strong fusion the three prompt treatments give other logits."""
    model = tiny_model("llama", fusion="glu")
    prompt = random_ids(1, 7, seed=11)[0]
    with torch.no_grad():
        logits = [reference_decode(model, prompt, m, 1)[1] for m in ("soft", "fused", "exact")]
    assert (logits[0] - logits[1]).abs().max() > 1e-4 and (logits[0] - logits[2]).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------- switch-on


def test_switch_on_rescales_the_fusion_to_the_embeddings_of_that_step(data, tmp_path):
    out = tmp_path / "run"
    common = ("--feedback-start", "0.5", "--lr", "0.02", "--save-every", "3")
    assert cli.main(train_args(data, out, *common, "--stop-after", "3")) == 0
    ckpt = load_file(str(out / "checkpoints" / "step-0000003" / "model.safetensors"))
    at_switch_on = float(ckpt["backbone.model.embed_tokens.weight"].pow(2).mean().sqrt())
    assert cli.main(train_args(data, out, *common, "--resume")) == 0
    model = fullband.model.modeling.load_model(str(out))
    initial = fullband.model.modeling.embedding_rms(fullband.FullBandwidthForCausalLM.from_backbone(
        model.backbone.__class__(model.config.text_config)).get_input_embeddings())
    assert model.config.embed_rms == pytest.approx(at_switch_on, rel=1e-6)
    assert abs(at_switch_on - initial) / initial > 0.05  # the embeddings did move before the switch-on
    # and the fused input entered at the embeddings' scale then: RMS(u) = RMS(e) for the GLU right after reset
    fresh = tiny_model("llama")
    fresh.reset_feedback()
    e = fresh.get_input_embeddings().weight[:20]
    u = fresh.feedback(torch.randn(20, fresh.config.text_config.hidden_size), e)
    assert float(u.detach().pow(2).mean().sqrt()) == pytest.approx(fresh.config.embed_rms, rel=1e-3)


def test_fusion_lr_mult_survives_resume(data, tmp_path):
    out = tmp_path / "run"
    assert cli.main(train_args(data, out, "--feedback-start", "0.5", "--save-every", "3", "--stop-after", "3")) == 0
    assert cli.main(train_args(data, out, "--feedback-start", "0.5", "--resume", "--fusion-lr-mult", "10")) == 0
    fb = [r for r in train_records(out) if r["num_passes"] > 1]
    assert len(fb) == 3
    for r in fb:
        assert r["fusion_lr"] == pytest.approx(10 * r["lr"])


def test_a_longer_run_branches_off_a_shorter_ones_checkpoint(data, tmp_path, capsys):
    plain = ["--num-passes", "1", "--lr-schedule", "wsd", "--decay-fraction", "0.2"]
    longer = [*plain, "--warmup-fraction", repr(2 / 14)]  # the same 2 warm-up steps over 14
    ref = tmp_path / "ref"
    assert cli.main(train_args(data, ref, *longer, steps=14)) == 0
    # a 10-step run (warm-up 2, decay from step 8) stopped after 7 steps, continued as the 14-step run
    out = tmp_path / "branch"
    assert cli.main(train_args(data, out, *plain, "--warmup-fraction", "0.2", "--stop-after", "7", steps=10)) == 0
    assert cli.main(train_args(data, out, *longer, "--resume", steps=14)) == 0
    got, want = train_records(out), train_records(ref)
    assert [r["step"] for r in got] == list(range(1, 15))
    assert [(r["loss"], r["lr"]) for r in got] == [(r["loss"], r["lr"]) for r in want]  # bitwise the longer run
    # past the shorter run's decay start the paths differ: refused, nothing changed
    late = tmp_path / "late"
    assert cli.main(train_args(data, late, *plain, "--warmup-fraction", "0.2", "--stop-after", "9", steps=10)) == 0
    capsys.readouterr()
    assert cli.main(train_args(data, late, *longer, "--resume", steps=14)) == 2
    assert "--steps" in capsys.readouterr().err
    assert len(train_records(late)) == 9


def test_lambda_ramp_and_fusion_warmup_follow_the_feedback_phase(data, tmp_path):
    out = tmp_path / "run"
    assert cli.main(train_args(data, out, "--feedback-start", "0.5", "--feedback-ramp", "0.6",
                               "--fusion-warmup", "1", "--deep-fraction", "0", "--fusion-lr-mult", "1", steps=10)) == 0
    recs = train_records(out)
    assert [r["feedback_weight"] for r in recs[:5]] == [None] * 5
    assert [r["feedback_weight"] for r in recs[5:]] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    assert [r["fusion_lr"] / r["lr"] for r in recs[5:]] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    # the logged loss is L_1 + ramped lambda * L_2
    for r in recs[5:]:
        assert r["loss"] == pytest.approx(r["pass_losses"][0] + r["feedback_weight"] * r["pass_losses"][1], rel=1e-5)


@pytest.mark.parametrize("mode", [("--exact-states", "--grad-passes", "2"), ("--full-backprop",)])
def test_lambda_and_its_ramp_are_refused_where_they_do_nothing(data, tmp_path, capsys, mode):
    """--exact-states / --full-backprop have no plain pass for λ to weigh: a λ or ramp away from the defaults is one
    line, exit 2, nothing written (the trainer's PassSchedule refuses it too); at the defaults the logged λ is None
    and the logged loss is what the step applied: the mean of the gradient passes."""
    fb = ("--feedback-start", "0", "--deep-fraction", "0")
    for bad in (("--feedback-weight", "0.5"), ("--feedback-ramp", "0.5")):
        out = tmp_path / f"bad{bad[0]}"
        capsys.readouterr()
        assert cli.main(train_args(data, out, *fb, *mode, *bad, steps=1)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--feedback-weight and --feedback-ramp do not apply with " + mode[0] in err[0], err
        assert not out.exists()
    options = {"exact_states": True, "grad_passes": 2} if mode[0] == "--exact-states" else {"full_backprop": True}
    with pytest.raises(ValueError, match="do not apply"):
        PassSchedule(feedback_start=0.0, feedback_weight=0.5, **options)
    assert PassSchedule(feedback_start=0.0, **options).weight_at(3, 10) is None
    out = tmp_path / "run"
    assert cli.main(train_args(data, out, *fb, *mode, "--feedback-ramp", "0", steps=2)) == 0
    recs = train_records(out)
    assert [r["feedback_weight"] for r in recs] == [None, None]
    for r in recs:
        assert len(r["pass_losses"]) == (2 if mode[0] == "--exact-states" else 1)
        assert r["loss"] == pytest.approx(sum(r["pass_losses"]) / len(r["pass_losses"]), rel=1e-5)


def test_fusion_only_phase_leaves_the_backbone_untouched(data, tmp_path):
    assert cli.main(train_args(data, tmp_path / "plain", "--num-passes", "1", steps=2)) == 0
    out = tmp_path / "fo"
    assert cli.main(train_args(data, out, "--init-from", str(tmp_path / "plain"), "--feedback-start", "0",
                               "--fusion-only", "1", "--fusion", "residual", steps=3)) == 0
    before = load_file(str(tmp_path / "plain" / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    for k, v in before.items():
        assert torch.equal(after["backbone." + k], v), k
    assert after["feedback.out_norm.weight"].abs().max() > 0  # the residual entry's gain left 0: the fusion trained
    assert all(r.get("backbone_frozen") for r in train_records(out))


def test_clip_gradients_clips_each_group_to_its_own_norm():
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.full((4,), 3.0), torch.full((3,), 0.1)  # norms 6.0 and ~0.173
    na, nb = clip_gradients([a], 1.0), clip_gradients([b], 1.0)
    assert na == pytest.approx(6.0) and nb == pytest.approx(0.1 * 3 ** 0.5, rel=1e-5)
    assert float(a.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(b.grad, torch.full((3,), 0.1))  # under the limit: untouched
    assert clip_gradients([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0  # no gradients at all


def test_per_group_clipping_logs_the_fusion_norm_before_clipping(data, tmp_path, monkeypatch):
    """The logged fusion_grad_norm of a K=2 step is the norm of the fusion's gradient, recomputed here from a copy
    of the model at that step after a plain forward + backward on the step's batch (no jitter, no prefix mixing:
    the batch and loss are deterministic); a clip limit far below it shows it is logged before clipping."""
    import copy

    from fullband.training import engine

    want = {}
    real_step = engine.Trainer.train_step

    def spy(self, step):
        if step == 4:  # a feedback step after the switch-on
            model = copy.deepcopy(engine.D.unwrap(self.model))
            model.zero_grad(set_to_none=True)
            batch = self.recipe.batch(step, 2, torch.Generator(), self.env)
            for mb in batch.micro:
                (model(**mb, num_passes=2, feedback_weight=1.0).loss * batch.loss_weight).backward()
            grads = [p.grad for n, p in model.named_parameters() if n.startswith("feedback.") and p.grad is not None]
            want["fusion"] = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
            backbone = [p.grad for n, p in model.named_parameters() if not n.startswith("feedback.") and p.grad is not None]
            want["backbone"] = float(torch.sqrt(sum(g.double().pow(2).sum() for g in backbone)))
        return real_step(self, step)

    monkeypatch.setattr(engine.Trainer, "train_step", spy)
    out = tmp_path / "run"
    assert cli.main(train_args(data, out, "--feedback-start", "0.5", "--clip-per-group", "--grad-clip", "1e-4",
                               "--jitter", "0", "--prefix-mix", "0", "--feedback-ramp", "0", "--deep-fraction", "0",
                               "--num-passes", "2")) == 0
    recs = train_records(out)
    assert all("fusion_grad_norm" not in r for r in recs[:3])
    assert [r["num_passes"] for r in recs] == [1, 1, 1, 2, 2, 2]
    got = recs[4]
    assert want["fusion"] > 1e-3  # far above the clip limit: a norm taken after clipping would read 1e-4
    assert got["fusion_grad_norm"] == pytest.approx(want["fusion"], rel=1e-4)
    # the step's grad_norm is the two groups' norms combined
    assert got["grad_norm"] == pytest.approx((want["fusion"] ** 2 + want["backbone"] ** 2) ** 0.5, rel=1e-4)


# ----------------------------------------------------------------------------------------------- plain baselines


def test_a_plain_run_is_saved_as_its_plain_backbone(data, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "base"
    assert cli.main(train_args(data, out, "--num-passes", "1", steps=2)) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not isinstance(model, fullband.FullBandwidthForCausalLM)
    capsys.readouterr()
    assert cli.main(["info", "--model", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["fusion"] is None
    assert cli.main(["generate", "--model", str(out), "--prompt", "the", "--max-new-tokens", "3",
                     "--mode", "exact"]) == 2  # a plain model has no feedback mode
    # retrofitting it works as for any HF checkpoint
    assert cli.main(train_args(data, tmp_path / "fbt", "--init-from", str(out), "--feedback-start", "0",
                               steps=2)) == 0


def test_data_offset_continues_the_data_order(data, tmp_path):
    from fullband.data.corpus import batch_rows

    assert torch.equal(batch_rows(0 + 5, 4, 100, 0), batch_rows(5, 4, 100, 0))
    assert cli.main(train_args(data, tmp_path / "bad", "--data-offset", "-1")) == 2


# ----------------------------------------------------------------------------------------------- the experiment


def _hand_flops(out, records, batch_size: int, seq_len: int) -> float:
    """Training FLOPs of a run written out from the micro preset's shapes (d 64, 2 layers, MLP 128, untied head;
    the vocabulary read off the saved LM head): per token and pass 6 N + 6 L T d, N = every backbone weight but
    the input embedding table (q, k, v, o, the SwiGLU's three matrices, the two norms of each layer, the final
    norm, the head); plus 6 x (2 d^2 + d) for the fusion on every fused pass."""
    d, layers, ff = 64, 2, 128
    weights = load_file(str(out / "model.safetensors"))
    vocab = next(v.shape[0] for k, v in weights.items() if k.endswith("lm_head.weight"))
    n = layers * (4 * d * d + 3 * d * ff + 2 * d) + d + d * vocab
    fusion = 2 * d * d + d
    tokens = batch_size * seq_len
    return sum(tokens * (r["num_passes"] * (6 * n + 6 * layers * seq_len * d) + (r["num_passes"] - 1) * 6 * fusion)
               for r in records)


def _per_seed_ci_bounds(diffs_per_seed):
    """The pooled percentile CI, by hand: a two-level bootstrap (the seeds drawn with replacement, then each drawn
    seed's rows), every one of its equally likely outcomes enumerated (two seeds of two rows: 4 seed draws x 16 row
    draws); the 2.5% and 97.5% quantiles of that distribution (the first value whose distribution function passes
    the level)."""
    n = len(diffs_per_seed)
    values = []
    for seeds in itertools.product(range(n), repeat=n):
        slots = [itertools.product(diffs_per_seed[s], repeat=len(diffs_per_seed[s])) for s in seeds]
        for draw in itertools.product(*slots):
            values.append(sum(sum(r) / len(r) for r in draw) / n)
    values.sort()
    return values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))]


def test_recipe_experiment_quick(tmp_path, capsys):
    import math

    from fullband.eval.scoring import load_any_model, row_losses
    from fullband.training.config import TrainConfig
    from fullband.training.pretrain import build_tokenizer_and_corpus, spread_rows

    out = tmp_path / "recipe"
    argv = ["experiment", "recipe", "--quick", "--out", str(out), "--no-progress", "--json",
            "--arms", "shipped,residual-warm", "--trunk-steps", "3", "--branch-steps", "2", "--eval-rows", "2"]
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["arms"]) == {"baseline", "baseline-decayed", "shipped", "residual-warm", "baseline-flops",
                                "baseline-epochs"}
    rows = {(r["arm"], r["mode"]): r for r in res["table"]}
    assert {m for a, m in rows if a == "residual-warm"} == {"standard", "K=2", "K=3", "exact", "soft", "fused"}
    # every figure is the mean of the per-row losses of its seeds; the delta is paired against the right baseline
    for (arm, mode), r in rows.items():
        per_seed = [s["runs"][arm]["losses"][mode] for s in res["per_seed"]]
        assert r["loss"] == pytest.approx(sum(sum(x) / len(x) for x in per_seed) / len(per_seed))
    r = rows[("shipped", "exact")]
    own = [s["runs"]["shipped"]["losses"]["exact"] for s in res["per_seed"]]
    ref = [s["runs"]["baseline-decayed"]["losses"]["standard"] for s in res["per_seed"]]
    diffs = [[a - b for a, b in zip(o, f)] for o, f in zip(own, ref)]
    assert r["delta_tokens"]["estimate"] == pytest.approx(sum(sum(d) / len(d) for d in diffs) / len(diffs))
    assert (r["delta_tokens"]["low"], r["delta_tokens"]["high"]) == pytest.approx(_per_seed_ci_bounds(diffs))
    assert "delta_flops" not in r  # a different LR schedule than the FLOP-matched baselines: not compared

    def flops_delta_by_hand(res, arm, mode):
        """The equal-FLOPs difference, by hand: the baseline's per-row loss at the arm's FLOPs, linear in log FLOPs
        between the baseline and the FLOP-matched baseline."""
        out = []
        for s in res["per_seed"]:
            base, big, run = (s["runs"][a] for a in ("baseline", "baseline-flops", arm))
            w = (math.log(run["flops"]) - math.log(base["flops"])) / (math.log(big["flops"]) - math.log(base["flops"]))
            assert 0 <= w <= 1
            out.append([m - (lo + w * (hi - lo)) for m, lo, hi in
                        zip(run["losses"][mode], base["losses"]["standard"], big["losses"]["standard"])])
        return out

    d_flops = flops_delta_by_hand(res, "residual-warm", "soft")
    got = rows[("residual-warm", "soft")]["delta_flops"]
    assert got["estimate"] == pytest.approx(sum(sum(d) / len(d) for d in d_flops) / len(d_flops))
    assert (got["low"], got["high"]) == pytest.approx(_per_seed_ci_bounds(d_flops))
    # training FLOPs, from the preset's shapes; the steps each run took
    bs, seq = 4, 32
    steps = {"baseline": 2, "baseline-decayed": 2, "shipped": 2, "residual-warm": 2, "baseline-flops": 5,
             "baseline-epochs": 5}  # ceil(2 x 2.3)
    for seed, s in zip((0, 1), res["per_seed"]):
        for arm, n in steps.items():
            recs = train_records(out / f"seed{seed}" / arm)
            assert len(recs) == n and s["runs"][arm]["steps"] == n
            assert s["runs"][arm]["flops"] == pytest.approx(_hand_flops(out / f"seed{seed}" / arm, recs, bs, seq))
        assert {r["num_passes"] for r in train_records(out / f"seed{seed}" / "baseline")} == {1}
        assert min(r["num_passes"] for r in train_records(out / f"seed{seed}" / "shipped")) >= 2
    assert (out / "report.md").is_file() and (out / "recipe.png").stat().st_size > 1000
    assert cli.main(["experiment", "recipe", "--quick", "--out", str(out), "--arms", "nope"]) == 2

    # ---- a changed option: the FLOP-matched baseline becomes 6 steps (seed 0 only, to keep it short). Without
    # --overwrite: refused, one line naming the option, nothing retrained or rewritten
    big = out / "seed0" / "baseline-flops"
    stamps = {p: p.stat().st_mtime_ns for p in (big / "model.safetensors", big / "metrics.jsonl",
                                                  out / "results.json", out / "seed0" / "shipped" / "model.safetensors")}
    capsys.readouterr()
    changed = argv + ["--flops-multiplier", "3", "--seeds", "0"]
    assert cli.main(changed) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "baseline-flops" in err and "--steps 5 -> 6" in err and "--overwrite" in err
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # with --overwrite: that run is retrained (the others reused), and the table follows the new model
    assert cli.main(changed + ["--overwrite"]) == 0
    capsys.readouterr()
    new = json.loads((out / "results.json").read_text())
    assert (out / "seed0" / "shipped" / "model.safetensors").stat().st_mtime_ns == stamps[out / "seed0" / "shipped" / "model.safetensors"]
    assert big.joinpath("model.safetensors").stat().st_mtime_ns != stamps[big / "model.safetensors"]
    assert new["seeds"] == [0]
    for seed, s in zip((0,), new["per_seed"]):
        recs = train_records(out / f"seed{seed}" / "baseline-flops")
        assert len(recs) == 6 and s["runs"]["baseline-flops"]["steps"] == 6
        assert s["runs"]["baseline-flops"]["flops"] == pytest.approx(_hand_flops(out / f"seed{seed}" / "baseline-flops", recs, bs, seq))
    # the per-row losses are the retrained model's, scored here afresh (not the cached ones of the old model)
    cfg = TrainConfig(**{k: v for k, v in json.loads((out / "seed0" / "trunk" / "run_config.json").read_text()).items()
                         if k in TrainConfig.field_names()})
    held_out = spread_rows(build_tokenizer_and_corpus(cfg).val_rows, 2)
    fresh = row_losses(load_any_model(str(big), device="cpu")[0], held_out, "standard", prompt_length=8).tolist()
    assert new["per_seed"][0]["runs"]["baseline-flops"]["losses"]["standard"] == pytest.approx(fresh, rel=1e-6)
    assert fresh != pytest.approx(res["per_seed"][0]["runs"]["baseline-flops"]["losses"]["standard"], rel=1e-6)
    got = {(r["arm"], r["mode"]): r for r in new["table"]}[("residual-warm", "soft")]["delta_flops"]
    d_new = flops_delta_by_hand(new, "residual-warm", "soft")
    assert got["estimate"] == pytest.approx(sum(sum(d) / len(d) for d in d_new) / len(d_new))
    old = flops_delta_by_hand(res, "residual-warm", "soft")[0]
    assert got["estimate"] != pytest.approx(sum(old) / len(old))  # seed 0's figure before the change
