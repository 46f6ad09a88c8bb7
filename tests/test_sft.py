"""``fullband sft``: chat template and assistant-token masks, chat jsonl checks, the loss on assistant tokens only,
gradient accumulation, starting points (fullband model, `fullband train` checkpoint, plain HF model), resume.

Everything runs a ``micro`` backbone with a 300-entry BPE on the shipped example conversations.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fullband
from fullband import cli
from fullband.data.corpus import train_tokenizer
from fullband.model.modeling import FullBandwidthForCausalLM
from fullband.training.chat import (
    CHAT_TEMPLATE,
    collate,
    encode_conversation,
    encode_conversations,
    load_conversations,
    read_chat_jsonl,
    set_chat_template,
    sft_feedback_mask,
    split_conversations,
    synthetic_conversations,
)
from fullband.training.presets import backbone_config
from fullband.training.sft import SFTConfig, sft
from fullband.utils.io import read_jsonl

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2=?"},
        {"role": "assistant", "content": "1+2=3. #### 3"}, {"role": "user", "content": "and 2*4?"},
        {"role": "assistant", "content": "2*4=8. #### 8"}]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(c) for c in load_conversations("example")] + ["System: User: Assistant: 0123456789+-*=?#"] * 4
    return set_chat_template(train_tokenizer(texts, 300))


@pytest.fixture(scope="module")
def dirs(tokenizer, tmp_path_factory):
    """A saved fullband micro model and the same backbone as a plain HF model, each with the tokenizer."""
    root = tmp_path_factory.mktemp("sft_models")
    torch.manual_seed(0)
    cfg = backbone_config("micro", len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    backbone = AutoModelForCausalLM.from_config(cfg)
    backbone.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    model = FullBandwidthForCausalLM.from_backbone(backbone, doc_start_token_id=1)
    model.save_pretrained(root / "fb")
    tokenizer.save_pretrained(root / "fb")
    return {"fb": str(root / "fb"), "hf": str(root / "hf")}


def sft_args(init, out, *extra, steps=4):
    return ["sft", "--init-from", str(init), "--out", str(out), "--data", "example", "--steps", str(steps),
            "--batch-size", "4", "--seq-len", "128", "--no-progress", "--no-tensorboard", "--no-plot",
            "--final-eval", "4", "--gen-eval", "2", "--max-new-tokens", "6", *extra]


def train_records(out):
    return [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("split") == "train"]


# ----------------------------------------------------------------------------------------------- template


def test_assistant_mask_covers_exactly_the_replies(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONV)
    text = tokenizer.decode(ids)
    assert text.startswith("<|bos|>System: Be brief.\n\nUser: 1+2=?\n\nAssistant: 1+2=3. #### 3<|eos|>")
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == " 1+2=3. #### 3<|eos|> 2*4=8. #### 8<|eos|>"
    # the prompt for generation ends where a reply starts
    prompt = tokenizer.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("User: 1+2=?\n\nAssistant:")


def test_incremental_rendering_matches_the_generation_block(tokenizer):
    """A template without {% generation %} gets the same assistant mask by incremental rendering."""
    plain = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    a = encode_conversation(tokenizer, CONV)
    old = tokenizer.chat_template
    try:
        tokenizer.chat_template = plain
        b = encode_conversation(tokenizer, CONV)
    finally:
        tokenizer.chat_template = old
    assert a == b


def test_collate_labels_only_assistant_tokens_and_right_padding(tokenizer):
    convs = [CONV, CONV[1:3]]
    enc = encode_conversations(tokenizer, convs, 512)
    b = collate(enc, [1, 0], pad_id=0)
    n_short = len(enc.ids[1])
    assert b["attention_mask"][0, :n_short].all() and not b["attention_mask"][0, n_short:].any()
    assert (b["labels"][0, n_short:] == -100).all()
    kept = b["labels"][1][b["labels"][1] != -100].tolist()
    assert tokenizer.decode(kept) == " 1+2=3. #### 3<|eos|> 2*4=8. #### 8<|eos|>"
    # truncation keeps the start; a conversation with no assistant token left is dropped
    short = encode_conversations(tokenizer, convs, 8)
    assert len(short) == 0 and short.dropped == 2


def test_feedback_mask_never_fuses_padding_or_bos(tokenizer):
    enc = encode_conversations(tokenizer, [CONV, CONV[1:3]], 512)
    b = collate(enc, [0, 1], pad_id=0)
    mask = sft_feedback_mask(b, 1, 0.5, [0, 1])
    assert not mask[:, 0].any() and not mask[~b["attention_mask"].bool()].any()


def test_chat_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: has no assistant message"):
        read_chat_jsonl(str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="role 'bot'"):
        read_chat_jsonl(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_chat_jsonl(str(bad))


def test_synthetic_conversations_and_split():
    convs = synthetic_conversations("mixed", 30, seed=3)
    assert len(convs) == 30 and all(c[-1]["role"] == "assistant" and "####" in c[-1]["content"] for c in convs)
    assert convs == synthetic_conversations("mixed", 30, seed=3)
    train, val, dup = split_conversations(convs + convs[:3], 0.2, seed=0)
    seen = {json.dumps(c) for c in train}
    assert not any(json.dumps(c) in seen for c in val) and len(train) + len(val) + dup == 33


# ----------------------------------------------------------------------------------------------- loss


def test_loss_is_taken_on_assistant_tokens_only(tokenizer, dirs):
    model = fullband.FullBandwidthForCausalLM.from_pretrained(dirs["fb"]).eval()
    enc = encode_conversations(tokenizer, [CONV, CONV[1:3]], 512)
    b = collate(enc, [0, 1], pad_id=0)
    with torch.no_grad():
        out = model(**b, num_passes=1)
    logits = out.logits[:, :-1]
    targets = b["labels"][:, 1:]
    keep = targets != -100
    manual = F.cross_entropy(logits[keep], targets[keep])
    assert out.loss.item() == pytest.approx(manual.item(), rel=1e-5)
    # changing what the user said changes nothing the loss is taken on as targets
    assert keep.sum() == sum(sum(m[1:]) for m in enc.mask)


def test_grad_accumulation_matches_full_batch(dirs, tmp_path):
    common = dict(init_from=dirs["fb"], data="example", steps=3, batch_size=4, seq_len=128, progress=False,
                  tensorboard=False, plot=False, feedback_start=0.3, final_eval=0, gen_eval=0,
                  fusion_lr_mult=1.0, fusion_warmup=0.0, clip_per_group=False, feedback_ramp=0.0)
    sft(SFTConfig(out=str(tmp_path / "a"), **common))
    sft(SFTConfig(out=str(tmp_path / "b"), grad_accum=2, **common))
    a, b = train_records(tmp_path / "a"), train_records(tmp_path / "b")
    assert [r["num_passes"] for r in a] == [1, 2, 2]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
        assert x["pass_losses"] == pytest.approx(y["pass_losses"], rel=1e-4, abs=1e-5)


# ----------------------------------------------------------------------------------------------- runs


def test_sft_end_to_end_from_fullband_model(dirs, tmp_path, capsys):
    out = tmp_path / "sft"
    rc = cli.main(sft_args(dirs["fb"], out, "--feedback-start", "0.5", "--save-every", "2"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out assistant-token loss" in printed and "exact recurrence" in printed and "| fused |" in printed
    rows = train_records(out)
    assert [r["num_passes"] for r in rows] == [1, 1, 2, 2]
    assert all(r["assistant_tokens"] > 0 and r["assistant_tokens"] < r["tokens_step"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "done" and summary["init_kind"] == "fullband"
    assert [e["mode"] for e in summary["eval"]] == ["standard", "passes", "exact"]
    assert set(summary["generation"]) == {"standard", "fused"}  # the model's default feedback mode
    # the saved model and tokenizer load with plain HF entry points; the tokenizer carries the chat template
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, fullband.FullBandwidthForCausalLM)
    assert tok.chat_template == CHAT_TEMPLATE
    ids = tok.apply_chat_template(CONV[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.isfinite(model(ids["input_ids"], num_passes=2).logits).all()
    # a refused second run into the same directory
    assert cli.main(sft_args(dirs["fb"], out)) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_resume_matches_uninterrupted(dirs, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(sft_args(dirs["fb"], full, "--feedback-start", "0.5", "--gen-eval", "0")) == 0
    assert cli.main(sft_args(dirs["fb"], part, "--feedback-start", "0.5", "--gen-eval", "0", "--stop-after", "3")) == 0
    assert cli.main(["sft", "--out", str(part), "--resume", "--no-progress"]) == 0
    a = [(r["step"], r["loss"], r["pass_losses"]) for r in train_records(full)]
    b = [(r["step"], r["loss"], r["pass_losses"]) for r in train_records(part)]
    assert a == b


def test_retrofit_from_plain_hf_model(dirs, tmp_path):
    out = tmp_path / "retro"
    assert cli.main(sft_args(dirs["hf"], out, "--num-passes", "1", "--deep-passes", "1", "--gen-eval", "0")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["init_kind"] == "hf" and [e["mode"] for e in summary["eval"]] == ["standard", "exact"]
    model = AutoModelForCausalLM.from_pretrained(out)
    # a retrofit never trained with feedback decodes plainly by default
    assert model.config.default_feedback_mode == "standard"


def test_start_from_a_train_checkpoint(tmp_path):
    data = tmp_path / "docs.jsonl"
    texts = [json.dumps(c) for c in load_conversations("example")]
    data.write_text("".join(json.dumps({"name": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    run = tmp_path / "pre"
    assert cli.main(["train", "--preset", "micro", "--steps", "2", "--out", str(run), "--data", str(data),
                     "--vocab-size", "300", "--seq-len", "32", "--batch-size", "2", "--save-every", "1",
                     "--keep-checkpoints", "2", "--no-progress", "--no-tensorboard", "--no-plot"]) == 0
    ckpt = run / "checkpoints" / "step-0000001"
    out = tmp_path / "from_ckpt"
    assert cli.main(sft_args(ckpt, out, "--steps", "2", "--gen-eval", "0", "--final-eval", "0")) == 0
    assert json.loads((out / "summary.json").read_text())["init_kind"] == "checkpoint"


def test_user_errors_exit_2(dirs, tmp_path, capsys):
    assert cli.main(["sft", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "--init-from DIR is required" in capsys.readouterr().err
    assert cli.main(sft_args(tmp_path / "missing", tmp_path / "y")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(sft_args(dirs["fb"], tmp_path / "z", "--data", str(tmp_path / "nope.jsonl"))) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(sft_args(dirs["fb"], tmp_path / "w", "--gen-modes", "psychic")) == 2
    assert "--gen-modes" in capsys.readouterr().err
    assert not (tmp_path / "z").exists() and not (tmp_path / "w").exists()
