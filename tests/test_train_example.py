"""jobs/examples/train.py off the cluster: what it reads from the data and the environment.

One process (RANK/WORLD_SIZE=0/1, an ephemeral rendezvous port): the image member and class
count come from the data, loader workers from SLURM_CPUS_PER_TASK, and a resumed run takes
them from the checkpoint. The Slurm tier runs it on the cluster (tests/test_slurm_byo.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, clean_env
from .imagedata import write_image_dataset

TRAIN = REPO / "jobs" / "examples" / "train.py"


def _train_module():
    spec = importlib.util.spec_from_file_location("example_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("env", "workers"),
    [
        ({}, 2),
        ({"SLURM_CPUS_PER_TASK": "8"}, 7),  # one core for the training loop
        ({"SLURM_CPUS_PER_TASK": "1"}, 0),
        ({"SLURM_CPUS_PER_TASK": "32", "LOCAL_WORLD_SIZE": "4"}, 7),  # torchrun: shared by 4
        ({"SLURM_CPUS_PER_TASK": "2", "LOCAL_WORLD_SIZE": "4"}, 0),
    ],
)
def test_default_workers_follow_the_allocation(env: dict[str, str], workers: int) -> None:
    assert _train_module().default_workers(env) == workers


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    return subprocess.run(
        [sys.executable, str(TRAIN), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_png_and_jpeg_dataset_detected_and_resumed_without_probing(tmp_path: Path) -> None:
    """The first sample's format alone (png) failed on the first JPEG: each is decoded."""
    data = tmp_path / "images"
    write_image_dataset(data, num_samples=40, num_classes=5, ext="png;jpg", seed=2)
    ckpt = tmp_path / "ckpt"
    common = ("--data", str(data), "--ckpt-dir", str(ckpt), "--batch-size", "8")
    first = _run(*common, "--steps", "4", "--ckpt-every", "4", env={"SLURM_CPUS_PER_TASK": "2"})
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        "images from .jpg/.jpeg/.png/.webp, labels from .cls, 5 classes, 1 loader workers per "
        "rank" in first.stdout
    )
    assert "done at step 4" in first.stdout

    again = _run(*common, "--steps", "6", "--workers", "0", "--resume", str(ckpt / "step-00000004"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "5 classes" in again.stdout and "resumed from" in again.stdout
    assert "done at step 6" in again.stdout


def test_no_image_member_says_which_flag_to_pass(tmp_path: Path) -> None:
    import io
    import tarfile

    data = tmp_path / "text"
    data.mkdir()
    with tarfile.open(data / "s-0000.tar", "w") as tar:
        for name, payload in (("a.txt", b"hello"), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out = _run("--data", str(data), "--ckpt-dir", str(tmp_path / "ck"), "--steps", "1")
    assert out.returncode != 0
    assert "have none of the image members jpg, jpeg, png, webp, npy" in out.stderr
    assert "(they have cls, txt); pass --image-key" in out.stderr
