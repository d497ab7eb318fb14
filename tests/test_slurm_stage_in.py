"""stage-in on the real test cluster: one private scratch per node, one copier per node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def shared_dataset(slurm_cluster) -> Path:
    """A dataset on the cluster's shared filesystem, under a path with a space and a quote."""
    src = slurm_cluster.shared_dir / "data sets" / "it's" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=6, samples_per_shard=20, image_bytes=512, seed=3)
    )
    return src


def _shards(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tar") if ".stager" not in p.parts)


def test_nodes_have_own_hostname_and_gpus(slurm_cluster) -> None:
    out = slurm_cluster.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=1",
            "--gres=gpu:4",
            "sh",
            "-c",
            'echo "$(hostname) $SLURM_NODEID"',
        ]
    )
    assert sorted(out.stdout.split("\n")[:2]) == ["node1 0", "node2 1"]


def test_stage_in_fills_each_nodes_private_scratch(slurm_cluster, shared_dataset: Path) -> None:
    script = (
        'stage-in "$0" --quiet && touch "/scratch/$SLURM_JOB_ID/only-on-$(hostname)" '
        '&& echo "$SLURM_JOB_ID"'
    )
    out = slurm_cluster.run(
        ["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", script, str(shared_dataset)]
    )
    job_id = out.stdout.split()[0]
    # The summary line of each node reaches the job's output.
    assert "[node1] stage-in: 6 files, 6 copied" in out.stderr, out.stderr
    assert "[node2] stage-in: 6 files, 6 copied" in out.stderr, out.stderr
    for node, other in (("node1", "node2"), ("node2", "node1")):
        job_dir = slurm_cluster.scratch(node) / job_id
        assert _shards(job_dir / "ds") == _shards(shared_dataset)
        assert (job_dir / f"only-on-{node}").exists()
        assert not (job_dir / f"only-on-{other}").exists()
    # Seen from inside the nodes: each /scratch holds only its own node's marker.
    seen = slurm_cluster.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=1",
            "sh",
            "-c",
            f'echo "$(hostname):$(ls /scratch/{job_id} | grep only-on)"',
        ]
    )
    assert sorted(seen.stdout.split()) == ["node1:only-on-node1", "node2:only-on-node2"]


def test_two_tasks_per_node_copy_each_shard_once(slurm_cluster, shared_dataset: Path) -> None:
    reports = slurm_cluster.shared_dir / "reports two tasks"
    reports.mkdir()
    # A bandwidth cap stretches the copy (~5 s) past the tasks' start skew, so the second task
    # on a node really finds the lock held and must wait for the copier instead of copying.
    script = 'stage-in "$0" --quiet --jitter-max 0 --bw-limit 0.05 --report "$1/$SLURM_PROCID.json"'
    slurm_cluster.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=2",
            "sh",
            "-c",
            script,
            str(shared_dataset),
            str(reports),
        ]
    )
    total_bytes = sum(p.stat().st_size for p in shared_dataset.rglob("*.tar"))
    by_node: dict[str, list[dict]] = {}
    for path in sorted(reports.glob("*.json")):
        report = json.loads(path.read_text())
        by_node.setdefault(report["node"], []).append(report)
    assert sorted(by_node) == ["node1", "node2"]
    for node, node_reports in by_node.items():
        assert sorted(r["role"] for r in node_reports) == ["copier", "waiter"], (node, node_reports)
        copier = next(r for r in node_reports if r["role"] == "copier")
        waiter = next(r for r in node_reports if r["role"] == "waiter")
        assert copier["files_copied"] == 6 and copier["files_failed"] == 0
        assert copier["bytes_read_source"] == total_bytes
        # The waiter's report is the copier's result, adopted: no second read of the source.
        assert {k: waiter[k] for k in ("files_copied", "bytes_read_source", "dataset_dir")} == {
            k: copier[k] for k in ("files_copied", "bytes_read_source", "dataset_dir")
        }
