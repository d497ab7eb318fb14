"""The staging order: how epoch 0 is read while ``stage-in --background`` is still copying.

stage-in and the loader share this plan, so shards land in the order ranks ask for them:

1. **Copy order.** stage-in copies a node's shards in :func:`copy_order` (a keyed order of the
   shard numbers, keyed by ``stage-in --seed``; with ``--subset node`` salted by the node).
2. **Windows of staged shards.** The shards in copy order are cut into windows of
   ``1, 2, 4, ...`` shards, then ``window_shards`` each, then ``..., 4, 2, 1`` at the end
   (:func:`window_starts`). The samples of a window are concatenated and permuted inside it
   by a key of (loader seed, epoch, window), so reading window ``w`` needs only the first
   shards of the copy order: the first batch needs only the first shard, and the epoch's last
   batches only the last one or two. In between, larger windows mix more.
3. **Steps interleaved across ranks.** Step ``i`` of the group's ``G`` ranks takes the
   ``G x batch`` positions after step ``i - 1`` (rank ``r`` the ``r``-th batch of them), so
   every rank's first batches come from the head of the copy order. (Outside a staging
   epoch a rank takes a contiguous slice, :mod:`stager.plan.ranks`, which would send the last
   rank to the last shards.) Evening is the usual one: ``"pad"`` positions past the end
   repeat the head, ``"drop"`` leaves out the tail.

Which epochs use this order is decided by the loader (the first epochs that start while
staging is incomplete on some node; recorded in its state, so a resume replays them). Like
the rest of :mod:`stager.plan` this is pure numpy and O(share): the largest array is one
entry per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stager.plan.order import shard_offsets
from stager.plan.permute import permute, round_keys, unpermute, window_keys
from stager.plan.ranks import PlanOptions, WorldLayout

__all__ = [
    "WINDOW_SHARDS",
    "StagingSpec",
    "copy_order",
    "copy_salt",
    "window_starts",
    "StagingOrder",
    "StagingShare",
    "staging_share",
    "interleaved_positions",
]

#: Largest window, in shards, of the staging order (recorded in loader states with the order).
WINDOW_SHARDS = 8

# Key streams, apart from those of stager.plan.order: the copy order never correlates with
# an epoch's own shard or sample order.
_COPY, _WINDOWS = 101, 102


@dataclass(frozen=True)
class StagingSpec:
    """What fixes a staging order besides the counts, layout and epoch: recorded in states."""

    copy_seed: int = 0  # stage-in --seed: keys the copy order
    window_shards: int = WINDOW_SHARDS

    def __post_init__(self) -> None:
        if self.window_shards < 1:
            raise ValueError(f"window_shards must be >= 1, got {self.window_shards}")

    def to_dict(self) -> dict[str, int]:
        return {"copy_seed": self.copy_seed, "window_shards": self.window_shards}

    @classmethod
    def from_dict(cls, payload: dict[str, int]) -> StagingSpec:
        return cls(int(payload["copy_seed"]), int(payload["window_shards"]))


def copy_salt(subset: str, node: int) -> int:
    """The salt of a node's copy order: 0 when every node stages everything (one order for
    all), ``1 + node`` for ``--subset node`` (each node orders its own shards)."""
    return 1 + node if subset == "node" else 0


def copy_order(num_shards: int, *, seed: int, salt: int = 0) -> np.ndarray:
    """Shard numbers (of the node's shards, in source order) in the order stage-in copies them."""
    keys = round_keys(seed, salt, _COPY)
    return permute(np.arange(num_shards, dtype=np.int64), num_shards, keys)


def window_starts(num_shards: int, window_shards: int = WINDOW_SHARDS) -> np.ndarray:
    """First copy-order position of each window, plus ``num_shards`` at the end.

    Windows of ``1, 2, 4, ...`` shards up to ``window_shards``, and the same sizes mirrored at
    the end (``..., 4, 2, 1``): the first batch waits for one shard, and so does the last
    stretch of the epoch while the copy finishes (a window is read only once all of it has
    landed, so a large last window would hold the epoch's end back by its whole copy).
    """
    ramp: list[int] = []
    size = 1
    while size < window_shards and 2 * (sum(ramp) + size) <= num_shards:
        ramp.append(size)
        size *= 2
    middle = num_shards - 2 * sum(ramp)
    while ramp and 0 < middle < ramp[-1]:  # too little left between the ramps: shorten them
        middle += 2 * ramp.pop()
    count = -(-middle // window_shards)
    mids = [middle // count + (1 if i < middle % count else 0) for i in range(count)]
    sizes = ramp + mids + ramp[::-1]
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(sizes, dtype=np.int64)])


class StagingOrder:
    """``order[p]`` of a staging epoch: :meth:`at` and :meth:`position_of`, as
    :class:`stager.plan.order.EpochOrder` (which :func:`stager.plan.ranks.evened` accepts)."""

    def __init__(
        self,
        counts: Sequence[int] | np.ndarray,
        *,
        spec: StagingSpec,
        seed: int,
        epoch: int,
        salt: int = 0,
    ):
        self.offsets = shard_offsets(counts)
        self.total = int(self.offsets[-1])
        num_shards = len(self.offsets) - 1
        self.shards = copy_order(num_shards, seed=spec.copy_seed, salt=salt)
        self.rank_of_shard = np.empty(num_shards, dtype=np.int64)
        self.rank_of_shard[self.shards] = np.arange(num_shards, dtype=np.int64)
        # sample offsets of the shards in copy order, and of the windows among them
        self.copy_offsets = shard_offsets(np.diff(self.offsets)[self.shards])
        self.window_bounds = self.copy_offsets[window_starts(num_shards, spec.window_shards)]
        self._keys = round_keys(seed, epoch, salt, _WINDOWS)

    def __len__(self) -> int:
        return self.total

    def _window(self, concatenated: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window = np.searchsorted(self.window_bounds, concatenated, side="right") - 1
        start = self.window_bounds[window]
        return window, start, self.window_bounds[window + 1] - start

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The global sample indices at ``positions`` (each in ``[0, len(self))``)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.total):
            raise ValueError(f"positions must lie in [0, {self.total})")
        window, start, size = self._window(positions)
        concatenated = start + permute(positions - start, size, window_keys(self._keys, window))
        k = np.searchsorted(self.copy_offsets, concatenated, side="right") - 1
        return self.offsets[self.shards[k]] + (concatenated - self.copy_offsets[k])

    def position_of(self, samples: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`at`."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= self.total):
            raise ValueError(f"samples must lie in [0, {self.total})")
        shard = np.searchsorted(self.offsets, samples, side="right") - 1
        k = self.rank_of_shard[shard]
        concatenated = self.copy_offsets[k] + (samples - self.offsets[shard])
        window, start, size = self._window(concatenated)
        keys = window_keys(self._keys, window)
        return start + unpermute(concatenated - start, size, keys)

    def materialise(self) -> np.ndarray:
        """The whole order (O(samples)): for tests and simulations only."""
        return self.at(np.arange(self.total, dtype=np.int64))


def interleaved_positions(
    items: np.ndarray, slot: int, group: int, per_rank: int, batch_size: int
) -> np.ndarray:
    """Positions of the evened order that items ``items`` of rank slot ``slot`` read.

    Full batch ``i`` of every slot comes from the group's step ``i``: positions
    ``(i * group + slot) * batch_size + k``; the short tail batch (``"pad"``, when
    ``per_rank`` is not a multiple of the batch) from the last ``group x tail`` positions. A
    bijection of (slot, item) onto ``[0, group * per_rank)``.
    """
    items = np.asarray(items, dtype=np.int64)
    full = (per_rank // batch_size) * batch_size
    tail = per_rank - full
    batch, k = np.divmod(items, batch_size)
    in_full = (batch * group + slot) * batch_size + k
    in_tail = full * group + slot * tail + (items - full)
    return np.where(items < full, in_full, in_tail)


@dataclass(frozen=True)
class StagingShare:
    """One rank's share of a staging epoch: like :class:`stager.plan.ranks.RankShare`."""

    order: StagingOrder
    slot: int
    group: int
    per_rank: int
    batch_size: int

    def __len__(self) -> int:
        return self.per_rank

    def positions(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.per_rank if stop is None else min(stop, self.per_rank)
        start = min(max(start, 0), stop)
        items = np.arange(start, stop, dtype=np.int64)
        return interleaved_positions(items, self.slot, self.group, self.per_rank, self.batch_size)

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Global sample indices of items ``start:stop`` of the share: O(stop - start)."""
        positions = self.positions(start, stop)
        if positions.size == 0:
            return np.zeros(0, np.int64)
        if self.order.total == 0:
            raise ValueError("cannot pad an empty dataset; stage or select at least one sample")
        return self.order.at(positions % self.order.total)


def staging_share(
    counts: Sequence[int] | np.ndarray,
    layout: WorldLayout,
    *,
    epoch: int,
    options: PlanOptions,
    spec: StagingSpec,
    per_rank: int,
) -> StagingShare:
    """The share of ``layout.rank`` in a staging epoch (``counts``: the node's shards for
    ``subset="node"``, as :func:`stager.plan.ranks.rank_share` takes them)."""
    if options.subset == "node":
        salt = copy_salt("node", layout.node)
        slot, group = layout.local_rank, layout.ranks_per_node
    else:
        salt, slot, group = 0, layout.rank, layout.world_size
    order = StagingOrder(counts, spec=spec, seed=options.seed, epoch=epoch, salt=salt)
    return StagingShare(order, slot, group, per_rank, options.batch_size)
