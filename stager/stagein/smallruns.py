"""Small local shards copied in runs: one compiled call and one pass of bookkeeping per run.

Why: the copier's Python per shard (the retry wrapper, the report, the journal line, the
stream controller, the progress) costs ~60-90 us, and one interpreter runs it one thread at
a time. From a memory-speed source that, not the bytes, bounded stage-in: 10,000 shards of
20 KB took 0.85 s to copy where ``cp -r`` took 0.27 s, however many cores the job had. A copy
thread now takes a run of shards from the feed (:class:`RunLength` of them), copies the small
ones with :func:`stager.storage.copyrun.copy_run` and books them together.

Runs grow only while shards are quick: :class:`RunLength` sizes a take to what copies within
:data:`RUN_BUDGET_S`. Behind a filesystem where an open is a round trip a shard takes
milliseconds, a take is one shard, and the copy is the one-by-one path with its many streams,
retries and first-byte timing, as before. Anything a run cannot do plainly (a shard that
fails, changed, or does not match its manifest) goes the one-by-one way too, whose errors say
what is wrong.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from stager.shards.tarnative import available as native_walk_available
from stager.shards.tarparse import TarSampleCounter
from stager.stagein.plan import CopyItem
from stager.storage import copyrun
from stager.storage.copy import CopyResult
from stager.storage.copyrun import RunJob
from stager.storage.paths import discard

if TYPE_CHECKING:
    from stager.stagein.copier import Copier

__all__ = ["RunLength", "SmallRuns", "RUN_BUDGET_S", "MAX_RUN"]

#: How long a take of the feed should copy for: short enough that a Ctrl-C, the stream
#: controller and the other threads are not kept waiting, long enough to spread the
#: bookkeeping over dozens of small shards.
RUN_BUDGET_S = 0.004
#: The most shards one take hands a copy thread.
MAX_RUN = 64


class RunLength:
    """How many items a copy thread takes from the feed at once: doubled after each copy
    while its shards were quick, cut to what fits :data:`RUN_BUDGET_S` when they were not
    (to one behind a slow filesystem). Threads share it; a lost update only delays a step."""

    def __init__(self, budget_s: float = RUN_BUDGET_S, most: int = MAX_RUN) -> None:
        self.budget_s, self.most = budget_s, most
        self.length = 1

    def __call__(self) -> int:
        return self.length

    def timed(self, seconds_per_shard: float) -> None:
        """A copy's time per shard (a run's, or one shard's)."""
        fits = int(self.budget_s / seconds_per_shard) if seconds_per_shard > 0 else self.most
        self.length = max(1, min(self.most, 2 * self.length, fits))


class SmallRuns:
    """A copier's runs of small shards; None from :meth:`of` where it can have none."""

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.block_bytes = copier.options.block_bytes
        self.count = copier.options.count_samples
        # Where samples are counted the run feeds each shard to its compiled walk: built into
        # the pump, and on for the tar walk too (STAGER_NATIVE_TAR, a UTF-8 file system).
        self.walks = copyrun.walks() and native_walk_available()
        self.made: set[str] = set()  # scratch directories known to exist (_make_directories)

    @classmethod
    def of(cls, copier: Copier) -> SmallRuns | None:
        """Runs for a local source copied straight to scratch, without a bandwidth cap: the
        node cache, a throttle and object stores take the one-by-one path."""
        plain = copier.source.is_local and copier.cache is None and copier.throttle is None
        return cls(copier) if plain and copyrun.available() else None

    def fits(self, item: CopyItem) -> bool:
        """Whether ``item`` can be copied in a run (else one by one)."""
        if not copyrun.fits(item.size, item.want_hash, self.block_bytes):
            return False
        return not self.count or (item.target.endswith(".tar") and self.walks)

    def copy(self, items: list[CopyItem]) -> None:
        """Copy ``items``: in runs, each shard a run cannot take one by one."""
        copier = self.copier
        while len(items) > 1:
            items = [item for item in items if copier.still_wanted(item)]  # (scratch filled?)
            if len(items) < 2:
                break
            copier.slots.take()
            copier.halt.check()
            started, cpu_started = time.perf_counter(), time.process_time()
            counters = [TarSampleCounter() if self.count else None for _ in items]
            results = self._run(items, counters)
            elapsed = time.perf_counter() - started
            copied = sum(1 for result in results if result is not None)
            if copied:  # (the others are timed one by one)
                cores = (time.process_time() - cpu_started) / elapsed if elapsed > 0 else 0.0
                copier.slots.finished(*_per_shard(results), cores, files=copied)
                copier.run_length.timed(elapsed / copied)
            for item, result in zip(items, results, strict=False):
                if result is None:
                    copier.copy_prepared(item)
            items = items[len(results) :]
        if items:
            copier.copy_prepared(items[0])

    def _run(
        self, items: list[CopyItem], counters: list[TarSampleCounter | None]
    ) -> list[CopyResult | None]:
        """Copy a run, publish and book what it copied; a result per item reached, None where
        that item is left to the one-by-one path.

        The compiled run checks each copy (its size, hash and, walked, its sample count) and
        renames it where no free-space verdict is pending; else the copies go to the gate,
        which holds them until the verdict, as one-by-one copies are."""
        copier = self.copier
        # renamed as soon as checked where no free-space verdict is pending (nor refused one)
        publish = copier.sizing is None or copier.sizing.gate.passed
        jobs = [
            RunJob(
                item.shard.path,
                item.target,
                item.size or 0,
                item.want_hash,
                counter,
                item.want_samples,  # (no node cache here: the manifest's is the count known)
            )
            for item, counter in zip(items, counters, strict=True)
        ]
        self._make_directories(jobs)
        try:
            results = copyrun.copy_run(
                jobs,
                block_bytes=self.block_bytes,
                fsync=copier.options.fsync,
                budget_s=RUN_BUDGET_S,
                publish=publish,
            )
        except Exception:  # noqa: BLE001 - (an audit hook's refusal, no memory): each shard is
            return [None] * len(items)  # copied one by one, which reports what went wrong

        copied = [i for i, result in enumerate(results) if result is not None]
        published = True
        if not publish:
            try:
                pairs = [(jobs[i].partial, jobs[i].final) for i in copied]
                published, errors = copier.publish_run(pairs)
            except BaseException:
                for i in copied:
                    discard(jobs[i].partial)
                raise
            for i, error in zip(copied, errors, strict=True):
                if error is not None:
                    results[i] = None  # the one-by-one copy says what is wrong
        booked = [
            (items[i], result, counters[i])
            for i, result in enumerate(results)
            if result is not None
        ]
        copier.book_run(booked, published)  # (journaled: a stop from here on keeps them)
        copier.on_bytes(sum(result.size for _, result, _ in booked))  # (stopped: CopierStopped)
        return results

    def _make_directories(self, jobs: list[RunJob]) -> None:
        """Make the partials' directories not made yet (a run ends at a partial it cannot
        create, and one shard per directory would end every run at its first)."""
        for job in jobs:
            directory = job.final.rpartition(os.sep)[0]  # (the partial's: ~0.6 us less a shard)
            if directory not in self.made:
                with contextlib.suppress(OSError):  # (the copy says what is wrong with it)
                    os.makedirs(directory, exist_ok=True)
                    self.made.add(directory)


def _per_shard(results: list[CopyResult | None]) -> tuple[float, float]:
    """The stream controller's timings for a run: the mean first-byte time of its shards (the
    opens: round trips where the source is remote) and their mean whole time (the reads and
    writes: CPU where it is memory-speed, which the controller then spreads over the cores)."""
    copied = [result for result in results if result is not None]
    if not copied:
        return 0.0, 0.0
    first = sum(result.first_byte_s for result in copied) / len(copied)
    return first, sum(result.seconds for result in copied) / len(copied)
