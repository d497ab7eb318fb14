"""Helpers of the background-staging tests: a dataset with a manifest, a copier process, the
batches the plan promises, and a watch on the loader's reads of the source."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from stager.layout import StagedDataset
from stager.plan.ranks import PlanOptions, WorldLayout, rank_indices, samples_per_rank
from stager.plan.staging import StagingSpec, staging_share
from stager.shards.build import build_manifest, write_manifest
from stager.shards.synth import SyntheticSpec, sample_key, write_synthetic_dataset
from stager.slurm import SlurmEnv
from stager.stagein.wait import wait_staged
from stager.storage.sources import resolve_source

from .conftest import BIN, clean_env

#: 6 shards of 20 samples, ~9 kB per sample: ~180 kB per shard.
SPEC = SyntheticSpec(num_shards=6, samples_per_shard=20, image_bytes=9000, seed=2)


def dataset(root: Path, spec: SyntheticSpec = SPEC) -> Path:
    """A synthetic dataset with the manifest (sample counts) background staging needs."""
    src = root / "src" / "ds"
    write_synthetic_dataset(src, spec)
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    return src


#: A job's identity as Slurm gives it to every step: a requeued run differs only by the count.
JOB_ID = "4242"


def job_env(restart_count: int = 0) -> dict[str, str]:
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_RESTART_COUNT": str(restart_count)}


def start_copier(src: Path, dest: Path, *args: str, restart_count: int = 0):
    """``stage-in --background`` as a process of its own, as a job step runs it."""
    argv = [str(BIN / "stage-in"), "--background", str(src), "--dest", str(dest)]
    argv += ["--progress", "none", "--jitter-max", "0", *args]
    return subprocess.Popen(
        argv,
        env=clean_env(**job_env(restart_count)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_plan(dest: Path, first_shards: int = 0, restart_count: int = 0, name: str = "ds") -> None:
    """``stage-in --wait-staged``, as the job's step before training runs it."""
    wait_staged(
        StagedDataset(dest, name),
        first_shards,
        slurm=SlurmEnv.from_environ(job_env(restart_count)),
        timeout_s=120,
        log=sys.stderr,
    )


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Signal the copier (if it still runs); its exit code and stderr."""
    if proc.poll() is None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def finished(proc: subprocess.Popen) -> int:
    """Wait for the copier to end on its own; its exit code."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return proc.returncode


def keys_of(indices: np.ndarray, counts: list[int]) -> list[str]:
    offsets = np.concatenate([[0], np.cumsum(counts)])
    shard = np.searchsorted(offsets, indices, side="right") - 1
    return [sample_key(int(s), int(g - offsets[s])) for s, g in zip(shard, indices, strict=True)]


def planned_keys(
    counts: list[int],
    *,
    batch: int,
    seed: int,
    epoch: int,
    staging: bool,
    layout: WorldLayout | None = None,
    copy_seed: int = 0,
    even: str = "pad",
) -> list[str]:
    """The keys a rank reads in ``epoch``: the staging order's, or the full shuffle's."""
    layout = layout or WorldLayout()
    options = PlanOptions(batch_size=batch, seed=seed, even=even)
    per_rank = samples_per_rank(int(sum(counts)), layout, even)
    if staging:
        share = staging_share(
            counts,
            layout,
            epoch=epoch,
            options=options,
            spec=StagingSpec(copy_seed),
            per_rank=per_rank,
        )
        indices = share.indices()
    else:
        indices = rank_indices(counts, layout, epoch=epoch, options=options, per_rank=per_rank)
    if even == "drop":
        indices = indices[: (per_rank // batch) * batch]
    return keys_of(indices, counts)


_WATCH: dict[str, str] = {}


def _audit(event: str, args: tuple) -> None:
    root = _WATCH.get("root")
    if root and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.startswith(root):
            with open(_WATCH["log"], "a") as log:  # opens the log, not under root: no recursion
                log.write(path + "\n")


_HOOKED: list[bool] = []


@contextlib.contextmanager
def source_reads(src: Path, log: Path) -> Iterator[Path]:
    """Record every file this process (and its forked workers) opens under ``src``."""
    if not _HOOKED:
        sys.addaudithook(_audit)  # cannot be removed: it checks _WATCH, cleared below
        _HOOKED.append(True)
    log.write_text("")
    _WATCH.update(root=str(src), log=str(log))
    try:
        yield log
    finally:
        _WATCH.clear()
