"""A keyed pseudo-random bijection of ``[0, n)``, evaluated only at the positions asked for.

Why not ``rng.permutation(n)``: a rank that needs 1/4,096 of an epoch would build all ``n``
entries to keep its slice (10 s and 2.4 GB per rank at 1e8 samples, ~48 GB at 2e9). A bijection
``position -> sample`` that is a pure function of a key costs O(positions asked), in any order,
and every rank and worker evaluates the same one without talking to the others.

Construction (the same idea as Google Grain's ``index_shuffle``, with a Feistel network in place
of Philox): an unbalanced Feistel network on ``[0, 2^bits)``, ``2^bits`` the smallest power of two
``>= n``. Each round maps ``(L, R) -> (R, L xor F(R, key))``, which is invertible whatever ``F``
is, so the whole network is a bijection of ``[0, 2^bits)``. Values that land outside ``[0, n)``
are sent through the network again ("cycle walking", Black & Rogaway 2002) until they land
inside; that restricts the bijection of the power of two to a bijection of ``[0, n)``. Since
``2^bits < 2n``, a value needs fewer than two passes on average.

The round function is the splitmix64 finaliser of ``R`` mixed with a 64-bit round key. Six
rounds: in the statistics of docs/loader.md (``benchmarks.bench_shuffle``), four rounds still
show a correlation between positions a power of two apart (z ~ 50 over 4,000 epochs: inputs that
share a half keep a relation), five pass, and six (one round of margin) are indistinguishable
from numpy's permutation. Everything is vectorised numpy on ``uint64`` (multiplication wraps
modulo 2^64, as the mixer wants), a chunk of positions at a time so temporaries stay bounded.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "round_keys", "window_keys", "permute", "unpermute"]

#: Feistel rounds; see the module docstring for why six.
ROUNDS = 6

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half of the output bits."""
    z = z ^ (z >> _U30)
    z = z * _M1
    z = z ^ (z >> _U27)
    z = z * _M2
    return z ^ (z >> _U31)


def round_keys(*words: int) -> np.ndarray:
    """``ROUNDS`` 64-bit keys from integer words (seed, epoch, salt...), via numpy's SeedSequence.

    SeedSequence hashes the words together, so ``(seed, epoch)`` pairs never alias the way
    ``seed + epoch`` would.
    """
    entropy = [int(w) & 0xFFFFFFFFFFFFFFFF for w in words]
    return np.random.SeedSequence(entropy).generate_state(ROUNDS, dtype=np.uint64)


def window_keys(keys: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Per-element round keys, shape ``(ROUNDS, len(windows))``: an independent key per window."""
    tags = _mix(np.asarray(windows, dtype=np.uint64) * _GOLDEN + _GOLDEN)
    return _mix(keys.reshape(-1, 1) ^ tags.reshape(1, -1))


def _bits(n: np.ndarray) -> np.ndarray:
    """``ceil(log2(n))`` per element, at least 1: the bit length of ``n - 1`` (exact below 2^53)."""
    _, exponent = np.frexp((np.asarray(n, dtype=np.int64) - 1).astype(np.float64))
    return np.maximum(exponent, 1).astype(np.uint64)


def _rounds(
    x: np.ndarray, keys: np.ndarray, bits: np.ndarray, *, inverse: bool = False
) -> np.ndarray:
    """One pass of the Feistel network over ``[0, 2^bits)`` (per element), or its inverse."""
    left = bits - bits // np.uint64(2)  # width of the left half before round 0
    right = bits // np.uint64(2)
    widths = []
    for _ in range(ROUNDS):
        widths.append((left, right))
        left, right = right, left
    order = range(ROUNDS - 1, -1, -1) if inverse else range(ROUNDS)
    for i in order:
        key = keys[i]  # a scalar, or one key per element
        lw, rw = widths[i]
        if not inverse:
            # (L, R) -> (R, L ^ F(R)): L has lw bits, R rw bits; the new left has rw bits.
            high = x >> rw
            low = x & ((_ONE << rw) - _ONE)
            f = _mix(low ^ key) & ((_ONE << lw) - _ONE)
            x = (low << lw) | (high ^ f)
        else:
            # undo: x = (R << lw) | (L ^ F(R))
            low = x >> lw
            high = (x & ((_ONE << lw) - _ONE)) ^ (_mix(low ^ key) & ((_ONE << lw) - _ONE))
            x = (high << rw) | low
    return x


#: Elements per vectorised step: bounds the temporaries (~a dozen arrays of this many words).
CHUNK = 1 << 16


def _walk(
    values: np.ndarray, n: np.ndarray | int, keys: np.ndarray, *, inverse: bool
) -> np.ndarray:
    values = np.asarray(values, dtype=np.int64)
    sizes = np.asarray(n, dtype=np.int64)
    if sizes.ndim and sizes.shape != values.shape:
        raise ValueError("per-element n must have the shape of the positions")
    if keys.ndim == 2 and keys.shape[1] != values.size:
        raise ValueError("per-element keys must have one column per position")
    flat = values.reshape(-1)
    out = np.empty(flat.shape, dtype=np.int64)
    for lo in range(0, flat.size, CHUNK):
        part = slice(lo, lo + CHUNK)
        out[part] = _walk_chunk(
            flat[part],
            sizes.reshape(-1)[part] if sizes.ndim else sizes,
            keys[:, part] if keys.ndim == 2 else keys,
            inverse=inverse,
        )
    return out.reshape(values.shape)


def _walk_chunk(
    values: np.ndarray, sizes: np.ndarray, keys: np.ndarray, *, inverse: bool
) -> np.ndarray:
    if ((values < 0) | (values >= sizes)).any():
        raise ValueError("positions must lie in [0, n)")
    per_element = keys.ndim == 2
    bits = _bits(sizes)
    limit = sizes.astype(np.uint64)
    out = _rounds(values.astype(np.uint64), keys, bits, inverse=inverse)
    todo = np.flatnonzero(out >= limit)
    # Cycle walking: each pass leaves [0, n) with probability < 1/2, so ~log2(len) passes.
    while todo.size:
        out[todo] = _rounds(
            out[todo],
            keys[:, todo] if per_element else keys,
            bits[todo] if bits.ndim else bits,
            inverse=inverse,
        )
        todo = todo[out[todo] >= (limit[todo] if limit.ndim else limit)]
    return out.astype(np.int64)


def permute(positions: np.ndarray, n: np.ndarray | int, keys: np.ndarray) -> np.ndarray:
    """The images of ``positions`` under the bijection of ``[0, n)`` keyed by ``keys``.

    ``n`` and ``keys`` may be per element (``n`` an array like ``positions``, ``keys`` of shape
    ``(ROUNDS, len(positions))``, see :func:`window_keys`): many small permutations at once.
    """
    return _walk(positions, n, keys, inverse=False)


def unpermute(values: np.ndarray, n: np.ndarray | int, keys: np.ndarray) -> np.ndarray:
    """The inverse of :func:`permute`: at which position each of ``values`` sits."""
    return _walk(values, n, keys, inverse=True)
