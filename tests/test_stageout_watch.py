"""stage-out --watch as a real background process: picks up new checkpoints, stops on signals."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import BIN, clean_env
from .test_stageout import (
    assert_committed_whole,
    records,
    same_tree,
    staging_entries,
    write_ckpt_dir,
)


def _wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _start(scratch: Path, dest: Path, *extra: str) -> subprocess.Popen:
    argv = [
        str(BIN / "stage-out"),
        "--watch",
        "--all",
        "--interval",
        "0.2",
        "--settle",
        "0.3",
        *extra,
        str(scratch),
        str(dest),
    ]
    return subprocess.Popen(
        argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen, sig: int) -> tuple[int, str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_watch_picks_up_new_checkpoints_and_stops_cleanly(tmp_path: Path, sig: int) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    scratch.mkdir()
    proc = _start(scratch, dest)
    try:
        write_ckpt_dir(scratch / "step-1", seed=1)
        assert _wait_for(lambda: "step-1" in records(dest)), "first checkpoint not staged"
        write_ckpt_dir(scratch / "step-2", seed=2)
        assert _wait_for(lambda: "step-2" in records(dest)), "new checkpoint not picked up"
    finally:
        rc, out, err = _finish(proc, sig)
    assert rc == 0, err
    assert out == ""
    assert "watch stopped" in err
    assert set(assert_committed_whole(dest)) == {"step-1", "step-2"}
    assert same_tree(scratch / "step-2", dest / "step-2")


def test_sigusr1_during_a_copy_finishes_it_and_exits_0(tmp_path: Path) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    scratch.mkdir()
    proc = _start(scratch, dest, "--bw-limit", "4")
    try:
        write_ckpt_dir(scratch / "step-1", files=8, size=500_000, seed=3)  # ~4 MB: ~1 s at 4 MB/s
        # In flight: an attempt exists at the destination but nothing is committed yet.
        assert _wait_for(lambda: bool(staging_entries(dest)) and not records(dest)), (
            "copy never started"
        )
    finally:
        rc, _, err = _finish(proc, signal.SIGUSR1)
    assert rc == 0, err
    # What was in flight is committed whole (this implementation finishes it) - never half.
    assert set(assert_committed_whole(dest)) == {"step-1"}
    assert same_tree(scratch / "step-1", dest / "step-1")
    assert staging_entries(dest) == []


def test_second_signal_abandons_the_copy_atomically(tmp_path: Path) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    scratch.mkdir()
    proc = _start(scratch, dest, "--bw-limit", "2")
    try:
        write_ckpt_dir(scratch / "step-1", files=8, size=500_000, seed=4)  # ~2 s at 2 MB/s
        assert _wait_for(lambda: bool(staging_entries(dest)) and not records(dest)), (
            "copy never started"
        )
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    finally:
        rc, _, err = _finish(proc, signal.SIGTERM)
    assert rc == 130, err
    assert records(dest) == {} and not (dest / "step-1").exists()
    assert staging_entries(dest) == []
