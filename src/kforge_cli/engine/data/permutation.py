"""Stateless pseudo-random functions the data order is built from.

The data order must be a pure function of (seed, position) so that a loader's state is
a few counters and any rank can compute any position without materialising a
permutation of billions of windows. Two building blocks:

- :func:`permute`: a keyed bijection on ``[0, n)`` (a Feistel network on the next
  even power of two, with cycle walking back into range), evaluated element-wise.
- :func:`weyl_uniform`: a low-discrepancy sequence (golden-ratio Weyl sequence in
  64-bit integers) used to pick mixture datasets, so the share of each dataset in any
  run of consecutive samples is within a few samples of its weight.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ROUNDS = 6


@functools.lru_cache(maxsize=4096)  # called per batch with few distinct arguments
def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (stable across processes and Python versions)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit hash (wrapping uint64 arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=256)
def _round_keys(key: int) -> tuple[np.uint64, ...]:
    return tuple(np.uint64(derive_key(key, r)) for r in range(_ROUNDS))


def permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """Image of ``positions`` (each in [0, n)) under a keyed pseudo-random permutation of [0, n)."""
    if n <= 0:
        raise ValueError("permute needs n >= 1")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = _round_keys(key)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        y = feistel(np.asarray(positions, dtype=np.uint64))
        out = y >= np.uint64(n)
        while out.any():  # cycle walking: the domain is < 4n, so this ends after a few rounds
            y[out] = feistel(y[out])
            out = y >= np.uint64(n)
    return y.astype(np.int64)


def weyl_uniform(positions: np.ndarray, key: int) -> np.ndarray:
    """Low-discrepancy uint64 values for integer positions: (key + g * golden) mod 2**64."""
    with np.errstate(over="ignore"):
        return np.uint64(key) + np.asarray(positions, dtype=np.uint64) * _GOLDEN
