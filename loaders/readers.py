"""The two ways ``ShardedLoader`` reads a dataset, behind one small interface (:class:`Reader`).

* :class:`StagedReader` (every shard a local uncompressed tar): a map-style dataset read by
  byte offset, plus the rank's batch sampler. Batches arrive in plan order whatever the worker
  count, so ``len`` is exact and resume is "skip the first k batches"; elastic resume works.
* :class:`StreamingReader` (a remote source, ``.tgz`` shards, or staged copies missing): a tar
  stream per worker over a coarser plan, re-ordered in the main process so resume is exact too
  (:mod:`stager_loaders.streaming`). Workers hold the epoch, so they restart each epoch.

The loader owns what both share (the layout, the epoch and position, the state, metrics); a
reader owns how batches are formed. Both are built in two steps: opening reads the sample
counts (from the index, the manifest, or the tar headers), :meth:`Reader.bind` then plans with
the per-rank figure the loader agreed on (an ``all_reduce`` for node subsets).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from stager.errors import IntegrityError, ResumeMismatch, SourceError, UsageError
from stager.layout import StagedDataset
from stager.plan.elastic import RemainingSamples
from stager.plan.ranks import PlanOptions, WorldLayout
from stager.plan.staging import StagingSpec
from stager.plan.streaming import StreamingPlan
from stager.shards.loader_index import build_flat_index

from .collective import count_in_shares
from .dataset import PackedBatch, StagedTarDataset
from .options import LoaderOptions
from .resolve import DatasetShards
from .sampler import RankBatchSampler
from .samples import SamplePipeline, collate_samples
from .streaming import StreamingShards, count_remote_samples, reorder_batches

log = logging.getLogger("stager_loaders")

__all__ = ["Reader", "StagedReader", "StreamingReader", "open_reader"]

Collate = Callable[[list[Any]], Any]


class Reader(Protocol):
    """How the loader's batches are made from one dataset."""

    counts: np.ndarray  # samples per shard (0 for a shard skipped as corrupt)
    skipped_shards: list[str]
    restarts_workers: bool  # True: workers hold the epoch, persistent workers are refused

    def bind(self, layout: WorldLayout, options: PlanOptions, per_rank: int) -> dict[str, Any]:
        """Plan for this rank; the DataLoader arguments that form batches (dataset and co)."""
        ...

    def num_batches(self, epoch: int) -> int:
        """Batches of ``epoch`` on this rank; the same on every rank."""
        ...

    def start(self, epoch: int, first_batch: int) -> None:
        """Before the DataLoader iterates: which epoch, and how many batches were delivered."""
        ...

    def deliver(self, batches: Iterator[Any], first_batch: int) -> Iterator[Any]:
        """The DataLoader's output, in plan order."""
        ...

    def resume_elsewhere(self, epoch: int, remaining: RemainingSamples) -> None:
        """Serve ``remaining`` as this rank's share of ``epoch`` (elastic resume)."""
        ...

    def use_order(self, epoch: int, spec: StagingSpec | None) -> None:
        """Read ``epoch`` in the staging order ``spec`` (None: the epoch's usual order)."""
        ...

    def elastic_epoch(self) -> int | None:
        """The epoch served by :meth:`resume_elsewhere`, if any."""
        ...

    def order_settings(self) -> dict[str, Any]:
        """What, beyond the plan's options, fixes the order of an epoch on this path (a resumed
        state must match it)."""
        ...


def _passthrough(batch: Any) -> Any:
    return batch


class _Collate:
    """Picklable collate: packed raw batches pass through, sample lists are collated."""

    def __init__(self, user: Collate | None):
        self.user = user

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, PackedBatch):
            return batch
        return (self.user or collate_samples)(batch)


def _source_unreadable(shards: DatasetShards, exc: OSError) -> SourceError | None:
    """A shard read from the source because its staged copy is missing or not whole (cut
    short, another size than the manifest's), where the source cannot be read either: say
    that in one line (SourceError) rather than a bare FileNotFoundError from a stat, which
    named only the source path and left out why the staged copy was passed by."""
    where = [i for i, loc in enumerate(shards.locations) if loc == exc.filename]
    if not where or not shards.from_source_flags[where[0]]:
        return None
    return SourceError(
        f"shard {shards.relpaths[where[0]]}: its staged copy in {shards.staged_dir} is missing "
        f"or not whole, and the source {exc.filename} cannot be read ({exc.strerror}); "
        "re-run stage-in with the source reachable"
    )


class StagedReader:
    """Local uncompressed tars: read by offset from the mapped dataset index."""

    restarts_workers = False

    def __init__(
        self,
        shards: DatasetShards,
        options: LoaderOptions,
        pipeline: SamplePipeline | None,
        collate_fn: Collate | None,
    ):
        self.locations = shards.locations  # str: pathlib costs 25 us each
        staged = shards.staged_dir
        try:
            self.index, self.skipped_shards = build_flat_index(
                self.locations,
                relpaths=shards.relpaths,
                expected_samples=shards.samples,
                cache_dir=StagedDataset.of(staged).index_dir if staged is not None else None,
                on_error=options.on_error,
                stats=shards.stats,
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            error = _source_unreadable(shards, exc)
            if error is None:
                raise
            raise error from exc
        self.counts = self.index.shard_samples
        self._pipeline = pipeline
        self._collate = collate_fn
        self.sampler: RankBatchSampler | None = None

    def _plan(self) -> RankBatchSampler:
        if self.sampler is None:
            raise RuntimeError("bind() the reader before reading")
        return self.sampler

    def bind(self, layout: WorldLayout, options: PlanOptions, per_rank: int) -> dict[str, Any]:
        self.sampler = RankBatchSampler(self.counts, layout, options, per_rank)
        dataset = StagedTarDataset(self.locations, self.index, self._pipeline)
        return {
            "dataset": dataset,
            "batch_sampler": self.sampler,
            "collate_fn": _Collate(self._collate),
        }

    def num_batches(self, epoch: int) -> int:
        return self._plan().num_batches_in(epoch)

    def start(self, epoch: int, first_batch: int) -> None:
        plan = self._plan()
        plan.epoch, plan.start_batch = epoch, first_batch

    def deliver(self, batches: Iterator[Any], first_batch: int) -> Iterator[Any]:
        return batches  # the sampler already started at first_batch, in plan order

    def resume_elsewhere(self, epoch: int, remaining: RemainingSamples) -> None:
        self._plan().override = (epoch, remaining)

    def use_order(self, epoch: int, spec: StagingSpec | None) -> None:
        self._plan().staging = (epoch, spec) if spec is not None else None

    def elastic_epoch(self) -> int | None:
        override = self._plan().override
        return override[0] if override is not None else None

    def order_settings(self) -> dict[str, Any]:
        return {}  # the plan alone: any worker count reads the same batches


class StreamingReader:
    """Shards streamed front to back, one contiguous range per worker (see ``StreamingPlan``)."""

    restarts_workers = True

    def __init__(
        self,
        shards: DatasetShards,
        options: LoaderOptions,
        pipeline: SamplePipeline,
        collate_fn: Collate | None,
        workers: int,
        layout: WorldLayout | None = None,
    ):
        """``layout``: the world the loader shares samples over, whose ranks count the shards
        with no count in shares (one, alone, where None)."""
        self.locations = list(shards.locations)
        self.skipped_shards: list[str] = []
        counts = list(shards.samples)
        # (each rank counts its share: a count reads the whole shard)
        counted, errors = count_in_shares(
            counts,
            lambda i: count_remote_samples(self.locations[i]),
            lambda i: shards.relpaths[i],
            shards.subset,
            layout or WorldLayout(1),
        )
        for i in sorted(counted.keys() | errors.keys()):
            error = errors.get(i)
            if error is not None and (
                options.on_error != "skip" or not isinstance(error, IntegrityError)
            ):
                raise error
            if error is not None:
                self.skipped_shards.append(shards.relpaths[i])
            counts[i] = counted.get(i, 0)  # a corrupt tar left out, as the staged reader does
        if self.skipped_shards:
            log.warning(
                "skipped %d corrupt shard(s): %s",
                len(self.skipped_shards),
                ", ".join(self.skipped_shards[:5]),
            )
        self.counts = np.asarray(counts, dtype=np.int64)
        self._options = options
        self._pipeline = pipeline
        self._collate = collate_fn
        self._workers = max(1, workers)
        self.plan: StreamingPlan | None = None
        self.dataset: StreamingShards | None = None

    def _bound(self) -> tuple[StreamingPlan, StreamingShards]:
        if self.plan is None or self.dataset is None:
            raise RuntimeError("bind() the reader before reading")
        return self.plan, self.dataset

    def bind(self, layout: WorldLayout, options: PlanOptions, per_rank: int) -> dict[str, Any]:
        self.plan = StreamingPlan(self.counts, layout, options, per_rank, self._workers)
        self.dataset = StreamingShards(
            self.locations,
            self.plan,
            self._pipeline,
            self._collate or collate_samples,
            buffer_samples=self._options.buffer_samples if options.shuffle != "none" else 0,
            on_error=self._options.on_error,
        )
        return {"dataset": self.dataset, "batch_size": None, "collate_fn": _passthrough}

    def num_batches(self, epoch: int) -> int:
        return self._bound()[0].num_batches

    def start(self, epoch: int, first_batch: int) -> None:
        self._bound()[1].configure(epoch, first_batch)

    def deliver(self, batches: Iterator[Any], first_batch: int) -> Iterator[Any]:
        return reorder_batches(batches, self._bound()[0].delivery_order()[first_batch:])

    def resume_elsewhere(self, epoch: int, remaining: RemainingSamples) -> None:
        raise ResumeMismatch(
            ["elastic resume needs data staged with --subset all (the random-access path)"]
        )

    def use_order(self, epoch: int, spec: StagingSpec | None) -> None:
        if spec is not None:
            raise ResumeMismatch(
                ["the state's epoch reads in the staging order, which needs local .tar shards"]
            )

    def elastic_epoch(self) -> int | None:
        return None

    def order_settings(self) -> dict[str, Any]:
        """Each worker streams its own range through its own shuffle buffer: both shape the
        order (a random-access path's order depends on neither), and so does how the ranges
        are cut ("batches": in whole batches; a state saved before, without it, is refused)."""
        buffer = self._options.buffer_samples if self._bound()[0].options.shuffle != "none" else 0
        return {
            "path": "streaming",
            "workers": self._workers,
            "buffer_samples": buffer,
            "worker_ranges": "batches",
        }


def open_reader(
    shards: DatasetShards,
    options: LoaderOptions,
    pipeline: SamplePipeline | None,
    collate_fn: Collate | None,
    workers: int,
    to_tuple: tuple[str, ...] | None,
    layout: WorldLayout | None = None,
) -> Reader:
    """The staged reader when every shard allows random access, else the streaming one; the
    growing reader while stage-in --background still copies (stager_loaders.staging)."""
    if shards.growing:
        from .staging import StagingReader  # imports this module

        if options.force_streaming:
            raise UsageError(
                "force_streaming cannot read a copy stage-in --background is still making"
            )
        return StagingReader(shards, options, pipeline, collate_fn)
    if shards.random_access and not options.force_streaming:
        return StagedReader(shards, options, pipeline, collate_fn)
    pipeline = pipeline or SamplePipeline(None, None, to_tuple)
    return StreamingReader(shards, options, pipeline, collate_fn, workers, layout)
