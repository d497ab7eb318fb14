"""Data-wait metrics: near zero when data keeps up, dominant when the data path is slow."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from loaders import LoaderOptions, ShardedLoader
from loaders.metrics import LoaderMetrics, batch_length


def _slow_sample(sample: dict) -> dict:
    time.sleep(0.01)  # an artificially slow source/decode: 10 ms per sample
    return sample


def _run_epoch(loader: ShardedLoader, step_s: float) -> dict[str, float]:
    loader.set_epoch(0)
    for _ in loader:
        time.sleep(step_s)  # the "model"
    return loader.metrics.as_dict()


def test_wait_is_near_zero_when_the_loader_keeps_up(small_dataset: Path, tmp_path: Path) -> None:
    loader = ShardedLoader(
        str(small_dataset), batch_size=16, num_workers=0, to_tuple=("__key__",), options=LoaderOptions(dest=str(tmp_path))
    )
    metrics = _run_epoch(loader, step_s=0.02)
    assert metrics["steps"] == len(loader)
    assert metrics["wait_fraction"] < 0.25, metrics
    assert metrics["samples_per_s"] > 0


def test_wait_dominates_when_the_data_path_is_slow(small_dataset: Path, tmp_path: Path) -> None:
    loader = ShardedLoader(
        str(small_dataset), batch_size=8, num_workers=0, map=_slow_sample, to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    metrics = _run_epoch(loader, step_s=0.001)
    assert metrics["wait_fraction"] > 0.7, metrics
    assert metrics["wait_ms_per_step"] > 50  # 8 samples x 10 ms


def test_metrics_log_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    metrics = LoaderMetrics(log_every=2)
    with caplog.at_level(logging.INFO, logger="loaders"):
        for _ in range(4):
            metrics.record(0.001, 8)
    lines = [r.getMessage() for r in caplog.records if r.name == "loaders"]
    assert len(lines) == 2 and "data wait" in lines[0] and "samples/s" in lines[0]


def test_batch_length_of_common_batch_shapes() -> None:
    assert batch_length({"__key__": ["a", "b"]}) == 2
    assert batch_length((["a", "b", "c"], [1, 2, 3])) == 3
    assert batch_length([[1, 2], [3, 4]]) == 2
