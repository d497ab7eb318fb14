"""Copy a node's planned shards: adaptive streams, a bandwidth cap, retries, verified publication.

Copy threads (started as needed) hold a stream slot, then take the next shard; the
:class:`StreamController` sets the slots. Each copy is verified and renamed by :func:`copy_file`,
its tar headers parsed in flight (:class:`TarSampleCounter`). Failures become report lines.

Shards walked without a manifest are sized while they copy (:mod:`stager.stagein.sizing`) and
stay ``.partial`` until the free-space check on those sizes has passed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, TextIO

from stager.errors import ShardFailure, one_line
from stager.shards.manifest import ManifestEntry
from stager.shards.tarparse import TarSampleCounter
from stager.stagein.feed import ItemFeed
from stager.stagein.journal import Journal
from stager.stagein.oneshard import copy_one
from stager.stagein.options import StageInOptions
from stager.stagein.pacing import Halt
from stager.stagein.plan import CopyItem, CopyOutcome, LocalPlan, count_samples_of
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport
from stager.stagein.settle import settle_sized_later
from stager.stagein.sizing import DROPPED, UNKNOWN, DeferredPreflight
from stager.stagein.smallruns import RunLength, SmallRuns
from stager.stagein.streams import KeptSlots, StreamController
from stager.storage.copy import CopyResult
from stager.storage.copyrun import publish_run
from stager.storage.sources import SourceSet
from stager.storage.throttle import Throttle
from stager.storage.workers import run_in_threads

if TYPE_CHECKING:
    from stager.stagein.cache import StageCache

__all__ = ["Copier", "CopyOutcome"]


class Copier:
    """Copies ``plan.to_copy`` from ``source``; :meth:`run` returns what was staged."""

    def __init__(
        self,
        source: SourceSet,
        plan: LocalPlan,
        options: StageInOptions,
        report: StageInReport,
        log: TextIO,
        journal: Journal | None = None,
        heartbeat: Callable[[], None] = lambda: None,
        cache: StageCache | None = None,
        streamed: bool = False,
    ):
        """``streamed``: items also arrive by :meth:`add` until :meth:`close` (streamed.py)."""
        self.source, self.plan, self.options = source, plan, options
        self.report, self.log = report, log
        self.served_samples: dict[str, int] = {}  # counts a cache hit brought
        self.served: set[str] = set()  # relpaths placed from the node cache (report counts)
        self.journal = journal
        self.heartbeat = heartbeat  # tells tasks waiting on the node lock that we progress
        self.cache = cache  # the node cache (--cache): serves hits, is filled by misses
        self.outcome = CopyOutcome()
        self.progress = Progress(
            plan.bytes_to_copy,
            len(plan.to_copy),
            label=f"[{report.node}] stage-in",
            mode=options.progress,
            interval_s=options.progress_interval_s,
            stream=log,
        )
        self.halt = Halt()  # Ctrl-C or SIGTERM: the copies in progress stop, waits end
        rate = options.bw_limit_mbps * 1e6 if options.bw_limit_mbps else None
        self.throttle = Throttle(rate, sleep=self.halt.pause) if rate else None
        self.lock = threading.Lock()
        self.full = threading.Event()  # scratch is full: the remaining copies cannot succeed
        self.dropped: list[str] = []  # sized later and found gone or a directory: not shards
        self.held: list[str] = []  # copied, but kept .partial until the free-space verdict
        self.count_later: list[str] = []  # held copies to count once renamed
        self.held_journaled = 0  # self.held[:held_journaled] were journaled when they passed
        later = plan.sized_later
        late = [item.shard for item in plan.to_copy if item.shard.relpath in later] if later else []
        relpaths = map(attrgetter("relpath"), late)
        self.late = dict(zip(relpaths, range(len(late)), strict=False))  # C loops
        self.sizing: DeferredPreflight | None = None
        self.stopped_by: BaseException | None = None  # why a streamed listing ended early
        if late or streamed:
            self.sizing = DeferredPreflight(
                [shard.path for shard in late],
                # Half the copy ceiling: a stat is one round trip where a copy makes three, so
                # half as many threads keep the sizes ahead (1.5 x --jobs requests in flight).
                max(1, options.jobs // 2),
                known_bytes=self.progress.total_bytes,
                free_bytes=plan.free_bytes,
                min_free_bytes=options.min_free_bytes,
                on_sized=lambda nbytes, gone: self.progress.add_totals(nbytes, -gone),
                more=streamed,
                on_passed=self._journal_passed,
            )
        # Shards the cache serves need no stream: a full hit runs on this thread alone.
        pending = len(plan.to_copy) if cache is None else cache.misses(plan)
        ceiling = options.jobs if streamed else max(1, min(options.jobs, pending))
        self.streams = StreamController(ceiling, floor=options.min_jobs, adaptive=options.adaptive)
        self.slots = KeptSlots(self.streams)
        self.feed = ItemFeed(plan.to_copy, closed=not streamed, on_wait=self.slots.give_back)
        self.small_runs = SmallRuns.of(self)  # small local shards copied in runs (smallruns.py)
        self.run_length = RunLength()  # their takes' length (_take_size)

    def run(self) -> CopyOutcome:
        """Copy every planned shard; failures are in the report, the staged ones in the outcome."""
        if self.sizing is not None:
            self.sizing.start()
        try:
            run_in_threads(
                self._copy_take,
                self.feed.runs(self._take_size),
                self.streams.ceiling,
                name="stage-in",
                on_exit=self.slots.give_back,
                before_take=self._before_take,
                on_interrupt=self._interrupt,
            )
            if self.sizing is not None:
                # Not on an error or interrupt: the probe's threads are daemons.
                self.sizing.finish()
        finally:
            self.progress.close()
            self.report.streams = self.streams.peak
        if self.sizing is not None:
            settle_sized_later(self, self.sizing)
        return self.outcome

    # -- a streamed listing feeds it ------------------------------------------------------
    def add(self, items: list[CopyItem]) -> None:
        """Copy these too, each sized while it copies (a copier made with ``streamed=True``)."""
        assert self.sizing is not None
        with self.lock:
            first = self.sizing.probe.add([item.shard.path for item in items])
            for offset, item in enumerate(items):
                self.late[item.shard.relpath] = first + offset
            self.plan.to_copy.extend(items)
            self.report.files_total += len(items)
            self.feed.add(items)
        self.progress.add_totals(0, len(items))

    def close(self) -> None:
        """The listing is complete: the copies and the free-space verdict end with the last."""
        if self.sizing is not None:
            self.sizing.probe.close()
        self.feed.close()

    def abort(self, exc: BaseException) -> None:
        """The listing failed: nothing copied so far is published (held copies are deleted),
        and :meth:`run` raises ``exc`` once the copies in progress have ended."""
        self.stopped_by = exc
        if self.sizing is not None:
            self.sizing.gate.refuse()
        self.close()

    def _interrupt(self) -> None:
        """Ctrl-C or SIGTERM on the main thread: each copy in progress stops at its next block,
        deleting its ``.partial``, and :meth:`abort` deletes those held for the verdict."""
        self.halt.set()
        self.abort(KeyboardInterrupt())

    def _journal_passed(self, failed: list[tuple[str, OSError]]) -> None:
        """Journal the held copies the verdict has just renamed, while other copies still run:
        a kill before the end must not leave final files that a rerun copies again."""
        if self.journal is None:
            return
        relpath_of = {i.target: i.shard.relpath for i in self.plan.to_copy} if failed else {}
        not_renamed = {relpath_of.get(final) for final, _ in failed}
        with self.lock:
            held = [self.outcome.entries.get(r) for r in self.held if r not in not_renamed]
            self.held_journaled = len(self.held)
        self.journal.record_all([entry for entry in held if entry is not None])

    # -- one shard, on a copy thread -------------------------------------------------------
    def fail(self, item: CopyItem, reason: str, kind: str = "source") -> None:
        with self.lock:  # (ShardFailure drops a leading URL: the FAILED line names it already)
            self.report.add_failure(ShardFailure(item.shard.url, reason, kind))

    def on_bytes(self, n: int) -> None:
        self.halt.check()  # CopierStopped unwinds copy_file, which deletes its .partial
        with self.lock:
            self.report.bytes_read_source += n
        self.progress.advance(n)
        # Progress within a shard, for those waiting on the node lock: a shard that takes longer
        # than --lock-timeout or the loader's copier_stall_s to copy (a large one at a capped
        # rate) is not a hung copier. (The lock's heartbeat touches its file at most once a
        # second; a read hung on a dead server calls nothing, and is still given up on.)
        self.heartbeat()

    def on_retry(self, attempt: int, exc: BaseException) -> None:
        with self.lock:
            self.report.retries += 1
        message = f"[{self.report.node}] retry {attempt} after: {one_line(exc)}"
        print(message, file=self.log, flush=True)

    def _late_size(self, item: CopyItem, index: int) -> CopyItem | None:
        """``item`` with its size from the probe (``paths[index]``), or None when it is not a
        shard to copy."""
        assert self.sizing is not None
        probe = self.sizing.probe
        size = probe.get(index)
        if size == DROPPED:
            with self.lock:
                self.dropped.append(item.shard.relpath)
            return None
        if size == UNKNOWN:
            self.fail(item, probe.error(index))
            return None
        return item.sized(size, probe.version(index))

    def _take_size(self) -> int:
        """Items per take of the feed: a run's length, or one where there are no runs."""
        return self.run_length() if self.small_runs is not None else 1

    def _before_take(self) -> None:
        """A slot before the next item (the thread that kept one copies the next file); none
        while the walk has nothing to hand out: a slot held waiting would hold up a copy."""
        self.slots.give_back() if self.feed.starved else self.slots.take()

    def _copy_take(self, take: list[CopyItem]) -> None:
        """Copy a take of the feed: small local shards in runs (smallruns.py), others one by one."""
        small = []
        for item in take:
            ready = self._prepare(item)
            if ready is None:
                continue
            if self.small_runs is not None and self.small_runs.fits(ready):
                small.append(ready)
            else:
                self.copy_prepared(ready)
        if small:
            assert self.small_runs is not None
            self.small_runs.copy(small)

    def _prepare(self, item: CopyItem) -> CopyItem | None:
        """``item`` sized, or None where it is not a shard to copy (gone, or its stat failed)."""
        sizing = self.sizing
        # (one lookup of the relpath, each shard: ~0.4 us less than asking in turn)
        index = self.late.get(item.shard.relpath) if sizing is not None else None
        if self.cache is not None or (
            index is not None and sizing is not None and not sizing.probe.ready(index)
        ):
            self.slots.give_back()  # not while waiting for a size or another job's fill
        return item if index is None else self._late_size(item, index)

    def still_wanted(self, item: CopyItem) -> bool:
        """False where a copy can no longer help: the free-space check refused the run (the
        refusal raised at the end says it for all), or scratch is full (a "not attempted")."""
        if self.sizing is not None and self.sizing.refused:
            return False
        if self.full.is_set():
            self.fail(item, "not attempted: the destination is full or not writable", "full")
            return False
        return True

    def copy_prepared(self, item: CopyItem) -> None:
        """Copy one shard (:meth:`_prepare`'d) with :func:`copy_file`, retried where it may help
        (:func:`stager.stagein.oneshard.copy_one`)."""
        copy_one(self, item)

    def samples_agree(self, item: CopyItem, counter: TarSampleCounter | None) -> bool:
        """False where the walk counted other samples than the manifest (or cache) says."""
        want, counted = self.known_samples(item), counter.samples if counter else None
        return want is None or counted is None or counted == want

    def publish_run(self, pairs: list[tuple[str, str]]) -> tuple[bool, list[OSError | None]]:
        """Rename a run's copies into place, or hold them for the free-space verdict:
        whether renamed, and each rename's error (see :meth:`PublishGate.publish_run`)."""
        if self.sizing is not None:
            return self.sizing.gate.publish_run(pairs)
        return True, publish_run(pairs)

    def known_samples(self, item: CopyItem) -> int | None:
        """The manifest's count, or the cache's for a shard it served."""
        served = self.served_samples.get(item.shard.relpath)
        return served if served is not None else item.want_samples

    def book_run(
        self,
        copies: list[tuple[CopyItem, CopyResult, TarSampleCounter | None]],
        published: bool,
    ) -> None:
        """Enter staged copies (one, or a run's) in the outcome, report, journal and progress,
        under the lock once."""
        booked = []
        for item, result, counter in copies:
            relpath = item.shard.relpath
            samples = self.known_samples(item)
            if counter is not None:  # (one that found no tar too: the finish checks the copy)
                self.outcome.parsed[relpath] = counter  # arrays are built at the end
                if counter.repeated_member is not None:
                    samples = None  # the finish refuses it; so, once journaled, does a resume
                elif samples is None:
                    samples = counter.samples
            # Compressed shards are counted here. A walk in flight that found no tar already ran
            # the slower indexers: the finish reads that copy once more and fails it.
            late_count = samples is None and counter is None and self.options.count_samples
            if late_count and published:
                samples = count_samples_of(item.final)
            version = result.version or item.shard.version  # at open, else as listed
            entry = ManifestEntry(relpath, result.size, result.hash, samples, version)
            booked.append((entry, late_count))
        with self.lock:
            entries = self.outcome.entries
            for entry, late_count in booked:
                if not published:  # held as .partial until the verdict: counted after, if need be
                    self.held.append(entry.relpath)
                    if late_count:
                        self.count_later.append(entry.relpath)
                entries[entry.relpath] = entry
            self.report.files_copied += len(booked)
            self.report.bytes_copied += sum(entry.size for entry, _ in booked)
        if published and self.journal is not None:
            self.journal.record_all([entry for entry, _ in booked])
        self.heartbeat()
        self.progress.file_done(len(booked))

    # -- after the copies -------------------------------------------------------------------
    def unstage(self, relpath: str) -> None:
        """Take a copy out of the outcome and the report (it is not staged after all)."""
        entry = self.outcome.entries.pop(relpath, None)
        self.outcome.parsed.pop(relpath, None)
        if entry is not None:
            self.report.files_copied -= 1
            self.report.bytes_copied -= entry.size
