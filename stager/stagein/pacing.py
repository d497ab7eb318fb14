"""``--bw-limit`` shared in copy order, and a stop that unwinds every copy without a partial.

A background copy is useful only if shards land in the order the loader reads them. With
``--bw-limit`` and a plain token bucket, ``k`` streams share the rate evenly and the first
``k`` shards land together after ``k`` shard-times; the loader's first batch would wait for
all of them. :class:`OrderedThrottle` hands the rate out by priority instead (the shard's
place in the copy order): the earliest shard in flight reserves the link back to back, a
later one only gets it when the link has stayed idle for ``grace_s`` (the earliest one is
between reads, or waits on its source), so shards land one after another at the full rate
while the other streams keep their connection and first block ready. The streams themselves
are still counted by the stream controller; only the bytes per second are ordered.

Stopping: a ``threading.Event`` set by the SIGTERM/SIGINT handler. Every block read passes
through :meth:`OrderedThrottle.consume` (also without a rate), which raises
:class:`CopierStopped` once it is set; that unwinds ``copy_file`` (which deletes its
``.partial``) and the copy thread without retries, because it is not an ``Exception``.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from stager.storage.throttle import Throttle

__all__ = ["CopierStopped", "Halt", "OrderedThrottle", "GRACE_S", "BURST_S"]

#: How long the link must stay idle before a later shard may take bytes from an earlier one.
GRACE_S = 0.1
#: Idle link time that may be caught up at once, as the plain throttle's bucket allows.
BURST_S = 1.0
_LAST = 1 << 62  # the priority of a thread that did not say which shard it copies


class CopierStopped(BaseException):
    """The copier was told to stop (a signal; Ctrl-C in the foreground): unwinds a copy thread
    (not an ``Exception``, so no retry loop or per-shard handler swallows it)."""


class Halt:
    """A foreground copier's stop (Ctrl-C or SIGTERM on the main thread): a copy thread
    raises :class:`CopierStopped` at its next block (:meth:`check`), and out of any wait it is
    in (:meth:`pause`: the ``--bw-limit`` sleep, a retry's back-off), not after it."""

    __slots__ = ("_event",)

    def __init__(self, event: threading.Event | None = None) -> None:
        """``event``: an existing stop to follow (background stage-in's), else a new one."""
        self._event = event or threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise CopierStopped

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, unless (or until) the copier is halted."""
        if self._event.wait(seconds):
            raise CopierStopped


class OrderedThrottle(Throttle):
    """A bandwidth cap (``None``: none) that serves the lowest priority first; see module doc.

    A copy thread calls :meth:`begin` with its shard's place in the copy order before the
    copy and :meth:`end` after it; ``copy_file`` calls :meth:`consume` per block.
    """

    def __init__(
        self,
        rate_bytes_per_s: float | None,
        stop: threading.Event,
        *,
        grace_s: float = GRACE_S,
        burst_s: float = BURST_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(rate_bytes_per_s, clock=clock)
        self.halt = Halt(stop)
        self.grace_s = grace_s
        self.burst_s = burst_s
        self._cond = threading.Condition()
        self._waiting: list[int] = []  # heap of the priorities waiting for the link
        self._busy_until = clock()  # the link is reserved until then
        self._holder: int | None = None  # priority of the last reservation's shard
        self._local = threading.local()

    def begin(self, priority: int) -> None:
        self._local.priority = priority

    def end(self) -> None:
        """The calling thread's shard is done: the next one in order may take the link."""
        priority = getattr(self._local, "priority", _LAST)
        self._local.priority = _LAST
        with self._cond:
            if self._holder == priority:
                self._holder = None
            self._cond.notify_all()

    def check(self) -> None:
        self.halt.check()

    def consume(self, nbytes: int) -> None:
        self.check()
        rate = self.rate_bytes_per_s
        if rate is None or nbytes <= 0:
            return
        priority = getattr(self._local, "priority", _LAST)
        with self._cond:
            heapq.heappush(self._waiting, priority)
            try:
                now = self._wait_turn(priority)
            finally:
                self._waiting.remove(priority)
                heapq.heapify(self._waiting)
            start = max(self._busy_until, now - self.burst_s)
            self._busy_until = start + nbytes / rate
            self._holder = priority
            self._cond.notify_all()
            until = self._busy_until
        # The reservation is made: sleep through it, waking early only to stop.
        delay = until - self._clock()
        if delay > 0:
            self.halt.pause(delay)
        self.check()

    def _wait_turn(self, priority: int) -> float:
        """Block (holding the condition) until ``priority`` may reserve; return the time."""
        while True:
            self.check()
            now = self._clock()
            timeout: float | None = 0.1  # re-check the stop flag at least this often
            if self._waiting[0] == priority:
                if self._holder is None or priority <= self._holder:
                    return now  # the earliest shard waiting, and no earlier one holds the link
                idle_at = self._busy_until + self.grace_s
                if now >= idle_at:
                    return now  # the earlier shard left the link idle: use it
                timeout = min(0.1, idle_at - now)
            self._cond.wait(timeout)
