"""``ShardedLoader``: a real ``torch.utils.data.DataLoader`` over staged (or source) shards.

Two paths, chosen per dataset:

* **staged / local** (every shard a local uncompressed tar): a map-style dataset read by byte
  offset plus a rank-aware batch sampler. Batches arrive in plan order whatever the worker
  count, so ``len(loader)`` is exact and resume is "skip the first k batches".
* **streaming** (a remote source, ``.tgz`` shards, or missing staged copies read from a remote
  source): a webdataset tar stream per worker over the same kind of plan, re-ordered in the
  main process so that resume is exact too (see :mod:`stager_loaders.streaming`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from stager_loaders.dataset import PackedBatch, StagedTarDataset
from stager_loaders.errors import ResumeMismatch
from stager.shards.loader_index import build_flat_index
from stager_loaders.metrics import LoaderMetrics, batch_length
from stager_loaders.resolve import DatasetShards, resolve_dataset
from stager_loaders.sampler import RankBatchSampler
from stager_loaders.samples import DecodeSpec, SamplePipeline, collate_samples, make_decoder
from stager_loaders.state import LoaderState
from stager_loaders.streaming import StreamingShards, count_remote_samples, reorder_batches
from stager_loaders.world import detect_layout
from stager.errors import UsageError
from stager.plan.elastic import remaining_after
from stager.plan.ranks import PlanOptions, WorldLayout, fingerprint, samples_per_rank
from stager.plan.streaming import StreamingPlan

__all__ = ["ShardedLoader", "LoaderOptions"]

log = logging.getLogger("stager_loaders")


@dataclass(frozen=True)
class LoaderOptions:
    """Less common knobs, grouped so the constructor keeps the DataLoader-like signature."""

    dest: str | None = (
        None  # stage-in's --dest (default: $STAGER_DEST, /scratch/$SLURM_JOB_ID, ...)
    )
    name: str | None = None  # stage-in's --name
    on_error: str = "raise"  # "raise" or "skip" for corrupt/truncated shards
    shuffle_mode: str = "global"  # "global" or "blocked" when shuffle=True
    block_samples: int = 4096  # window of the blocked shuffle
    buffer_samples: int = 1000  # shuffle buffer per worker on the streaming path
    ranks_per_node: int | None = None  # default: from Slurm/torchrun
    force_streaming: bool = (
        False  # read local shards through the streaming path (benchmarks, tests)
    )
    log_every: int = 0  # log data-wait time and samples/s every N steps (logger "loaders"); 0: off


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


def _passthrough(batch: Any) -> Any:
    return batch


class _Collate:
    """Picklable collate: packed raw batches pass through, sample lists are collated."""

    def __init__(self, user: Callable[[list[Any]], Any] | None):
        self.user = user

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, PackedBatch):
            return batch
        return (self.user or collate_samples)(batch)


class ShardedLoader(DataLoader):
    """Sharded, shuffled, equal-length epochs for every DDP rank; a drop-in DataLoader.

    ``shuffle``: True (seeded, ``options.shuffle_mode``), False, or "global"/"blocked".
    ``decode``: None (raw: every member is a uint8 tensor view, see docs/loader.md), a
    webdataset spec such as "torchrgb"/"rgb8"/"pil", or a callable on the sample dict.
    ``map`` runs on the decoded sample dict before ``to_tuple``.
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
        to_tuple: Sequence[str] | None = None,
        map: Callable[[Any], Any] | None = None,  # noqa: A002 - the contract's name
        even: str = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        options: LoaderOptions = LoaderOptions(),
    ):
        if options.on_error not in ("raise", "skip"):
            raise UsageError(f"on_error must be 'raise' or 'skip', not {options.on_error!r}")
        make_decoder(decode)  # refuse a bad spec now, not in a worker
        mode = (
            shuffle if isinstance(shuffle, str) else (options.shuffle_mode if shuffle else "none")
        )
        layout = detect_layout(
            rank, world_size, workers_per_rank=num_workers, ranks_per_node=options.ranks_per_node
        )
        self.layout: WorldLayout = layout
        self.shards: DatasetShards = resolve_dataset(source, dest=options.dest, name=options.name)
        self.skipped_shards: list[str] = []
        self._to_tuple = tuple(to_tuple) if to_tuple is not None else None
        self._epoch = 0
        self._skip = 0
        self._consumed = 0
        self._elastic_origin: dict[str, int] | None = None
        self._streaming = options.force_streaming or not self.shards.random_access
        self.metrics = LoaderMetrics(log_every=options.log_every)
        relpaths = [s.relpath for s in self.shards.shards]
        locations = [Path(s.location) for s in self.shards.shards] if not self._streaming else []
        packed = decode is None and map is None and collate_fn is None
        pipeline = None if packed else SamplePipeline(decode, map, self._to_tuple)

        if not self._streaming:
            staged = self.shards.staged_dir
            index, self.skipped_shards = build_flat_index(
                locations,
                relpaths=relpaths,
                expected_samples=[s.samples for s in self.shards.shards],
                cache_dir=staged / ".stager" / "index" if staged is not None else None,
                on_error=options.on_error,
            )
            counts = index.shard_samples
        else:
            counts = np.asarray(
                [
                    s.samples if s.samples is not None else count_remote_samples(s.location)
                    for s in self.shards.shards
                ],
                dtype=np.int64,
            )
        self.plan_options = PlanOptions(
            batch_size=batch_size,
            seed=seed,
            shuffle=mode,
            even=even,
            block_samples=options.block_samples,
            subset=self.shards.subset,
        )
        self.shard_samples = counts
        self.fingerprint = fingerprint(relpaths, counts.tolist())
        per_rank = self._agree_per_rank(int(counts.sum()))
        common = dict(
            num_workers=num_workers,
            pin_memory=pin_memory,
            # streaming workers hold the epoch in their dataset copy, so they are restarted per epoch
            persistent_workers=persistent_workers and num_workers > 0 and not self._streaming,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
        )
        if not self._streaming:
            self.batch_plan = RankBatchSampler(counts, layout, self.plan_options, per_rank)
            dataset = StagedTarDataset(locations, index, pipeline)
            super().__init__(
                dataset, batch_sampler=self.batch_plan, collate_fn=_Collate(collate_fn), **common
            )
            self._num_batches = len(self.batch_plan)
        else:
            self.stream_plan = StreamingPlan(
                counts, layout, self.plan_options, per_rank, max(1, num_workers)
            )
            dataset = StreamingShards(
                [s.location for s in self.shards.shards],
                self.stream_plan,
                pipeline or SamplePipeline(None, None, self._to_tuple),
                collate_fn or collate_samples,
                buffer_samples=options.buffer_samples if mode != "none" else 0,
                on_error=options.on_error,
            )
            super().__init__(dataset, batch_size=None, collate_fn=_passthrough, **common)
            self._num_batches = self.stream_plan.num_batches

    def _agree_per_rank(self, local_total: int) -> int:
        """Samples per rank; for node subsets every node must agree (one all_reduce)."""
        if self.plan_options.subset != "node":
            return samples_per_rank(local_total, self.layout, self.plan_options.even)
        share = samples_per_rank(
            [local_total], WorldLayout(1, self.layout.ranks_per_node), self.plan_options.even
        )
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # NCCL reduces only GPU tensors; gloo (and the rest) CPU ones
            on_gpu = dist.get_backend() == "nccl"
            value = torch.tensor([share], dtype=torch.int64, device="cuda" if on_gpu else "cpu")
            op = dist.ReduceOp.MIN if self.plan_options.even == "drop" else dist.ReduceOp.MAX
            dist.all_reduce(value, op=op)
            return int(value.item())
        if self.layout.num_nodes > 1:
            raise UsageError(
                "this dataset was staged with --subset node, so nodes hold different samples; "
                "initialise torch.distributed before creating the loader so nodes agree on the epoch length"
            )
        return share

    # -- epochs -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank; identical on every rank."""
        return len(self.batch_plan) if not self._streaming else self._num_batches

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a resumed epoch keeps its position, any other starts at 0."""
        if epoch != self._epoch:
            self._epoch, self._skip, self._consumed = epoch, 0, 0
        if not self._streaming:
            self.batch_plan.epoch = epoch  # len() follows the epoch (an elastic epoch differs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        start, self._skip = self._skip, 0
        self._consumed = start
        if self._streaming:
            self.dataset.configure(self._epoch, start)  # type: ignore[attr-defined]
        else:
            self.batch_plan.epoch, self.batch_plan.start_batch = self._epoch, start
        inner = super().__iter__()
        _widen_result_pipe(inner)
        if self._streaming:
            inner = reorder_batches(inner, self.stream_plan.delivery_order()[start:])
        return self._deliver(inner)

    def _deliver(self, inner: Iterator[Any]) -> Iterator[Any]:
        asked = (
            time.perf_counter()
        )  # from the loop asking for a batch to its arrival: the data wait
        for batch in inner:
            self._consumed += (
                1  # counted before the caller sees it: a checkpoint taken in the step includes it
            )
            out = batch.unpack(self._to_tuple) if isinstance(batch, PackedBatch) else batch
            self.metrics.record(time.perf_counter() - asked, batch_length(out))
            yield out
            asked = time.perf_counter()

    # -- resume -------------------------------------------------------------------------------
    def _state(self, consumed: int) -> LoaderState:
        elastic = None
        if (
            not self._streaming
            and self.batch_plan.override is not None
            and self.batch_plan.override[0] == self._epoch
        ):
            elastic = self._elastic_origin
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
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: epoch and batches consumed, plus what must match to resume."""
        return self._state(max(self._consumed, self._skip)).to_dict()

    def load_state_dict(self, state: dict[str, Any], *, elastic: bool = False) -> None:
        """Continue mid-epoch where ``state`` stopped; refuses (ResumeMismatch) a state that does not fit.

        ``elastic=True`` accepts a state saved by a world of another size: the samples that
        epoch still owed are spread over this world (none repeated, none lost, except the
        usual pad/drop evening), and later epochs follow this world's normal plan.
        """
        saved = LoaderState.from_dict(state)
        saved.check_resumable_by(self._state(0), elastic=elastic)
        origin = saved.elastic_from
        if origin is not None and saved.world_size != self.layout.world_size:
            raise ResumeMismatch(
                [
                    f"the state was saved inside an epoch already resumed elastically on {saved.world_size} ranks; "
                    "changing the world again mid-epoch is not supported: resume on that world size"
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
        if not self._streaming:
            self.batch_plan.epoch = saved.epoch
        if not 0 <= skip <= len(self):
            raise ResumeMismatch([f"batches_consumed {skip} outside 0..{len(self)}"])

    def _redistribute(self, epoch: int, origin: dict[str, int]) -> None:
        if self._streaming or self.plan_options.subset != "all":
            raise ResumeMismatch(
                ["elastic resume needs staged data staged with --subset all (the fast path)"]
            )
        remaining = remaining_after(
            self.shard_samples,
            origin["num_nodes"],
            origin["ranks_per_node"],
            epoch=epoch,
            options=self.plan_options,
            batches_consumed=origin["batches_consumed"],
        )
        self.batch_plan.override = (epoch, remaining)
        self._elastic_origin = dict(origin)
