"""SlurmEnv and hostlist parsing against Slurm's documented examples."""

from __future__ import annotations

import pytest

from stager.errors import UsageError
from stager.slurm import LOCAL_JOB_ID, SlurmEnv, parse_hostlist


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[01-02,07],gpu-a[1-2]", ["node01", "node02", "node07", "gpu-a1", "gpu-a2"]),
        ("a,b,c", ["a", "b", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("tux[8-10]x", ["tux8x", "tux9x", "tux10x"]),
        ("", []),
    ],
)
def test_parse_hostlist_documented_examples(spec: str, hosts: list[str]) -> None:
    assert parse_hostlist(spec) == hosts


@pytest.mark.parametrize(
    "spec", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", "node[[1]]", "a,,b", "node[]"]
)
def test_parse_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(UsageError):
        parse_hostlist(spec)


def test_outside_slurm_is_a_local_single_task_job() -> None:
    env = SlurmEnv.from_environ({"HOME": "/root"})
    assert env.job_id == LOCAL_JOB_ID and not env.in_slurm
    assert (env.node, env.num_nodes, env.rank, env.local_rank, env.ntasks) == (0, 1, 0, 0, 1)


def test_inside_slurm_reads_every_field() -> None:
    env = SlurmEnv.from_environ(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "3",
            "SLURM_JOB_NODELIST": "gpu[01-03]",
            "SLURMD_NODENAME": "gpu02",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "12",
            "SLURM_TASKS_PER_NODE": "4(x3)",
            "SLURM_RESTART_COUNT": "2",
        }
    )
    assert env.in_slurm and env.job_id == "4242"
    assert env.nodelist == ("gpu01", "gpu02", "gpu03") and env.first_host == "gpu01"
    assert (env.node, env.num_nodes, env.rank, env.local_rank) == (1, 3, 5, 1)
    assert (env.ntasks, env.tasks_per_node, env.restart_count) == (12, 4, 2)


def test_bad_integer_variable_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="SLURM_PROCID"):
        SlurmEnv.from_environ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "x"})
