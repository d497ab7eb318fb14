"""The stream count for files too small to time, found by measuring how fast files complete.

The stream controller (:mod:`stager.stagein.streams`) sizes the stream count from each file's
latency and transfer time. A shard that arrives whole in its first read has no transfer time
to measure, and then the latency it sees is not the link's alone: on a page-cached or
memory-speed source it is the copy's own Python work, which one interpreter runs one thread at
a time. Each system call hands the interpreter to another thread and back, so more streams
only add that traffic: 10,000 shards of 20 KB from tmpfs took 2.7 s with one stream and 4.1 s
with two, 5.7 s with the controller's 4-64. Behind NFS round trips the same files need dozens.

So for these files the limit is searched, not computed: after each window (at least
``window_s`` seconds and ``min_files`` files) the completion rate is compared with the previous
window's. The search divides the limit by ``factor`` while that does not make the rate worse
than ``1 - tolerance`` of the last, and goes back one step and holds as soon as it does. After
``hold_windows`` windows held it looks the other way (more streams if it last went down), so
a source that slows down or speeds up later is followed; each look that changes nothing
doubles the wait before the next, since a look costs a window at a worse limit. Fewer
streams win ties: they load the shared filesystem less.
"""

from __future__ import annotations

__all__ = ["RateProbe"]


class RateProbe:
    """Searches the stream limit between ``floor`` and ``ceiling`` by completion rate.

    Not thread-safe: the controller calls :meth:`completed` under its lock. Time is passed in
    (``now``, seconds) so the search can be tested without a clock.
    """

    def __init__(
        self,
        ceiling: int,
        *,
        floor: int = 1,
        window_s: float = 0.2,
        min_files: int = 32,
        tolerance: float = 0.1,
        hold_windows: int = 10,
        factor: int = 4,
    ) -> None:
        self.ceiling, self.floor = ceiling, max(1, min(floor, ceiling))
        self.window_s, self.min_files = window_s, min_files
        self.tolerance, self.hold_windows, self.factor = tolerance, hold_windows, factor
        self.limit = ceiling
        self._window_start: float | None = None
        self._files = 0
        self._previous: tuple[int, float] | None = None  # (limit, rate) of the last window
        self._step = -1  # -1: halving, +1: doubling, 0: holding
        self._last_step = -1  # the direction of the last search
        self._held = 0
        self._patience = hold_windows  # windows to hold before looking again
        self._looked_from: int | None = None  # the limit held when the search looked again

    def start(self, limit: int) -> None:
        """Begin a search from ``limit`` (the controller's limit when these files began)."""
        self.limit = max(self.floor, min(self.ceiling, limit))
        self._window_start, self._files, self._previous = None, 0, None
        self._step = self._last_step = -1
        self._held, self._patience, self._looked_from = 0, self.hold_windows, None

    def completed(self, now: float, files: int = 1) -> int:
        """Count ``files`` finished at time ``now``; returns the limit to run at."""
        if self._window_start is None:
            self._window_start = now  # the first file only opens the window
            return self.limit
        self._files += files
        elapsed = now - self._window_start
        if elapsed >= self.window_s and self._files >= self.min_files:
            self._judge(self._files / elapsed)
            self._window_start, self._files = now, 0
        return self.limit

    def _judge(self, rate: float) -> None:
        if self._step == 0:
            self._held += 1
            if self._held >= self._patience:  # look again, the other way from last time
                self._held, self._looked_from = 0, self.limit
                step = -self._last_step
                if self.limit == self.floor or self.limit == self.ceiling:
                    step = 1 if self.limit == self.floor else -1  # the only way there is
                self._step = self._last_step = step
                self._advance(rate)
            return
        previous = self._previous
        if previous is not None and not self._kept(rate, previous[1]):
            self.limit = previous[0]  # one step back
            self._hold()
            return
        self._advance(rate)

    def _hold(self) -> None:
        """Stop searching. A look that changed nothing doubles the wait before the next (up
        to 32 times ``hold_windows``): a steady source pays for fewer looks."""
        self._step, self._previous = 0, None
        if self._looked_from is None or self.limit != self._looked_from:
            self._patience = self.hold_windows
        else:
            self._patience = min(2 * self._patience, 32 * self.hold_windows)

    def _kept(self, rate: float, before: float) -> bool:
        """Whether the step just taken stands: fewer streams must not be slower, more streams
        must be clearly faster."""
        if self._step < 0:
            return rate >= before * (1 - self.tolerance)
        return rate > before * (1 + self.tolerance)

    def _advance(self, rate: float) -> None:
        """Record this window and take the next step, or hold at a bound."""
        self._previous = (self.limit, rate)
        moved = self.limit // self.factor if self._step < 0 else self.limit * self.factor
        moved = max(self.floor, min(self.ceiling, moved))
        if moved == self.limit:
            self._hold()
        self.limit = moved
