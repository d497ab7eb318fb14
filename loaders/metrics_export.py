"""Loader metrics (data-wait fraction, samples/s) to a CSV file or to TensorBoard.

Both writers take ``write(step, metrics)`` with the dict of
:meth:`stager_loaders.LoaderMetrics.as_dict`, so either can be attached to a loader
(``loader.metrics.attach(writer, every_steps=50)``) or called from the training loop with its
own step. TensorBoard is optional: :class:`TensorBoardMetrics` imports
``torch.utils.tensorboard`` when it is created and says in one line what to install.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CsvMetrics", "TensorBoardMetrics", "METRIC_FIELDS"]

#: Columns of the CSV file, in order: the keys of ``LoaderMetrics.as_dict()`` after ``step``.
METRIC_FIELDS = (
    "steps",
    "samples",
    "wait_s_total",
    "wait_ms_per_step",
    "wait_fraction",
    "samples_per_s",
    "staging_wait_s",
    "shards_waited",
)


class CsvMetrics:
    """Append one row per ``write`` to ``path`` (header written once, when the file is new).

    Appending lets a requeued job continue the same file; each row is flushed, so a killed job
    keeps every row it wrote. Give each rank its own file (``loader-rank{rank}.csv``): the wait
    of one rank stalls all of them, so the per-rank files show which one is data-bound.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - closed by close()
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(("step", *METRIC_FIELDS))
            self._file.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._csv.writerow((step, *(_fmt(metrics.get(name, "")) for name in METRIC_FIELDS)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CsvMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


class TensorBoardMetrics:
    """``add_scalar`` of every metric under ``prefix`` (``loader/wait_fraction``, ...).

    Pass ``log_dir`` to open a ``SummaryWriter`` of its own, or ``writer`` to share the one the
    training script already logs to (it is then not closed here).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        writer: Any = None,
        prefix: str = "loader/",
    ):
        if writer is None:
            writer = _summary_writer_class()(log_dir=None if log_dir is None else str(log_dir))
            self._owned = True
        else:
            self._owned = False
        self.writer = writer
        self.prefix = prefix

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for name in METRIC_FIELDS:
            if name in metrics and name != "steps":
                self.writer.add_scalar(self.prefix + name, metrics[name], step)

    def close(self) -> None:
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> TensorBoardMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises ImportError naming tensorboard when it is missing
        raise ModuleNotFoundError(
            "TensorBoardMetrics needs the tensorboard package, which is not installed here "
            f"({exc}); pip install tensorboard (or write CSV with CsvMetrics)",
            name="tensorboard",
        ) from None
    return SummaryWriter
