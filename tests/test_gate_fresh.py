"""The gate is never stale: after real training steps (``fullband train`` and ``fullband sft`` with the package's
own fused AdamW, run in this process) and after every other way of changing the weights (``p.data.copy_``,
``load_state_dict``, ``.to(dtype)``, ``resize_token_embeddings``, another optimizer), every inference path -- the
K-pass forward, the exact recurrence, the lean loop, HF ``generate()``, with and without a call-scoped gate table --
gives the logits of a reference computed from the raw weights by the equations (``tests/reference.py``).

The bug these catch: a per-vocabulary gate table cached across calls and keyed on the weights' version counters,
which fused AdamW and ``p.data.copy_`` do not bump (logits off by up to ~0.5 after one step, in-training
evaluation and train-then-generate silently using the pre-step gate).
"""

from __future__ import annotations

import json
import os

import pytest
import reference as ref
import torch
from conftest import random_ids, tiny_model
from transformers import AutoModelForCausalLM

import fullband.model.modeling as modeling
from fullband.data.corpus import train_tokenizer
from fullband.model.feedback import clear_gate_table
from fullband.model.generation import generate
from fullband.model.modeling import FullBandwidthForCausalLM, load_model
from fullband.training.chat import load_conversations, set_chat_template
from fullband.training.config import TrainConfig
from fullband.training.engine import run
from fullband.training.optimizer import build_optimizer
from fullband.training.presets import backbone_config
from fullband.training.pretrain import PretrainRecipe, spread_rows
from fullband.training.sft import SFTConfig, SFTRecipe, evaluate_sft_loss
from fullband.utils.io import read_jsonl

ATOL = 2e-5


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


class Keep:
    """A recipe mixin that keeps the trained model object (the run's own, as ``finish`` gets it)."""

    def finish(self, model, summary):
        super().finish(model, summary)
        self.model = model


class KeepPretrain(Keep, PretrainRecipe):
    pass


class KeepSFT(Keep, SFTRecipe):
    pass


def check_every_path(model, ids):
    """Eval mode, no gradient: K-pass, recurrence, lean loop and HF generate() against the references."""
    model.eval()
    with torch.no_grad():
        close(model(ids, num_passes=2).logits, ref.k_pass_logits(model, ids, 2))
        close(model(ids, num_passes=3).logits, ref.k_pass_logits(model, ids, 3))
        close(model.recurrent_forward(ids).logits, ref.recurrence_logits(model, ids))
    prompt = ids[:, :6]
    lean = generate(model, prompt, mode="exact", max_new_tokens=4, ignore_eos=True, output_logits=True)
    expect = ref.recurrence_logits(model, lean.sequences)[:, prompt.shape[1] - 1:-1]
    close(lean.logits, expect)
    hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), feedback_mode="exact", max_new_tokens=4,
                        do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                        pad_token_id=0)
    assert torch.equal(hf.sequences, lean.sequences)
    close(torch.stack(hf.logits, 1), expect)


# ----------------------------------------------------------------------------------------------- fullband train


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """Three `fullband train` steps in this process: micro preset, paper GLU fusion (the gate reaches the output
    at full strength), feedback from step 0, validation after every step."""
    out = tmp_path_factory.mktemp("gate_train") / "run"
    cfg = TrainConfig(out=str(out), preset="micro", steps=3, seed=0, data=data, vocab_size=300, seq_len=32,
                      batch_size=4, progress=False, tensorboard=False, plot=False, fusion="glu", feedback_start=0.0,
                      eval_every=1, eval_rows=4, deep_fraction=0.0)
    recipe = KeepPretrain(cfg)
    assert run(recipe)["status"] == "done"
    return recipe


def test_training_uses_the_fused_optimizer(trained):
    """The optimizer the run builds is the fused AdamW (the one that leaves version counters alone)."""
    opt = build_optimizer(trained.model, trained.cfg, torch.device("cpu"))
    assert opt.defaults.get("fused") is True


def test_in_training_validation_scores_the_current_weights(trained):
    """The K-pass validation loss logged after the last step equals the reference loss of the final weights
    (stale-table bug: the log scored the gate of step 1's weights)."""
    cfg = trained.cfg
    vals = [r for r in read_jsonl(os.path.join(cfg.out, "metrics.jsonl")) if "val_loss_passes" in r]
    assert [r["step"] for r in vals] == [1, 2, 3]
    rows = spread_rows(trained.val_rows, cfg.eval_rows)
    model = trained.model.eval()
    expected = ref.next_token_loss(ref.k_pass_logits(model, rows, cfg.num_passes), rows)
    assert vals[-1]["val_loss_passes"] == pytest.approx(expected, abs=1e-5)


def test_trained_model_every_path_matches_the_reference(trained):
    check_every_path(trained.model, trained.val_rows[:2, :16])


def test_a_call_large_enough_for_a_gate_table_matches_the_reference(trained, monkeypatch):
    """A decode call that fuses >= vocab tokens looks the gate up in a table built for that call, from the
    current weights, and drops it afterwards."""
    model = trained.model.eval()
    built = []
    real = modeling.gate_table
    monkeypatch.setattr(modeling, "gate_table", lambda *a, **k: built.append(1) or real(*a, **k))
    vocab = model.get_input_embeddings().num_embeddings
    prompt = trained.val_rows[:8, :4]
    n = vocab // 8 + 2  # 8 rows x n new tokens >= vocab
    res = generate(model, prompt, mode="soft", max_new_tokens=n, ignore_eos=True, output_logits=True)
    assert built == [1] and model._scoped_gate_table is None
    # soft: the prompt plain, each new token fused with the state before it = the recurrence with the prompt's
    # positions left unfused
    seq = res.sequences
    mask = ref.feedback_mask(seq, model.config.doc_start_token_id)
    mask[:, :prompt.shape[1]] = False
    close(res.logits, ref.recurrence_logits(model, seq, mask=mask)[:, prompt.shape[1] - 1:-1])
    hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), feedback_mode="soft", max_new_tokens=n,
                        do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                        pad_token_id=0)
    assert built == [1, 1] and model._scoped_gate_table is None
    close(torch.stack(hf.logits, 1), res.logits)
    small = generate(model, prompt[:1], mode="soft", max_new_tokens=3, ignore_eos=True)
    model.generate(prompt[:1], feedback_mode="soft", max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert built == [1, 1] and small.num_new_tokens == 3  # a small call computes the gate per token


def test_train_then_generate_equals_generate_after_reload(trained):
    model = trained.model.eval()
    prompt = trained.val_rows[:2, :8]
    here = generate(model, prompt, mode="fused", max_new_tokens=6, ignore_eos=True, output_logits=True)
    reloaded = load_model(trained.cfg.out).eval()
    there = generate(reloaded, prompt, mode="fused", max_new_tokens=6, ignore_eos=True, output_logits=True)
    assert torch.equal(here.sequences, there.sequences)
    close(here.logits, there.logits, atol=1e-5)
    hf_here = model.generate(prompt, feedback_mode="soft", max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    hf_there = reloaded.generate(prompt, feedback_mode="soft", max_new_tokens=6, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    close(torch.stack(hf_here.logits, 1), torch.stack(hf_there.logits, 1), atol=1e-5)


# ----------------------------------------------------------------------------------------------- fullband sft


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """Two `fullband sft` steps in this process on a GLU micro model, validation after each step, then the
    final per-mode losses."""
    texts = [json.dumps(c) for c in load_conversations("example")] + ["System: User: Assistant: 0123456789+-*=?#"] * 4
    tok = set_chat_template(train_tokenizer(texts, 300))
    root = tmp_path_factory.mktemp("gate_sft")
    torch.manual_seed(0)
    backbone = AutoModelForCausalLM.from_config(backbone_config("micro", len(tok), bos_token_id=1, eos_token_id=2,
                                                                pad_token_id=0))
    FullBandwidthForCausalLM.from_backbone(backbone, fusion="glu", doc_start_token_id=1).save_pretrained(root / "fb")
    tok.save_pretrained(root / "fb")
    cfg = SFTConfig(init_from=str(root / "fb"), out=str(root / "out"), data="example", steps=2, batch_size=4,
                    seq_len=128, progress=False, tensorboard=False, plot=False, eval_every=1, eval_rows=4,
                    final_eval=4, gen_eval=0, deep_fraction=0.0)
    recipe = KeepSFT(cfg)
    summary = run(recipe)
    assert summary["status"] == "done"
    return recipe, summary


def test_sft_final_losses_equal_rescoring_the_saved_model(sft_run):
    recipe, summary = sft_run
    logged = {e["mode"]: e["loss"] for e in summary["eval"]}
    assert set(logged) == {"standard", "passes", "exact"}
    reloaded = load_model(recipe.cfg.out).eval()
    for mode, k in (("passes", recipe.cfg.num_passes), ("exact", 2)):
        again = evaluate_sft_loss(reloaded, recipe.val_enc, mode, k, batch_size=16, max_examples=4)["loss"]
        assert logged[mode] == pytest.approx(again, abs=1e-5), mode


def test_sft_model_every_path_matches_the_reference(sft_run):
    recipe, _ = sft_run
    ids = torch.tensor([recipe.val_enc.ids[i][:14] for i in range(2)])
    check_every_path(recipe.model, ids)


# ----------------------------------------------------------------------------------------------- other changes


@pytest.fixture
def glu():
    model = tiny_model("llama", fusion="glu", seed=3)
    with torch.no_grad():
        model.feedback.out_norm.weight.mul_(4.0)  # the fused term well above the noise
    return model


def _warm(model, ids):
    """An inference call before the change (what would have built and cached a table)."""
    with torch.no_grad():
        model.eval()(ids, num_passes=2)
        generate(model, ids[:, :3], mode="soft", max_new_tokens=2, ignore_eos=True)


def _assert_fresh(model, ids):
    model.eval()
    with torch.no_grad():
        close(model(ids, num_passes=2).logits, ref.k_pass_logits(model, ids, 2))
        close(model.recurrent_forward(ids).logits, ref.recurrence_logits(model, ids))
        with model.frozen_gate_table():
            close(model(ids, num_passes=2).logits, ref.k_pass_logits(model, ids, 2))
        assert model._scoped_gate_table is None


def test_data_copy_is_seen(glu):
    ids = random_ids(2, 10)
    _warm(glu, ids)
    with torch.no_grad():
        glu.feedback.gate_proj.weight.data.copy_(torch.randn_like(glu.feedback.gate_proj.weight))
    _assert_fresh(glu, ids)
    _warm(glu, ids)
    emb = glu.get_input_embeddings().weight
    emb.data.copy_(emb.data.flip(0))
    _assert_fresh(glu, ids)


def test_load_state_dict_and_other_optimizers_are_seen(glu):
    ids = random_ids(2, 10)
    _warm(glu, ids)
    other = tiny_model("llama", fusion="glu", seed=5)
    glu.load_state_dict(other.state_dict())
    _assert_fresh(glu, ids)
    for opt in (torch.optim.SGD(glu.parameters(), lr=1.0), torch.optim.AdamW(glu.parameters(), lr=0.05, fused=True)):
        _warm(glu, ids)
        glu.train()
        glu(ids, labels=ids, num_passes=2).loss.backward()
        opt.step()
        opt.zero_grad()
        _assert_fresh(glu, ids)


def test_dtype_moves_and_resizing_are_seen(glu):
    ids = random_ids(2, 10)
    _warm(glu, ids)
    glu.to(torch.float64)
    _assert_fresh(glu, ids)
    glu.to(torch.bfloat16).to(torch.float32)  # rounded weights, possibly back at the old addresses
    _assert_fresh(glu, ids)
    _warm(glu, ids)
    vocab = glu.get_input_embeddings().num_embeddings
    glu.resize_token_embeddings(vocab + 8)
    wide = ids.clone()
    wide[:, 4] = vocab + 3  # a new entry
    _assert_fresh(glu, wide)


def test_frozen_scope_is_dropped_on_error_and_clear_is_deprecated(glu):
    with pytest.raises(RuntimeError):
        with glu.frozen_gate_table():
            assert glu._scoped_gate_table is not None
            raise RuntimeError("boom")
    assert glu._scoped_gate_table is None
    with pytest.warns(DeprecationWarning):
        clear_gate_table(glu)
