"""kill -9 during stage-out, at random points: the previous checkpoint stays restorable, no half
checkpoint is ever committed, and the next run cleans up and commits."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import BIN, clean_env
from .test_stageout import (
    assert_committed_whole,
    records,
    restore_here,
    same_tree,
    set_mtime,
    stage,
    staging_entries,
    write_ckpt_dir,
)


def _trial(tmp_path: Path, seed: int) -> float:
    """One kill at a random moment of a ~1 s stage-out; returns the delay used."""
    rng = random.Random(seed)
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    old = write_ckpt_dir(scratch / "step-1", files=2, seed=1)
    set_mtime(old, 1_700_000_000)
    assert stage(dest, old) == ["committed"]
    new = write_ckpt_dir(scratch / "step-2", files=24, size=200_000, seed=2)  # ~4.8 MB at 8 MB/s

    proc = subprocess.Popen(
        [str(BIN / "stage-out"), "--bw-limit", "8", str(new), str(dest)],
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if seed % 3 == 0:  # during start-up, hashing or the first bytes
        delay_s = rng.uniform(0.05, 0.5)
        time.sleep(delay_s)
    else:  # once the attempt exists at DEST: mid-copy, during the commit, or just after
        started = time.monotonic()
        while not staging_entries(dest) and proc.poll() is None and time.monotonic() - started < 20:
            time.sleep(0.005)
        delay_s = rng.uniform(0.0, 0.8)
        time.sleep(delay_s)
    proc.kill()
    proc.wait(timeout=30)

    committed = assert_committed_whole(dest)  # whatever is committed is whole
    if (dest / "step-2").exists():  # on a local DEST even an uncommitted NAME is never torn
        assert same_tree(new, dest / "step-2")
    assert set(committed) <= {"step-1", "step-2"} and "step-1" in committed
    restored = restore_here(dest, tmp_path / f"local-{seed}")
    assert same_tree(new if "step-2" in committed else old, restored)

    assert stage(dest, new) in (["committed"], ["already"])
    assert set(assert_committed_whole(dest)) == {"step-1", "step-2"}
    assert same_tree(new, dest / "step-2") and same_tree(old, dest / "step-1")
    assert staging_entries(dest) == []  # the killed attempt's leftovers are gone
    assert set(records(dest)) == {"step-1", "step-2"}
    return delay_s


@pytest.mark.parametrize("seed", range(3))
def test_kill_9_at_a_random_point(tmp_path: Path, seed: int) -> None:
    _trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 23))
def test_kill_9_at_a_random_point_many(tmp_path: Path, seed: int) -> None:
    _trial(tmp_path, seed)
