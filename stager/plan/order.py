"""An epoch's visiting order over the samples, as a function of position: ``order[p]``.

Global sample ``g`` numbers the samples of all shards in shard order: shard ``s`` owns
``offsets[s]:offsets[s + 1]`` where ``offsets = cumsum([0] + counts)``. The order is a bijection
``position -> sample`` keyed by (seed, epoch, salt) (:mod:`stager.plan.permute`), evaluated only
at the positions a rank or worker reads, so nothing here costs O(samples): the largest array is
one entry per shard, and only the ``"blocked"`` mode and streaming build even that.

Modes:

* ``"none"``: file order, ``order[p] = p``;
* ``"global"``: one keyed bijection of all samples;
* ``"blocked"``: shards in a keyed order, their samples concatenated, then each window of
  ``block_samples`` consecutive positions permuted by its own key, so a contiguous slice of the
  order touches few shards (suits slow disks and the streaming reader).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from stager.plan.permute import permute, round_keys, unpermute, window_keys

__all__ = ["EpochOrder", "shard_offsets", "shard_order", "seeded_rng"]

# Key streams: one bijection per purpose, so the shard order never correlates with the
# sample order of the same epoch.
_SAMPLES, _SHARDS, _WINDOWS = 0, 1, 2


def shard_offsets(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: the first global index of each shard, plus the total."""
    array = np.asarray(counts, dtype=np.int64)
    if array.ndim != 1 or (array < 0).any():
        raise ValueError("shard sample counts must be a 1-D list of non-negative integers")
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(array)])


def shard_order(num_shards: int, *, seed: int, epoch: int, salt: int = 0) -> np.ndarray:
    """Shard numbers in the keyed order of ``(seed, epoch, salt)``: O(shards)."""
    keys = round_keys(seed, epoch, salt, _SHARDS)
    return permute(np.arange(num_shards, dtype=np.int64), num_shards, keys)


def seeded_rng(seed: int, *words: int) -> np.random.Generator:
    """A numpy generator for (seed, words...): for sampling that need not be a bijection."""
    return np.random.default_rng(
        np.random.SeedSequence([int(w) & (2**64 - 1) for w in (seed, *words)])
    )


#: Positions evaluated per vectorised step: bounds the temporaries (a dozen arrays of this many
#: 64-bit words, per-element round keys included) whatever the number of positions asked.
CHUNK = 1 << 16


def _chunked(evaluate: Callable[[np.ndarray], np.ndarray], values: np.ndarray) -> np.ndarray:
    if values.size <= CHUNK:
        return evaluate(values)
    flat = values.reshape(-1)
    out = np.empty(flat.shape, dtype=np.int64)
    for lo in range(0, flat.size, CHUNK):
        out[lo : lo + CHUNK] = evaluate(flat[lo : lo + CHUNK])
    return out.reshape(values.shape)


class EpochOrder:
    """``order[p]`` for one epoch: :meth:`at` maps positions to samples, :meth:`position_of` back.

    ``salt`` separates orders that must differ for the same seed and epoch (each node's order
    over its own shards in node-subset mode).
    """

    def __init__(
        self,
        counts: Sequence[int] | np.ndarray,
        *,
        mode: str,
        seed: int,
        epoch: int,
        salt: int = 0,
        block_samples: int = 4096,
    ):
        if mode not in ("none", "global", "blocked"):
            raise ValueError(f"unknown shuffle mode {mode!r}")
        if block_samples < 1:
            raise ValueError(f"block_samples must be >= 1, got {block_samples}")
        self.offsets = shard_offsets(counts)
        self.total = int(self.offsets[-1])
        self.mode = mode
        self.block_samples = block_samples
        self._words = (seed, epoch, salt)
        self._sample_keys = round_keys(seed, epoch, salt, _SAMPLES)
        self._window_keys = round_keys(seed, epoch, salt, _WINDOWS)
        self._shards: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.total

    def _shard_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(shards in this epoch's order, offsets of their samples in that order), cached."""
        if self._shards is None:
            seed, epoch, salt = self._words
            order = shard_order(len(self.offsets) - 1, seed=seed, epoch=epoch, salt=salt)
            self._shards = (order, shard_offsets(np.diff(self.offsets)[order]))
        return self._shards

    def _windows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        block = self.block_samples
        window = positions // block
        start = window * block
        size = np.minimum(block, self.total - start)
        return window, start, size

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` (each in ``[0, len(self))``), as int64 global indices."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.total):
            raise ValueError(f"positions must lie in [0, {self.total})")
        return _chunked(self._at, positions)

    def _at(self, positions: np.ndarray) -> np.ndarray:
        if self.mode == "none":
            return positions.copy()
        if self.mode == "global":
            return permute(positions, self.total, self._sample_keys)
        window, start, size = self._windows(positions)
        keys = window_keys(self._window_keys, window)
        concatenated = start + permute(positions - start, size, keys)
        shards, perm_offsets = self._shard_layout()
        k = np.searchsorted(perm_offsets, concatenated, side="right") - 1
        return self.offsets[shards[k]] + (concatenated - perm_offsets[k])

    def position_of(self, samples: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`at`: where each of ``samples`` sits this epoch."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= self.total):
            raise ValueError(f"samples must lie in [0, {self.total})")
        return _chunked(self._position_of, samples)

    def _position_of(self, samples: np.ndarray) -> np.ndarray:
        if self.mode == "none":
            return samples.copy()
        if self.mode == "global":
            return unpermute(samples, self.total, self._sample_keys)
        shard = np.searchsorted(self.offsets, samples, side="right") - 1
        seed, epoch, salt = self._words
        num_shards = len(self.offsets) - 1
        rank_of_shard = unpermute(shard, num_shards, round_keys(seed, epoch, salt, _SHARDS))
        _, perm_offsets = self._shard_layout()
        concatenated = perm_offsets[rank_of_shard] + (samples - self.offsets[shard])
        window, start, size = self._windows(concatenated)
        keys = window_keys(self._window_keys, window)
        return start + unpermute(concatenated - start, size, keys)

    def materialise(self) -> np.ndarray:
        """The whole order (O(samples)): for simulations, tests and benchmarks only."""
        return self.at(np.arange(self.total, dtype=np.int64))
