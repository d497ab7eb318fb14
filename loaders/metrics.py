"""Is training waiting for data? Per-step data-wait time and throughput of a loader.

The wait of a step is the time from the training loop asking for the next batch until it
arrives; the rest of the step is the model's. A data-bound job shows a wait fraction well above
zero; a compute-bound one shows near-zero waits because workers prefetch ahead. Logged every
``log_every`` steps on the ``loaders`` logger, and available as a dict for any tracker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoaderMetrics", "batch_length"]

log = logging.getLogger("stager_loaders")


def batch_length(batch: Any) -> int:
    """Samples in a collated batch: dict (``__key__`` or any field), tuple/list, or tensor."""
    if isinstance(batch, dict):
        value = batch.get("__key__", next(iter(batch.values()), ()))
        return len(value)
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        return len(first) if hasattr(first, "__len__") else len(batch)
    return len(batch) if hasattr(batch, "__len__") else 1


@dataclass
class LoaderMetrics:
    """Running totals plus a sliding window of the last ``window`` steps."""

    log_every: int = 0  # steps between log lines; 0: never log
    window: int = 100
    steps: int = 0
    samples: int = 0
    wait_s: float = 0.0
    _started: float | None = field(default=None, init=False, repr=False)
    _recent: deque = field(default_factory=deque, init=False, repr=False)  # (wait_s, samples, at)

    def start_epoch(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def record(self, wait_s: float, samples: int) -> None:
        now = time.perf_counter()
        if self._started is None:
            self._started = now - wait_s
        self.steps += 1
        self.samples += samples
        self.wait_s += wait_s
        self._recent.append((wait_s, samples, now))
        while len(self._recent) > self.window:
            self._recent.popleft()
        if self.log_every and self.steps % self.log_every == 0:
            m = self.as_dict()
            log.info(
                "step %d: data wait %.1f ms/step (%.1f%% of the time), %.0f samples/s",
                self.steps,
                m["wait_ms_per_step"],
                100 * m["wait_fraction"],
                m["samples_per_s"],
            )

    def as_dict(self) -> dict[str, float]:
        """Totals since creation and rates over the recent window."""
        recent = list(self._recent)
        if len(recent) >= 2:
            span = recent[-1][2] - recent[0][2] + recent[0][0]
            rate = sum(s for _, s, _ in recent) / span if span > 0 else 0.0
            fraction = sum(w for w, _, _ in recent) / span if span > 0 else 0.0
        else:
            elapsed = (time.perf_counter() - self._started) if self._started is not None else 0.0
            rate = self.samples / elapsed if elapsed > 0 else 0.0
            fraction = self.wait_s / elapsed if elapsed > 0 else 0.0
        return {
            "steps": float(self.steps),
            "samples": float(self.samples),
            "wait_s_total": self.wait_s,
            "wait_ms_per_step": 1000 * sum(w for w, _, _ in recent) / len(recent)
            if recent
            else 0.0,
            "wait_fraction": min(1.0, fraction),
            "samples_per_s": rate,
        }
