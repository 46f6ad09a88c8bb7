"""Where documents come from: streaming readers, one per source kind, shared by the in-memory corpus
(:func:`fullband.data.corpus.load_documents`) and ``fullband data prepare`` (:mod:`fullband.data.prepare`).

Owns :class:`Document`, :func:`list_sources` (a source path -> the files it stands for, in reading order) and
:func:`iter_documents` (their documents, one at a time: memory is bounded by one document or one record batch).
Kinds:

* ``text``: a text file is one document (in a folder: ``.txt``, ``.md``, ``.text``; given alone: any file);
* ``jsonl``: one document per line, a JSON object with a string ``text`` field (``name`` or ``id`` names it);
  ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (zstandard is optional: the ``data`` extra);
* ``parquet``: a ``text`` column, read in record batches with pyarrow;
* ``datasets``: a local Hugging Face ``datasets`` directory (``save_to_disk`` output; its ``train`` split, else
  the first), read in batches from its memory-mapped Arrow files.

A folder is walked in sorted order (a directory's files before its sub-directories); files of other kinds are
skipped. Bad input is a one-line ``ValueError`` naming the file and the line (or row). Empty (whitespace-only)
documents are dropped.
"""

from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass

from ..utils.io import iter_jsonl_objects

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
_BATCH = 1024


@dataclass(frozen=True)
class Document:
    name: str
    text: str


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


def iter_file_documents(sf: SourceFile):
    """The non-empty documents of one source file, in order."""
    for doc in _READERS[sf.kind](sf):
        if doc.text.strip():
            yield doc


def iter_documents(files: list[SourceFile]):
    """The non-empty documents of ``files`` (:func:`list_sources`), in order, one at a time."""
    for sf in files:
        yield from iter_file_documents(sf)
