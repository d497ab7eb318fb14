"""The test cluster itself: rendered config and stale-run reaping (fast), isolation (slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster.cluster import ROOT_PREFIX, SlurmCluster, reap_stale
from .cluster.config import ClusterLayout, render_gres_conf, render_hosts, render_slurm_conf


def _layout(num_nodes: int = 3) -> ClusterLayout:
    ports = tuple(range(17001, 17001 + num_nodes))
    return ClusterLayout(
        Path("/tmp/c 1"), num_nodes=num_nodes, host_name="vm", ctld_port=17000, node_ports=ports
    )


def test_one_node_line_per_node_with_its_own_port_and_fake_gpus() -> None:
    conf = render_slurm_conf(_layout(3))
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert [line.split()[0] for line in nodes] == [
        "NodeName=node1",
        "NodeName=node2",
        "NodeName=node3",
    ]
    assert [line.split()[3] for line in nodes] == ["Port=17001", "Port=17002", "Port=17003"]
    assert all("NodeHostname=vm" in line and "Gres=gpu:4" in line for line in nodes)
    assert "SlurmctldHost=vm(127.0.0.1)" in conf and "SlurmctldPort=17000" in conf
    # Declared CPUs exceed the machine's: without config_overrides slurmd would drain the nodes.
    assert "SlurmdParameters=config_overrides" in conf and "GresTypes=gpu" in conf
    assert "AuthInfo=socket=/tmp/c 1/munge/munge.socket,cred_expire=15" in conf


def test_gres_and_hosts() -> None:
    layout = _layout(2)
    assert render_gres_conf(layout) == "Name=gpu File=/tmp/c 1/fakegpu/gpu[0-3]\n"
    hosts = render_hosts(layout, "127.0.0.1 localhost\n")
    assert hosts.splitlines() == ["127.0.0.1 localhost", "127.0.0.1 node1 node2"]


def test_layout_refuses_mismatched_ports() -> None:
    with pytest.raises(ValueError, match="one port per node"):
        ClusterLayout(Path("/tmp/x"), num_nodes=2, node_ports=(1,))


def test_reap_stale_kills_only_daemons_of_a_dead_owner(tmp_path: Path) -> None:
    stale, live = tmp_path / f"{ROOT_PREFIX}stale", tmp_path / f"{ROOT_PREFIX}live"
    stale.mkdir()
    live.mkdir()
    # A "daemon" with the cluster root in its command line, as slurmd has its -f CONF.
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(stale)])
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        owner = {"pid": gone.pid, "pids": [daemon.pid, os.getpid()], "mnt_ns": []}
        (stale / "owner.json").write_text(json.dumps(owner))
        (live / "owner.json").write_text(json.dumps({"pid": os.getpid(), "pids": [], "mnt_ns": []}))
        assert reap_stale(tmp_path) == [stale]
        assert daemon.wait(timeout=10) != 0
        assert not stale.exists() and live.exists()  # a live owner's cluster is left alone
    finally:
        daemon.kill()
        daemon.wait()


@pytest.mark.slurm
def test_a_second_cluster_runs_beside_the_first(slurm_cluster) -> None:
    """Own temp dir, ports and namespaces: concurrent runs (or a crashed one) never collide."""
    with SlurmCluster(num_nodes=3) as other:
        assert other.layout is not None and slurm_cluster.layout is not None
        assert other.layout.root != slurm_cluster.layout.root
        assert other.layout.ctld_port != slurm_cluster.layout.ctld_port
        out = other.run(["srun", "-N3", "sh", "-c", "hostname; touch /scratch/mark"])
        assert sorted(out.stdout.split()) == ["node1", "node2", "node3"]
        assert all((other.scratch(n) / "mark").exists() for n in other.node_names)
        assert not any(
            (slurm_cluster.scratch(n) / "mark").exists() for n in slurm_cluster.node_names
        )
    out = slurm_cluster.run(["srun", "-N2", "hostname"])
    assert sorted(out.stdout.split()) == ["node1", "node2"]
