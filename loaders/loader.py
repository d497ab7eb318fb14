"""``ShardedLoader``: a real ``torch.utils.data.DataLoader`` over staged (or source) shards.

The loader owns what every way of reading shares: where this process sits (the layout), the
epoch and the position in it, the resumable state and the metrics. How batches are formed is a
:class:`stager_loaders.readers.Reader`: the staged reader (local uncompressed tars, random access
by offset) or the streaming one (remote sources, ``.tgz``, staged copies missing).
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Sampler

from stager.errors import ResumeMismatch, StagingStopped, UsageError
from stager.gcpause import collection_paused
from stager.plan.elastic import remaining_after
from stager.plan.ranks import PlanOptions, WorldLayout, fingerprint

from .collective import agree_on_dataset, failing_together
from .dataset import PackedBatch
from .failed import refuse_nothing
from .metrics import LoaderMetrics, batch_length
from .options import (
    DROP_LAST_HINT,
    LEGACY_KEYWORDS,
    LoaderOptions,
    refuse_batch_size,
    to_dataloader,
)
from .orders import EpochOrders
from .readers import Reader, open_reader
from .resolve import DatasetShards, resolve_dataset
from .samples import DecodeSpec, SamplePipeline, make_decoder, tuple_fields, unpack_ragged
from .staging import StagingReader, staging_incomplete
from .state import LoaderState
from .world import agree_per_rank, detect_layout

__all__ = ["ShardedLoader", "LoaderOptions"]

log = logging.getLogger("stager_loaders")


#: The size asked for the workers' result pipe: batches under 1 MiB (``SHARED_MEMORY_MIN_BYTES``
#: in :mod:`stager_loaders.dataset`) cross it pickled. 1 MiB is also Linux's default
#: ``fs.pipe-max-size``, the most an unprivileged process may ask for.
RESULT_PIPE_BYTES = 1 << 20


def _widen_result_pipe(iterator: Any) -> None:
    """Let the workers' result pipe hold a whole pipe-sent batch instead of 64 KiB of it.

    Batches under 1 MiB leave the workers pickled through torch's result queue, a pipe whose
    default 64 KiB made a 256 KB batch cross in four or five write/wake-up rounds between a
    worker and the training process. With 20k samples of ~1 KB and 2 workers, an epoch took
    ~10% less with the wider pipe (medians of 15 alternating runs). Torch has started the
    workers by the time the iterator is returned, so the first prefetched batches may still
    cross the narrow way. Best effort: torch keeps the queue in a private attribute, and a
    lower ``fs.pipe-max-size`` (or a user over ``fs.pipe-user-pages-soft``) refuses; either way
    the loader works as before, without the gain.
    """
    reader = getattr(getattr(iterator, "_worker_result_queue", None), "_reader", None)
    if reader is None or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return  # no workers, a torch that names it differently, or not Linux
    try:
        fcntl.fcntl(reader.fileno(), fcntl.F_SETPIPE_SZ, RESULT_PIPE_BYTES)
    except (OSError, ValueError) as exc:
        log.debug("could not widen the workers' result pipe: %s", exc)


def _whole(value: object) -> bool:
    """An integer (numpy's too), not a bool: DataLoader's ``shuffle=True`` in a positional slot."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _with_legacy(options: LoaderOptions, legacy: dict[str, Any]) -> LoaderOptions:
    """Fold the keywords earlier versions took (``rank=``, ``persistent_workers=``...) in.

    DataLoader's defaults spelled out (``drop_last=False``, ``sampler=None``,
    ``batch_sampler=None``, as a script that swaps the class name keeps them) are what the loader
    does anyway: taken. What would change the plan is refused in one line."""
    if legacy.pop("drop_last", False):
        raise UsageError(DROP_LAST_HINT)
    sampler, batch_sampler = legacy.pop("sampler", None), legacy.pop("batch_sampler", None)
    if sampler is not None or batch_sampler is not None:
        raise UsageError(
            "ShardedLoader plans each rank's batches itself (no overlap, equal counts on every "
            "rank): pass no sampler= or batch_sampler= (a DistributedSampler is not needed)"
        )
    unknown = sorted(set(legacy) - set(LEGACY_KEYWORDS))
    if unknown:
        raise TypeError(f"ShardedLoader() got an unexpected keyword argument {unknown[0]!r}")
    return dataclasses.replace(options, **legacy) if legacy else options


def _ended_by_a_newer_one(inner: Iterator[Any], ended: Callable[[], bool]) -> Iterator[Any]:
    """``inner``'s batches, until ``ended()``: asked before each batch is taken, so an ended
    iterator takes none from the newer one (persistent workers serve both from one queue)."""
    batches = iter(inner)
    while True:
        if ended():
            # Two live iterators shared one position (state_dict counted both, and a second
            # iter() rewound the first): the newer one reads the pass.
            raise UsageError(
                "this iterator of the loader was ended by a newer iter(loader): a loader reads "
                "one pass at a time (its position is what state_dict() saves); build a second "
                "loader to read two at once"
            )
        try:
            batch = next(batches)
        except StopIteration:
            return
        yield batch


class ShardedLoader(DataLoader):
    """Sharded, shuffled, equal-length epochs for every DDP rank; a drop-in DataLoader.

    ``shuffle``: True (seeded, ``options.shuffle_mode``), False, or "global"/"blocked".
    ``decode``: None (raw: every member is a uint8 tensor view, see docs/loader.md), a
    webdataset spec such as "torchrgb"/"rgb8"/"pil", or a callable on the sample dict.
    ``map`` runs on the decoded sample dict before ``to_tuple``. ``even``: "pad" repeats a few
    samples, "drop" drops them, so every rank has the same batches (DataLoader's ``drop_last``
    is ``even="drop"``). Rarer settings (rank and world overrides, worker tuning, where the
    staged copy is) are in :class:`LoaderOptions`; ``rank=``, ``world_size=``,
    ``persistent_workers=`` and ``prefetch_factor=`` are still accepted as keywords.
    DataLoader's ``timeout=``, ``worker_init_fn=``, ``multiprocessing_context=`` and
    ``pin_memory_device=`` are passed on as they are; ``sampler=``, ``batch_sampler=``,
    ``generator=``, ``in_order=False`` and ``drop_last=True`` are refused in one line saying
    what to pass instead (DataLoader's defaults, ``sampler=None``, ``drop_last=False``..., are
    taken). ``loader.sampler.set_epoch`` is ``set_epoch``, as a ``DistributedSampler``'s is
    for a DataLoader.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        batch_size: int = 64,
        num_workers: int = 0,
        *,
        shuffle: bool | str = True,
        seed: int = 0,
        decode: DecodeSpec = None,
        to_tuple: str | Sequence[str] | None = None,
        map: Callable[[Any], Any] | None = None,  # noqa: A002 - the contract's name
        even: str = "pad",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        options: LoaderOptions | None = None,
        **legacy: Any,
    ):
        passed = to_dataloader(legacy)  # (timeout=, worker_init_fn=, multiprocessing_context=)
        if options is not None and not isinstance(options, LoaderOptions):
            raise UsageError(
                f"options must be a LoaderOptions, not {type(options).__name__}: "
                "options=LoaderOptions(...)"
            )
        options = _with_legacy(options or LoaderOptions(), legacy)
        refuse_batch_size(batch_size)
        if not _whole(num_workers):
            raise UsageError(
                f"num_workers must be a whole number >= 0, not {num_workers!r} (ShardedLoader's "
                "third argument is num_workers: pass shuffle= by keyword)"
            )
        if num_workers < 0:
            raise UsageError(f"num_workers must be >= 0, got {num_workers}")
        if not _whole(seed):
            raise UsageError(
                f"seed must be an integer, not {seed!r}: the order is a function of (seed, epoch), "
                "the same on every rank"
            )
        if not -(1 << 63) <= seed < 1 << 64:  # (the order keys take 64 bits of it: 2**64 was 0)
            raise UsageError(f"seed must fit in 64 bits (-2**63 <= seed < 2**64), got {seed}")
        for name, given in (("map", map), ("collate_fn", collate_fn)):
            if given is not None and not callable(given):  # (else a TypeError at the first batch)
                raise UsageError(f"{name} must be callable, not {given!r}")
        if passed.get("timeout") and num_workers == 0:  # (torch: an AssertionError at iter())
            raise UsageError(
                f"timeout={passed['timeout']!r} bounds the wait for a worker's batch: it needs "
                "num_workers >= 1 (with num_workers=0 the batches are made in this process)"
            )
        make_decoder(decode)  # refuse a bad spec now, not in a worker
        if isinstance(shuffle, str) and shuffle not in ("none", "global", "blocked"):
            raise UsageError(f"shuffle must be True, False, 'global' or 'blocked', not {shuffle!r}")
        mode = (
            shuffle if isinstance(shuffle, str) else (options.shuffle_mode if shuffle else "none")
        )
        self.options = options
        self.layout: WorldLayout = detect_layout(
            options.rank,
            options.world_size,
            workers_per_rank=num_workers,
            ranks_per_node=options.ranks_per_node,
        )
        self._to_tuple = tuple_fields(to_tuple)
        self._own_collate = collate_fn is None
        self._epoch, self._skip, self._consumed = 0, 0, 0
        self._iterators = 0  # iter() calls so far: only the newest iterator reads
        self._collected = False
        self._elastic_origin: dict[str, int] | None = None
        self.metrics = LoaderMetrics(log_every=options.log_every)
        raw = decode is None and map is None and collate_fn is None
        pipeline = None if raw else SamplePipeline(decode, map, self._to_tuple)
        # Reading the staged manifest builds a dict per shard and frees it at once; with torch
        # imported (~170k tracked objects) each full collection pass they trigger costs ~0.1 s:
        # three of them, 0.3 s of a 100k-shard start. Nothing built here holds a cycle (see
        # stager.gcpause); the pass the imports left due runs in __iter__, before forking.
        # (a rank failing alone fails every rank: else they wait for it in the collectives)
        with collection_paused(), failing_together(self.layout, source):
            self.shards: DatasetShards = resolve_dataset(
                source, dest=options.dest, name=options.name, on_error=options.on_error
            )
        with collection_paused(), failing_together(self.layout, source):
            self.reader: Reader = open_reader(
                self.shards, options, pipeline, collate_fn, num_workers, self._to_tuple, self.layout
            )
            #: (the reader's list: a streaming reader adds to it as it reads)
            self.skipped_shards: list[str] = self.reader.skipped_shards
            self.skipped_shards[:0] = self.shards.left_out  # found corrupt by stage-in
            self.shard_samples = self.reader.counts
            refuse_nothing(source, self.shard_samples, self.skipped_shards, self.shards.subset)
        self.plan_options = PlanOptions(
            batch_size=batch_size,
            seed=seed,
            shuffle=mode,
            even=even,
            block_samples=options.block_samples,
            subset=self.shards.subset,
        )
        # (else each rank plans its own epoch; under --subset node, the job's fingerprint)
        self._own_fingerprint = fingerprint(self.shards.relpaths, self.shard_samples)
        self.fingerprint = agree_on_dataset(
            self._own_fingerprint,
            self.plan_options.digest(),
            source,
            self.shards.subset,
            self.layout,
        )
        per_rank = agree_per_rank(
            int(self.shard_samples.sum()), self.layout, even, self.plan_options.subset
        )
        # stage-in --background: which order each epoch reads in (stager_loaders.orders)
        self.orders = EpochOrders(self.shards.staging, self.layout, shuffled=mode != "none")
        workers_on = num_workers > 0
        super().__init__(
            **self.reader.bind(self.layout, self.plan_options, per_rank),
            num_workers=num_workers,
            pin_memory=pin_memory,
            # a reader whose workers hold the epoch restarts them each epoch
            persistent_workers=options.persistent_workers
            and workers_on
            and not self.reader.restarts_workers,
            prefetch_factor=options.prefetch_factor if workers_on else None,
            **passed,
        )
        # DataLoader leaves it None beside a batch sampler; code that sizes batches from it
        # (loggers, trainers) reads the loader's (DataLoader refuses a plain assignment).
        object.__setattr__(self, "batch_size", batch_size)
        # (DataLoader refuses a plain assignment of its sampler too)
        object.__setattr__(self, "sampler", _EpochSampler(self.sampler, self))

    # -- epochs -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank; identical on every rank."""
        return self.reader.num_batches(self._epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a resumed epoch keeps its position, any other starts at 0."""
        if epoch != self._epoch:
            self._epoch, self._skip, self._consumed = epoch, 0, 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._iterators += 1  # (an earlier iterator still live is ended: see _deliver)
        start, self._skip = self._skip, 0
        self._consumed = start
        spec = self.orders.begin(
            self._epoch, lambda: staging_incomplete(self.shards.staged_dir, self.shards.staging)
        )
        self.reader.use_order(self._epoch, spec)
        self.reader.start(self._epoch, start)
        if not start and not len(self) and int(self.shard_samples.sum()):
            log.warning(  # (as DataLoader(drop_last=True) would, but not without a word)
                "epoch %d has no batch on any rank: a rank's share is under batch_size=%d and "
                "even='drop' drops it; use even='pad' or a smaller batch_size",
                self._epoch,
                self.plan_options.batch_size,
            )
        if self.num_workers > 0 and not self._collected:
            # Once, before the first workers are forked: a full collection that falls due
            # right after the fork (importing torch leaves one due) makes the parent write to
            # the header of every object it shares with the workers, copying those pages; done
            # here it costs one pass (~0.1 s) instead of ~0.25 s of the first batch at 10k.
            self._collected = True
            gc.collect()
        inner = super().__iter__()
        _widen_result_pipe(inner)
        return self._deliver(self.reader.deliver(inner, start), self._iterators)

    def _deliver(self, inner: Iterator[Any], generation: int) -> Iterator[Any]:
        asked = time.perf_counter()  # from the loop asking for a batch to its arrival: the wait
        staging = self.reader if isinstance(self.reader, StagingReader) else None
        try:
            for batch in _ended_by_a_newer_one(inner, lambda: generation != self._iterators):
                self._consumed += 1  # before the caller sees it: a checkpoint in the step has it
                if isinstance(batch, PackedBatch):
                    out = batch.unpack(self._to_tuple)
                elif self._own_collate:  # collate_samples packed ragged tensors for the trip
                    out = unpack_ragged(batch)
                else:
                    out = batch
                if staging is not None:
                    staging.look()
                    wait_s, waits = staging.wait_totals()
                    self.metrics.staging_wait_s, self.metrics.shards_waited = wait_s, waits
                self.metrics.record(time.perf_counter() - asked, batch_length(out))
                yield out
                asked = time.perf_counter()
            if staging is not None:
                staging.look(final=True)
        except StagingStopped as exc:
            if staging is None:
                raise
            # from a worker, torch wraps it in a traceback: say it in one line
            raise StagingStopped(_said_by_worker(exc) or staging.stopped_line()) from None

    # -- resume -------------------------------------------------------------------------------
    def _state(self, consumed: int) -> LoaderState:
        elastic = self._elastic_origin if self.reader.elastic_epoch() == self._epoch else None
        return LoaderState(
            epoch=self._epoch,
            batches_consumed=consumed,
            batches_per_epoch=len(self),
            seed=self.plan_options.seed,
            batch_size=self.plan_options.batch_size,
            world_size=self.layout.world_size,
            num_nodes=self.layout.num_nodes,
            ranks_per_node=self.layout.ranks_per_node,
            shuffle=self.plan_options.shuffle,
            even=self.plan_options.even,
            subset=self.plan_options.subset,
            fingerprint=self.fingerprint,
            num_samples=int(self.shard_samples.sum()),
            elastic_from=elastic,
            staging_order=self.orders.recorded(self._epoch),
            order=self._order_settings(),
        )

    def _order_settings(self) -> dict[str, Any]:
        settings = self.reader.order_settings()
        if self.plan_options.shuffle == "blocked":
            settings = {**settings, "block_samples": self.plan_options.block_samples}
        return settings

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: epoch and batches consumed, plus what must match to resume."""
        return self._state(max(self._consumed, self._skip)).to_dict()

    def load_state_dict(self, state: dict[str, Any], *, elastic: bool = False) -> None:
        """Continue mid-epoch where ``state`` stopped; refuse (ResumeMismatch) a state that differs.

        ``elastic=True`` accepts a state saved by a world of another size: the samples that
        epoch still owed are spread over this world (none repeated, none lost, except the
        usual pad/drop evening), and later epochs follow this world's normal plan.
        """
        saved = LoaderState.from_dict(state)
        if saved.subset == "node" and saved.fingerprint == self._own_fingerprint:
            # (saved before states recorded the job's fingerprint: this node's own shards)
            saved = dataclasses.replace(saved, fingerprint=self.fingerprint)
        saved.check_resumable_by(self._state(0), elastic=elastic)
        # Checked before anything changes: a refused state left the loader at its epoch and
        # position (an epoch of no batches after batches_consumed=999).
        if saved.epoch < 0 or saved.batches_consumed < 0:
            raise ResumeMismatch(
                [f"epoch {saved.epoch} and batches_consumed {saved.batches_consumed} must be >= 0"]
            )
        resumes_here = saved.world_size == self.layout.world_size
        if resumes_here and saved.staging_order is None and saved.elastic_from is None:
            batches = self.reader.num_batches(saved.epoch)
            if saved.batches_consumed > batches:
                raise ResumeMismatch(
                    [f"batches_consumed {saved.batches_consumed} outside 0..{batches}"]
                )
        if saved.staging_order is not None and saved.world_size != self.layout.world_size:
            raise ResumeMismatch(
                [
                    "the state's epoch reads in the staging order of stage-in --background, "
                    "which is cut for its world size: resume it on "
                    f"{saved.world_size} ranks (later epochs may change the world)"
                ]
            )
        self.orders.restore(saved.epoch, saved.staging_order, saved.batches_consumed)
        origin = saved.elastic_from
        if origin is not None and saved.world_size != self.layout.world_size:
            raise ResumeMismatch(
                [
                    "the state was saved inside an epoch already resumed elastically on "
                    f"{saved.world_size} ranks; changing the world again mid-epoch is not "
                    "supported: resume on that world size"
                ]
            )
        if origin is None and saved.world_size != self.layout.world_size:
            origin = {
                "num_nodes": saved.num_nodes,
                "ranks_per_node": saved.ranks_per_node,
                "batches_consumed": saved.batches_consumed,
            }
            skip = 0
        else:
            skip = saved.batches_consumed
        if origin is not None:
            self._redistribute(saved.epoch, origin)
        self._epoch, self._skip, self._consumed = saved.epoch, skip, skip
        if not 0 <= skip <= len(self):
            raise ResumeMismatch([f"batches_consumed {skip} outside 0..{len(self)}"])

    def _redistribute(self, epoch: int, origin: dict[str, int]) -> None:
        if self.plan_options.subset != "all":
            raise ResumeMismatch(
                ["elastic resume needs data staged with --subset all (nodes hold every shard)"]
            )
        remaining = remaining_after(
            self.shard_samples,
            origin["num_nodes"],
            origin["ranks_per_node"],
            epoch=epoch,
            options=self.plan_options,
            batches_consumed=origin["batches_consumed"],
        )
        self.reader.resume_elsewhere(epoch, remaining)
        self._elastic_origin = dict(origin)


class _EpochSampler(Sampler[Any]):
    """``loader.sampler``: DataLoader's own sampler, plus the ``set_epoch`` of a
    ``DistributedSampler``, which tells the loader the epoch.

    DDP scripts call ``loader.sampler.set_epoch(epoch)`` (an AttributeError on the
    ``SequentialSampler`` DataLoader leaves beside a batch sampler), and Lightning, Accelerate
    and the like tell a loader the epoch only that way: each epoch of a ShardedLoader handed to
    ``Trainer.fit`` read epoch 0's order again, without a word. (A weak reference: no cycle.)
    """

    def __init__(self, inner: Any, loader: ShardedLoader):
        self.inner = inner
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _said_by_worker(exc: StagingStopped) -> str | None:
    """The one line a reader raised, out of the traceback torch wraps a worker's error in
    (its last line, ``stager.errors.StagingStopped: ...``), or None where it is not there."""
    text = str(exc).strip()
    if "\n" not in text:
        return text or None
    prefix = f"{StagingStopped.__module__}.{StagingStopped.__qualname__}: "
    last = text.rsplit("\n", 1)[-1]
    return last.removeprefix(prefix) if last.startswith(prefix) else None
