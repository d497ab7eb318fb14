"""Progress for long copies: a tqdm bar on a terminal, plain periodic lines in batch logs.

``slurm-%j.out`` is not a terminal: a carriage-return bar there becomes megabytes of noise, so
in a non-TTY we print one line every ``interval_s`` instead. ``quiet`` prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from stager.units import human_bytes

__all__ = ["Progress"]


class Progress:
    """Thread-safe byte/file counter rendered as tqdm, periodic lines, or nothing."""

    def __init__(
        self,
        total_bytes: int,
        total_files: int,
        *,
        label: str,
        mode: str = "auto",
        interval_s: float = 10.0,
        stream: TextIO | None = None,
    ):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.interval_s = interval_s
        self.bytes_done = 0
        self.files_done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_line = self._start
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=label,
                file=self.stream,
            )

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_done += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)
            elif self.mode == "lines":
                now = time.monotonic()
                if now - self._last_line >= self.interval_s:
                    self._last_line = now
                    self._print_line(now)

    def add_totals(self, nbytes: int, files: int = 0) -> None:
        """Grow the totals by shards sized after the start (see :mod:`stager.stagein.sizing`)."""
        with self._lock:
            self.total_bytes += nbytes
            self.total_files += files
            if self._bar is not None:
                self._bar.total = self.total_bytes
                self._bar.refresh()

    def file_done(self, files: int = 1) -> None:
        with self._lock:
            self.files_done += files
            if self._bar is not None:
                self._bar.set_postfix_str(
                    f"files {self.files_done}/{self.total_files}", refresh=False
                )

    def _print_line(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        pct = 100.0 * self.bytes_done / self.total_bytes if self.total_bytes else 100.0
        print(
            f"{self.label}: {pct:5.1f}% "
            f"{human_bytes(self.bytes_done)}/{human_bytes(self.total_bytes)} "
            f"files {self.files_done}/{self.total_files} {self.bytes_done / elapsed / 1e6:.1f} "
            "MB/s",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
