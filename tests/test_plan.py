"""``fullband train --dry-run``: the plan's counts against a real run and against arithmetic done by hand."""

from __future__ import annotations

import collections
import json
import os

import pytest
from transformers import AutoModelForCausalLM

from fullband import cli
from fullband.model.modeling import load_model
from fullband.training.config import TrainConfig
from fullband.training.plan import GIB, activation_bytes_per_token, make_plan
from fullband.training.presets import backbone_config
from fullband.utils.io import read_jsonl

RUN = ["--preset", "micro", "--seq-len", "32", "--batch-size", "4", "--seed", "0", "--no-progress",
       "--no-tensorboard", "--feedback-start", "0.5", "--deep-fraction", "0.34"]


@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory):
    """A real 6-step run (K = 1, 1, 1, 2, 2, 4) whose logged steps the plan must predict."""
    out = tmp_path_factory.mktemp("plan") / "run"
    assert cli.main(["train", "--steps", "6", "--out", str(out), "--data", data, "--vocab-size", "300", *RUN]) == 0
    return str(out)


def test_plan_predicts_the_run_it_plans(finished_run, capsys):
    """Bugs caught: a schedule in the plan that differs from the trainer's (another K histogram), a parameter count
    of the meta-device model that differs from the real one (e.g. an untied head counted once, the fusion missed),
    a per-step FLOP figure that is not what experiments charge a finished run."""
    capsys.readouterr()
    rc = cli.main(["train", "--dry-run", "--json", "--steps", "6", "--out", finished_run, "--tokenizer", finished_run,
                   *RUN])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    records = [r for r in read_jsonl(os.path.join(finished_run, "metrics.jsonl")) if r.get("split") == "train"]
    assert plan["passes_histogram"] == {str(k): n for k, n in
                                        sorted(collections.Counter(r["num_passes"] for r in records).items())}
    model = load_model(finished_run)
    backbone = sum(p.numel() for p in model.backbone.parameters())
    fusion = sum(p.numel() for p in model.feedback.parameters())
    assert plan["model"]["backbone_params"] == backbone
    assert plan["model"]["fusion_params"] == fusion
    # the FLOP rule written here from the saved model's own tensors and the logged K of every step (not through
    # the package's flop_parameters / training_flops, which the plan calls): every weight but the input embedding
    # (untied head) costs 6 FLOPs per token and pass, the causal attention 6·L·T·d, a fused pass 6 per fusion weight
    matmul = backbone - model.backbone.get_input_embeddings().weight.numel()
    assert plan["model"]["matmul_params"] == matmul
    cfg = model.config.text_config
    per_pass = 6 * matmul + 6 * cfg.num_hidden_layers * 32 * cfg.hidden_size
    by_hand = sum(4 * 32 * (r["num_passes"] * per_pass + (r["num_passes"] - 1) * 6 * fusion) for r in records)
    assert plan["total_flops"] == pytest.approx(by_hand, rel=1e-12)


def test_plan_arithmetic_by_hand():
    """Micro preset (d64, L2, MLP 128, 4 heads), vocabulary 300, untied head, residual fusion. Worked by hand:
    backbone = L·(4·d² + 3·d·f + 2·d) + 2·V·d + d = 2·(16384 + 24576 + 128) + 38400 + 64 = 120640;
    fusion = W_G + W_U (d² each) + the output norm's gain (d) = 8256; matmul = 120640 − V·d = 101440.
    FLOPs per token and pass = 6·101440 + 6·L·T·d = 608640 + 6·2·32·64 = 633216; a K=2 step of 4 rows × 32 tokens
    = 128 · (2·633216 + 6·8256) = 168,443,904. Memory: 16 + 2 bytes per parameter (fp32 weights, grads, AdamW,
    bf16 copies); FSDP over 4 devices divides it by 4.
    Bugs caught: a wrong layer formula, the fusion counted per pass twice, FSDP not sharding the states."""
    cfg = TrainConfig(out="x", preset="micro", steps=10, seq_len=32, batch_size=4, vocab_size=300, num_passes=2,
                      feedback_start=0.5, deep_fraction=0.0)
    plan = make_plan(cfg, world_size=1, gpu="h100", mfu=0.5)
    m = plan["model"]
    assert (m["backbone_params"], m["fusion_params"], m["matmul_params"]) == (120640, 8256, 101440)
    assert plan["passes_histogram"] == {1: 5, 2: 5}
    assert plan["flops_per_step"][2] == 168_443_904
    assert plan["total_flops"] == 5 * 128 * 633216 + 5 * 168_443_904
    assert plan["seconds"] == pytest.approx(plan["total_flops"] / (989e12 * 0.5))
    # --grad-passes 1 at K=3: one pass with gradient, two forward-only without the LM head (V·d = 19200 weights:
    # 2·(101440 − 19200) + 2·2·32·64 = 172672 each), one of them fused (a third of 49536):
    # 633216 + 2·172672 + 49536 + 49536/3 = 1,044,608 per token; x 128 tokens = 133,709,824
    truncated = make_plan(TrainConfig(**{**cfg.to_dict(), "num_passes": 3, "grad_passes": 1}), gpu="h100")
    assert truncated["flops_per_step"][3] == pytest.approx(133_709_824, rel=1e-12)
    assert truncated["passes_with_graph"] == 1
    mem = plan["memory_per_device_bytes"]
    n = 120640 + 8256
    assert (mem["weights"], mem["gradients"], mem["adamw"], mem["bf16_weight_copies"]) == (4 * n, 4 * n, 8 * n, 2 * n)
    sharded = make_plan(TrainConfig(**{**cfg.to_dict(), "parallel": "fsdp"}), world_size=4, gpu="h100")
    assert sharded["memory_per_device_bytes"]["adamw"] == 8 * n / 4
    # activations: per token and pass L·(10d + 4f)·2 bytes + V·4 bytes of fp32 logits = 2·1152·2 + 1200 = 5808
    p = dict(m, seq_len=32)
    assert activation_bytes_per_token(p, 2, False, gpu_attention=True) == 5808
    # with checkpointing: L·d + one layer's (10d + 4f), bf16, plus the logits = (128 + 1152)·2 + 1200 = 3760
    assert activation_bytes_per_token(p, 2, True, gpu_attention=True) == 3760
    assert mem["activations"] == 4 * 32 * 5808 * 2  # micro-batch tokens x K=2 graphs (no lever on)
    # --activation-checkpointing --loss-chunk 48: no logits per token, (L·d + one layer's 10d + 4f)·2 bytes =
    # (128 + 1152)·2 = 2560, x 128 tokens x 2 graphs = 655,360; plus one chunk's fp32 logits and gradient,
    # 8 B x 48 x 300 = 115,200: 770,560. A chunk longer than the micro-batch counts the micro-batch's 128 positions.
    assert activation_bytes_per_token(p, 2, True, gpu_attention=True, loss_chunk=48) == 2560
    levers = make_plan(TrainConfig(**{**cfg.to_dict(), "activation_checkpointing": True, "loss_chunk": 48}), gpu="h100")
    assert levers["memory_per_device_bytes"]["activations"] == 770_560
    assert plan["activations_with_levers_bytes"] == 128 * 2560 * 2 + 8 * 128 * 300  # the levers' default 4096 chunk
    assert levers["memory_per_device_bytes"]["weights"] == mem["weights"]


def test_plan_of_a_tied_gpt2_small_shape_and_a_config_too_big_for_one_device():
    """The tied head is counted once (GPT-2 small's shape at GPT-2's vocabulary is ≈124M parameters), and a
    batch that cannot fit gets the --grad-accum that does."""
    cfg = TrainConfig(out="x", preset="gpt2-small", steps=100, seq_len=1024, batch_size=512, vocab_size=50257)
    plan = make_plan(cfg, gpu="h200")
    real = AutoModelForCausalLM.from_config(backbone_config("gpt2-small", 50257, max_position_embeddings=2048))
    assert plan["model"]["tied_embeddings"] is True
    assert plan["model"]["backbone_params"] == sum(p.numel() for p in real.parameters())
    assert plan["model"]["matmul_params"] == plan["model"]["backbone_params"]
    static = sum(v for k, v in plan["memory_per_device_bytes"].items() if not k.startswith("activations"))
    accum = plan["grad_accum_to_fit"]
    assert accum is not None and accum > 1 and 512 % accum == 0
    per_row = plan["memory_per_device_bytes"]["activations"] / 512
    assert static + per_row * 512 / accum <= 0.9 * 141 * GIB < static + per_row * 512 / (accum // 2)


def test_dry_run_writes_nothing_and_bad_values_are_one_line(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["train", "--dry-run", "--out", str(out), "--preset", "tiny", "--steps", "50"]) == 0
    text = capsys.readouterr().out
    assert "K=1: 35" in text and "K=2" in text and not out.exists()
    assert cli.main(["train", "--dry-run", "--plan-mfu", "2", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plan-mfu" in err[0]


def test_layers_shapes_the_backbone_the_run_trains_and_the_plan_counts(data, tmp_path, capsys):
    """``--layers 3`` on the micro preset: the trained model has 3 decoder layers, and ``--dry-run`` counts a
    3-layer backbone, by hand: micro's per-layer weights 4·d² + 3·d·f + 2·d = 41,088 (d64, f128), so 3 layers and
    the 300-entry untied embeddings and head give 3·41088 + 2·300·64 + 64 = 161,728. ``--layers 0`` and
    ``--layers`` with ``--init-from`` are one-line errors (exit 2). Bug caught: the option parsed but the
    preset's 2 layers built (120,640 parameters)."""
    out = tmp_path / "run"
    assert cli.main(["train", "--steps", "1", "--out", str(out), "--data", data, "--vocab-size", "300", "--layers", "3",
                     *RUN]) == 0
    model = load_model(str(out))  # one step before the feedback start: saved as the plain HF model it is
    assert model.config.num_hidden_layers == 3 == len(model.model.layers)
    capsys.readouterr()
    assert cli.main(["train", "--dry-run", "--json", "--preset", "micro", "--vocab-size", "300", "--layers", "3",
                     "--seq-len", "32", "--steps", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["backbone_params"] == 161728 == sum(p.numel() for p in model.parameters())
    for bad, says in ((["--layers", "0"], "--layers"), (["--layers", "3", "--init-from", str(out)], "--init-from")):
        assert cli.main(["train", "--dry-run", "--preset", "micro", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]
