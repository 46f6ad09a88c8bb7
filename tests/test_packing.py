"""Packed, padding-free rows (TRL's ``packing=True``; a Qwen2 backbone, whose tokenizer adds no BOS): the state is
reset wherever the position ids restart, so the K-pass forward and the exact recurrence of a packed row equal those
of each packed sample run on its own -- and TRL's SFTTrainer really passes such rows (position ids, no mask)."""

from __future__ import annotations

import pytest
import torch

import fullband
from fullband.model.feedback import build_feedback_mask
from fullband.training.hf_trainer import PassSchedule, sft_trainer_class

from conftest import TEXTS, VOCAB, tiny_backbone_config, tiny_model

LENGTHS = (5, 7, 4)


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, n), generator=g) for n in LENGTHS]  # no BOS anywhere


def _packed(samples):
    ids = torch.cat(samples, 1)
    pos = torch.cat([torch.arange(s.shape[1]) for s in samples])[None]
    return ids, pos


@pytest.mark.parametrize("K", [3, sum(LENGTHS)])
def test_a_packed_row_runs_as_its_samples_apart(K):
    """K = 3 and K = T (the exact recurrence) on a packed row of three samples: logits and final hidden states of
    each sample equal a raw run of that sample alone; and the recurrence on the packed row equals the samples'
    recurrences. On the old mask (BOS only) the state crossed from one sample into the next."""
    model = tiny_model("qwen2", fusion="glu")
    samples = _samples()
    ids, pos = _packed(samples)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, num_passes=K)
        alone = [model(s, num_passes=min(K, s.shape[1])) for s in samples]
    cuts = torch.tensor((0, *LENGTHS)).cumsum(0).tolist()
    for (a, b), ref in zip(zip(cuts, cuts[1:]), alone):
        torch.testing.assert_close(packed.last_hidden_state[:, a:b], ref.last_hidden_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[:, a:b], ref.logits, rtol=1e-5, atol=1e-5)
    rec = model.recurrent_forward(ids, position_ids=pos)
    for (a, b), s in zip(zip(cuts, cuts[1:]), samples):
        ref = model.recurrent_forward(s)
        torch.testing.assert_close(rec.logits[:, a:b], ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rec.last_hidden_state[:, a:b], ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    if K == ids.shape[1]:  # K = T passes is the recurrence, on a packed row too
        torch.testing.assert_close(packed.logits, rec.logits, rtol=1e-4, atol=1e-4)


def test_position_restarts_follow_hugging_face_packing_rule():
    from fullband.model.feedback import position_restarts  # (new in this module)

    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0]])
    assert position_restarts(pos, 2, 8).tolist() == [[True, False, False, True, False, True, False, True]] * 2
    ids = torch.full((1, 8), 5)
    assert build_feedback_mask(ids, position_ids=pos).tolist() == [[False, True, True, False, True, False, True,
                                                                    False]]
    assert build_feedback_mask(ids).all(1).tolist() == [False]  # without position ids: only position 0


def test_trl_packing_passes_position_ids_and_the_trainer_resets_at_each_sample(tmp_path):
    """TRL's SFTTrainer with ``packing=True`` (BFD, padding-free) hands compute_loss one row of packed samples with
    ``position_ids`` restarting at 0 per sample and no ``attention_mask`` (see below for the keys): the trainer's
    feedback mask starts a document at every packed sample."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from fullband.data.corpus import train_tokenizer

    from tokenizers import processors

    tok = train_tokenizer(TEXTS * 4, vocab_size=300)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")  # no BOS: Qwen2's
    assert tok("to be")["input_ids"][0] != tok.bos_token_id
    cfg = tiny_backbone_config("qwen2", vocab_size=len(tok))
    cfg.bos_token_id = None
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = fullband.FullBandwidthForCausalLM.from_backbone(AutoModelForCausalLM.from_config(cfg), fusion="glu",
                                                            doc_start_token_id=None)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, learning_rate=1e-3,
                         logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, max_length=96,
                         disable_tqdm=True, seed=0, packing=True)
    texts = [{"text": line} for t in TEXTS for line in t.strip().split("\n")]
    trainer = sft_trainer_class()(model=model, args=args, train_dataset=Dataset.from_list(texts), processing_class=tok,
                                  pass_schedule=PassSchedule(feedback_start=0.0, num_passes=2, deep_fraction=0.0,
                                                             prefix_mix=0.0, feedback_ramp=0.0))
    seen = []
    real = trainer.feedback_mask
    trainer.feedback_mask = lambda m, inputs, step, micro: seen.append((dict(inputs), real(m, inputs, step, micro))) \
        or seen[-1][1]
    trainer.train()
    inputs, mask = seen[0]
    assert "attention_mask" not in inputs and {"input_ids", "labels", "position_ids"} <= inputs.keys()
    pos = inputs["position_ids"]
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    assert inputs["input_ids"].shape[0] == 1 and len(starts) > 1  # several samples in one row
    assert torch.equal(mask[0], pos[0] != 0)  # the state everywhere but into a packed sample's first token
    print("TRL packing=True passes compute_loss:", sorted(inputs))
