"""The streaming path: remote sources and compressed shards, read front to back.

Random access is impossible on a gzip stream or too slow over a network, so here the plan is
coarser than on staged data, but still a pure function of (counts, layout, epoch, seed):

* shards are visited in a seeded order and their samples concatenated; the even-ed sequence is
  cut into one contiguous range per rank and one per worker (``StreamingPlan``);
* each worker streams its range (skipping the samples before it by counting tar members, never
  decoding them), passes samples through a bounded shuffle buffer seeded by (seed, epoch, rank,
  worker), and yields batches tagged with (worker, batch number);
* the main process re-emits batches in the plan's round-robin order (``reorder_batches``), so
  the sequence does not depend on worker timing, and resume after ``k`` batches means: each
  worker skips the batches of its own that were delivered (read, shuffled, not decoded).

Limits (see docs/loader.md): skipping re-reads the skipped bytes; ``on_error="skip"`` ends the
bad shard's range early, which shortens that rank's epoch.
"""

from __future__ import annotations

import gzip
import logging
import tarfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from stager.errors import IntegrityError, SourceError, one_line
from stager.plan.order import seeded_rng
from stager.plan.streaming import StreamingPlan
from stager.shards.members import SampleRuns, split_message
from stager.shards.tarindex import RESTAGE_HELPS, count_samples, is_compressed, split_key

from .samples import SamplePipeline

__all__ = [
    "StreamingShards",
    "count_remote_samples",
    "reorder_batches",
    "iter_tar_samples",
]

log = logging.getLogger("stager_loaders")


def _open(location: str) -> Any:
    import fsspec

    try:
        return _SourceReads(fsspec.open(location, "rb").open(), location)
    except FileNotFoundError as exc:
        raise SourceError(
            f"shard not found: {location}; re-run stage-in or check the source"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - a store's own errors (botocore's are no OSError)
        raise SourceError(
            f"cannot open shard {location}: {one_line(exc)}; check the source"
        ) from exc


class _SourceReads:
    """A shard's handle whose failed reads are the source's (:class:`SourceError`), never the
    tar's: a store refusing an object (403 AccessDenied, 503 SlowDown, a dropped endpoint) was
    called a corrupt shard ("re-create this shard"), and with ``on_error='skip'`` the loader
    left it out and trained without it."""

    def __init__(self, handle: Any, location: str):
        self.handle = handle
        self.location = location
        self.name = getattr(handle, "name", location)
        self.mode = "rb"

    def read(self, size: int = -1) -> bytes:
        try:
            return self.handle.read(size)
        except Exception as exc:  # noqa: BLE001 - whatever the store raised
            raise SourceError(
                f"cannot read shard {self.location}: {one_line(exc)}; check the source and "
                "its credentials"
            ) from exc

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> _SourceReads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def iter_tar_samples(location: str) -> Iterator[dict[str, Any]]:
    """Samples of one tar/tgz stream as dicts of bytes, grouped by key the way webdataset does."""
    last_name = "<start of archive>"
    current: dict[str, Any] | None = None
    runs = SampleRuns()

    def ended(sample: dict[str, Any]) -> dict[str, Any]:
        if runs.apart(sample["__key__"], set(sample) - {"__key__", "__shard__"}):
            message = split_message(sample["__key__"])
            raise IntegrityError(f"{location}: {message}, or pass on_error='skip'")
        return sample

    with _open(location) as handle:
        try:
            # gzip's own reader, not tarfile's "r|gz": that stops at the end of the first gzip
            # member, and a shard written by a parallel gzip (bgzip, pigz -i, `cat a.gz b.gz`)
            # has several; the indexer reads them all (stager.shards.tarindex), so must this.
            gzipped = is_compressed(location)
            source = gzip.GzipFile(fileobj=handle, mode="rb") if gzipped else handle
            with tarfile.open(fileobj=source, mode="r|" if gzipped else "r|*") as stream:
                for info in stream:
                    last_name = info.name
                    parts = split_key(info.name) if info.isfile() else None
                    if parts is None:
                        continue
                    key, ext = parts
                    if current is not None and current["__key__"] != key:
                        yield ended(current)
                        current = None
                    if current is None:
                        current = {"__key__": key, "__shard__": location}
                    elif ext in current:
                        raise IntegrityError(
                            f"{location}: member {info.name!r} appears twice in one sample; "
                            "fix the shard, or pass on_error='skip'"
                        )
                    member = stream.extractfile(info)
                    current[ext] = member.read() if member is not None else b""
        except SourceError:
            raise  # (the store's failure, not the shard's: SourceError is an OSError)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise IntegrityError(
                f"{location}: corrupt or truncated after member {last_name!r} ({exc}); "
                f"re-create this shard ({RESTAGE_HELPS}), or pass on_error='skip'"
            ) from exc
    if current is not None:
        yield ended(current)


def count_remote_samples(location: str) -> int:
    """Samples in a shard without a manifest count: tar headers read once, payloads skipped."""
    if "://" not in location:
        return count_samples(location)
    return sum(1 for _ in iter_tar_samples(location))


class StreamingShards(IterableDataset):
    """Each worker streams its ranges and yields ``(worker, batch number, batch)``."""

    def __init__(
        self,
        locations: Sequence[str],
        plan: StreamingPlan,
        pipeline: SamplePipeline,
        collate: Callable[[list[Any]], Any],
        *,
        buffer_samples: int = 1000,
        on_error: str = "raise",
    ):
        self.locations = list(locations)
        self.plan = plan
        self.pipeline = pipeline
        self.collate = collate
        self.buffer_samples = buffer_samples
        self.on_error = on_error
        self.epoch = 0
        self.skip_batches = [0] * plan.workers

    def configure(self, epoch: int, start_batch: int) -> None:
        """Set the epoch and the batches already delivered (per worker) before workers start."""
        self.epoch = epoch
        done = Counter(w for w, _ in self.plan.delivery_order()[:start_batch])
        self.skip_batches = [done.get(w, 0) for w in range(self.plan.workers)]

    def _raw(self, worker: int) -> Iterator[dict[str, Any]]:
        for shard, first, stop in self.plan.segments(self.epoch, worker):
            location = self.locations[shard]
            planned = int(self.plan.counts[shard])
            try:
                # Held to the count the plan was made from, as a staged shard is: a shard
                # changed since (an object rewritten) gave a rank fewer samples, or dropped
                # the ones past the count, without a word.
                read = 0
                for sample in iter_tar_samples(location):
                    if read >= stop:
                        if stop == planned:  # (one past the count: more than planned)
                            raise _count_changed(location, f"more than {planned}", planned)
                        break
                    if read >= first:
                        yield sample
                    read += 1
                if read < stop:
                    raise _count_changed(location, str(read), planned)
            except IntegrityError:
                if self.on_error != "skip":
                    raise
                log.warning("skipping the rest of corrupt shard %s", location)

    def _shuffled(self, samples: Iterable[dict[str, Any]], worker: int) -> Iterator[dict[str, Any]]:
        if self.buffer_samples <= 0:
            yield from samples
            return
        # its own stream: (seed, epoch, tag, rank, worker) never collides with another worker's
        rng = seeded_rng(self.plan.options.seed, self.epoch, 3, self.plan.layout.rank, worker)
        buffer: list[dict[str, Any]] = []
        for sample in samples:
            buffer.append(sample)
            if len(buffer) >= self.buffer_samples:
                pick = int(rng.integers(len(buffer)))
                buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
                yield buffer.pop()
        while buffer:
            pick = int(rng.integers(len(buffer)))
            buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
            yield buffer.pop()

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        size = self.plan.options.batch_size
        limit = self.plan.worker_batches[worker]
        skip_samples = self.skip_batches[worker] * size
        number, batch = self.skip_batches[worker], []
        for i, sample in enumerate(self._shuffled(self._raw(worker), worker)):
            if i < skip_samples:
                continue  # resume: delivered before the checkpoint; read but never decoded
            batch.append(self.pipeline(sample))
            if len(batch) == size:
                yield worker, number, self.collate(batch)
                number, batch = number + 1, []
        if batch and number < limit:
            yield worker, number, self.collate(batch)


def _count_changed(location: str, held: str, planned: int) -> IntegrityError:
    return IntegrityError(
        f"{location}: holds {held} samples but the plan counted {planned}: the shard changed "
        "since it was counted (re-run stager index or stage-in), or pass on_error='skip'"
    )


def reorder_batches(
    tagged: Iterable[tuple[int, int, Any]], expected: Sequence[tuple[int, int]]
) -> Iterator[Any]:
    """Yield batches in ``expected`` order whatever order workers produced them in.

    Torch already delivers round robin, so the buffer holds about one batch per worker; it
    only matters after a resume, when workers have different numbers of batches left.
    """
    pending: dict[tuple[int, int], Any] = {}
    position = 0
    for worker, number, batch in tagged:
        pending[(worker, number)] = batch
        while position < len(expected) and expected[position] in pending:
            yield pending.pop(expected[position])
            position += 1
    if pending or position < len(expected):
        log.warning(
            "streaming epoch ended after %d of %d batches "
            "(a shard was skipped or shorter than counted)",
            position,
            len(expected),
        )
    for key in sorted(pending):
        yield pending.pop(key)
