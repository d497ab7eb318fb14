"""Shared fixtures: real tar shards written with webdataset, and helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 shards x 50 samples of ~1 KB, uneven sizes; shared read-only by tests."""
    out = tmp_path_factory.mktemp("src") / "ds"
    write_synthetic_dataset(
        out, SyntheticSpec(num_shards=8, samples_per_shard=50, uneven=True, seed=1)
    )
    return out


@pytest.fixture()
def dataset_copy(small_dataset: Path, tmp_path: Path) -> Path:
    """A private copy of the small dataset that a test may change or delete."""
    import shutil

    dst = tmp_path / "src" / "ds"
    shutil.copytree(small_dataset, dst)
    return dst


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any Slurm variables of an enclosing job, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, **kw
) -> subprocess.CompletedProcess:
    """Run a console script from the test venv and capture its output."""
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster (munged, slurmctld, 2 slurmd nodes with private /scratch), per session.

    Started on first use by a ``slurm``-marked test and torn down by PID at the end of the
    session; see tests/cluster/cluster.py. Skips only where the machine cannot run it.
    """
    from .cluster.cluster import SlurmCluster, cannot_run_reason

    reason = cannot_run_reason()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(num_nodes=int(os.environ.get("STAGER_TEST_SLURM_NODES", "2"))) as cluster:
        yield cluster
