"""The multi-node template with STAGE_BACKGROUND=1 on the real test cluster: training starts
while each node's copier (a job step of its own) stages the dataset under --bw-limit; a USR1
lands while staging still runs (stage out, requeue: Slurm ends the copier step, which leaves no
partial file); the requeued run's copier keeps what was published and copies the rest, and
training continues at the same step with the same samples as an uninterrupted run.

Two jobs run at once: the uninterrupted reference and the signalled one, both with background
staging (epoch 0 reads in the staging order, so the reference must too). Steps are slowed down
so that each epoch outlasts the copy: which order an epoch uses depends on whether staging was
complete when it started, and both jobs must decide alike for their key logs to compare. Key
logs are compared exactly, models within a tolerance (see tests/test_slurm_jobs.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stager.shards.build import build_manifest, write_manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sources import resolve_source

from .test_slurm_jobs import (
    TWO_NODES,
    Job,
    _assert_same_model,
    _key_log,
    _keys_up_to,
    _submit,
    _wait_done,
    _wait_for_log,
)

pytestmark = pytest.mark.slurm

STEPS = 30
SHARDS = 8
# 320 samples, 2 ranks, batch 8: 20 steps per epoch, so 30 steps end inside epoch 1. ~80 kB
# per shard at 0.016 MB/s: ~40 s of copying, the first checkpoint (step 5) after ~3 shards.
TRAIN = (
    f"--steps {STEPS} --ckpt-every 5 --keep-local 10 --batch-size 8 --workers 1 --log-every 5 "
    "--num-classes 10 --step-sleep-s 0.3"
)
BACKGROUND = {
    "STAGE_BACKGROUND": "1",
    "STAGE_WAIT_SHARDS": "1",
    "STAGE_IN_ARGS": "--bw-limit 0.016",
    # The scratch is kept after the job (CLEAN_SCRATCH=0): the test reads what the copier left.
    "CLEAN_SCRATCH": "0",
}


@pytest.fixture(scope="module")
def jobs(slurm_cluster) -> dict[str, Job]:
    data = slurm_cluster.shared_dir / "datasets" / "background set"
    write_synthetic_dataset(
        data, SyntheticSpec(num_shards=SHARDS, samples_per_shard=40, image_bytes=300, seed=5)
    )
    # Background staging needs the sample counts up front (`stager index`).
    write_manifest(build_manifest(resolve_source(str(data))), str(data / "stager-manifest.json"))
    return {
        name: _submit(
            slurm_cluster,
            f"bg-{name}",
            "train-multi-node.sbatch",
            data,
            TWO_NODES,
            TRAIN,
            **BACKGROUND,
        )
        for name in ("reference", "signalled")
    }


def _staged(cluster, job: Job, node: str) -> Path:
    return cluster.scratch(node) / job.job_id / "background set"


def test_usr1_while_staging_runs_requeues_and_continues_exactly(slurm_cluster, jobs) -> None:
    job, reference = jobs["signalled"], jobs["reference"]
    _wait_for_log(slurm_cluster, job, "checkpoints/step-00000005")
    published = {
        n: len(list(_staged(slurm_cluster, job, n).glob("*.tar"))) for n in ("node1", "node2")
    }
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    assert min(published.values()) < SHARDS, (
        f"staging ended before the signal: {published}\n{job.text()}"
    )

    record = _wait_done(slurm_cluster, job, timeout_s=300)
    assert record["Restarts"] == "1"
    text = job.text()
    # Both runs staged in the background; the second kept what the first had published.
    runs = re.findall(
        r"\[(node\d)\] stage-in --background: (\d+) of 8 shard\(s\) staged already", text
    )
    first = [int(k) for node, k in runs[:2]]
    again = [int(k) for node, k in runs[2:]]
    assert len(runs) == 4 and first == [0, 0], runs
    assert all(0 < k for k in again) and min(again) < SHARDS, runs
    for node in ("node1", "node2"):
        staged = _staged(slurm_cluster, job, node)
        assert len(list(staged.glob("*.tar"))) == SHARDS
        assert not list(staged.rglob("*.partial"))  # SIGTERM at the requeue left none

    stopped = re.search(r"stopped by signal 10 at step (\d+)", text)
    assert stopped, text
    k = int(stopped.group(1))
    assert 5 <= k < 20  # inside epoch 0, which reads in the staging order
    assert f"resumed from /scratch/{job.job_id}/restore/step-{k:08d} at step {k}" in text

    _wait_done(slurm_cluster, reference, timeout_s=300)
    for rank in (0, 1):
        interrupted = _key_log(job, rank)
        assert [step for step, _ in interrupted] == list(range(1, STEPS + 1))
        assert interrupted == _key_log(reference, rank)
    final = f"step-{STEPS:08d}/state.pt"
    _assert_same_model(job.ckpt_dest / final, reference.ckpt_dest / final)


def test_background_reference_reads_every_sample_in_epoch_0(slurm_cluster, jobs) -> None:
    reference = jobs["reference"]
    _wait_done(slurm_cluster, reference, timeout_s=300)
    text = reference.text()
    for node in ("node1", "node2"):
        assert f"[{node}] stage-in --background: done, 8 of 8 shard(s) staged" in text, text
    first_epoch = _keys_up_to(reference, range(2), 20)
    assert len(first_epoch) == 320 and len(set(first_epoch)) == 320
