"""Where documents come from: streaming readers, one per source kind, shared by the in-memory corpus
(:func:`fullband.data.corpus.load_documents`) and ``fullband data prepare`` (:mod:`fullband.data.prepare`).

Owns :class:`Document`, :func:`list_sources` (a source path -> the files it stands for, in reading order),
:func:`iter_documents` (their documents, one at a time: memory is bounded by one document or one record batch)
and :func:`iter_pieces` (the same documents as :class:`Piece` s of at most ``piece_chars`` characters, cut by
:func:`split_text` at a space or newline between words: what ``fullband data prepare`` reads, so its memory does
not grow with a document's size). Kinds:

* ``text``: a text file is one document (in a folder: ``.txt``, ``.md``, ``.text``; given alone: any file);
* ``jsonl``: one document per line, a JSON object with a string ``text`` field (``name`` or ``id`` names it);
  ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (zstandard is optional: the ``data`` extra);
* ``parquet``: a ``text`` column, read in record batches with pyarrow;
* ``datasets``: a local Hugging Face ``datasets`` directory (``save_to_disk`` output; its ``train`` split, else
  the first), read in batches from its memory-mapped Arrow files.

A folder is walked in sorted order (a directory's files before its sub-directories); files of other kinds are
skipped. Bad input is a one-line ``ValueError`` naming the file and the line (or row). Empty (whitespace-only)
documents are dropped.

Memory of :func:`iter_pieces`: a ``text`` file is read ``piece_chars`` characters at a time (one piece and the
uncut tail of the last read are held: about ``2 x piece_chars`` characters), whatever its size. A record of the
other kinds (a jsonl line, a parquet / datasets row with its record batch of 1024 rows) is parsed whole by its
reader: the raw line or batch and the decoded ``text`` string are held at once, so that memory grows with the
largest record (or batch); its pieces are then tokenized ``piece_chars`` at a time like a text file's, so only
reading, not tokenizing, costs in proportion to a huge record.
"""

from __future__ import annotations

import gzip
import io
import os
import re
from dataclasses import dataclass
from typing import NamedTuple

from ..utils.io import iter_jsonl_objects

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
_BATCH = 1024
PIECE_CHARS = 1 << 20  # characters of one document read and tokenized at once (fullband data prepare --piece-mb)


@dataclass(frozen=True)
class Document:
    name: str
    text: str


class Piece(NamedTuple):
    """A run of document ``doc``'s text (``doc``: its index among the non-empty documents, in reading order),
    starting at character ``offset`` of it; ``first`` / ``last``: whether it starts / ends the document. (A named
    tuple: ``tuple(piece)`` pickles about 10x faster than a dataclass, for a pool's workers.)"""

    doc: int
    text: str
    offset: int
    first: bool
    last: bool


@dataclass(frozen=True)
class SourceFile:
    """One file (or datasets directory) of a source: ``kind`` says how to read it, ``name`` names a text document."""

    path: str
    kind: str
    name: str

    @property
    def bytes(self) -> int:
        if os.path.isdir(self.path):
            return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(self.path) for f in fs)
        return os.path.getsize(self.path)


def is_datasets_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in ("dataset_info.json", "dataset_dict.json"))


def _kind(name: str, alone: bool) -> str | None:
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES) or alone:
        return "text"
    return None


def list_sources(source: str) -> list[SourceFile]:
    """The files ``source`` (a file, a folder, or a datasets directory) stands for, in reading order."""
    if os.path.isdir(source):
        if is_datasets_dir(source):
            return [SourceFile(source, "datasets", os.path.basename(os.path.normpath(source)))]
        files = []
        for root, dirs, names in os.walk(source):
            dirs.sort()
            for name in sorted(names):
                kind = _kind(name, alone=False)
                if kind is not None:
                    full = os.path.join(root, name)
                    files.append(SourceFile(full, kind, os.path.relpath(full, source)))
        if not files:
            raise ValueError(f"folder {source!r} holds no .txt/.md/.jsonl(.gz/.zst)/.parquet files")
        return files
    if os.path.isfile(source):
        return [SourceFile(source, _kind(source, alone=True), os.path.basename(source))]
    raise FileNotFoundError(f"data source {source!r} does not exist (give a text file, folder, .jsonl(.gz/.zst) or "
                            ".parquet file, or datasets directory)")


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path} is zstandard-compressed: `pip install zstandard` (or fullband[data]) to read "
                             "it") from None
        raw = open(path, "rb")
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl(sf: SourceFile):
    expected = "an object with a string 'text' field"
    base = os.path.basename(sf.path)
    try:
        for n, record in iter_jsonl_objects(sf.path, expected, opener=_open_text):
            if not isinstance(record.get("text"), str):
                raise ValueError(f"{sf.path}:{n}: each line must be {expected}")
            yield Document(str(record.get("name", record.get("id", f"{base}:{n}"))), record["text"])
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a truncated or corrupt archive, bytes that are not UTF-8
        raise ValueError(f"{sf.path}: cannot read it: {str(err).splitlines()[0]}") from None


def _parquet(sf: SourceFile):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(sf.path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises its own error types for a file that is not parquet
        raise ValueError(f"{sf.path}: not a readable parquet file: {str(err).splitlines()[0]}") from None
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{sf.path}: no 'text' column (columns: {pf.schema_arrow.names})")
    base, i = os.path.basename(sf.path), 0
    for batch in pf.iter_batches(batch_size=_BATCH, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ValueError(f"{sf.path}: row {i}: 'text' must be a string, got {type(text).__name__}")
            yield Document(f"{base}:{i}", text)
            i += 1


def _datasets(sf: SourceFile):
    try:
        import datasets
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError(f"{sf.path} looks like a Hugging Face datasets directory; `pip install datasets` to read "
                         "it") from None
    ds = datasets.load_from_disk(sf.path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if "text" not in ds.column_names:
        raise ValueError(f"dataset at {sf.path} has no 'text' column (columns: {ds.column_names})")
    i = 0
    for batch in ds.select_columns(["text"]).iter(batch_size=_BATCH):
        for text in batch["text"]:
            if not isinstance(text, str):
                raise ValueError(f"{sf.path}: row {i}: 'text' must be a string, got {type(text).__name__}")
            yield Document(f"{sf.name}:{i}", text)
            i += 1


def _text(sf: SourceFile):
    with open(sf.path, encoding="utf-8", errors="replace") as f:
        yield Document(sf.name, f.read())


_READERS = {"jsonl": _jsonl, "parquet": _parquet, "datasets": _datasets, "text": _text}

# Where a piece may end (split_text says why tokens do not change there): first choice, before a space with a
# non-space on both sides or before a newline after a letter / digit and before a non-space; else (a window of text
# without one) before ASCII whitespace that starts a run after a non-space or ends one before a non-space.
_CUTS = (re.compile(r"(?<=\S) (?=\S)|(?<=[^\W_])\n(?=\S)"), re.compile(r"(?<=\S)[ \t\n\r\f\v]|[ \t\n\r\f\v](?=\S)"))


def _last_cut(text: str, end: int) -> int:
    """The position of the last cut in ``text[:end]`` of the first kind there is (0: none); the search looks at
    the tail first."""
    for pattern in _CUTS:
        span = 4096
        while True:
            start, last = max(end - span, 0), 0
            for m in pattern.finditer(text, start, end):
                last = m.start()
            if last or start == 0:
                break
            span *= 8
        if last:
            return last
    return 0


def _cut_pieces(read, piece_chars: int, where: str):
    """``(text, offset, last)``: the text that ``read(n)`` returns (at most ``n`` characters, fewer only at its end)
    cut into pieces of at most ``piece_chars`` characters, each cut at the last cut (see :func:`split_text`) of the
    ``piece_chars`` characters ahead; one piece when the text is that short. At most ``piece_chars + 1`` characters
    are held; ``ValueError`` naming ``where`` when a piece-long run has no cut."""
    buf, offset = read(piece_chars + 1), 0
    while len(buf) > piece_chars:
        cut = _last_cut(buf, piece_chars)
        if cut == 0:
            raise ValueError(f"{where}: the {piece_chars:,} characters from character {offset:,} hold no space or "
                             "newline between words to cut the document at, so they cannot be tokenized in bounded "
                             "memory; pass a larger --piece-mb or fix the file")
        yield buf[:cut], offset, False
        offset += cut
        buf = buf[cut:]
        buf += read(piece_chars + 1 - len(buf))
    yield buf, offset, True


def _string_reader(text: str):
    pos = 0

    def read(n: int) -> str:
        nonlocal pos
        out = text[pos:pos + n]
        pos += len(out)
        return out

    return read


def split_text(text: str, piece_chars: int = PIECE_CHARS, where: str = "text") -> list[str]:
    """``text`` as consecutive pieces of at most ``piece_chars`` characters (itself when it is that short), each
    ending at the last cut in the ``piece_chars`` characters ahead: preferably before a space with a non-space on
    both sides or before a newline that follows a letter or digit and precedes a non-space; where a window has none,
    before ASCII whitespace that starts a run of whitespace after a non-space, or before the last whitespace of a
    run followed by a non-space. ``ValueError`` naming ``where`` when a window has no cut at all (a run of
    ``piece_chars`` characters without whitespace between non-spaces cannot be cut without cutting tokens).

    Why the tokens do not change: a tokenizer that splits text into pre-tokens encodes each pre-token alone, so the
    ids of the pieces, concatenated, are the ids of the whole text when every cut is a pre-token boundary of the
    whole text and the pre-tokens on each side depend only on that side. Both hold for every cut above with the
    byte-level BPE of :func:`fullband.data.corpus.train_tokenizer` (GPT-2's pattern ``'s|'t|'re|'ve|'m|'ll|'d|
    ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``, no prefix space, no normalizer): no alternative
    runs from a non-space into whitespace, so a run of whitespace ``W`` after a non-space starts a pre-token; the
    whole text matches ``W`` before a non-space as ``W[:-1]`` (``\\s+(?!\\S)``) then ``W[-1]`` starting the next
    pre-token, and a piece that ends with ``W[:-1]`` matches it the same way (at the end of text); no alternative
    looks left. tests/test_prepare_memory.py checks it on the embedded corpus, cut every 60 characters and more.
    For other tokenizers the first-choice cuts are where GPT-2 / Llama-3 patterns, whitespace splitting (BERT) and
    Metaspace with ``split=True`` start a pre-token; the fallback cuts are not always (Llama-3's punctuation
    alternative takes the newlines after punctuation). It does not hold where a tokenizer adds something to the
    start of every input -- a normalizer that prepends ``▁`` (Llama-2-style SentencePiece conversions), Metaspace's
    ``prepend_scheme`` or ``add_prefix_space=True`` before a piece that starts with a newline -- or lets a token span
    a space (SentencePiece with ``split=False``): then the tokens next to a cut may differ. Only documents longer
    than ``piece_chars`` are cut."""
    return [t for t, _, _ in _cut_pieces(_string_reader(text), piece_chars, where)]


def iter_pieces(files: list[SourceFile], piece_chars: int = PIECE_CHARS):
    """The documents of :func:`iter_documents` as :class:`Piece` s of at most ``piece_chars`` characters, in order
    (a document that short is one piece, ``first`` and ``last``). A text file is read piece by piece, never whole."""
    if piece_chars < 2:
        raise ValueError(f"the piece size must be >= 2 characters, got {piece_chars}")
    i = 0
    for sf in files:
        if sf.kind == "text":
            with open(sf.path, encoding="utf-8", errors="replace") as f:
                for text, offset, last in _cut_pieces(f.read, piece_chars, sf.path):
                    if offset == 0 and last and not text.strip():
                        i -= 1  # an empty document is dropped (a piece that is not last holds a non-space)
                        break
                    yield Piece(i, text, offset, offset == 0, last)
            i += 1
            continue
        for doc in iter_file_documents(sf):
            for text, offset, last in _cut_pieces(_string_reader(doc.text), piece_chars, f"{sf.path} ({doc.name})"):
                yield Piece(i, text, offset, offset == 0, last)
            i += 1


def iter_file_documents(sf: SourceFile):
    """The non-empty documents of one source file, in order."""
    for doc in _READERS[sf.kind](sf):
        if doc.text.strip():
            yield doc


def iter_documents(files: list[SourceFile]):
    """The non-empty documents of ``files`` (:func:`list_sources`), in order, one at a time."""
    for sf in files:
        yield from iter_file_documents(sf)
