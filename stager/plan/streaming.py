"""The streaming path's plan: contiguous sample ranges per rank and worker over a keyed shard order.

Random access is impossible on a gzip stream or too slow over a network, so the streaming
reader (:mod:`stager_loaders.streaming`) reads shards front to back; its plan is coarser than the
staged path's but still a pure function of (counts, layout, epoch, seed): shards are visited in
a keyed order (:func:`stager.plan.order.shard_order`, the one the blocked mode uses) and their
samples concatenated; the even-ed sequence is cut into one contiguous range per rank and one
per worker. Cost per rank: O(shards) for the shard order (the input is that large already) plus
O(batches) for :meth:`StreamingPlan.delivery_order`; nothing is O(samples).
"""

from __future__ import annotations

import numpy as np

from stager.plan.order import shard_offsets, shard_order
from stager.plan.ranks import PlanOptions, WorldLayout, num_batches

__all__ = ["StreamingPlan", "worker_samples"]


def worker_samples(per_rank: int, workers: int, batch_size: int) -> list[int]:
    """How many of a rank's samples each worker streams: whole batches, spread as evenly as
    they go, and the rank's remainder (fewer than a batch) on the worker after the last one
    with an extra batch.

    Why: each worker makes its own batches, so a part that is no multiple of the batch size
    leaves a short batch per worker (``pad``) or drops its tail (``drop``). Split per sample,
    2 ranks x 3 workers with batches of 21 and 58 samples a rank dropped them all (an epoch of
    no batches), and larger runs lost up to ``world x workers x (batch_size - 1)`` samples an
    epoch. In whole batches a rank has at most one short batch and drops fewer than a batch.
    """
    full, remainder = divmod(per_rank, batch_size)
    base, extra = divmod(full, workers)
    parts = [(base + (1 if w < extra else 0)) * batch_size for w in range(workers)]
    parts[extra] += remainder  # (extra < workers)
    return parts


class StreamingPlan:
    """Per worker of this rank: the (shard, first, stop) ranges it streams, and its batch count."""

    def __init__(
        self,
        counts: np.ndarray,
        layout: WorldLayout,
        options: PlanOptions,
        per_rank: int,
        workers: int,
    ):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.layout = layout
        self.options = options
        self.per_rank = per_rank
        self.workers = workers
        self.worker_samples = worker_samples(per_rank, workers, options.batch_size)
        self.worker_batches = [
            num_batches(n, options.batch_size, options.even) for n in self.worker_samples
        ]

    @property
    def num_batches(self) -> int:
        return sum(self.worker_batches)

    def delivery_order(self) -> list[tuple[int, int]]:
        """(worker, batch number) in the order the loader yields them: round robin, like torch."""
        order: list[tuple[int, int]] = []
        cursor = [0] * self.workers
        while len(order) < self.num_batches:
            for w in range(self.workers):
                if cursor[w] < self.worker_batches[w]:
                    order.append((w, cursor[w]))
                    cursor[w] += 1
        return order

    def segments(self, epoch: int, worker: int) -> list[tuple[int, int, int]]:
        """``(shard, first sample, stop sample)`` ranges streamed by ``worker`` this epoch."""
        shards = np.arange(len(self.counts))
        salt = 1 + self.layout.node if self.options.subset == "node" else 0
        if self.options.shuffle != "none":
            shards = shard_order(len(self.counts), seed=self.options.seed, epoch=epoch, salt=salt)
        offsets = shard_offsets(self.counts[shards])
        total = int(offsets[-1])
        position = self.layout.local_rank if self.options.subset == "node" else self.layout.rank
        lo = position * self.per_rank + sum(self.worker_samples[:worker])
        hi = lo + self.worker_samples[worker]
        out: list[tuple[int, int, int]] = []
        while lo < hi:
            if total == 0:
                raise ValueError("cannot pad an empty dataset")
            base = lo % total
            k = int(np.searchsorted(offsets, base, side="right") - 1)
            take = min(hi - lo, int(offsets[k + 1]) - base)
            first = base - int(offsets[k])
            out.append((int(shards[k]), first, first + take))
            lo += take
        return out
