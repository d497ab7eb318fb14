"""How many copy streams to run at once, chosen from the latency the copies observe.

A fixed stream count is wrong at one end or the other: on a local disk or a bandwidth-bound
link a few streams saturate it, while on NFS each small file costs metadata round trips
(lookup, open, first read) during which a stream moves no bytes. If a file takes ``L`` seconds
of latency and ``T`` seconds of transfer, ``(L + T) / T`` streams keep the link busy. The
controller measures both per file (time to first byte, then from it to the last byte read),
keeps the medians of a sliding window, and sets the limit to that ratio, clamped to
``[floor, ceiling]`` where the ceiling is ``--jobs``. ``T`` stops at the last byte read: the
local work after it (the end-of-file read, the last write, the rename) is not the link's, and
with dozens of copy threads sharing one interpreter it can take milliseconds, which read as a
slow link made the limit sag below the ceiling on small files. (The hashing and writing of
earlier blocks, between reads, still count: they are small next to a multi-block transfer.)

Where transfer dominates and the process keeps its CPUs busy meanwhile (a memory-speed source:
each stream copies, hashes and indexes on a core of its own), the CPUs decide instead. Once the
copies keep a core busy per stream, the streams are bound by the CPU, not the link, and the
limit rises to the CPUs the job has (``--cpus-per-task``) until each copy keeps less than half
a core busy (then they wait on a server or a disk again): on 16 cores four streams had held
large shards from a tmpfs at ~3 GB/s where 16 ``cp`` processes moved 16.
Where the job has fewer CPUs than the floor, the floor gives way to them: more streams would
only take turns on them. Reads that wait on a server leave the CPUs idle, and keep the floor.

When the link is shared, ``T`` grows as streams are added, so the target falls back by itself:
it never overloads a server that is slow for lack of bandwidth. Shards that arrive whole in
the first read (64 KiB) have no ``T`` to measure: while the window's median ``T`` is 0, the
limit is searched by completion rate instead (:mod:`stager.stagein.rateprobe`), starting from
the ratio above with ``T`` taken as 0.1 ms (the ceiling behind NFS round trips). From a
memory-speed source that search ends at one or two streams, below ``--min-jobs``: there the
copies' own Python work is the cost, and more threads only pass the interpreter around.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from stager.slurm import usable_cpus
from stager.stagein.rateprobe import RateProbe

__all__ = ["StreamController", "KeptSlots", "DEFAULT_JOBS"]

#: The most copy streams per node unless ``--jobs`` says otherwise. The stream controller runs
#: this many only while per-file latency dominates (many small files on a slow-to-answer
#: filesystem); large shards settle at a few. 64 rather than 32: behind 10 ms per operation,
#: 3,000 small files staged ~15% faster with 48 or 64 streams than with 32 on a quiet machine,
#: and ~25% faster when other work took CPU (docs/tuning.md); 96 gained nothing more.
DEFAULT_JOBS = 64


#: The transfer time taken for files that arrive whole in their first read (too short to time):
#: the ceiling of a transfer behind NFS round trips.
_UNTIMED_S = 1e-4

#: Copies during which the process kept at least this share of the cores busy saturate them;
#: copies that each keep this share of a core busy are bound by the CPU.
SATURATED = 0.8
#: Copies that each keep less than this share of a core busy wait on something else.
RELEASED = 0.5


def _streams_for(latency_s: float, transfer_s: float) -> int:
    """Streams that keep a link busy whose files wait ``latency_s`` before ``transfer_s`` of
    bytes: (latency + transfer) / transfer."""
    return math.ceil((latency_s + transfer_s) / transfer_s)


def _median(values: deque[float]) -> float:
    """The median of a window of at most a few dozen timings (``statistics`` costs 4 ms to
    import, a twentieth of stage-in's start-up)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class StreamController:
    """A resizable limit on concurrent copies; threads ``acquire`` before and ``release`` after."""

    def __init__(
        self,
        ceiling: int,
        *,
        floor: int = 4,
        window: int = 32,
        adaptive: bool = True,
        cores: int | None = None,
        grow_to_cores: bool = True,
    ):
        """``cores``: the CPUs this process may use (default: its affinity, which Slurm sets
        to the job's ``--cpus-per-task``); files that are mostly transfer run on no more
        streams than that, even below ``floor``, and on that many once each stream keeps a core
        busy, unless ``grow_to_cores`` is False (a copier beside training, which needs them)."""
        if ceiling < 1:
            raise ValueError("ceiling must be >= 1")
        self.ceiling = ceiling
        self.floor = max(1, min(floor, ceiling))
        self.cores = max(1, cores if cores is not None else usable_cpus())
        self.adaptive = adaptive
        self.grow_to_cores = grow_to_cores
        #: Copies keep a core busy each: a stream per core, until they wait on other things.
        self.cpu_bound = False
        self.limit = self.floor if adaptive else ceiling
        self.peak = self.limit
        self._active = 0
        self._latency_s: deque[float] = deque(maxlen=window)
        self._transfer_s: deque[float] = deque(maxlen=window)
        self._cores_used: deque[float] = deque(maxlen=window)
        self._core_share: deque[float] = deque(maxlen=window)
        self._cond = threading.Condition()
        self._probe: RateProbe | None = None  # searching, while transfers are too short to time

    def acquire(self) -> None:
        with self._cond:
            while self._active >= self.limit:
                self._cond.wait()
            self._active += 1

    def release(
        self,
        first_byte_s: float | None = None,
        last_byte_s: float | None = None,
        cores_used: float | None = None,
    ) -> None:
        """Give the slot back, reporting the finished file's timing (None after a failure).

        ``first_byte_s`` and ``last_byte_s`` are seconds since the file's copy started, to its
        first byte and to its last; ``cores_used``, the CPUs the process kept busy meanwhile.
        """
        with self._cond:
            running = self._active
            self._active -= 1
            self._record(first_byte_s, last_byte_s, cores_used, running)
            self._wake()

    def finished(
        self,
        first_byte_s: float | None = None,
        last_byte_s: float | None = None,
        cores_used: float | None = None,
        *,
        files: int = 1,
    ) -> bool:
        """Report a finished file as :meth:`release` does, but keep the slot for the caller's
        next file while the limit allows it: True when kept (then :meth:`release` it once the
        caller has no next file), False when given back. ``files``: a run of that many small
        files copied by one call (:mod:`stager.storage.copyrun`), its timings per file.

        Why: handing the slot to a parked thread costs two thread switches per file, and from
        a memory-speed source those were most of a small shard's copy time.
        """
        with self._cond:
            self._record(first_byte_s, last_byte_s, cores_used, self._active, files)
            keep = self._active <= self.limit
            if not keep:
                self._active -= 1
            self._wake()
            return keep

    def still_kept(self) -> bool:
        """Whether a slot kept by :meth:`finished` may start the caller's next file now; False
        when it was given back, because another file's end lowered the limit in between (the
        caller then waits in :meth:`acquire` like any other thread)."""
        with self._cond:
            if self._active <= self.limit:
                return True
            self._active -= 1
            self._wake()
            return False

    def _record(
        self,
        first_byte_s: float | None,
        last_byte_s: float | None,
        cores_used: float | None = None,
        running: int = 1,
        files: int = 1,
    ) -> None:
        """``running``: the copies in flight as this one ended (itself included)."""
        if self.adaptive and first_byte_s is not None and last_byte_s is not None:
            self._latency_s.append(max(0.0, first_byte_s))
            self._transfer_s.append(max(0.0, last_byte_s - first_byte_s))
            self._cores_used.append(cores_used or 0.0)
            # The share of a core each running copy kept busy (at most one core each).
            self._core_share.append((cores_used or 0.0) / max(1, min(running, self.cores)))
            self.limit = self._next_limit(files)
            self.peak = max(self.peak, self.limit)

    def _wake(self) -> None:
        # Wake only as many waiters as there are free slots: waking all of them on every
        # file (notify_all) makes dozens of threads fight for the GIL to find one slot,
        # which on small files cost more than the copies themselves.
        free = self.limit - self._active
        if free > 0:
            self._cond.notify(free)

    def _next_limit(self, files: int = 1) -> int:
        """The model's target, or while the window's files were too small to time, the rate
        search's limit (started from the model's target)."""
        if _median(self._transfer_s) > 0:
            self._probe = None
            return self.target()
        if self._probe is None:
            self._probe = RateProbe(self.ceiling)
            self._probe.start(self._probe_start())
        return self._probe.completed(time.monotonic(), files)

    def _probe_start(self) -> int:
        """Where the rate search starts: the model's target, but no more streams than the
        cores where the files' latency asks for fewer (a memory-speed source, where streams
        past the cores only pass the interpreter around, and the search had too few windows in
        a short run to come down from the floor: 10,000 x 20 KB from a tmpfs on 2 cores took
        ~0.70 s from 4 streams, ~0.54 s at 2). Behind a server's latency it is the target."""
        wanted = _streams_for(_median(self._latency_s), _UNTIMED_S)
        return max(1, min(self.target(), max(self.cores, wanted)))

    def target(self) -> int:
        """The stream count the current window of timings asks for."""
        if not self._latency_s:
            return self.limit
        latency = _median(self._latency_s)
        measured = _median(self._transfer_s)
        transfer = max(measured, _UNTIMED_S)
        wanted = _streams_for(latency, transfer)
        floor = self.floor
        if latency < transfer:
            busy = _median(self._cores_used)
            # Timed: not whole files in the first read, whose cost is the interpreter's (the
            # rate search sizes those). Growable: more CPUs than the floor, or nothing to gain.
            timed = latency < measured
            if timed and self.grow_to_cores and self.cores > self.floor:
                share = _median(self._core_share)
                if share >= SATURATED:
                    # Mostly transfer, and each running copy keeps a core busy: the CPU bounds
                    # each stream, so more streams move more bytes until the cores are used.
                    self.cpu_bound = True
                elif share < RELEASED:
                    # The copies now wait on something else (a server, the disk): the
                    # latency model decides again. Between the two thresholds the state
                    # holds: at a stream per core the copies share the memory bus, and each
                    # keeping less than a whole core busy is no reason to drop back to 4.
                    self.cpu_bound = False
                if self.cpu_bound:
                    floor = min(self.cores, self.ceiling)
            if busy >= SATURATED * self.cores:
                # The copies together keep the cores busy (a memory-speed source, not reads
                # that wait on a server): streams past the cores only take turns on them.
                # 16 x 64 MB from a tmpfs on 2 cores: 4 streams took ~10% longer than 2.
                floor = min(floor, self.cores)
        return max(floor, min(self.ceiling, wanted))


class KeptSlots:
    """Each copy thread's stream slot, kept from one file to the next where the controller
    allows (:meth:`StreamController.finished`): a thread that keeps its slot starts its next
    file without queueing behind the others."""

    def __init__(self, streams: StreamController) -> None:
        self.streams = streams
        self._local = threading.local()  # .held: this thread kept its slot for the next file

    def take(self) -> None:
        """A slot for this thread's next file: the kept one if still allowed, else wait."""
        if not (getattr(self._local, "held", False) and self.streams.still_kept()):
            self.streams.acquire()
            self._local.held = True

    def give_back(self) -> None:
        """Release the slot this thread kept from its last file, if it kept one."""
        if getattr(self._local, "held", False):
            self._local.held = False
            self.streams.release()

    def finished(self, *timing: float, files: int = 1) -> None:
        """This thread's file, or run of ``files``, ended (its timing: see
        :meth:`StreamController.finished`)."""
        self._local.held = self.streams.finished(*timing, files=files)
