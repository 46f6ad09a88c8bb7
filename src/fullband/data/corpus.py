"""Training and evaluation text: documents, tokenizer, packing, splits and a resumable data order.

Owns
* the embedded corpus (39 works of Shakespeare shipped inside the package, one work = one document) and
  :func:`load_documents` (it, or any source :mod:`fullband.data.sources` reads: text files and folders, jsonl
  (also .gz / .zst), parquet, local ``datasets`` directories), all in memory;
* the train / validation split, by whole documents and deterministic for a seed;
* the tokenizer: a local HF tokenizer directory, or a byte-level BPE trained with ``tokenizers`` on the training
  documents (``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2; encoding a text prepends BOS, so a prompt starts
  like a document did in training);
* packing: every document becomes ``BOS text EOS``, the stream is cut into fixed-length rows (so a BOS marks
  each document start inside a row);
* :class:`Corpus`: the in-memory rows a run trains on (its data order: :func:`fullband.data.order.batch_rows`,
  re-exported here). Prepared data of any size (``fullband data prepare``) is read lazily by
  :mod:`fullband.data.shards` instead.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
from dataclasses import dataclass
from importlib import resources

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .order import batch_rows  # noqa: F401  (re-exported: the data order of a Corpus)
from .sources import TEXT_SUFFIXES, Document, iter_documents, list_sources  # noqa: F401  (re-exported)

EMBEDDED = "shakespeare"


# ----------------------------------------------------------------------------------------------- sources


def embedded_corpus() -> list[Document]:
    """The 39 public-domain works shipped with the package (see ``fullband/corpus/README.md``)."""
    path = resources.files("fullband") / "corpus" / "shakespeare.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [Document(d["name"], d["text"]) for d in map(json.loads, f)]


def load_documents(source: str | None = None) -> list[Document]:
    """Documents from ``source`` (``None`` or ``"shakespeare"``: the embedded corpus; else any source of
    :mod:`fullband.data.sources`), all in memory. Empty documents are dropped."""
    if source is None or source == EMBEDDED:
        docs = [d for d in embedded_corpus() if d.text.strip()]
    else:
        try:
            docs = list(iter_documents(list_sources(source)))
        except FileNotFoundError:
            raise FileNotFoundError(f"data source {source!r} does not exist (give a text file, folder, .jsonl file, "
                                    "datasets directory, or 'shakespeare' for the embedded corpus)") from None
    if not docs:
        raise ValueError(f"data source {source!r} holds no non-empty documents")
    return docs


def split_documents(docs: list[Document], val_fraction: float = 0.1, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split by whole documents: a seeded shuffle of the names, the first ``ceil(val_fraction·n)`` go to validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0.0:
        return list(docs), []
    if len(docs) < 2:
        raise ValueError("need at least 2 documents to split train / validation by document; add documents or set val_fraction 0")
    order = sorted(range(len(docs)), key=lambda i: docs[i].name)
    random.Random(seed).shuffle(order)
    n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
    val = set(order[:n_val])
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


# ----------------------------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}


def train_tokenizer(texts, vocab_size: int = 4096):
    """A byte-level BPE trained with ``tokenizers``, wrapped as a ``PreTrainedTokenizerFast`` (BOS prepended on encode)."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 for a byte-level BPE (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30, **SPECIAL_TOKENS)


def load_tokenizer(path: str):
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not load a tokenizer from {path!r}: {str(err).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def special_ids(tokenizer) -> tuple[int, int | None]:
    """(bos_id, eos_id): the document-start token (BOS, else EOS as GPT-2 does) and the end token."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if bos is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to mark document starts")
    return bos, tokenizer.eos_token_id


def tokenize_documents(tokenizer, docs: list[Document]) -> list[list[int]]:
    """Each document as ``BOS ids EOS``."""
    bos, eos = special_ids(tokenizer)
    encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    return [[bos, *ids] + ([eos] if eos is not None and eos != bos else []) for ids in encoded]


def pack(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate the documents and cut the stream into rows of ``seq_len`` (the incomplete tail is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    stream = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long)
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"only {stream.numel()} tokens: not one row of {seq_len}; use a shorter --seq-len or more data")
    return stream[: n * seq_len].view(n, seq_len)


@dataclass
class Corpus:
    """Tokenized, packed train / validation rows and the tokenizer that made them."""

    tokenizer: object
    train_rows: torch.Tensor
    val_rows: torch.Tensor
    train_docs: list[str]
    val_docs: list[str]
    order: str = "randperm"  # the index map of fullband.data.order.batch_rows

    @property
    def train_tokens(self) -> int:
        return self.train_rows.numel()


def build_corpus(source: str | None = None, seq_len: int = 256, vocab_size: int = 4096, tokenizer_path: str | None = None,
                 val_fraction: float = 0.1, seed: int = 0, tokenizer=None) -> Corpus:
    """Load, split (by document), tokenize (given, local, or a BPE trained on the training documents) and pack."""
    docs = load_documents(source)
    train, val = split_documents(docs, val_fraction, seed)
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else train_tokenizer((d.text for d in train), vocab_size)
    train_rows = pack(tokenize_documents(tokenizer, train), seq_len)
    val_rows = pack(tokenize_documents(tokenizer, val), seq_len) if val else torch.empty(0, seq_len, dtype=torch.long)
    return Corpus(tokenizer, train_rows, val_rows, [d.name for d in train], [d.name for d in val])
