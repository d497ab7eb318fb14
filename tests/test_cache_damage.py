"""The node cache damaged, stopped or left half-done: each is passed by or repaired, in one line.

What a cache holds outlives jobs, versions of stager and kills; a damaged part of it must cost
at most a copy from the source, never a job (tests/test_cache.py holds the rest of the cache's
promises).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .inproc import clean_process_env, run_main
from .test_fanout_procs import _assert_identical

SPEC = SyntheticSpec(num_shards=4, samples_per_shard=6, image_bytes=800, seed=9)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


def _stage(capsys, src: Path, dest: Path, cache: Path, *extra: str) -> tuple[int, dict, str]:
    report = dest.parent / f"{dest.name}.report.json"
    argv = ["stage-in", str(src), "--dest", str(dest), "--cache", str(cache), "--quiet"]
    result = run_main(capsys, *argv, "--jitter-max", "0", "--report", str(report), *extra)
    payload = json.loads(report.read_text()) if report.exists() else {}
    return result.returncode, payload, result.stderr


def _dataset_record(cache: Path) -> Path:
    (record,) = (cache / "datasets").glob("*.json")
    return record


def test_a_dataset_record_of_another_shape_is_no_record(capsys, tmp_path: Path) -> None:
    """Valid JSON that is not this version's record (damaged, or another version's) is passed
    by as no record: stage-in, `stager ls` and `stager clean --cache` ended in a TypeError."""
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    assert _stage(capsys, src, tmp_path / "job1", cache)[0] == 0
    record = _dataset_record(cache)
    payload = json.loads(record.read_text())
    payload["shards"] = {relpath: entry[1] for relpath, entry in payload["shards"].items()}
    record.write_text(json.dumps(payload))

    code, report, stderr = _stage(capsys, src, tmp_path / "job2", cache)
    assert code == 0, stderr
    _assert_identical(src, tmp_path / "job2" / "ds")
    record.write_text(json.dumps(payload))  # (job2 wrote a good one)
    listed = run_main(capsys, "stager", "ls", "--cache", str(cache))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    cleaned = run_main(capsys, "stager", "clean", "--cache", str(cache))
    assert cleaned.returncode == 0 and "Traceback" not in cleaned.stderr, cleaned.stderr
    code, report, stderr = _stage(capsys, src, tmp_path / "job3", cache)
    assert code == 0, stderr
    _assert_identical(src, tmp_path / "job3" / "ds")
