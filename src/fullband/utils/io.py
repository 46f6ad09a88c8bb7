"""Atomic file and directory writes, and JSON-lines logs.

Every writer here writes to a temporary name in the destination's own directory (same file system), flushes and
fsyncs it, then renames it over the destination, so a reader (or a run killed with SIGKILL half-way) sees either
the old content or the new one, never a torn file.

* :func:`atomic_write_bytes`, :func:`atomic_write_text`, :func:`atomic_write_json`, :func:`atomic_torch_save`;
* :func:`atomic_directory`: build a directory under a temporary name, then swap it in;
* :func:`atomic_save_pretrained`: ``obj.save_pretrained`` (model, tokenizer, config) through
  :func:`atomic_directory` (``mode="replace"``), or into an existing directory file by file (``mode="merge"``,
  ``config.json`` last, so a directory with a config is a complete model);
* :func:`append_jsonl` / :func:`read_jsonl` (tolerates a torn last line) / :func:`rewrite_jsonl`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile

import torch


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    return parent


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, with the permissions a plain ``open(path, "wb")`` would give."""
    parent = _parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, obj, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def atomic_torch_save(obj, path: str) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


@contextlib.contextmanager
def atomic_directory(path: str):
    """``with atomic_directory(dst) as tmp:`` fill ``tmp``; on success it replaces ``dst`` (on an exception it is
    removed and ``dst`` is untouched). An existing ``dst`` is first renamed aside, then deleted; should the
    process die between the two renames, ``dst + ".old"`` still holds the previous content."""
    path = os.path.abspath(path)
    parent = _parent(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if os.path.lexists(path):
            old = path + ".old"
            if os.path.lexists(old):
                shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.unlink(old)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.unlink(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_save_pretrained(obj, path: str, mode: str = "replace", **kwargs) -> None:
    """``obj.save_pretrained`` done atomically.

    ``mode="replace"``: ``path`` becomes exactly what was saved (whole-directory swap).
    ``mode="merge"``: the saved files are renamed one by one into ``path``, which may hold other things (logs,
    checkpoints); ``config.json`` goes last, so a reader that finds the new config finds the new weights too.
    """
    if mode == "replace":
        with atomic_directory(path) as tmp:
            obj.save_pretrained(tmp, **kwargs)
        return
    if mode != "merge":
        raise ValueError(f"mode must be 'replace' or 'merge', got {mode!r}")
    os.makedirs(path, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".save_pretrained.", suffix=".tmp", dir=path)
    try:
        obj.save_pretrained(tmp, **kwargs)
        names = sorted(os.listdir(tmp), key=lambda n: (n == "config.json", n))
        for name in names:
            src = os.path.join(tmp, name)
            with open(src, "rb") as f:
                os.fsync(f.fileno())
            dst = os.path.join(path, name)
            if os.path.isdir(src):
                if os.path.isdir(dst):
                    shutil.rmtree(dst)
            os.replace(src, dst)
        fsync_dir(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- json lines


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON object as a line and flush it to disk."""
    line = json.dumps(record, allow_nan=True) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list[dict]:
    """All complete records of a JSON-lines file; a torn or garbled line (a killed writer) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def rewrite_jsonl(path: str, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in records))


def iter_jsonl_objects(path: str, expected: str = "a JSON object", opener=None):
    """``(line_number, record)`` for each non-blank line of a jsonl file; ``ValueError`` naming the line when a line
    is not valid JSON or not a JSON object (``expected`` says what a line should be). ``opener(path)``: a text
    stream of the file (default: ``open(path, encoding="utf-8")``; e.g. a decompressing one)."""
    with (open(path, encoding="utf-8") if opener is None else opener(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n}: each line must be {expected}")
            yield n, record
