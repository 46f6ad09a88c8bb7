"""Prepared data on disk (``fullband data prepare``): its format, and reading it lazily for training.

Owns the format (version :data:`FORMAT_VERSION`) and :func:`open_prepared`. A prepared directory holds

* ``manifest.json`` -- written last, so a directory with a manifest is complete: format version, token dtype,
  tokenizer identity (where it came from, sha256 of its files, size, BOS / EOS ids), the split rule, token and
  document counts per split, the shards in order with their sha256, the sources read;
* ``tokenizer/`` -- the tokenizer every shard was encoded with (``save_pretrained``);
* ``shards/NNNNNN.{train,val}.bin`` -- the token stream of a split, flat little-endian ``uint16`` (a vocabulary
  of <= 65,536 entries) or ``uint32``: every document as ``BOS text EOS``, documents in source order, shards in
  index order (the nanoGPT / Megatron-style flat token array: a row of the packed stream is one contiguous slice,
  read through ``np.memmap`` with no parsing and no copy of the file into memory);
* ``shards/NNNNNN.{train,val}.docs.npy`` -- the document boundaries: int64 offsets of each document's first
  token in the shard, then the shard's length. A document longer than a shard (``fullband data prepare`` cuts
  shards by text size, and streams a long document in pieces) runs on into the next shards of its split: a shard
  whose manifest entry has ``"continues": true`` starts with the rest of the previous shard's last document, its
  offsets start with 0 for that run, and its ``documents`` count leaves it out (the key is absent otherwise, so
  data of documents shorter than a shard is as before).

:class:`TokenRows` exposes a split as the ``[num_rows, seq_len]`` rows the trainer indexes (the same packing
as :func:`fullband.data.corpus.pack`: the concatenated stream cut into rows, the tail dropped), read on demand.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .corpus import load_tokenizer

FORMAT = "fullband-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (a vocabulary of at most 65,536 entries), else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def files_sha256(folder: str) -> str:
    """sha256 over the names and bytes of the files in ``folder`` (sorted): a tokenizer's identity."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def is_prepared(path) -> bool:
    """Whether ``path`` is a directory of prepared data (complete or not)."""
    return path is not None and os.path.isdir(path) and (os.path.exists(os.path.join(path, MANIFEST)) or
                                                         os.path.exists(os.path.join(path, "prepare.json")))


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        raise ValueError(f"{path} holds an unfinished `fullband data prepare` (no {MANIFEST}): run the same command "
                         "again to finish it")
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file} is not a fullband prepared-data manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file} has format version {manifest.get('format_version')}; this fullband reads version "
                         f"{FORMAT_VERSION}: prepare the data again")
    return manifest


class TokenRows:
    """A split's packed rows ``[num_rows, seq_len]``, read lazily from memory-mapped shards.

    Indexing (an int, a slice, or an index tensor / list / array) returns int64 tensors, as indexing the
    in-memory rows tensor does; only the rows asked for are read."""

    def __init__(self, files: list[str], dtype, seq_len: int):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.arrays = [np.memmap(f, dtype=dtype, mode="r") for f in files if os.path.getsize(f) > 0]
        self.bounds = np.cumsum([0] + [a.shape[0] for a in self.arrays]).astype(np.int64)
        self.total_tokens = int(self.bounds[-1])
        self.seq_len = seq_len
        self.shape = (self.total_tokens // seq_len, seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def numel(self) -> int:
        return self.shape[0] * self.seq_len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream positions ``[start, stop)`` as int64 (a span may cross shards)."""
        out = np.empty(stop - start, dtype=np.int64)
        i, done = int(np.searchsorted(self.bounds, start, side="right")) - 1, 0
        while done < out.shape[0]:
            lo = start + done - int(self.bounds[i])
            take = min(out.shape[0] - done, self.arrays[i].shape[0] - lo)
            out[done:done + take] = self.arrays[i][lo:lo + take]
            done, i = done + take, i + 1
        return out

    def row(self, r: int) -> np.ndarray:
        if not -self.shape[0] <= r < self.shape[0]:
            raise IndexError(f"row {r} out of range for {self.shape[0]} rows")
        r %= self.shape[0]
        return self.tokens(r * self.seq_len, (r + 1) * self.seq_len)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, (int, np.integer)):
            return torch.from_numpy(self.row(int(index)))
        if isinstance(index, slice):
            index = range(*index.indices(self.shape[0]))
        idx = index.tolist() if hasattr(index, "tolist") else list(index)
        out = np.empty((len(idx), self.seq_len), dtype=np.int64)
        for k, r in enumerate(idx):
            out[k] = self.row(int(r))
        return torch.from_numpy(out)


@dataclass
class PreparedCorpus:
    """A prepared directory opened for training: its tokenizer, lazily read rows, and identity."""

    path: str
    manifest: dict
    tokenizer: object
    train_rows: TokenRows
    val_rows: TokenRows
    order: str = "feistel"  # O(batch) index map of fullband.data.order.batch_rows

    @property
    def train_tokens(self) -> int:
        return self.train_rows.numel()

    @property
    def fingerprint(self) -> str:
        """What a run reads: the shards' content (their sha256, recorded when they were written) and the row length."""
        return hashlib.sha256(f"{self.manifest['sha256']}:{self.train_rows.seq_len}".encode()).hexdigest()

    def documents(self, split: str):
        """Each document of ``split`` as an int64 array ``BOS ids EOS`` (in stream order; a document that runs on
        across shards, joined)."""
        held = []  # the runs of the document not yet ended
        for shard in self.manifest["splits"][split]["shards"]:
            arr = np.memmap(os.path.join(self.path, shard["file"]), dtype=self.manifest["dtype"], mode="r") if \
                shard["tokens"] else np.zeros(0, dtype=self.manifest["dtype"])
            bounds = np.load(os.path.join(self.path, shard["docs"]))
            for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                if held and not (n == 0 and shard.get("continues")):
                    yield np.concatenate(held)
                    held = []
                held.append(np.asarray(arr[a:b], dtype=np.int64))
        if held:
            yield np.concatenate(held)


def open_prepared(path: str, seq_len: int) -> PreparedCorpus:
    """The prepared data in ``path`` as rows of ``seq_len`` (a one-line error when incomplete or tampered with)."""
    manifest = read_manifest(path)
    tok_dir = os.path.join(path, manifest["tokenizer"]["path"])
    if files_sha256(tok_dir) != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"{tok_dir} differs from the tokenizer the shards were encoded with (sha256 mismatch)")
    tokenizer = load_tokenizer(tok_dir)
    rows = {}
    for split in SPLITS:
        files = []
        for shard in manifest["splits"][split]["shards"]:
            file = os.path.join(path, shard["file"])
            size = os.path.getsize(file) if os.path.exists(file) else -1
            if size != shard["tokens"] * np.dtype(manifest["dtype"]).itemsize:
                raise ValueError(f"{file}: {size} bytes, the manifest says {shard['tokens']} tokens of "
                                 f"{manifest['dtype']}: prepare the data again")
            files.append(file)
        rows[split] = TokenRows(files, manifest["dtype"], seq_len)
    if rows["train"].shape[0] == 0:
        raise ValueError(f"{path}: only {rows['train'].total_tokens} training tokens: not one row of {seq_len}; use "
                         "a shorter --seq-len or more data")
    return PreparedCorpus(path, manifest, tokenizer, rows["train"], rows["val"])
