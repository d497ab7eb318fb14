"""The example training scripts exit 0 on gloo, even when gloo's worker threads run last.

A gloo worker thread frees each finished collective after waking the rank that waited on it.
When that collective still holds a Python object (DDP's gradient all-reduce holds the
backward pass's context; ``dist.barrier()`` keeps the last one alive until the barrier is
freed) and the rank has meanwhile begun to exit, the thread cannot take the interpreter lock
and the process aborts: "terminate called without an active exception", exit 134, and the
job template fails the job. It failed CI once, and came once in a hundred local runs of
``minimal_train.py``.

Here every thread of a rank shares one CPU and gloo's threads run at ``SCHED_IDLE``, so they
run only while the main thread waits: the race is lost whenever the script's ending gives them
no wait. The scripts' old endings (``dist.barrier()``, then ``destroy_process_group()`` and
exit) aborted within the first six pairs in each of six runs of this test; ending with a short
sleep, both passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster.procs import free_ports
from .conftest import REPO, clean_env
from .imagedata import write_image_dataset

EXAMPLES = REPO / "jobs" / "examples"
PAIRS = 10

GLOO_RUNS_LAST = """
import os
import torch.distributed as dist

_init = dist.init_process_group


def _gloo_runs_last(*args, **kwargs):
    result = _init(*args, **kwargs)
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith(("pt_gloo", "gloo")):
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    return result


dist.init_process_group = _gloo_runs_last
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling policies")
@pytest.mark.parametrize(
    ("script", "done"),
    [("minimal_train.py", "rank 0: done at step 6"), ("train.py", "train: done at step 6")],
)
def test_example_exits_cleanly_when_gloo_threads_run_last(
    tmp_path: Path, script: str, done: str
) -> None:
    data = tmp_path / "photos"
    write_image_dataset(data, num_samples=64, num_classes=4, seed=3)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GLOO_RUNS_LAST)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    for attempt in range(PAIRS):
        ckpt = tmp_path / f"ckpt{attempt}"
        (port,) = free_ports(1)
        env = clean_env(
            PYTHONPATH=path,
            SLURM_NTASKS="2",
            SLURM_CPUS_PER_TASK="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        command = [sys.executable, str(EXAMPLES / script), "--data", str(data)]
        ranks = [
            subprocess.Popen(
                [*command, "--ckpt-dir", str(ckpt), "--steps", "6", "--num-classes", "4"],
                env={**env, "SLURM_PROCID": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [proc.communicate(timeout=300)[0] for proc in ranks]
        for rank, (proc, out) in enumerate(zip(ranks, outputs, strict=True)):
            assert proc.returncode == 0, f"run {attempt} rank {rank}: {proc.returncode}\n{out}"
        assert done in outputs[0], outputs[0]
        assert any(ckpt.iterdir()), f"run {attempt}: no checkpoint in {ckpt}"
