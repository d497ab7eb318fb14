"""The rank's batches as a torch batch sampler: the plan of :mod:`stager.plan.ranks`, replayed.

The sampler runs in the main process; DataLoader hands batch ``i`` to worker ``i % workers``
and returns results in order, so skipping the first ``k`` batches of the plan is an exact
resume that reads and decodes nothing it skips.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from stager.plan.ranks import (
    PlanOptions,
    WorldLayout,
    num_batches,
    rank_batches,
    rank_indices,
    samples_per_rank,
)

__all__ = ["RankBatchSampler"]


class RankBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of global sample indices for the current epoch."""

    def __init__(
        self,
        counts: np.ndarray,
        layout: WorldLayout,
        options: PlanOptions,
        per_rank: int | None = None,
    ):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.layout = layout
        self.options = options
        if per_rank is None:
            per_rank = samples_per_rank(int(self.counts.sum()), layout, options.even)
        self.per_rank = per_rank
        self.epoch = 0
        self.start_batch = 0
        # (epoch, this rank's indices) for an epoch resumed elastically on a different world
        self.override: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        if self.override is not None and self.override[0] == self.epoch:
            return num_batches(len(self.override[1]), self.options.batch_size, self.options.even)
        return num_batches(self.per_rank, self.options.batch_size, self.options.even)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """All batches of ``epoch`` on this rank (also used by tests and tools)."""
        if self.override is not None and self.override[0] == epoch:
            indices = self.override[1]
        else:
            indices = rank_indices(
                self.counts, self.layout, epoch=epoch, options=self.options, per_rank=self.per_rank
            )
        return rank_batches(indices, self.options.batch_size, self.options.even)

    def __iter__(self) -> Iterator[list[int]]:
        start, epoch = self.start_batch, self.epoch
        for batch in self.batches(epoch)[start:]:
            yield batch.tolist()
