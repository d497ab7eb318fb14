"""Elastic resume: what an interrupted epoch still owed, spread over a world of another size.

Pure and O(share), like the rest of :mod:`stager.plan`: the samples still owed are described by
positions of the old world's order (:class:`RemainingSamples`), never listed, so a new rank
evaluates only the slice it reads. Nothing here depends on the old world beyond its layout and
the batches every rank had consumed.

What is owed, in the old world's order: the old plan gave rank ``r`` the positions
``r * per_rank + j`` (``j < per_rank``) of the padded order; every rank consumed ``cut`` of its
positions (``batches_consumed`` batches). Owed are the positions with ``cut <= j < owed`` (with
``"drop"`` only full batches were ever owed), each sample once: a padded position ``p >= n``
repeats position ``p mod n``, which comes earlier in the same order, so it is never owed itself;
and a sample whose padded repeat was already delivered (possible when ranks get fewer samples
than there are ranks) is not owed either. There are fewer padded positions than ranks, so that
exception list is O(world).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stager.plan.order import EpochOrder
from stager.plan.ranks import (
    PlanOptions,
    WorldLayout,
    num_batches,
    plan_order,
    samples_per_rank,
)

__all__ = ["RemainingSamples", "remaining_after", "elastic_indices"]


@dataclass(frozen=True)
class RemainingSamples:
    """The samples an epoch still owes, as a lazily evaluated sequence (``len``, :meth:`at`).

    Element ``i`` is the ``i``-th owed position of the old order (ascending, which is the old
    world's rank order), skipping ``excluded`` (owed-candidate numbers whose sample was
    delivered through a padded repeat).
    """

    order: EpochOrder
    old_per_rank: int
    cut: int  # positions each old rank consumed
    owed: int  # positions each old rank owed in all
    limit: int  # positions below this are distinct samples: min(n, old world x per_rank)
    row_starts: np.ndarray  # candidate number of each old rank's first owed position, + total
    excluded: np.ndarray  # sorted candidate numbers that are not owed after all

    def __len__(self) -> int:
        return int(self.row_starts[-1]) - len(self.excluded)

    def positions(self, items: np.ndarray) -> np.ndarray:
        """Positions of the old order of owed items ``items`` (each in ``[0, len(self))``)."""
        items = np.asarray(items, dtype=np.int64)
        # The i-th survivor is candidate i + (number of exclusions at or before it): with
        # e_m - m non-decreasing, that count is searchsorted(e - arange, i, "right").
        shifted = self.excluded - np.arange(len(self.excluded), dtype=np.int64)
        candidate = items + np.searchsorted(shifted, items, side="right")
        row = np.searchsorted(self.row_starts, candidate, side="right") - 1
        return row * self.old_per_rank + self.cut + (candidate - self.row_starts[row])

    def at(self, items: np.ndarray) -> np.ndarray:
        """The global sample indices of owed items ``items``."""
        return self.order.at(self.positions(items))

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        """Every owed sample, in order: O(owed samples), for tests and small worlds."""
        array = self.at(np.arange(len(self), dtype=np.int64))
        return array if dtype is None else array.astype(dtype)


def remaining_after(
    counts: Sequence[int] | np.ndarray,
    num_nodes: int,
    ranks_per_node: int,
    *,
    epoch: int,
    options: PlanOptions,
    batches_consumed: int,
) -> RemainingSamples:
    """The samples an epoch still owes after every rank consumed ``batches_consumed`` batches.

    In the old world's rank order, each sample once: padding repeats of samples already
    delivered are not owed. This is what an elastic resume redistributes over a new world.
    Costs O(old world), whatever the dataset size.
    """
    if options.subset != "all":
        raise ValueError("elastic resume covers subset='all'")
    order = plan_order(counts, epoch=epoch, options=options)
    world = num_nodes * ranks_per_node
    total = len(order)
    per_rank = samples_per_rank(total, WorldLayout(num_nodes, ranks_per_node), options.even)
    cut = min(batches_consumed * options.batch_size, per_rank)
    owed = per_rank
    if options.even == "drop":  # the old plan never owed the samples it dropped
        owed = num_batches(per_rank, options.batch_size, "drop") * options.batch_size
    padded = per_rank * world
    limit = min(total, padded)
    row_first = np.arange(world, dtype=np.int64) * per_rank + cut
    row_sizes = np.clip(limit - row_first, 0, max(owed - cut, 0))
    row_starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(row_sizes)])
    # Padded positions (fewer than `world`) that were delivered repeat an earlier position;
    # when that earlier position is an owed candidate, it is not owed after all.
    pad = np.arange(limit, padded, dtype=np.int64)
    delivered_pad = pad[(pad % max(per_rank, 1)) < cut]
    source = np.unique(delivered_pad % total) if total else np.zeros(0, np.int64)
    row, within = np.divmod(source, max(per_rank, 1))
    owed_source = source[(within >= cut) & (within < owed)]
    excluded = row_starts[owed_source // max(per_rank, 1)] + (owed_source % max(per_rank, 1)) - cut
    return RemainingSamples(
        order=order,
        old_per_rank=per_rank,
        cut=cut,
        owed=owed,
        limit=limit,
        row_starts=row_starts,
        excluded=np.sort(excluded).astype(np.int64),
    )


def elastic_indices(
    remaining: RemainingSamples | np.ndarray,
    layout: WorldLayout,
    even: str,
    *,
    start: int = 0,
    stop: int | None = None,
) -> np.ndarray:
    """This rank's share of ``remaining`` in a new world: contiguous, evened like a normal epoch.

    O(share): only this rank's items are evaluated (``start``/``stop`` select part of it).
    """
    count = len(remaining)
    per_rank = samples_per_rank(count, layout, even)
    stop = per_rank if stop is None else min(stop, per_rank)
    start = min(max(start, 0), stop)
    items = layout.rank * per_rank + np.arange(start, stop, dtype=np.int64)
    if items.size == 0:
        return np.zeros(0, np.int64)
    if count == 0:
        raise ValueError("cannot pad an empty remainder")
    items %= count
    if isinstance(remaining, RemainingSamples):
        return remaining.at(items)
    return np.asarray(remaining, dtype=np.int64)[items]
