"""The data order: which rows make global batch number ``step``, epoch after epoch, as a pure function of the step.

Owns :func:`batch_rows` and its two index maps, both seeded permutations of ``[0, num_rows)`` per epoch, so a
run resumed at step s reads exactly what an uninterrupted run reads:

* ``"randperm"`` (in-memory corpora, conversations): ``torch.randperm`` with a generator seeded by
  ``seed * 1_000_003 + epoch`` -- the order every run so far was trained with. The permutation of an epoch is
  built once and cached (a few epochs of the last sizes), not once per step;
* ``"feistel"`` (prepared data of any size, :mod:`fullband.data.shards`): a 4-round Feistel network over the
  smallest even power of two >= ``num_rows``, keyed by ``(seed, epoch)``, with cycle-walking (an index that
  lands outside ``[0, num_rows)`` is encrypted again until it lands inside; the walk stays on the cycle of the
  starting index, so the map is a bijection of ``[0, num_rows)``). A batch costs O(batch) time and memory: no
  array of ``num_rows`` entries is ever built.

A run may also re-read a fixed pool (:func:`pool_batch_rows`, ``fullband train --unique-batches N``): the rows
that batches ``offset .. offset+N-1`` of the ordinary order read, epoch after epoch, each epoch a fresh seeded
permutation of the pool's ``N x batch`` slots (the same index maps over ``[0, N x batch)``), so it reads exactly
the unique rows of an ordinary N-batch run, as often as its steps say. :func:`distinct_rows_read` counts the
distinct rows a run reads (its unique tokens).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import torch

ORDERS = ("randperm", "feistel")
_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=4)
def _randperm(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    digest = hashlib.sha256(f"fullband-feistel:{seed}:{epoch}".encode()).digest()
    return [np.uint64(int.from_bytes(digest[8 * r:8 * r + 8], "little")) for r in range(_ROUNDS)]


def feistel_permute(index: np.ndarray, num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded bijection of ``[0, num_rows)`` applied to ``index`` (int array, each in range)."""
    half = max(1, (max(1, int(num_rows - 1).bit_length()) + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = _round_keys(seed, epoch)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        y = encrypt(np.asarray(index, dtype=np.uint64))
        out = y >= np.uint64(num_rows)
        while out.any():  # cycle-walking: < 4 rounds expected (the domain is < 4 x num_rows)
            y[out] = encrypt(y[out])
            out = y >= np.uint64(num_rows)
    return y.astype(np.int64)


def batch_rows(step: int, batch_size: int, num_rows: int, seed: int = 0, order: str = "randperm") -> torch.Tensor:
    """Row indices of global batch ``step``: positions ``step*batch_size ...`` of the endless sequence of epochs,
    each epoch a seeded permutation of the rows (``order``: see the module docstring)."""
    return position_rows(np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64), num_rows, seed, order)


def position_rows(pos: np.ndarray, num_rows: int, seed: int = 0, order: str = "randperm") -> torch.Tensor:
    """Row indices at positions ``pos`` (int array) of the endless sequence of epochs (:func:`batch_rows`)."""
    if num_rows < 1:
        raise ValueError("no training rows")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    pos = np.asarray(pos, dtype=np.int64)
    epochs, within = np.divmod(pos, num_rows)
    rows = np.empty(pos.shape[0], dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        sel = epochs == epoch
        if order == "randperm":
            rows[sel] = _randperm(num_rows, seed, epoch)[torch.from_numpy(within[sel])].numpy()
        else:
            rows[sel] = feistel_permute(within[sel], num_rows, seed, epoch)
    return torch.from_numpy(rows)


def _pool_seed(seed: int) -> int:
    """The seed of a pool's epoch permutations: its own stream, not the ordinary order's."""
    return int.from_bytes(hashlib.sha256(f"fullband-pool:{seed}".encode()).digest()[:4], "little")


def pool_batch_rows(step: int, batch_size: int, num_rows: int, seed: int, order: str, pool_batches: int,
                    offset: int = 0) -> torch.Tensor:
    """Row indices of batch ``step`` of a run that re-reads the pool of batches ``offset .. offset+pool_batches-1``
    of the ordinary order: slot ``j`` of the pool is ordinary position ``offset x batch + j``; the run's positions
    run over epochs of the pool's slots, each a seeded permutation (``order``'s map over the slots)."""
    if pool_batches < 1:
        raise ValueError(f"the pool needs at least one batch, got {pool_batches}")
    slots = batch_rows(step, batch_size, pool_batches * batch_size, _pool_seed(seed), order).numpy()
    return position_rows(offset * batch_size + slots, num_rows, seed, order)


def distinct_rows_read(steps: int, batch_size: int, num_rows: int, seed: int = 0, order: str = "randperm",
                       offset: int = 0, pool_batches: int = 0) -> int:
    """How many distinct rows a run of ``steps`` batches reads (ordinary order from batch ``offset``, or re-reading
    the pool of ``pool_batches`` batches from there): ``num_rows`` once an epoch is covered, the number of reads
    while they stay inside one epoch; only a window across an epoch boundary is counted row by row (O(reads))."""
    reads = steps * batch_size
    start = offset * batch_size
    if pool_batches:
        window = pool_batches * batch_size
        if reads < window:  # part of the pool's first epoch: distinct slots, i.e. distinct positions
            if start // num_rows == (start + window - 1) // num_rows:
                return reads
            pos = start + batch_rows(0, reads, window, _pool_seed(seed), order).numpy()
            return int(np.unique(position_rows(pos, num_rows, seed, order).numpy()).size)
        reads = window  # every slot of the pool read at least once
    if reads >= num_rows:
        return num_rows
    if start // num_rows == (start + reads - 1) // num_rows:
        return reads
    pos = np.arange(start, start + reads, dtype=np.int64)
    return int(np.unique(position_rows(pos, num_rows, seed, order).numpy()).size)
