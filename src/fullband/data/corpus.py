"""Training and evaluation text: documents, tokenizer, packing, splits and a resumable data order.

Owns
* where documents come from: the embedded corpus (39 works of Shakespeare shipped inside the package, one work
  = one document), a text file, a folder of text files, a jsonl file with a ``text`` field, or a local
  Hugging Face ``datasets`` directory (``save_to_disk`` output);
* the train / validation split, by whole documents and deterministic for a seed;
* the tokenizer: a local HF tokenizer directory, or a byte-level BPE trained with ``tokenizers`` on the training
  documents (``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2; encoding a text prepends BOS, so a prompt starts
  like a document did in training);
* packing: every document becomes ``BOS text EOS``, the stream is cut into fixed-length rows (so a BOS marks
  each document start inside a row);
* :func:`batch_rows`: which rows make global batch number ``step`` (a seeded permutation per epoch), so a run
  resumed at step s reads exactly what an uninterrupted run reads.
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

from ..utils.io import iter_jsonl_objects

EMBEDDED = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md", ".text")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


# ----------------------------------------------------------------------------------------------- sources


def embedded_corpus() -> list[Document]:
    """The 39 public-domain works shipped with the package (see ``fullband/corpus/README.md``)."""
    path = resources.files("fullband") / "corpus" / "shakespeare.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [Document(d["name"], d["text"]) for d in map(json.loads, f)]


def _read_jsonl(path: str) -> list[Document]:
    docs = []
    expected = "an object with a string 'text' field"
    for n, record in iter_jsonl_objects(path, expected):
        if not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{n}: each line must be {expected}")
        docs.append(Document(str(record.get("name", record.get("id", f"{os.path.basename(path)}:{n}"))),
                             record["text"]))
    return docs


def _read_hf_dataset(path: str) -> list[Document]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError(f"{path} looks like a Hugging Face datasets directory; `pip install datasets` to read it") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if "text" not in ds.column_names:
        raise ValueError(f"dataset at {path} has no 'text' column (columns: {ds.column_names})")
    return [Document(f"{os.path.basename(path)}:{i}", t) for i, t in enumerate(ds["text"])]


def load_documents(source: str | None = None) -> list[Document]:
    """Documents from ``source`` (``None`` or ``"shakespeare"``: the embedded corpus). Empty documents are dropped."""
    if source is None or source == EMBEDDED:
        docs = embedded_corpus()
    elif os.path.isdir(source):
        if os.path.exists(os.path.join(source, "dataset_info.json")) or os.path.exists(os.path.join(source, "dataset_dict.json")):
            docs = _read_hf_dataset(source)
        else:
            docs = []
            for root, dirs, files in os.walk(source):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(root, name)
                    if name.endswith(".jsonl"):
                        docs.extend(_read_jsonl(full))
                    elif name.endswith(TEXT_SUFFIXES):
                        with open(full, encoding="utf-8", errors="replace") as f:
                            docs.append(Document(os.path.relpath(full, source), f.read()))
            if not docs:
                raise ValueError(f"folder {source!r} holds no .txt/.md/.jsonl files")
    elif os.path.isfile(source):
        if source.endswith(".jsonl"):
            docs = _read_jsonl(source)
        else:
            with open(source, encoding="utf-8", errors="replace") as f:
                docs = [Document(os.path.basename(source), f.read())]
    else:
        raise FileNotFoundError(f"data source {source!r} does not exist (give a text file, folder, .jsonl file, "
                                "datasets directory, or 'shakespeare' for the embedded corpus)")
    docs = [d for d in docs if d.text.strip()]
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


def batch_rows(step: int, batch_size: int, num_rows: int, seed: int = 0) -> torch.Tensor:
    """Row indices of global batch ``step``: epochs of seeded permutations, read in order."""
    if num_rows < 1:
        raise ValueError("no training rows")
    perms: dict[int, torch.Tensor] = {}
    rows = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        rows.append(int(perms[epoch][i]))
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class Corpus:
    """Tokenized, packed train / validation rows and the tokenizer that made them."""

    tokenizer: object
    train_rows: torch.Tensor
    val_rows: torch.Tensor
    train_docs: list[str]
    val_docs: list[str]

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
