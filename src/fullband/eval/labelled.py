"""Scoring labelled tasks (:mod:`fullband.data.labelled`) per position, in every decode mode.

Owns the held-out scoring of ``fullband eval labelled``: the test rows read against the model's own vocabulary
(:func:`read_test_rows`; an unknown token is a ``file:line`` error), the test/train overlap check
(:func:`check_no_overlap`), the per-position predictions of a mode (:func:`predictions`: ``standard``, ``passes``
with K, ``exact`` through :func:`fullband.eval.scoring.mode_logits`; ``soft`` / ``fused`` after a prompt of P input
tokens through the decode loop of :mod:`fullband.model.generation`, teacher-forced), the accuracy where a target is,
overall, per length bucket and per position, with 95% percentile-bootstrap CIs that resample ROWS
(:func:`accuracy_ci`, :func:`fullband.utils.stats.bootstrap_ci`), and :func:`target_loss` (the mean NLL at the
targets, training's held-out loss).

Positions: the model at the position of ``x_t`` predicts ``target[t]`` (the layout of :mod:`fullband.data.labelled`).
Whole-row modes score every target; ``soft`` / ``fused`` take ``<bos> x_1 .. x_P`` as the prompt (plain, or with
``prefill_passes`` Jacobi passes) and score the targets at positions ``P .. T``, the predictions a decode makes
(position P's from the prompt's last state, each later one from a fused step), so their counts differ.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..data.labelled import IGNORE, encode_row, iter_rows, row_key, training_row_keys
from ..model.generation import _run as decode_run  # the one decode loop (teacher-forced: ``forced``)
from ..utils.stats import bootstrap_ci
from .scoring import MODES as WHOLE_ROW_MODES
from .scoring import mode_logits

MODES = ("standard", "passes", "exact", "soft", "fused")
PROMPT_MODES = ("soft", "fused")
CI_NOTE = ("95% percentile bootstrap CIs resampling ROWS ({n} resamples, seed {seed}): the accuracy (correct "
           "targets / targets) is resampled through its per-row linearisation acc + (c_r - acc * n_r) / mean(n) "
           "(c_r correct of n_r targets in row r; the row mean of per-row accuracies when rows have equal counts)")


def read_test_rows(path: str, tokenizer) -> list[dict]:
    """Every row of the labelled jsonl ``path`` encoded with ``tokenizer``'s vocabulary: ``{"where", "length",
    "ids", "labels", "key"}``; a token the model does not know is a one-line error naming ``file:line``."""
    vocab = tokenizer.get_vocab()
    rows = []
    for where, inputs, targets in iter_rows(path):
        ids, labels = encode_row(inputs, targets, vocab, where, "the model's vocabulary")
        rows.append({"where": where, "length": len(inputs), "ids": ids, "labels": labels, "key": row_key(inputs)})
    if not rows:
        raise ValueError(f"{path}: no test row")
    return rows


def check_no_overlap(rows: list[dict], train_path: str) -> int:
    """A one-line ``ValueError`` naming the first test row whose inputs equal a row of the training data
    ``train_path`` (jsonl or prepared directory, both splits); returns the number of training rows compared."""
    keys = {}
    for r in rows:
        keys.setdefault(r["key"], r["where"])
    n = 0
    for key in training_row_keys(train_path):
        n += 1
        if key in keys:
            raise ValueError(f"{keys[key]}: this test row's input equals a row of the training data {train_path!r}: "
                             "held-out rows must not occur in training")
    return n


@torch.no_grad()
def predictions(model, ids: torch.Tensor, mode: str, num_passes: int = 2, prompt_tokens: int = 0,
                prefill_passes: int = 1) -> tuple[torch.Tensor, int]:
    """``(pred, first)``: ``pred[:, p]`` is the argmax at position p, aligned with ``labels[:, p + 1]`` (``[B, L-1]``
    for rows of L ids), valid from position ``first`` on (0 for whole-row modes, P for ``soft`` / ``fused``)."""
    if mode in WHOLE_ROW_MODES:
        return mode_logits(model, ids, mode, num_passes)[:, :-1].argmax(-1), 0
    if mode not in PROMPT_MODES:
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    P = prompt_tokens
    if P < 1 or P + 2 > ids.shape[1]:
        raise ValueError(f"mode {mode!r} needs --prompt-tokens P with 1 <= P <= the row's input length "
                         f"({ids.shape[1] - 2}), got {P}")
    res = decode_run(model, ids[:, :P + 1], None, mode=mode, max_new_tokens=ids.shape[1] - P - 1,
                     prefill_passes=prefill_passes, do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
                     generator=None, eos_token_id=None, pad_token_id=None, stopping=None, streamer=None,
                     cache_implementation="auto", output_logits=False, forced=ids[:, P + 1:])
    pred = torch.full((ids.shape[0], ids.shape[1] - 1), -1, dtype=torch.long, device=ids.device)
    pred[:, P:] = res.logits.argmax(-1)
    return pred, P


def score_rows(model, rows: list[dict], mode: str, num_passes: int = 2, prompt_tokens: int = 0,
               prefill_passes: int = 1, batch_size: int = 32) -> list[dict]:
    """Per row (in ``rows``' order): ``{"length", "positions": [t, ...], "correct": [0/1, ...]}`` over the targets
    scored in ``mode`` (t = 1..T, the input position whose prediction is the target). Rows of one length are
    batched together (no padding)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = [None] * len(rows)
    by_length = {}
    for i, r in enumerate(rows):
        by_length.setdefault(len(r["ids"]), []).append(i)
    try:
        for L in sorted(by_length):
            index = by_length[L]
            for s in range(0, len(index), batch_size):
                chunk = index[s:s + batch_size]
                ids = torch.tensor([rows[i]["ids"] for i in chunk], device=device)
                labels = torch.tensor([rows[i]["labels"] for i in chunk])[:, 1:]
                pred, first = predictions(model, ids, mode, num_passes, prompt_tokens, prefill_passes)
                pred = pred.cpu()
                for b, i in enumerate(chunk):
                    where = (labels[b] != IGNORE).nonzero().flatten()
                    where = where[where >= first]
                    out[i] = {"length": rows[i]["length"], "positions": where.tolist(),
                              "correct": (pred[b, where] == labels[b, where]).long().tolist()}
    finally:
        model.train(was_training)
    return out


def accuracy_ci(per_row: list[dict], seed: int = 0, n_resamples: int = 10_000) -> dict:
    """Accuracy over the targets of ``per_row`` (correct / targets) with its row-resampling bootstrap CI
    (:data:`CI_NOTE`): ``{"rows", "targets", "correct", "accuracy": {"estimate", "low", "high", "confidence"}}``."""
    c = np.array([sum(r["correct"]) for r in per_row if r["correct"]], dtype=np.float64)
    n = np.array([len(r["correct"]) for r in per_row if r["correct"]], dtype=np.float64)
    if n.size == 0:
        return {"rows": 0, "targets": 0, "correct": 0, "accuracy": None}
    acc = c.sum() / n.sum()
    ci = bootstrap_ci(acc + (c - acc * n) / n.mean(), seed, n_resamples, 0.95).as_dict()
    ci["estimate"] = float(acc)  # the same number, without the linearisation's rounding
    return {"rows": int(n.size), "targets": int(n.sum()), "correct": int(c.sum()), "accuracy": ci}


def length_buckets(lengths, edges=None) -> list[tuple[int, int]]:
    """``(low, high)`` input-length buckets: ``edges`` (upper bounds, inclusive; the last bucket open-ended), else
    each distinct length when there are at most 16 of them, else powers of two."""
    lengths = sorted(set(lengths))
    if edges:
        edges = sorted(set(edges))
        bounds = [(lo + 1, hi) for lo, hi in zip([0] + edges[:-1], edges)]
        return bounds + [(edges[-1] + 1, max(lengths[-1], edges[-1] + 1))] if lengths[-1] > edges[-1] else bounds
    if len(lengths) <= 16:
        return [(n, n) for n in lengths]
    top = 1 << (lengths[-1] - 1).bit_length()
    bounds, lo = [], 1
    while lo <= top:
        bounds.append((lo, 2 * lo - 1))  # 1, 2-3, 4-7, 8-15, ...
        lo *= 2
    return [(lo, hi) for lo, hi in bounds if any(lo <= n <= hi for n in lengths)]


def summarize_mode(per_row: list[dict], buckets, seed: int = 0, n_resamples: int = 10_000,
                   train_max_length: int | None = None) -> dict:
    """Overall, per length bucket, per position (and, given ``train_max_length``, within / beyond the training
    lengths) accuracy of one mode."""
    res = {"overall": accuracy_ci(per_row, seed, n_resamples), "by_length": []}
    for lo, hi in buckets:
        sel = [r for r in per_row if lo <= r["length"] <= hi]
        res["by_length"].append({"lengths": f"{lo}" if lo == hi else f"{lo}-{hi}",
                                 **accuracy_ci(sel, seed, n_resamples)})
    if train_max_length is not None:
        res["within_training_lengths"] = accuracy_ci([r for r in per_row if r["length"] <= train_max_length], seed,
                                                     n_resamples)
        res["beyond_training_lengths"] = accuracy_ci([r for r in per_row if r["length"] > train_max_length], seed,
                                                     n_resamples)
    counts, right = {}, {}
    for r in per_row:
        for t, ok in zip(r["positions"], r["correct"]):
            counts[t] = counts.get(t, 0) + 1
            right[t] = right.get(t, 0) + ok
    res["by_position"] = [{"position": t, "targets": counts[t], "accuracy": right[t] / counts[t]}
                          for t in sorted(counts)]
    return res


@torch.no_grad()
def target_loss(model, batch: dict, mode: str = "standard", num_passes: int = 2) -> torch.Tensor:
    """``[sum of NLL at the targets, number of targets]`` (float64) of a collated batch
    (:func:`fullband.data.labelled.collate_rows`) in a whole-row mode."""
    logits = mode_logits(model, batch["input_ids"], mode, num_passes, batch["attention_mask"])
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                          reduction="sum")
    return torch.stack([nll.double(), (labels != IGNORE).sum().double()])
