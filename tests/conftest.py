"""Shared fixtures: tiny random backbones of several families, built from configs (no download)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

import fullband

VOCAB = 97
BOS, EOS, PAD = 1, 2, 0

torch.set_num_threads(1)


def tiny_backbone_config(family: str = "llama", vocab_size: int = VOCAB, hidden: int = 32, layers: int = 2):
    common = dict(vocab_size=vocab_size, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if family == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **common)
    if family == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **common)
    if family == "mistral":
        return MistralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             sliding_window=None, **common)
    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=128, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, **common)
    raise ValueError(family)


def tiny_backbone(family: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_backbone_config(family, **kw)).eval()


def tiny_model(family: str = "llama", fusion: str = "glu", seed: int = 0, **feedback_kwargs):
    backbone = tiny_backbone(family, seed)
    torch.manual_seed(seed + 1)
    return fullband.FullBandwidthForCausalLM.from_backbone(backbone, fusion=fusion, **feedback_kwargs).eval()


def random_ids(batch: int, length: int, seed: int = 0, bos: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    if bos:
        ids[:, 0] = BOS
    return ids


FAMILIES = ["llama", "gpt2", "qwen2", "mistral"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


# ----------------------------------------------------------------------------- saved model directories

TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n",
    "And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end\n",
]


def save_model_dir(root, fusion: str = "glu", plain: bool = False, seed: int = 0) -> str:
    """A tiny Llama (fullband-wrapped unless ``plain``) and a BPE tokenizer of matching vocabulary, saved."""
    from fullband.data.corpus import train_tokenizer

    tok = train_tokenizer(TEXTS * 4, vocab_size=300)
    cfg = tiny_backbone_config("llama", vocab_size=len(tok))
    cfg.max_position_embeddings = 256
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if not plain:
        torch.manual_seed(seed + 1)
        model = fullband.FullBandwidthForCausalLM.from_backbone(model, fusion=fusion)
    path = str(root)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("fullband"))


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("plain"), plain=True)


# ----------------------------------------------------------------------------------------------- a small jsonl corpus

WORDS = "the a of to and in that is was he for it with as his on be at by had not are but from".split()


def write_small_corpus(path) -> str:
    """Twelve documents of 300 random common words (seeded), as a jsonl corpus (``fullband train --data``); also
    ``benchmarks/thread_drift.py``'s."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(12):
            f.write(json.dumps({"name": f"d{i:02d}", "text": " ".join(rng.choice(WORDS) for _ in range(300))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """:func:`write_small_corpus` in a fresh directory."""
    return write_small_corpus(tmp_path_factory.mktemp("data") / "docs.jsonl")


# ----------------------------------------------------------------------------------------------- another reduction order

FP32_EPS = torch.finfo(torch.float32).eps


def reorder_rtol(*terms: int) -> float:
    """Relative tolerance for a float32 result computed with its sums in another order (another process count, thread
    count or micro-batch split): a sum of n float32 terms taken in another order can differ by up to about n·eps
    relative (the worst-case bound of recursive summation, n·u/(1 - n·u), Higham, *Accuracy and Stability of
    Numerical Algorithms*, §4.2). ``terms``: the lengths of the reductions on the value's path whose order may change
    (the tokens averaged into a loss, the widths contracted by the matmuls that feed it: hidden, MLP, vocabulary),
    added. A tolerance that follows from the arithmetic, not from what one machine happened to give."""
    return FP32_EPS * sum(terms)


def assert_losses_close(got, want, rtol: float) -> None:
    """Two logged losses or lists of per-pass losses equal to ``rtol`` (relative); a pass that was not scored
    (``None``) must be unscored in both."""
    got, want = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (got, want))
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None), (got, want)
        if a is not None:
            assert a == pytest.approx(b, rel=rtol, abs=0), (got, want, rtol)


def micro_rtol(tokens: int) -> float:
    """:func:`reorder_rtol` of the ``micro`` preset's reductions (d_model 64, MLP 128, the tests' 300-entry BPE
    vocabulary) on a loss averaged over ``tokens`` tokens."""
    return reorder_rtol(tokens, 64, 128, 300)


class Rows(torch.utils.data.Dataset):
    """Token rows as a dataset for HF ``Trainer`` (each row its own labels)."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
