"""stage-in --fanout on the real test cluster: 2 nodes under srun, private /scratch each.

The rendezvous is what a user gets: the job's first node, port derived from the job id. Source
bytes are counted by the ``countfile://`` filesystem of test_fanout_procs.py, loaded into the
tasks through PYTHONPATH (srun exports the environment).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .test_fanout_procs import SITECUSTOMIZE, _assert_identical, _total

pytestmark = pytest.mark.slurm


def test_two_nodes_under_srun_read_the_source_once(slurm_cluster) -> None:
    shared = slurm_cluster.shared_dir / "fanout"
    src = shared / "data" / "ds"
    write_synthetic_dataset(
        src,
        SyntheticSpec(num_shards=8, samples_per_shard=20, image_bytes=4000, uneven=True, seed=9),
    )
    (shared / "site").mkdir()
    (shared / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    count_log = shared / "source-reads.log"
    count_log.write_text("")
    script = (
        'stage-in "countfile://$0" --fanout --quiet --fanout-timeout 60 --report '
        '"$1/report-$SLURM_NODEID.json" '
        '&& echo "$SLURM_JOB_ID"'
    )
    out = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", script, str(src), str(shared)],
        env={"PYTHONPATH": str(shared / "site"), "FANOUT_TEST_COUNT_LOG": str(count_log)},
        timeout=180,
    )
    job_id = out.stdout.split()[0]
    assert "warning" not in out.stderr, out.stderr  # the group formed: no fallback
    total = _total(src)
    assert sum(int(n) for n in count_log.read_text().split()) == total
    reports = [json.loads((shared / f"report-{rank}.json").read_text()) for rank in range(2)]
    assert sorted(r["node"] for r in reports) == ["node1", "node2"]
    for report in reports:
        assert report["fanout"] == "on" and report["files_copied"] == 8, report
        assert report["bytes_read_source"] + report["bytes_received_peers"] == total
    assert sum(r["bytes_read_source"] for r in reports) == total
    for node in slurm_cluster.node_names:
        staged = Path(slurm_cluster.scratch(node)) / job_id / "ds"
        _assert_identical(src, staged)


def test_two_tasks_per_node_join_the_group_once_per_node(slurm_cluster) -> None:
    """--ntasks-per-node=2: one task per node copies and joins the group, the other adopts its
    result."""
    shared = slurm_cluster.shared_dir / "fanout-2tasks"
    src = shared / "data" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=6, samples_per_shard=20, image_bytes=4000, seed=4)
    )
    (shared / "site").mkdir()
    (shared / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    count_log = shared / "source-reads.log"
    count_log.write_text("")
    # A bandwidth cap keeps the copier busy well past the tasks' start skew, so the second task
    # of each node really finds the lock held.
    script = (
        'stage-in "countfile://$0" --fanout --quiet --fanout-timeout 60 --bw-limit 0.1 '
        '--report "$1/report-$SLURM_PROCID.json"'
    )
    slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=2", "sh", "-c", script, str(src), str(shared)],
        env={"PYTHONPATH": str(shared / "site"), "FANOUT_TEST_COUNT_LOG": str(count_log)},
        timeout=180,
    )
    total = _total(src)
    assert sum(int(n) for n in count_log.read_text().split()) == total
    by_node: dict[str, list[dict]] = {}
    for rank in range(4):
        report = json.loads((shared / f"report-{rank}.json").read_text())
        by_node.setdefault(report["node"], []).append(report)
    assert sorted(by_node) == ["node1", "node2"]
    for node, reports in by_node.items():
        assert sorted(r["role"] for r in reports) == ["copier", "waiter"], (node, reports)
        assert all(r["fanout"] == "on" and r["exit_code"] == 0 for r in reports), reports
