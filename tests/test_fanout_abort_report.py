"""What a fan-out stopped by a dead peer reports: the shards it left staged, and its time.

An owner's source reads run ahead of its broadcasts and publish each shard (journaled) when
read; the report counted a shard only once broadcast, so a run failed by a dead peer said
"0 copied ... 0 B in 0.00 s" beside shards it had staged and kept for the rerun. Found by a
hostile review.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from stager.errors import EXIT_FANOUT

from .test_fanout_procs import Nodes, _finish, _shards, fanout_dataset  # noqa: F401 - a fixture


def test_a_fanout_failed_by_a_dead_peer_reports_what_it_staged(
    fanout_dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    nodes = Nodes(tmp_path, 2)
    procs = nodes.start(fanout_dataset, "--bw-limit", "0.5", "--fanout-op-timeout", "60")
    mine = nodes.dest(0) / "ds"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (not mine.exists() or not _shards(mine)):
        assert procs[0].poll() is None and procs[1].poll() is None, _finish(procs)
        time.sleep(0.05)
    # Node 1 stops answering: node 0's main thread waits in a collective while its readers
    # go on publishing its own shards; then node 1 dies.
    procs[1].send_signal(signal.SIGSTOP)
    time.sleep(4)
    procs[1].send_signal(signal.SIGKILL)
    results = _finish(procs)
    code, err = results[0]
    assert code == EXIT_FANOUT, err
    report = nodes.report(0)
    staged = _shards(mine)
    assert report["files_copied"] == len(staged) > 0, (report, staged)
    assert report["bytes_copied"] == sum((mine / rel).stat().st_size for rel in staged)
    assert report["seconds"] > 0, report
