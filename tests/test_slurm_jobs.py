"""The sbatch templates in jobs/, unmodified, on the real test cluster.

Three jobs run at once to keep the tier short: an uninterrupted 2-node run (the reference),
the same run interrupted by USR1 (stage out, requeue, restore, finish), and the single-node
template with the torchrun launcher. Paths carry spaces and a quote on purpose.

What is compared between runs is what the project guarantees: the same batches in the same
order on every rank (the per-rank key logs), the same step count, a committed checkpoint. The
models are compared within a tolerance, never bit for bit: two launchers (srun across nodes,
torchrun inside one) or two processes may sum floats in another order (intra-op thread counts,
gloo's algorithm within a node or across nodes, the CPU's kernels), so bit-identical weights
hold only on the machine and launcher where they were written. Feeding different samples is
caught by the key logs, exactly; the weight check only catches a grossly different run.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .cluster.procs import free_ports

pytestmark = pytest.mark.slurm

JOBS = Path(__file__).resolve().parent.parent / "jobs"
STEPS = 40
# 160 samples, 2 ranks, batch 8: 10 batches per rank per epoch, so 40 steps span 4 epochs.
TRAIN = f"--steps {STEPS} --ckpt-every 10 --keep-local 10 --batch-size 8 --workers 1 --log-every 10"
# Submission options that shrink the templates' GPU-sized defaults to the 2-core machine.
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gres=gpu:1")


@dataclass(frozen=True)
class Job:
    job_id: str
    output: Path
    ckpt_dest: Path
    key_log: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""


def _submit(
    cluster,
    name: str,
    template: str,
    data: Path,
    sbatch_args: tuple[str, ...],
    train_args: str,
    **env: str,
) -> Job:
    base = cluster.shared_dir / "jobs" / f"{name} it's"
    base.mkdir(parents=True)
    job_env = {
        "DATA_SRC": str(data),
        "CKPT_DEST": str(base / "ckpt dest"),
        "TRAIN_SCRIPT": str(JOBS / "examples" / "train.py"),
        "TRAIN_ARGS": f"{train_args} --key-log {shlex.quote(str(base / 'keys'))}",
        # A port the kernel reports free now, not the template's 20000 + job id: that one was
        # found taken on this machine in some runs (EADDRINUSE at the rendezvous)
        "MASTER_PORT": str(free_ports(1)[0]),
        **env,
    }
    output = base / "job.out"
    job_id = cluster.sbatch(
        JOBS / template, *sbatch_args, f"--output={output}", f"--job-name={name}", env=job_env
    )
    return Job(job_id, output, base / "ckpt dest", base / "keys")


@pytest.fixture(scope="module")
def jobs(slurm_cluster) -> dict[str, Job]:
    data = slurm_cluster.shared_dir / "datasets" / "train set"
    write_synthetic_dataset(
        data, SyntheticSpec(num_shards=4, samples_per_shard=40, image_bytes=300, seed=5)
    )
    return {
        # Its scratch is kept (CLEAN_SCRATCH=0): the tests read it after the job.
        "reference": _submit(
            slurm_cluster,
            "reference",
            "train-multi-node.sbatch",
            data,
            TWO_NODES,
            TRAIN,
            CLEAN_SCRATCH="0",
        ),
        # Slowed down so that USR1 lands mid-training.
        "signalled": _submit(
            slurm_cluster,
            "signalled",
            "train-multi-node.sbatch",
            data,
            TWO_NODES,
            f"{TRAIN} --step-sleep-s 0.3",
            STAGER_CACHE="/scratch/cache-templates",  # passed through to stage-in
        ),
        "torchrun": _submit(
            slurm_cluster,
            "torchrun",
            "train-single-node.sbatch",
            data,
            ("--ntasks-per-node=1", "--cpus-per-task=2", "--gres=gpu:2"),
            TRAIN.replace(f"--steps {STEPS}", "--steps 20"),
            LAUNCHER="torchrun",
        ),
    }


def _wait_done(cluster, job: Job, timeout_s: float = 240) -> dict[str, str]:
    record = cluster.wait_job(job.job_id, timeout_s=timeout_s, output=job.output)
    if record["JobState"] != "COMPLETED" or record["ExitCode"] != "0:0":
        # Whole, on stdout: pytest shows it for a failed test, where the assertion's repr is
        # cut in the middle, and the job's files go with the test cluster.
        print(f"--- job {job.job_id} ({record['JobState']}, {record['ExitCode']}) ---")
        print(job.text())
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, job.text())
    return record


def _key_log(job: Job, rank: int) -> list[tuple[int, str]]:
    """(step, keys of that step's batch) in the order the rank logged them."""
    lines = (job.key_log / f"rank-{rank}.keys").read_text().splitlines()
    return [(int(step), keys) for step, keys in (line.split(" ", 1) for line in lines)]


def _wait_for_log(cluster, job: Job, text: str, timeout_s: float = 180) -> None:
    """Wait until ``text`` shows in the job's output, failing if the job ends first."""
    deadline = time.monotonic() + timeout_s
    while text not in job.text():
        assert time.monotonic() < deadline, f"no {text!r} in time:\n{job.text()}"
        assert cluster.job(job.job_id).get("JobState") in ("PENDING", "RUNNING"), job.text()
        time.sleep(0.2)


def _keys_up_to(job: Job, ranks: range, last_step: int) -> list[str]:
    """Every sample key the ranks logged in steps 1..``last_step``, repeats kept."""
    return [
        k
        for rank in ranks
        for step, keys in _key_log(job, rank)
        if step <= last_step
        for k in keys.split()
    ]


#: Weights of two runs fed the same batches differ only by float summation order: on this
#: model and 40 SGD steps that was 1.5e-8 at most (weights ~0.2); another seed differs by ~0.3.
MODEL_RTOL, MODEL_ATOL = 1e-4, 1e-5


def _assert_same_model(state_path: Path, reference_path: Path) -> None:
    """The two checkpoints hold the same model up to float summation order (see the module doc)."""
    import torch

    got = torch.load(state_path, map_location="cpu", weights_only=False)["model"]
    want = torch.load(reference_path, map_location="cpu", weights_only=False)["model"]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=MODEL_RTOL, atol=MODEL_ATOL, msg=name
        )


def test_two_node_job_stages_in_per_node_trains_and_stages_out(slurm_cluster, jobs) -> None:
    job = jobs["reference"]
    _wait_done(slurm_cluster, job)
    text = job.text()
    for node in ("node1", "node2"):
        assert f"[{node}] stage-in: 4 files, 4 copied" in text, text
        staged = slurm_cluster.scratch(node) / job.job_id / "train set"
        assert len(list(staged.glob("*.tar"))) == 4  # --subset all: every shard on every node
    assert "train: rank 0 of 2, backend gloo" in text
    assert f"done at step {STEPS}" in text
    # The final checkpoint is committed on the shared filesystem.
    assert (job.ckpt_dest / f"step-{STEPS:08d}" / "state.pt").is_file()
    assert f"stage-out: committed step-{STEPS:08d}" in text
    # DDP over 2 ranks reading disjoint samples: the first epoch covers all 160 samples once.
    first_epoch = _keys_up_to(job, range(2), 10)
    assert len(first_epoch) == 160 and len(set(first_epoch)) == 160


def test_usr1_stages_out_requeues_and_resumes_exactly(slurm_cluster, jobs) -> None:
    job, reference = jobs["signalled"], jobs["reference"]
    _wait_for_log(slurm_cluster, job, "checkpoints/step-00000010")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])

    # The trap requeues the job; the cluster's cred_expire (15 s) holds it back that long.
    record = _wait_done(slurm_cluster, job)
    assert record["Restarts"] == "1"

    text = job.text()
    stopped = re.search(r"stopped by signal 10 at step (\d+)", text)
    assert stopped, text
    k = int(stopped.group(1))
    assert 10 <= k < STEPS
    name = f"step-{k:08d}"
    assert f"stage-out: committed {name}" in text
    assert re.search(rf"restored checkpoint: /scratch/{job.job_id}/restore/{name}\b", text), text
    assert f"resumed from /scratch/{job.job_id}/restore/{name} at step {k}" in text
    assert (job.ckpt_dest / name).is_dir() and (job.ckpt_dest / f"step-{STEPS:08d}").is_dir()

    _wait_done(slurm_cluster, reference)
    for rank in (0, 1):
        interrupted = _key_log(job, rank)
        # The step count continues exactly: 1..k in the first run, k+1..STEPS after the restore.
        assert [step for step, _ in interrupted] == list(range(1, STEPS + 1))
        # ...and so do the samples: the same batches, in the same order, as the uninterrupted run.
        assert interrupted == _key_log(reference, rank)
    final = f"step-{STEPS:08d}/state.pt"
    _assert_same_model(job.ckpt_dest / final, reference.ckpt_dest / final)
    # STAGER_CACHE reached stage-in; both runs cleaned their scratch once stage-out committed.
    assert text.count("[cache: ") >= 2, text
    for node in slurm_cluster.node_names:
        assert not (slurm_cluster.scratch(node) / job.job_id).exists()


def test_single_node_template_with_torchrun(slurm_cluster, jobs) -> None:
    """torchrun on one node feeds every rank the batches the srun reference fed it, in order."""
    job, reference = jobs["torchrun"], jobs["reference"]
    _wait_done(slurm_cluster, job)
    text = job.text()
    assert "launcher torchrun" in text and "train: rank 0 of 2, backend gloo" in text
    assert (
        "[node1] stage-in: 4 files, 4 copied" in text
        or "[node2] stage-in: 4 files, 4 copied" in text
    )
    assert "done at step 20" in text
    assert (job.ckpt_dest / "step-00000020" / "state.pt").is_file()
    for node in slurm_cluster.node_names:  # CLEAN_SCRATCH=1, the default: nothing left behind
        assert not (slurm_cluster.scratch(node) / job.job_id).exists()
    # Same world size, data and seed as the srun-launched reference: the same batches on each
    # rank for the 20 steps, and so the same model up to summation order.
    _wait_done(slurm_cluster, reference)
    for rank in (0, 1):
        torchrun_keys = _key_log(job, rank)
        assert [step for step, _ in torchrun_keys] == list(range(1, 21))
        assert torchrun_keys == _key_log(reference, rank)[:20]
    ref_node = next(
        n
        for n in slurm_cluster.node_names
        if (slurm_cluster.scratch(n) / reference.job_id / "checkpoints").is_dir()
    )
    ref_state = (
        slurm_cluster.scratch(ref_node)
        / reference.job_id
        / "checkpoints"
        / "step-00000020"
        / "state.pt"
    )
    _assert_same_model(job.ckpt_dest / "step-00000020" / "state.pt", ref_state)


def test_usr1_during_stage_in_is_acted_on_at_once(slurm_cluster, jobs) -> None:
    """bash runs a trap only once the foreground command ends: with stage-in in the foreground,
    the pre-timeout warning waited for the whole copy, too late to checkpoint or requeue. The
    template's steps are backgrounded and waited on, so the trap runs while stage-in copies."""
    data = slurm_cluster.shared_dir / "datasets" / "train set"
    job = _submit(
        slurm_cluster,
        "usr1 while staging",
        "train-multi-node.sbatch",
        data,
        TWO_NODES,
        TRAIN,
        STAGE_IN_ARGS="--bw-limit 0.002 --jobs 1",  # (minutes for the dataset, at this pace)
        REQUEUE_ON_SIGNAL="0",
    )
    _wait_for_log(slurm_cluster, job, "run 1 on 2 node(s)")
    time.sleep(3)  # (stage-in started, far from done)
    signalled = time.monotonic()
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    _wait_done(slurm_cluster, job, timeout_s=120)
    text = job.text()
    assert "USR1 at" in text and "no checkpoint on scratch yet" in text, text
    assert "stage-in: 4 files, 4 copied" not in text, text  # (stopped, not waited for)
    assert time.monotonic() - signalled < 60, text
