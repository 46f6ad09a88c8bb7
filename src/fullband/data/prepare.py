"""``fullband data prepare``: any source, streamed, tokenized by a pool of processes into token shards.

Owns :func:`prepare` (the format it writes is :mod:`fullband.data.shards`'). The steps:

1. the documents of the source (:mod:`fullband.data.sources`), one at a time, each numbered in reading order, as
   pieces of at most ``piece_mb`` MB of text (:func:`fullband.data.sources.iter_pieces`: a text file is read piece
   by piece; a longer document is cut at a space or newline between words, where the embedded BPE's tokens do not
   change: :func:`fullband.data.sources.split_text` says why and for which tokenizers);
2. the split, decided per document with no global pass: document ``i`` is held out when the first 8 bytes of
   ``sha256("{seed}:{i}")``, read as an integer, fall below ``val_fraction * 2**64`` (:func:`is_val`);
3. the tokenizer: ``tokenizer`` (a local HF tokenizer directory), else a byte-level BPE
   (:func:`fullband.data.corpus.train_tokenizer`) trained on the first ``tokenizer_sample_mb`` MB of training
   documents (all of them when the corpus is smaller: then it is the in-memory path's tokenizer of the same
   training documents), its pieces as the trainer's texts; saved into ``OUT/tokenizer`` before any shard;
4. shards: the pieces in chunks of about ``shard_mb`` MB of text; chunk ``k`` becomes shard ``k`` (its
   training and held-out documents as ``BOS text EOS``: the ids of :func:`fullband.data.corpus.tokenize_documents`,
   from the backend's ``encode_batch_fast`` on about 1 MB of text at a time, one BOS before a document's first
   piece and one EOS after its last; a document longer than a chunk runs on into the next shards, which say so:
   ``continues`` in :mod:`fullband.data.shards`), tokenized by one of ``workers``
   processes (one thread each), at most ``2 x workers`` chunks in flight (bounded memory); a shard's files are
   written under temporary names, renamed, then its ``NNNNNN.done.json`` marker written;
5. ``manifest.json``, last.

Resuming: ``prepare.json`` records the settings (sources with sizes and mtimes, tokenizer, split, shard size); a
second run with the same settings skips every shard that has its done marker (its chunk is read, not tokenized),
so a prepare killed at any point finishes with byte-identical shards. Other settings in a non-empty ``OUT`` are
refused unless ``overwrite``. Shard bytes do not depend on ``workers``.

Memory, whatever the size of a document or of the corpus: the main process holds the chunk it is filling and up to
``2 x workers`` chunks in flight (each at most ``shard_mb`` MB plus one piece), a worker one chunk and the
encoding of about 1 MB of text (``max(1 MB, piece_mb)``); the BPE trainer its sample. A text file is read a piece at a
time; a single record of the other formats is parsed whole first (:mod:`fullband.data.sources` gives the bound).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ..utils.io import atomic_save_pretrained, atomic_write_json
from .corpus import load_tokenizer, special_ids, train_tokenizer
from .shards import FORMAT, FORMAT_VERSION, MANIFEST, SPLITS, files_sha256, token_dtype
from .sources import Piece, iter_pieces, list_sources

SETTINGS = "prepare.json"
SHARDS = "shards"
TOKENIZER = "tokenizer"
_ENCODE_BATCH = 1 << 20  # characters of text encoded at once inside a worker (bounds its Python int lists)


def is_val(index: int | str, seed: int, val_fraction: float) -> bool:
    """Whether document ``index`` (0-based, in reading order; or a labelled row's key, a hex string) is held out: a
    hash of (seed, index), no global pass."""
    if val_fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")
    return h < val_fraction * 2.0 ** 64


def _chunks(files, shard_bytes: int, piece_chars: int):
    """Lists of :class:`~fullband.data.sources.Piece` s of about ``shard_bytes`` characters each (at most one piece
    more), in reading order; with documents of one piece each, the chunks of whole documents."""
    chunk, size = [], 0
    for piece in iter_pieces(files, piece_chars):
        chunk.append(piece)
        size += len(piece.text)
        if size >= shard_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------------------------- worker side

_WORKER = {}


def _init_worker(tok_dir: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the backend encodes serially, no rayon pool
    tokenizer = load_tokenizer(tok_dir)
    tokenizer([""], add_special_tokens=False)  # sets the backend up as a call does (no truncation / padding)
    _WORKER.update(tokenizer=tokenizer, dtype=np.dtype(dtype))


def _encode_flat(tokenizer, pieces: list[Piece]) -> tuple[np.ndarray, list[int]]:
    """The pieces as :func:`fullband.data.corpus.tokenize_documents` encodes their documents (``BOS ids EOS``: BOS
    before a first piece, EOS after a last one), flat as int64, and each piece's length. The backend's
    ``encode_batch_fast`` (no offsets, no ``BatchEncoding``) gives the ids of ``tokenizer(texts,
    add_special_tokens=False)`` at about half its cost (tests/test_prepare.py checks them against that call)."""
    bos, eos = special_ids(tokenizer)
    tail = (eos,) if eos is not None and eos != bos else ()
    texts = [p.text for p in pieces]
    ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    del texts
    heads = [(bos,) if p.first else () for p in pieces]
    tails = [tail if p.last else () for p in pieces]
    lengths = [len(h) + len(x) + len(t) for h, x, t in zip(heads, ids, tails)]
    parts = (part for h, x, t in zip(heads, ids, tails) for part in (h, x, t))
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=sum(lengths)), lengths


def _write_split(path: str, docs: list[Piece], tokenizer, dtype) -> dict:
    """Tokenize the pieces ``docs`` into ``path`` (+ ``.docs.npy``: where each document starts, and the
    continued document's tokens when the first piece is not a document's first); returns counts and the sha256
    (``continues``: true when the first piece continues a document of an earlier shard; on an error, the
    temporary files are removed)."""
    tmp = f"{path}.tmp"
    try:
        return _write_split_files(path, tmp, docs, tokenizer, dtype)
    except BaseException:
        for name in (tmp, f"{path[:-4]}.docs.npy.tmp"):
            with contextlib.suppress(OSError):
                os.unlink(name)
        raise


def _write_split_files(path: str, tmp: str, docs: list[Piece], tokenizer, dtype) -> dict:
    h, bounds, total, limit = hashlib.sha256(), [], 0, np.iinfo(dtype).max
    with open(tmp, "wb") as f:
        i = 0
        while i < len(docs):
            j, size = i, 0
            while j < len(docs) and (j == i or size + len(docs[j].text) <= _ENCODE_BATCH):
                size += len(docs[j].text)
                j += 1
            flat, lengths = _encode_flat(tokenizer, docs[i:j])
            if flat.size and (flat.min() < 0 or flat.max() > limit):
                raise ValueError(f"token id {int(flat.max())} does not fit {dtype.name}")
            data = flat.astype(dtype).tobytes()
            f.write(data)
            h.update(data)
            for piece, n in zip(docs[i:j], lengths):
                if piece.first or not bounds:  # a document starts (or, first in the shard, continues) here
                    bounds.append(total)
                total += n
            i = j
        bounds.append(total)  # then the length
        f.flush()
        os.fsync(f.fileno())
    with open(f"{path[:-4]}.docs.npy.tmp", "wb") as f:
        np.save(f, np.asarray(bounds, dtype=np.int64))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    os.replace(f"{path[:-4]}.docs.npy.tmp", f"{path[:-4]}.docs.npy")
    continues = bool(docs) and not docs[0].first
    out = {"tokens": total, "documents": len(bounds) - 1 - continues, "sha256": h.hexdigest()}
    return dict(out, continues=True) if continues else out


def _tokenize_shard(out: str, k: int, chunk: list[tuple], val_flags: list) -> dict:
    """Worker: shard ``k`` from its chunk (its pieces as plain tuples); writes the files and the done marker,
    returns the marker."""
    start, cpu = time.perf_counter(), time.process_time()
    chunk = [Piece(*p) for p in chunk]
    tokenizer, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    base = os.path.join(out, SHARDS, f"{k:06d}")
    marker = {"index": k, "text_chars": sum(len(p.text) for p in chunk), "first_document": chunk[0].doc}
    if chunk[0].offset:
        marker["first_offset"] = chunk[0].offset  # the chunk starts inside that document
    for split in SPLITS:
        pieces = [p for p, v in zip(chunk, val_flags) if v == (split == "val")]
        marker[split] = dict(_write_split(f"{base}.{split}.bin", pieces, tokenizer, dtype),
                             file=f"{SHARDS}/{k:06d}.{split}.bin", docs=f"{SHARDS}/{k:06d}.{split}.docs.npy")
    marker["seconds"], marker["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
    atomic_write_json(f"{base}.done.json", marker)
    return marker


# ----------------------------------------------------------------------------------------------- main side


def _settings(files, tokenizer, tokenizer_sample_mb, vocab_size, val_fraction, seed, shard_mb, piece_mb) -> dict:
    return {"format_version": FORMAT_VERSION,
            "sources": [{"path": os.path.abspath(f.path), "kind": f.kind, "bytes": f.bytes,
                         "mtime_ns": os.stat(f.path).st_mtime_ns} for f in files],
            "tokenizer": {"dir": os.path.abspath(tokenizer), "sha256": files_sha256(tokenizer)} if tokenizer else
            {"bpe_vocab_size": vocab_size, "sample_mb": tokenizer_sample_mb},
            "val_fraction": val_fraction, "seed": seed, "shard_mb": shard_mb, "piece_mb": piece_mb}


def _claim_out(out: str, settings: dict, overwrite: bool) -> None:
    """Make ``out`` this prepare's directory: new, or the same settings (resume), or replaced when ``overwrite``."""
    if os.path.isdir(out) and os.listdir(out):
        saved = None
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(out, SETTINGS), encoding="utf-8") as f:
                saved = json.load(f)
        if saved != settings:
            if saved is None and not overwrite:
                raise ValueError(f"--out {out!r} is a non-empty directory that is not prepared data; choose another")
            if saved is None:
                raise ValueError(f"--out {out!r} is a non-empty directory that is not prepared data; --overwrite only "
                                 "replaces prepared data: choose another")
            if not overwrite:
                changed = sorted(k for k in settings if saved.get(k) != settings[k])
                raise ValueError(f"--out {out!r} holds data prepared with other settings ({', '.join(changed)}); "
                                 "pass --overwrite to replace it, or choose another --out")
            shutil.rmtree(out)
    elif os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {out!r} is a file")
    os.makedirs(os.path.join(out, SHARDS), exist_ok=True)
    for name in os.listdir(os.path.join(out, SHARDS)):  # leftovers of a killed run
        if name.endswith(".tmp"):
            os.unlink(os.path.join(out, SHARDS, name))
    if not os.path.exists(os.path.join(out, SETTINGS)):
        atomic_write_json(os.path.join(out, SETTINGS), settings)


def _tokenizer_for(out: str, files, tokenizer: str | None, sample_mb: float, vocab_size: int, val_fraction, seed,
                   piece_chars: int):
    """The tokenizer directory inside ``out`` (copied from ``tokenizer``, or a BPE trained on a bounded sample: the
    first pieces of training documents, each piece one text of the trainer; cut where the pre-tokens do not change,
    so the word counts it learns from are those of the whole documents)."""
    tok_dir = os.path.join(out, TOKENIZER)
    if os.path.isdir(tok_dir):  # saved atomically by an earlier (interrupted) run with the same settings
        return tok_dir, load_tokenizer(tok_dir)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        budget, texts = sample_mb * 1e6, []
        for piece in iter_pieces(files, piece_chars):
            if budget <= 0:
                break
            if not is_val(piece.doc, seed, val_fraction):
                texts.append(piece.text)
                budget -= len(piece.text)
        if not texts:
            raise ValueError("no training documents to train a tokenizer on (every document is held out); lower "
                             "--val-fraction or give --tokenizer DIR")
        tok = train_tokenizer(texts, vocab_size)
        del texts
    if not getattr(tok, "is_fast", False):
        raise ValueError("the tokenizer must be a fast (tokenizers-backed) one: its directory needs a tokenizer.json")
    atomic_save_pretrained(tok, tok_dir)
    return tok_dir, load_tokenizer(tok_dir)


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit="B", unit_scale=True, desc="prepare", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


def prepare(source: str, out: str, tokenizer: str | None = None, vocab_size: int = 4096, val_fraction: float = 0.1,
            seed: int = 0, workers: int = 1, shard_mb: float = 32.0, tokenizer_sample_mb: float = 64.0,
            overwrite: bool = False, progress: bool = False, stop_after_shards: int | None = None,
            piece_mb: float = 1.0) -> dict:
    """Prepare ``source`` into ``out`` (see the module docstring); returns the manifest, plus a ``run`` entry with
    this invocation's throughput (``status`` ``partial`` when ``stop_after_shards`` stopped it early): wall-clock
    rates, per busy worker (its wall time tokenizing and writing), and per CPU-second of a worker (less sensitive
    to a shared machine's load). ``piece_mb``: MB (10^6 characters) of a document read and tokenized at once; a
    document is cut only at a space or newline between words, so one with a longer run without one is refused."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_mb <= 0 or tokenizer_sample_mb <= 0:
        raise ValueError("--shard-mb and --tokenizer-sample-mb must be > 0")
    piece_chars = int(piece_mb * 1e6)
    if piece_chars < 2:
        raise ValueError(f"--piece-mb must be at least 2 characters (2e-6), got {piece_mb}")
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise FileNotFoundError(f"--tokenizer directory {tokenizer!r} does not exist")
    files = list_sources(source)
    settings = _settings(files, tokenizer, tokenizer_sample_mb, vocab_size, val_fraction, seed, shard_mb, piece_mb)
    _claim_out(out, settings, overwrite)
    t0 = time.perf_counter()
    tok_dir, tok = _tokenizer_for(out, files, tokenizer, tokenizer_sample_mb, vocab_size, val_fraction, seed,
                                  piece_chars)
    special_ids(tok)  # a document start token is needed
    dtype = token_dtype(len(tok))
    t_tok = time.perf_counter() - t0

    markers, new, stats = {}, 0, {"text_chars": 0, "tokens": 0, "worker_seconds": 0.0, "worker_cpu_seconds": 0.0}
    bar = _progress(progress)

    def record(marker, fresh):
        markers[marker["index"]] = marker
        if fresh:
            stats["text_chars"] += marker["text_chars"]
            stats["tokens"] += marker["train"]["tokens"] + marker["val"]["tokens"]
            stats["worker_seconds"] += marker["seconds"]
            stats["worker_cpu_seconds"] += marker["cpu_seconds"]
        if bar is not None:
            bar.update(marker["text_chars"])
            el = max(time.perf_counter() - t1, 1e-9)
            bar.set_postfix_str(f"{stats['tokens'] / el / 1e6:.2f}M tok/s")

    def done_marker(k):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(out, SHARDS, f"{k:06d}.done.json"), encoding="utf-8") as f:
                return json.load(f)
        return None

    t1 = time.perf_counter()
    status = "done"
    env_before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool forks after the tokenizer ran; one core per worker
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tok_dir, dtype.str))
    if pool is None:
        _init_worker(tok_dir, dtype.str)
    pending = deque()
    try:
        for k, chunk in enumerate(_chunks(files, int(shard_mb * 1e6), piece_chars)):
            marker = done_marker(k)
            if marker is not None and (marker.get("first_document"), marker.get("first_offset", 0)) == (
                    chunk[0].doc, chunk[0].offset):
                record(marker, fresh=False)
                continue
            if stop_after_shards is not None and new >= stop_after_shards:
                status = "partial"
                break
            new += 1
            flags = [is_val(p.doc, seed, val_fraction) for p in chunk]
            chunk = [tuple(p) for p in chunk]  # plain tuples pickle fast
            if pool is None:
                record(_tokenize_shard(out, k, chunk, flags), fresh=True)
                continue
            pending.append(pool.submit(_tokenize_shard, out, k, chunk, flags))
            del chunk
            while len(pending) >= 2 * workers:
                record(pending.popleft().result(), fresh=True)
        while pending:
            record(pending.popleft().result(), fresh=True)
    finally:
        for fut in pending:
            fut.cancel()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
        if env_before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = env_before
    elapsed = time.perf_counter() - t1
    run = {"status": status, "workers": workers, "new_shards": new, "tokenizer_seconds": round(t_tok, 3),
           "seconds": round(elapsed, 3), "text_mb": round(stats["text_chars"] / 1e6, 3), "tokens": stats["tokens"],
           "mb_per_s": round(stats["text_chars"] / 1e6 / max(elapsed, 1e-9), 3),
           "tokens_per_s": round(stats["tokens"] / max(elapsed, 1e-9)),
           "tokens_per_s_per_worker": round(stats["tokens"] / max(stats["worker_seconds"], 1e-9)),
           "tokens_per_cpu_s_per_worker": round(stats["tokens"] / max(stats["worker_cpu_seconds"], 1e-9)),
           "mb_per_cpu_s_per_worker": round(stats["text_chars"] / 1e6 / max(stats["worker_cpu_seconds"], 1e-9), 3)}
    if status != "done":
        return {"run": run}
    manifest = _manifest(out, files, tokenizer, tok, dtype, markers, settings)
    atomic_write_json(os.path.join(out, MANIFEST), manifest)
    return dict(manifest, run=run)


def _manifest(out, files, tokenizer, tok, dtype, markers: dict, settings: dict) -> dict:
    order = [markers[k] for k in sorted(markers)]
    bos, eos = special_ids(tok)
    splits, h = {}, hashlib.sha256(f"{FORMAT}:{FORMAT_VERSION}:{dtype.str}".encode())
    for split in SPLITS:
        shards = [{k: m[split][k] for k in ("file", "docs", "tokens", "documents", "sha256", "continues")
                   if k in m[split]} for m in order]
        for s in shards:
            h.update(f"{split}:{s['sha256']}".encode())
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                         "shards": shards}
    tok_dir = os.path.join(out, TOKENIZER)
    source = (f"given: {os.path.abspath(tokenizer)}" if tokenizer else
              f"byte-level BPE ({settings['tokenizer']['bpe_vocab_size']} entries) trained on the first "
              f"{settings['tokenizer']['sample_mb']} MB of training documents")
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
            "tokenizer": {"path": TOKENIZER, "source": source, "name_or_path": getattr(tok, "name_or_path", None),
                          "sha256": files_sha256(tok_dir), "vocab_size": len(tok), "bos_id": bos, "eos_id": eos},
            "packing": "each document as BOS text EOS; documents in source order; shards in index order",
            "split": {"val_fraction": settings["val_fraction"], "seed": settings["seed"],
                      "rule": "document i (0-based, reading order) is held out when int.from_bytes(sha256("
                              "f'{seed}:{i}')[:8], 'little') < val_fraction * 2**64"},
            "documents": splits["train"]["documents"] + splits["val"]["documents"],
            "tokens": splits["train"]["tokens"] + splits["val"]["tokens"],
            "text_chars": sum(m["text_chars"] for m in order), "splits": splits,
            "sources": [{k: s[k] for k in ("path", "kind", "bytes")} for s in settings["sources"]],
            "sha256": h.hexdigest()}
