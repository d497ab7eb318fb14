"""Shared fixtures: real tar shards written with webdataset, and helpers to run the CLI."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def mount_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``"1536k"``, ``"8m"``) mounted at ``mount_point`` for the
    ``with`` block. Skips the test where mounting is not allowed (not root)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


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
