"""Size walked shards in the background, ahead of their copies, and hold back their publication
until the free-space check on those sizes has passed.

Why: a shard found by walking a directory (no manifest beside it) has no size until a stat, and
on NFS each stat is a metadata round trip. Statting all of them before the first copy cost
~1.1 s per 3,000 shards at 10 ms, and the entries it cached had expired by the time the copies
reached them, so each copy paid the lookup again. Here the stats run on their own threads in
listing order while the copies follow, so the copies find the entries fresh; the free-space
check runs when the last size is in (or as soon as the sizes seen so far exceed the space).
Until it has passed, finished copies stay ``.partial``: a refusal still leaves nothing staged.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence

from stager.stagein.feed import ItemFeed
from stager.stagein.publishgate import PublishGate
from stager.storage.identity import version_of
from stager.storage.statmany import StatRow, stat_many
from stager.storage.workers import run_in_threads

# (PublishGate is in publishgate.py; named here for callers that import it from this module.)
__all__ = ["DROPPED", "UNKNOWN", "SizeProbe", "PublishGate", "DeferredPreflight"]

#: The shard vanished since the listing, is a directory named like a shard, or is not a regular
#: file (a FIFO, a device): the walk would not have listed it, so it is dropped without a
#: failure (:attr:`SizeProbe.not_regular` and :attr:`SizeProbe.directories` list the last two
#: kinds, which deserve a warning).
DROPPED = -1
#: The stat failed otherwise (e.g. permission denied, EIO): :meth:`SizeProbe.error` says why.
UNKNOWN = -2
_PENDING = object()
_FORMAT_BITS = 0o170000  # the file-type bits of st_mode (what stat.S_IFMT keeps)


#: The stats a probe thread runs for one take of the interpreter lock (the helper stops once
#: they have taken this long), and the most paths one take claims. On NFS, where a stat is a
#: round trip, that is one path, and the threads keep the round trips in flight. Where stats
#: turn slow inside a claimed run, its rest is handed back path by path (:meth:`_claims`):
#: 256 slow stats after 2,000 fast ones on 32 threads took 0.66 s without that, 0.10 s with it.
RUN_BUDGET_S = 0.002
MAX_RUN = 64

#: How the probe stats a run of paths (a module attribute, so tests can count and slow them).
_stat_run = stat_many


class SizeProbe:
    """``stat`` each path on background threads, in order; :meth:`get` waits for one result.

    Results are a size in bytes, :data:`DROPPED` or :data:`UNKNOWN`. ``on_size(nbytes)`` is
    called (on a probe thread) with the total of each run of sizes found; ``on_done()`` once
    all are in.

    A thread claims a run of paths and stats them with the interpreter lock released once
    (:mod:`stager.storage.statmany`), not once per path. The run doubles while a stat takes
    less than :data:`RUN_BUDGET_S` over its length and shrinks to what fits in it once stats
    are slower: on tmpfs a run is :data:`MAX_RUN` paths, on NFS one. Why: beside copy threads
    that keep the lock busy, a thread that takes it back after every stat waits for it each
    time; 32 probe threads took 1.0-1.5 s for 10,000 stats of a tmpfs that take ~40 ms alone,
    and the copies waited on them.
    """

    def __init__(
        self,
        paths: Sequence[str],
        threads: int,
        *,
        on_size: Callable[[int], None] | None = None,
        on_done: Callable[[], None] | None = None,
        more: bool = False,
    ):
        self._paths = list(paths)
        self._results: list[object] = [_PENDING] * len(self._paths)
        # more: paths keep arriving (:meth:`add`) until :meth:`close`; the probe ends after
        self._indexes: ItemFeed[int] = ItemFeed(range(len(self._paths)), closed=not more)
        self._ended = False
        self._threads = max(1, threads if more else min(threads, len(self._paths)))
        self._on_size = on_size
        self._on_done = on_done
        self._cond = threading.Condition()
        self._waiting = 0
        self._errors: dict[int, str] = {}
        self._run_length = 1  # paths per take: grown while stats are fast (see the class docstring)
        self._handed_back: list[int] = []  # paths of claimed runs left for any thread (_claims)
        self._in_flight = 0  # runs being statted
        self._claims_cond = threading.Condition()
        self._versions: list[str | None] = [None] * len(self._paths)  # (:meth:`version`)
        self.not_regular: list[int] = []  # indexes of FIFOs, sockets, devices
        self.directories: list[int] = []  # indexes of directories named like shards
        self.failure: BaseException | None = None  # the probe itself broke (not one stat)
        self._runner = threading.Thread(target=self._run, name="size-probe", daemon=True)

    def __len__(self) -> int:
        return len(self._paths)

    def add(self, paths: Sequence[str]) -> int:
        """Probe these paths too (a probe made with ``more=True``); returns the first one's
        index. After the probe has ended (it broke), they are :data:`UNKNOWN` at once."""
        with self._cond:
            first = len(self._paths)
            self._paths.extend(paths)
            self._results.extend([UNKNOWN if self._ended else _PENDING] * len(paths))
            self._versions.extend([None] * len(paths))
        self._indexes.add(range(first, first + len(paths)))  # after their result slots exist
        return first

    def close(self) -> None:
        """No more paths: the probe ends once it has probed those it has."""
        self._indexes.close()

    def start(self) -> SizeProbe:
        self._runner.start()
        return self

    def join(self) -> None:
        self._runner.join()

    def get(self, index: int) -> int:
        """The result for ``paths[index]``, waiting for the probe to reach it."""
        result = self._results[index]
        if result is _PENDING:
            with self._cond:
                self._waiting += 1
                while self._results[index] is _PENDING:
                    self._cond.wait()
                self._waiting -= 1
                result = self._results[index]
        return result  # type: ignore[return-value]

    def ready(self, index: int) -> bool:
        """Whether :meth:`get` would answer without waiting."""
        return self._results[index] is not _PENDING

    def error(self, index: int) -> str:
        """Why ``paths[index]`` is :data:`UNKNOWN`."""
        return self._errors.get(index, "the size probe stopped before reaching it")

    def _probe(self, run: list[int]) -> None:
        """Stat a claimed run; where its stats turned slow, hand the rest back one path at a
        time and help with them (a thread waiting in the feed for the listing cannot)."""
        try:
            self._stat_run(run)
            while (index := self._take_one()) is not None:
                try:
                    self._stat_run([index])
                finally:
                    self._done_one()
        finally:
            self._done_one()

    def _stat_run(self, run: list[int]) -> None:
        paths = [self._paths[index] for index in run]
        done = 0
        while done < len(run):  # the helper stops once its budget is spent
            results, spent_s = _stat_run(paths[done:], RUN_BUDGET_S)
            per_stat_s = spent_s / max(1, len(results))
            fits = int(RUN_BUDGET_S / per_stat_s) if per_stat_s > 0 else MAX_RUN
            self._run_length = max(1, min(MAX_RUN, 2 * self._run_length, fits))
            self._record_run(run[done : done + len(results)], results)
            done += len(results)
            if done < len(run) and len(results) == 1:
                # One stat took the whole budget: round trips. The rest goes back, path by
                # path (a thread merely preempted mid-run goes on with its run).
                with self._claims_cond:
                    self._handed_back.extend(run[done:])
                    self._claims_cond.notify_all()
                return

    def _take_one(self) -> int | None:
        """A path handed back, now in flight; None when there is none."""
        with self._claims_cond:
            if not self._handed_back:
                return None
            self._in_flight += 1
            return self._handed_back.pop(0)

    def _done_one(self) -> None:
        with self._claims_cond:
            self._in_flight -= 1
            self._claims_cond.notify_all()

    def _claims(self) -> Iterator[list[int]]:
        """The runs the probe threads take: paths handed back first, then the feed's runs;
        once the feed is done, it ends only when no run is in flight (one may hand some back).

        Why hand back: a run claimed while stats were fast is only known to be too long when
        its stats turn slow (attributes cached by the listing, then not), and one thread would
        then do its round trips in a row while the others have nothing to do.
        """
        for run in self._indexes.runs(lambda: self._run_length):
            yield from self._take_handed_back()
            with self._claims_cond:
                self._in_flight += 1
            yield run
        while True:
            with self._claims_cond:
                while not self._handed_back and self._in_flight:
                    self._claims_cond.wait()
                if not self._handed_back:
                    return
            yield from self._take_handed_back()

    def _take_handed_back(self) -> Iterator[list[int]]:
        while (index := self._take_one()) is not None:
            yield [index]

    def _record_run(self, indexes: list[int], found: list[StatRow | int]) -> None:
        """Enter a run's stats: each regular file's size and version, then one ``on_size``
        call and one lock for the run.

        Why a run at a time: the probe's Python per path (a lock, a callback and a wakeup
        each) held the interpreter lock for ~11 us a shard, 18% of a 10,000-shard stage-in
        on 16 cores, where the copies waited for it. The few that are not regular files go
        through :meth:`_record_odd`.
        """
        sizes: list[int | None] = []  # (None: entered by _record_odd)
        odd = []
        total = 0
        versions = self._versions
        for index, row in zip(indexes, found, strict=True):
            if not isinstance(row, int) and row[0] & _FORMAT_BITS == stat.S_IFREG:
                size = row[1]
                versions[index] = version_of(row[2], row[3], row[4])
                sizes.append(size)
                total += size
            else:
                sizes.append(None)
                odd.append((index, row))
        if self._on_size is not None and len(odd) < len(indexes):
            self._on_size(total)
        with self._cond:
            results = self._results
            for index, entered in zip(indexes, sizes, strict=True):
                if entered is not None:
                    results[index] = entered
            if self._waiting:
                self._cond.notify_all()
        for index, row in odd:
            self._record_odd(index, row)

    def _record_odd(self, index: int, found: StatRow | int) -> None:
        """A failed stat, or something other than a regular file."""
        if isinstance(found, int):  # an errno
            if found == errno.ENOENT:  # gone since the listing: as if never listed
                result = DROPPED
                if os.path.islink(self._paths[index]):  # a symlink to nothing: said, as a FIFO is
                    with self._cond:
                        self.not_regular.append(index)
            else:
                result = UNKNOWN
                self._errors[index] = f"cannot stat it: {os.strerror(found)}"
        else:
            result = DROPPED  # a directory named like a shard, or a FIFO, socket or device
            with self._cond:
                (self.directories if stat.S_ISDIR(found[0]) else self.not_regular).append(index)
        with self._cond:
            self._results[index] = result
            if self._waiting:
                self._cond.notify_all()

    def version(self, index: int) -> str | None:
        """The version (:mod:`stager.storage.identity`) of ``paths[index]`` as its stat found
        it; None where it was not a regular file or is not statted yet."""
        return self._versions[index]

    def _run(self) -> None:
        try:
            run_in_threads(self._probe, self._claims(), self._threads, name="size-probe")
        except BaseException as exc:  # noqa: BLE001 - kept for the caller; no copy may wait forever
            self.failure = exc
        finally:
            with self._cond:  # whatever went wrong, no copy may wait forever
                self._ended = True
                for i, result in enumerate(self._results):
                    if result is _PENDING:
                        self._results[i] = UNKNOWN
                self._cond.notify_all()
            if self._on_done is not None:
                self._on_done()


class DeferredPreflight:
    """The free-space check for shards sized while they copy: a :class:`SizeProbe` feeding a
    running total, and the :class:`PublishGate` it opens or shuts.

    Refuses as soon as the sizes seen so far (plus ``known_bytes``, the shards sized before,
    and ``min_free_bytes``) exceed ``free_bytes``, the space free before the first copy; passes
    when the last size is in. ``on_sized(total_bytes, dropped)`` runs once all sizes are in,
    ``on_passed(failed_renames)`` right after a pass has renamed the copies held.
    """

    def __init__(
        self,
        paths: Sequence[str],
        threads: int,
        *,
        known_bytes: int,
        free_bytes: int,
        min_free_bytes: int = 0,
        on_sized: Callable[[int, int], None] | None = None,
        more: bool = False,
        on_passed: Callable[[list[tuple[str, OSError]]], None] | None = None,
    ):
        self.gate = PublishGate()
        self.needed_bytes = known_bytes
        self.probed_bytes = 0
        self.free_bytes = free_bytes
        self._limit = free_bytes - min_free_bytes
        self._lock = threading.Lock()
        self._on_sized = on_sized
        self._on_passed = on_passed  # (failed renames): the held copies have their names now
        self.probe = SizeProbe(paths, threads, on_size=self._add, on_done=self._done, more=more)
        self.failed_renames: list[tuple[str, OSError]] = []

    def start(self) -> DeferredPreflight:
        self.probe.start()
        return self

    def finish(self) -> None:
        """Wait until every size is in and the verdict is given."""
        self.probe.join()

    @property
    def refused(self) -> bool:
        return self.gate.refused

    def _add(self, nbytes: int) -> None:
        """A run of sizes found, ``nbytes`` together."""
        with self._lock:
            self.probed_bytes += nbytes
            self.needed_bytes += nbytes
            over = self.needed_bytes > self._limit
        if over:
            self.gate.refuse()

    def _done(self) -> None:
        if self.probe.failure is not None or self.needed_bytes > self._limit:
            self.gate.refuse()  # a broken probe has no total to pass on
        else:
            self.failed_renames = self.gate.pass_()
            if self._on_passed is not None:
                self._on_passed(self.failed_renames)
        if self._on_sized is not None:
            self._on_sized(
                self.probed_bytes,
                sum(1 for i in range(len(self.probe)) if self.probe.get(i) == DROPPED),
            )
