"""A token bucket shared by all copy streams of a node, for ``--bw-limit``.

The limit is per node, not per stream: with 16 streams and ``--bw-limit 200`` the node reads at
most ~200 MB/s from the shared filesystem in total, which is what an NFS admin asks for.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Throttle"]


class Throttle:
    """Blocks callers so that bytes consumed per second stay under ``rate_bytes_per_s``.

    ``None`` means unlimited. The bucket holds at most one second of tokens so a stream that
    was idle cannot burst far above the limit afterwards.
    """

    def __init__(self, rate_bytes_per_s: float | None, *, clock=time.monotonic, sleep=time.sleep):
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError("rate must be positive or None")
        self.rate_bytes_per_s = rate_bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = clock()

    def consume(self, nbytes: int) -> None:
        """Account for ``nbytes`` just read, sleeping as long as the budget requires."""
        if self.rate_bytes_per_s is None or nbytes <= 0:
            return
        with self._lock:
            now = self._clock()
            capacity = self.rate_bytes_per_s
            self._tokens = min(capacity, self._tokens + (now - self._last) * self.rate_bytes_per_s)
            self._last = now
            self._tokens -= nbytes
            deficit = -self._tokens
        if deficit > 0:
            self._sleep(deficit / self.rate_bytes_per_s)
