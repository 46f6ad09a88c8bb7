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
    if num_rows < 1:
        raise ValueError("no training rows")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    pos = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
    epochs, within = np.divmod(pos, num_rows)
    rows = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        sel = epochs == epoch
        if order == "randperm":
            rows[sel] = _randperm(num_rows, seed, epoch)[torch.from_numpy(within[sel])].numpy()
        else:
            rows[sel] = feistel_permute(within[sel], num_rows, seed, epoch)
    return torch.from_numpy(rows)
