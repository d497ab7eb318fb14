"""Is training waiting for data? Per-step data-wait time and throughput of a loader.

The wait of a step is the time from the training loop asking for the next batch until it
arrives; the rest of the step is the model's. A data-bound job shows a wait fraction well above
zero; a compute-bound one shows near-zero waits because workers prefetch ahead. Logged every
``log_every`` steps on the ``loaders`` logger, available as a dict for any tracker, and sent
to attached writers (CSV, TensorBoard: :mod:`stager_loaders.metrics_export`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["LoaderMetrics", "MetricsWriter", "batch_length"]

log = logging.getLogger("stager_loaders")


def _sized(value: Any) -> int | None:
    """``len(value)`` when it has one; None for scalars, 0-d tensors and arrays, strings."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return len(value)
    except TypeError:  # no __len__, or a 0-d tensor/array, which has one that raises
        return None


def batch_length(batch: Any) -> int:
    """Samples in a collated batch: dict (``__key__`` or the first sized field), tuple/list, or
    tensor; 1 when nothing in it has a length.

    Total on purpose: it runs on every batch whatever the user's ``collate_fn`` returns (a dict
    whose first value is a number, a custom object), and a metric must never stop training.
    """
    if isinstance(batch, Mapping):
        fields = [batch["__key__"]] if "__key__" in batch else []
        fields += list(batch.values())
    elif isinstance(batch, (tuple, list)):
        fields = list(batch)
        if fields and _sized(fields[0]) is None:
            return len(fields)  # a list of samples, not of columns
    else:
        fields = [batch]
    for value in fields:
        length = _sized(value)
        if length is not None:
            return length
    return 1


class MetricsWriter(Protocol):
    """Where :meth:`LoaderMetrics.attach` sends the metrics: CSV, TensorBoard, a tracker."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...


@dataclass
class LoaderMetrics:
    """Running totals plus a sliding window of the last ``window`` steps."""

    log_every: int = 0  # steps between log lines; 0: never log
    window: int = 100
    steps: int = 0
    samples: int = 0
    wait_s: float = 0.0
    #: Seconds DataLoader workers (or the loader itself) waited for shards that stage-in
    #: --background had not published yet, and how many times; part of ``wait_s`` when the
    #: training loop had nothing else to wait for.
    staging_wait_s: float = 0.0
    shards_waited: int = 0
    _started: float | None = field(default=None, init=False, repr=False)
    _recent: deque = field(default_factory=deque, init=False, repr=False)  # (wait_s, samples, at)
    _writers: list = field(default_factory=list, init=False, repr=False)  # (writer, every_steps)

    def attach(self, writer: MetricsWriter, every_steps: int = 100) -> None:
        """Send :meth:`as_dict` to ``writer.write(step, metrics)`` every ``every_steps`` batches.

        ``step`` counts the batches this loader delivered since it was created. To log against
        the training loop's own step instead, call ``writer.write(step, loader.metrics.as_dict())``
        yourself.
        """
        if every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, not {every_steps}")
        self._writers.append((writer, every_steps))

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
        for writer, every_steps in self._writers:
            if self.steps % every_steps == 0:
                writer.write(self.steps, self.as_dict())
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
            "staging_wait_s": self.staging_wait_s,
            "shards_waited": float(self.shards_waited),
        }
