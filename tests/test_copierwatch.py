"""CopierWatch: the one rule for "the background copier is gone" (its node lock free for
GONE_AFTER_S with no result), shared by --wait-staged, the loader's shard gate and its monitor."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from stager.layout import StagedDataset
from stager.stagein.status import GONE_AFTER_S, CopierWatch


def test_the_grace_runs_from_the_first_free_sighting_and_a_held_lock_starts_it_over(
    tmp_path: Path,
) -> None:
    staged = StagedDataset.of(tmp_path / "ds")
    staged.lock_path.parent.mkdir(parents=True, exist_ok=True)
    watch = CopierWatch(staged)
    assert watch.free_for(100.0) == 0.0  # no lock file at all: free, first seen now
    assert not watch.gone(100.0 + GONE_AFTER_S)  # not longer than the grace
    assert watch.gone(100.1 + GONE_AFTER_S)
    fd = os.open(staged.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a copier (another open file description) holds it
        assert watch.free_for(200.0) is None
        assert not watch.gone(1e9, at_once=True)
    finally:
        os.close(fd)
    assert watch.free_for(300.0) == 0.0  # held in between: the grace starts over
    assert watch.gone(300.0, at_once=True)  # the end of an epoch does not wait for it
    assert watch.free_for(301.0) == 1.0
    watch.forget()
    assert watch.free_for(302.0) == 0.0
