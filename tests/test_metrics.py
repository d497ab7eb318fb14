"""Data-wait metrics: near zero when data keeps up, dominant when the data path is slow."""

from __future__ import annotations

import csv
import logging
import sys
import time
from pathlib import Path

import pytest

from stager_loaders import CsvMetrics, LoaderOptions, ShardedLoader, TensorBoardMetrics
from stager_loaders.metrics import LoaderMetrics, batch_length


class FakeClock:
    """``time.perf_counter`` that moves only when the test says so: the assertions below are exact
    on any machine, however loaded, instead of thresholds on real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def _run_epoch(loader: ShardedLoader, clock: FakeClock, step_s: float) -> dict[str, float]:
    loader.set_epoch(0)
    for _ in loader:
        clock.advance(step_s)  # the "model"
    return loader.metrics.as_dict()


def test_wait_is_zero_when_the_data_is_ready(
    small_dataset: Path, tmp_path: Path, clock: FakeClock
) -> None:
    """Only the time from asking for a batch to its arrival counts; the model's time does not."""
    loader = ShardedLoader(
        str(small_dataset),
        batch_size=16,
        num_workers=0,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    metrics = _run_epoch(loader, clock, step_s=0.02)
    assert metrics["steps"] == len(loader) and metrics["samples"] == loader.shard_samples.sum()
    assert metrics["wait_s_total"] == 0 and metrics["wait_fraction"] == 0
    # Over the window: every sample delivered, in the model's time from the first batch to
    # the last.
    assert metrics["samples_per_s"] == pytest.approx(
        metrics["samples"] / ((len(loader) - 1) * 0.02)
    )


def test_wait_dominates_when_the_data_path_is_slow(
    small_dataset: Path, tmp_path: Path, clock: FakeClock
) -> None:
    def slow_sample(sample: dict) -> dict:
        clock.advance(0.01)  # an artificially slow source/decode: 10 ms per sample
        return sample

    loader = ShardedLoader(
        str(small_dataset),
        batch_size=8,
        num_workers=0,
        map=slow_sample,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    metrics = _run_epoch(loader, clock, step_s=0.001)
    samples, steps = int(loader.shard_samples.sum()), len(loader)
    assert metrics["steps"] == steps and metrics["samples"] == samples
    assert metrics["wait_s_total"] == pytest.approx(samples * 0.01)  # 10 ms per sample waited for
    assert metrics["wait_ms_per_step"] == pytest.approx(1000 * samples * 0.01 / steps)
    # The window spans every step here: all of it was waiting but the model's 1 ms per step.
    span = samples * 0.01 + (steps - 1) * 0.001
    assert metrics["wait_fraction"] == pytest.approx(samples * 0.01 / span)


def test_metrics_log_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    metrics = LoaderMetrics(log_every=2)
    with caplog.at_level(logging.INFO, logger="stager_loaders"):
        for _ in range(4):
            metrics.record(0.001, 8)
    lines = [r.getMessage() for r in caplog.records if r.name == "stager_loaders"]
    assert len(lines) == 2 and "data wait" in lines[0] and "samples/s" in lines[0]


def test_batch_length_of_common_batch_shapes() -> None:
    assert batch_length({"__key__": ["a", "b"]}) == 2
    assert batch_length((["a", "b", "c"], [1, 2, 3])) == 3
    assert batch_length([[1, 2], [3, 4]]) == 2


def test_attached_csv_writer_gets_a_row_every_n_steps(tmp_path: Path, clock: FakeClock) -> None:
    metrics = LoaderMetrics()
    path = tmp_path / "m" / "loader-rank0.csv"
    with CsvMetrics(path) as writer:
        metrics.attach(writer, every_steps=2)
        for _ in range(5):
            clock.advance(0.25)  # waiting for the batch
            metrics.record(0.25, 8)
            clock.advance(0.25)  # the model's time
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [2, 4]
    # Step 4: four waits of 0.25 s over 1.75 s (first wait to fourth arrival).
    assert float(rows[-1]["samples"]) == 32
    assert float(rows[-1]["wait_fraction"]) == pytest.approx(1.0 / 1.75, rel=1e-5)
    # A requeued job appends to the same file; the header is not repeated.
    with CsvMetrics(path) as writer:
        writer.write(6, metrics.as_dict())
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("step,") and lines[-1].startswith("6,")


def test_tensorboard_writer_logs_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = LoaderMetrics()
    with TensorBoardMetrics(tmp_path / "tb") as writer:
        metrics.attach(writer, every_steps=1)
        metrics.record(0.0, 4)
        metrics.record(0.0, 4)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loader/wait_fraction", "loader/samples_per_s", "loader/samples"} <= tags
    assert [e.step for e in events.Scalars("loader/samples")] == [1, 2]
    assert [e.value for e in events.Scalars("loader/samples")] == [4.0, 8.0]


def test_tensorboard_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install tensorboard") as info:
        TensorBoardMetrics("unused")
    assert "\n" not in str(info.value)


def test_attach_refuses_a_zero_interval() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        LoaderMetrics().attach(CsvMetrics.__new__(CsvMetrics), every_steps=0)
