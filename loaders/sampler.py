"""The rank's batches as a torch batch sampler: the plan of :mod:`stager.plan.ranks`, replayed.

The sampler runs in the main process; DataLoader hands batch ``i`` to worker ``i % workers``
and returns results in order, so skipping the first ``k`` batches of the plan is an exact
resume that reads and decodes nothing it skips. The plan is evaluated a chunk of batches at a
time (the order is a function of position), so the first batch costs one chunk, not the whole
share, and a resume evaluates nothing before its position.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from stager.plan.elastic import RemainingSamples, elastic_indices
from stager.plan.ranks import (
    PlanOptions,
    RankShare,
    WorldLayout,
    num_batches,
    rank_batches,
    rank_share,
    samples_per_rank,
)
from stager.plan.staging import StagingShare, StagingSpec, staging_share

__all__ = ["RankBatchSampler"]

#: Positions evaluated per step of the sampler: ~1 ms of planning, ~0.5 MB of indices.
CHUNK_SAMPLES = 1 << 15


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
        # (epoch, what it still owed) for an epoch resumed elastically on a different world
        self.override: tuple[int, RemainingSamples] | None = None
        # (epoch, spec) for an epoch read in the staging order (stager.plan.staging)
        self.staging: tuple[int, StagingSpec] | None = None
        self._share_cache: tuple[int, RankShare | StagingShare] | None = None

    def _share(self, epoch: int) -> int:
        """Samples of this rank in ``epoch``."""
        if self.override is not None and self.override[0] == epoch:
            return samples_per_rank(len(self.override[1]), self.layout, self.options.even)
        return self.per_rank

    def num_batches_in(self, epoch: int) -> int:
        """Batches of ``epoch`` on this rank (an elastically resumed epoch has its own count)."""
        return num_batches(self._share(epoch), self.options.batch_size, self.options.even)

    def __len__(self) -> int:
        return self.num_batches_in(self.epoch)

    def indices(self, epoch: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """This rank's sample indices ``start:stop`` of ``epoch``: O(stop - start)."""
        if self.override is not None and self.override[0] == epoch:
            return elastic_indices(
                self.override[1], self.layout, self.options.even, start=start, stop=stop
            )
        cached = self._share_cache
        staging = self.staging[1] if self.staging and self.staging[0] == epoch else None
        if (
            cached is None
            or cached[0] != epoch
            or isinstance(cached[1], StagingShare) != bool(staging)
        ):
            share: RankShare | StagingShare
            if staging is not None:
                share = staging_share(
                    self.counts,
                    self.layout,
                    epoch=epoch,
                    options=self.options,
                    spec=staging,
                    per_rank=self.per_rank,
                )
            else:
                share = rank_share(
                    self.counts,
                    self.layout,
                    epoch=epoch,
                    options=self.options,
                    per_rank=self.per_rank,
                )
            cached = self._share_cache = (epoch, share)  # the O(shards) part, once
        return cached[1].indices(start, stop)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """All batches of ``epoch`` on this rank (also used by tests and tools)."""
        return rank_batches(self.indices(epoch), self.options.batch_size, self.options.even)

    def __iter__(self) -> Iterator[list[int]]:
        start, epoch = self.start_batch, self.epoch
        size = self.options.batch_size
        share = self._share(epoch)
        count = num_batches(share, size, self.options.even)
        step = max(1, CHUNK_SAMPLES // size)
        for first in range(start, count, step):
            last = min(count, first + step)
            chunk = self.indices(epoch, first * size, min(last * size, share))
            for lo in range(0, len(chunk), size):
                yield chunk[lo : lo + size].tolist()
