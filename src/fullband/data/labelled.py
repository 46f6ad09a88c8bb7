"""Labelled tasks: a researcher's own rows with a target at some or all positions (format, vocabulary, storage).

Owns the jsonl row format, its word-level vocabulary and tokenizer, the row encoding with its label layout, and
the prepared directory (``fullband data prepare FILE.jsonl --labelled --out DIR``) that ``fullband train`` reads.

Row format (one JSON object per line; blank lines are skipped; other keys are ignored)::

    {"input": ["a", "b", "c"], "target": ["x", null, "y"]}
    {"input": "a b c", "target": "x _ y"}

* ``input``: the row's tokens, a list of strings or one whitespace-separated string (at least one token);
* ``target``: one entry per input token, the same two forms; ``null`` or ``"_"`` means no target at that position
  (``_`` is reserved: it is never a token). At least one target per row. Targets are tokens of the same vocabulary.
* a token is a non-empty string without whitespace, not ``_`` and not a special token (``<|pad|>``, ``<|bos|>``,
  ``<|eos|>``).

Label layout: a row of T inputs is encoded ``<bos> x_1 .. x_T <eos>`` (T + 2 ids). The model at the position of
``x_t`` predicts ``target[t]``: in Hugging Face's shifted convention (logits at position p are scored against
``labels[p + 1]``) that is ``labels[t + 1] = target[t]`` -- ``labels = [-100, -100, y_1, .., y_T]`` with ``-100``
where a row has no target. The loss is taken at the targets only.

Vocabulary: the specials first (``<|pad|>``, ``<|bos|>``, ``<|eos|>``), then every input and target token of the
training file in order of first appearance; saved as a ``tokenizers`` WordLevel ``PreTrainedTokenizerFast``
(whitespace-split, as :func:`fullband.eval.state_tasks.state_tokenizer`). Rows are encoded from the vocabulary
itself, so an unknown token is a one-line error naming ``file:line``, never a silent ``unk``.

Prepared directory: ``manifest.json`` (``format`` ``fullband-labelled``, counts per split, lengths, the
vocabulary size and the arrays' sha256), ``tokenizer/``, and per split ``{split}_ids.npy`` / ``{split}_labels.npy``
(int32, every row's ids / labels one after the other) and ``{split}_offsets.npy`` (int64, N + 1 row starts), read
memory-mapped (:class:`LabelledRows`). The split is by a row's content: a row is held out when the hash of
``(seed, row_key(inputs))`` says so (:func:`row_key`; :func:`fullband.data.prepare.is_val`, the document split of
``data prepare``), so rows of equal inputs fall in one split and no validation input is a training input; the
number of rows whose inputs repeat an earlier row's is counted (``duplicate_rows``). Preparing reads the file twice
(vocabulary and counts, then the rows into memory-mapped arrays): memory holds the vocabulary and a 16-byte key a
row, not the rows; a bad row fails in the first pass and the directory is written atomically, so nothing is left
behind on an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..utils.io import atomic_directory, atomic_save_pretrained, iter_jsonl_objects
from .corpus import SPECIAL_TOKENS, load_tokenizer
from .prepare import is_val

FORMAT = "fullband-labelled"
FORMAT_VERSION = 2  # 2: the split by row content (1: by row number)
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
NO_TARGET = "_"
IGNORE = -100
SPLITS = ("train", "val")
ROW_FORMAT = ('one JSON object per line: {"input": [tokens] or "a b c", "target": [token or null per input] or '
              '"x _ y"}')


# ----------------------------------------------------------------------------------------------- rows


def _tokens(value, where: str, name: str, targets: bool) -> list:
    if isinstance(value, str):
        items = value.split()
    elif isinstance(value, list):
        items = value
    else:
        raise ValueError(f"{where}: {name!r} must be a list or a whitespace-separated string ({ROW_FORMAT})")
    out = []
    for tok in items:
        if targets and (tok is None or tok == NO_TARGET):
            out.append(None)
            continue
        if not isinstance(tok, str) or not tok or any(c.isspace() for c in tok):
            raise ValueError(f"{where}: {name} token {tok!r} is not a non-empty string without whitespace")
        if tok == NO_TARGET or tok in SPECIAL_TOKENS.values():
            raise ValueError(f"{where}: {name} token {tok!r} is reserved (the no-target mark or a special token)")
        out.append(tok)
    return out


def parse_row(record: dict, where: str) -> tuple[list[str], list[str | None]]:
    """``(inputs, targets)`` of one jsonl object (``targets[t]`` is ``None`` where there is no target)."""
    if "input" not in record or "target" not in record:
        raise ValueError(f"{where}: a row needs \"input\" and \"target\" ({ROW_FORMAT})")
    inputs = _tokens(record["input"], where, "input", targets=False)
    targets = _tokens(record["target"], where, "target", targets=True)
    if not inputs:
        raise ValueError(f"{where}: empty row (no input tokens)")
    if len(targets) != len(inputs):
        raise ValueError(f"{where}: {len(targets)} targets for {len(inputs)} input tokens (one per input token; "
                         "null or \"_\" where there is none)")
    if all(t is None for t in targets):
        raise ValueError(f"{where}: the row has no target (give at least one)")
    return inputs, targets


def iter_rows(path: str):
    """``(where, inputs, targets)`` of every row of a labelled jsonl file (``where`` = ``file:line``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"labelled data file {path!r} does not exist")
    for n, record in iter_jsonl_objects(path, ROW_FORMAT):
        where = f"{path}:{n}"
        yield (where, *parse_row(record, where))


def is_labelled_file(path) -> bool:
    """Whether ``path`` is a .jsonl file whose first row has ``input`` and ``target`` (the format is detected)."""
    if not isinstance(path, str) or not path.endswith(".jsonl") or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and "input" in record and "target" in record
    return False


def is_labelled_dir(path) -> bool:
    """Whether ``path`` is a directory of ``fullband data prepare --labelled``."""
    file = os.path.join(path, MANIFEST) if isinstance(path, str) else ""
    if not os.path.isfile(file):
        return False
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def is_labelled(path) -> bool:
    return is_labelled_dir(path) or is_labelled_file(path)


def encode_row(inputs, targets, vocab: dict, where: str, what: str = "the vocabulary"):
    """``(ids, labels)`` lists of one row in the layout of the module docstring; a one-line error naming
    ``where`` for a token not in ``vocab``."""
    bos, eos = vocab[SPECIAL_TOKENS["bos_token"]], vocab[SPECIAL_TOKENS["eos_token"]]
    try:
        ids = [bos] + [vocab[w] for w in inputs] + [eos]
        labels = [IGNORE, IGNORE] + [IGNORE if y is None else vocab[y] for y in targets]
    except KeyError as err:
        raise ValueError(f"{where}: token {err.args[0]!r} is not in {what}") from None
    return ids, labels


def row_key(inputs) -> bytes:
    """What makes two rows the same (for the test/train overlap check and the validation split): their input tokens."""
    return hashlib.sha256("\x00".join(inputs).encode("utf-8")).digest()[:16]


# ----------------------------------------------------------------------------------------------- vocabulary


def labelled_tokenizer(words) -> PreTrainedTokenizerFast:
    """A word-level ``PreTrainedTokenizerFast`` over the specials, then ``words`` (whitespace-split; no BOS added)."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIAL_TOKENS.values(), *words]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["pad_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30, **SPECIAL_TOKENS)


# ----------------------------------------------------------------------------------------------- storage


class LabelledRows:
    """Rows of one split: flat ``ids`` / ``labels`` (int32) and ``offsets`` (int64, N + 1), in memory or mapped."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray):
        self.ids, self.labels, self.offsets = ids, labels, offsets

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.ids[a:b], dtype=np.int64), np.asarray(self.labels[a:b], dtype=np.int64)

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])


@dataclasses.dataclass
class LabelledData:
    """A labelled data set: its tokenizer, its two splits and what identifies it."""

    tokenizer: PreTrainedTokenizerFast
    train: LabelledRows
    val: LabelledRows
    fingerprint: str
    info: dict


def row_split(key: bytes, seed: int, val_fraction: float) -> str:
    """``"val"`` or ``"train"``: the split of a row by its :func:`row_key` ``key``, so equal rows share one."""
    return "val" if is_val(key.hex(), seed, val_fraction) else "train"


def _scan(path: str, seed: int, val_fraction: float):
    """Pass 1: the vocabulary (first appearance), per split ``[rows, ids, max input length, targets]`` and the number
    of rows whose inputs repeat an earlier row's; validates every row."""
    words, counts, keys, duplicates = {}, {s: [0, 0, 0, 0] for s in SPLITS}, set(), 0
    for _, inputs, targets in iter_rows(path):
        for w in inputs:
            words.setdefault(w, None)
        for y in targets:
            if y is not None:
                words.setdefault(y, None)
        key = row_key(inputs)
        duplicates += key in keys
        keys.add(key)
        c = counts[row_split(key, seed, val_fraction)]
        c[0] += 1
        c[1] += len(inputs) + 2
        c[2] = max(c[2], len(inputs))
        c[3] += sum(y is not None for y in targets)
    if counts["train"][0] == 0:
        raise ValueError(f"{path}: no training row (the file is empty or --val-fraction holds every row out)")
    return list(words), counts, duplicates


def _fill(path: str, seed: int, val_fraction: float, vocab: dict, arrays: dict) -> None:
    """Pass 2: every row's ids and labels into ``arrays[split] = (ids, labels, offsets)``."""
    at = {s: [0, 0] for s in SPLITS}  # rows, ids written
    for where, inputs, targets in iter_rows(path):
        split = row_split(row_key(inputs), seed, val_fraction)
        ids, labels = encode_row(inputs, targets, vocab, where)
        a_ids, a_labels, a_off = arrays[split]
        r, p = at[split]
        a_ids[p:p + len(ids)] = ids
        a_labels[p:p + len(ids)] = labels
        a_off[r + 1] = p + len(ids)
        at[split] = [r + 1, p + len(ids)]


def _fingerprint(tokenizer, arrays: dict) -> str:
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for split in SPLITS:
        for a in arrays[split]:
            for i in range(0, a.shape[0], 1 << 20):  # a piece at a time: memory flat with the data's size
                h.update(np.ascontiguousarray(a[i:i + (1 << 20)]).tobytes())
    return h.hexdigest()


def _info(path, counts, duplicates, tokenizer, seed, val_fraction) -> dict:
    return {"format": FORMAT, "version": FORMAT_VERSION, "source": os.path.abspath(path), "seed": seed,
            "val_fraction": val_fraction, "vocab_size": len(tokenizer), "duplicate_rows": duplicates,
            "splits": {s: {"rows": c[0], "ids": c[1], "max_length": c[2], "targets": c[3]}
                       for s, c in counts.items()}}


def _build(path: str, seed: int, val_fraction: float, alloc):
    words, counts, duplicates = _scan(path, seed, val_fraction)
    tokenizer = labelled_tokenizer(words)
    arrays = {s: (alloc(f"{s}_ids", counts[s][1], np.int32), alloc(f"{s}_labels", counts[s][1], np.int32),
                  alloc(f"{s}_offsets", counts[s][0] + 1, np.int64)) for s in SPLITS}
    for s in SPLITS:
        arrays[s][2][0] = 0
    _fill(path, seed, val_fraction, tokenizer.get_vocab(), arrays)
    return tokenizer, arrays, counts, duplicates


def prepare_labelled(src: str, out: str, val_fraction: float = 0.1, seed: int = 0, overwrite: bool = False) -> dict:
    """Prepare the labelled jsonl ``src`` into the directory ``out`` (atomically); returns its manifest."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if os.path.exists(out) and not overwrite and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out!r} already exists; pass --overwrite to replace it, or choose another --out")
    with atomic_directory(out) as tmp:
        def alloc(name, n, dtype):
            return np.lib.format.open_memmap(os.path.join(tmp, f"{name}.npy"), mode="w+", dtype=dtype, shape=(n,))

        tokenizer, arrays, counts, duplicates = _build(src, seed, val_fraction, alloc)
        for split in SPLITS:
            for a in arrays[split]:
                a.flush()
        manifest = {**_info(src, counts, duplicates, tokenizer, seed, val_fraction), "sha256": _fingerprint(tokenizer, arrays)}
        del arrays
        atomic_save_pretrained(tokenizer, os.path.join(tmp, TOKENIZER_DIR))
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
    return manifest


def load_labelled(path: str, seed: int = 0, val_fraction: float = 0.1) -> LabelledData:
    """A prepared directory (memory-mapped; its own split: ``seed`` / ``val_fraction`` do not apply) or a labelled
    jsonl file (read into memory, split by ``seed`` / ``val_fraction``)."""
    if is_labelled_dir(path):
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            info = json.load(f)
        if info.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: labelled data of format version {info.get('version')}, this fullband reads "
                             f"version {FORMAT_VERSION}: prepare it again")
        rows = {}
        for s in SPLITS:
            try:
                rows[s] = LabelledRows(*(np.load(os.path.join(path, f"{s}_{k}.npy"), mmap_mode="r")
                                         for k in ("ids", "labels", "offsets")))
            except (OSError, ValueError) as err:
                raise ValueError(f"{path}: unreadable prepared labelled data ({err}); prepare it again") from None
        return LabelledData(load_tokenizer(os.path.join(path, TOKENIZER_DIR)), rows["train"], rows["val"],
                            info["sha256"], info)
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory of `fullband data prepare --labelled` (no labelled "
                         f"{MANIFEST}); give it a labelled .jsonl file or such a directory")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    tokenizer, arrays, counts, duplicates = _build(path, seed, val_fraction,
                                                   lambda name, n, dtype: np.zeros(n, dtype=dtype))
    return LabelledData(tokenizer, LabelledRows(*arrays["train"]), LabelledRows(*arrays["val"]),
                        _fingerprint(tokenizer, arrays), _info(path, counts, duplicates, tokenizer, seed, val_fraction))


def training_row_keys(path: str):
    """The :func:`row_key` of every row of training data ``path`` (a labelled jsonl file or prepared directory,
    both splits), one at a time."""
    if is_labelled_dir(path):
        data = load_labelled(path)
        words = {i: w for w, i in data.tokenizer.get_vocab().items()}
        for rows in (data.train, data.val):
            for i in range(len(rows)):
                ids, _ = rows.row(i)
                yield row_key([words[int(t)] for t in ids[1:-1]])
    else:
        for _, inputs, _ in iter_rows(path):
            yield row_key(inputs)


def collate_rows(rows: LabelledRows, indices, pad_id: int) -> dict:
    """``input_ids``, ``attention_mask`` and ``labels`` of rows ``indices``, right-padded to the longest of them
    (padding: ``pad_id``, attention 0, label -100)."""
    pairs = [rows.row(int(i)) for i in indices]
    T = max(len(ids) for ids, _ in pairs)
    ids = np.full((len(pairs), T), pad_id, dtype=np.int64)
    labels = np.full((len(pairs), T), IGNORE, dtype=np.int64)
    attn = np.zeros((len(pairs), T), dtype=np.int64)
    for r, (x, y) in enumerate(pairs):
        ids[r, :len(x)], labels[r, :len(y)], attn[r, :len(x)] = x, y, 1
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attn),
            "labels": torch.from_numpy(labels)}
