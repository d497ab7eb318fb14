"""The job templates' USR1 path at its edges, on the real test cluster (a hostile review).

* a USR1 that arrives while the template still sets up, before its trap: the batch shell died
  by signal 10, the job FAILED 0:10 with an empty log (Slurm sends the pre-timeout signal at
  once when the time left is already below the ``--signal`` lead);
* a run that restores a checkpoint taken at the last step trains no step and saves nothing:
  the job FAILED (exit 9) saying nothing was committed, with the whole series in CKPT_DEST;
* USR1 with ``REQUEUE_ON_SIGNAL=0`` and a stage-out that fails: the job ended COMPLETED, 0;
* USR1 on a job that cannot be requeued (``--no-requeue``): scontrol's error and exit 1, no
  line of the template's;
* an unknown ``LAUNCHER`` was refused only after stage-in and restore had run;
* USR1 with ``LAUNCHER=torchrun`` on two nodes: srun took the trap's TERM as "force the
  step's end" and killed every worker before any saved.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .test_slurm_byo import JOBS, ONE_TASK, SAVER_THEN_SLEEPER, Job, _done, _script, _submit
from .test_slurm_jobs import _wait_for_log

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def data(slurm_cluster) -> Path:
    path = slurm_cluster.shared_dir / "datasets" / "signals"
    write_synthetic_dataset(
        path, SyntheticSpec(num_shards=2, samples_per_shard=16, image_bytes=200, seed=3)
    )
    return path


@pytest.mark.parametrize("template", ["train-single-node.sbatch", "train-multi-node.sbatch"])
def test_usr1_before_the_trap_is_set_is_acted_on(slurm_cluster, data: Path, template) -> None:
    # A PYTHON that is slow on the template's first shlex split (before `trap on_usr1`) and
    # says when that moment has come: the USR1 lands in the window, every time.
    base = slurm_cluster.shared_dir / "signals" / f"early-{template}"
    base.mkdir(parents=True)
    mark = base / "setting-up"
    slow = base / "slow-python"
    slow.write_text(
        "#!/bin/bash\n"
        f'if [[ "$*" == *shlex* && ! -e "{mark}" ]]; then touch "{mark}"; sleep 4; fi\n'
        'exec python3 "$@"\n'
    )
    slow.chmod(0o755)
    nodes = ("--nodes=2",) if "multi" in template else ()
    job = _submit(
        slurm_cluster,
        f"early-usr1-{template.split('-')[1]}",
        template,
        (*nodes, *ONE_TASK),
        DATA_SRC=str(data),
        PYTHON=str(slow),
        REQUEUE_ON_SIGNAL="0",
    )
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert time.monotonic() < deadline, job.text()
        time.sleep(0.05)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    text = _done(slurm_cluster, job)  # (unfixed: FAILED 0:10, nothing in the log)
    assert "USR1 at" in text and "no checkpoint on scratch yet" in text, text
    assert "warning: USR1 came before training started" in text, text  # (and says why)
    assert "stage-in:" not in text, text  # acted on before anything was staged


def test_a_run_resumed_at_its_last_step_is_not_a_failure(slurm_cluster, data: Path) -> None:
    args = {
        "DATA_SRC": str(data),
        "TRAIN_SCRIPT": str(JOBS / "examples" / "minimal_train.py"),
        "TRAIN_ARGS": "--steps 2 --num-classes 10",
    }
    first = _submit(slurm_cluster, "resumed-at-end", "train-single-node.sbatch", ONE_TASK, **args)
    _done(slurm_cluster, first)
    # The series is finished; a requeue after training ended (or RESUME=always) restores its
    # last checkpoint, trains no step and saves nothing new.
    again = _submit(
        slurm_cluster,
        "resumed-at-end",
        "train-single-node.sbatch",
        ONE_TASK,
        CKPT_DEST=str(first.ckpt_dest),
        RESUME="always",
        **args,
    )
    text = _done(slurm_cluster, again)  # (unfixed: FAILED 9, "nothing committed")
    assert "restored checkpoint:" in text and "rank 0: done at step 2" in text, text
    assert "no new checkpoint since the restored last.pt" in text, text
    assert f"job {again.job_id} finished" in text


def _saver_job(cluster, data: Path, name: str, *sbatch_args: str, **env: str) -> Job:
    script = _script(cluster, "signals_saver.py", SAVER_THEN_SLEEPER)
    job = _submit(
        cluster,
        name,
        "train-single-node.sbatch",
        (*sbatch_args, *ONE_TASK),
        DATA_SRC=str(data),
        TRAIN_SCRIPT=str(script),
        **env,
    )
    _wait_for_log(cluster, job, "saved, training on")
    cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    return job


def test_usr1_not_requeued_whose_stage_out_fails_fails_the_job(slurm_cluster, data) -> None:
    job = _saver_job(
        slurm_cluster,
        data,
        "usr1-dest-fails",
        CKPT_DEST="/proc/no-checkpoints-here",  # (cannot be created)
        REQUEUE_ON_SIGNAL="0",
        STOP_GRACE_S="2",
    )
    text = _done(slurm_cluster, job, "FAILED", "5:0")  # (unfixed: COMPLETED 0:0)
    said = r"error: stage-out of \S+ to /proc/no-checkpoints-here failed \(exit 5\)"
    assert re.search(said, text), text


def test_usr1_on_a_job_that_cannot_be_requeued_says_so(slurm_cluster, data: Path) -> None:
    job = _saver_job(slurm_cluster, data, "usr1-no-requeue", "--no-requeue", STOP_GRACE_S="2")
    text = _done(slurm_cluster, job, "FAILED", "1:0")
    assert "stage-out: committed last.pt" in text, text
    assert f"error: job {job.job_id} could not be requeued" in text, text
    assert (job.ckpt_dest / "last.pt").read_text() == "weights"


def test_usr1_with_torchrun_on_two_nodes_lets_training_save(slurm_cluster, data: Path) -> None:
    job = _submit(
        slurm_cluster,
        "usr1-torchrun-2n",
        "train-multi-node.sbatch",
        ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--gres=gpu:2"),
        DATA_SRC=str(data),
        LAUNCHER="torchrun",
        REQUEUE_ON_SIGNAL="0",
        TRAIN_ARGS="--steps 400 --ckpt-every 1000 --batch-size 4 --workers 0 --step-sleep-s 0.2",
    )
    _wait_for_log(slurm_cluster, job, "train: rank 0 of 4")
    time.sleep(3)  # (a few steps, no checkpoint yet: --ckpt-every 1000)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    text = _done(slurm_cluster, job)
    # Unfixed: srun "forcing job termination", every worker killed, nothing saved or committed.
    stopped = re.search(r"stopped by signal 15 at step (\d+); checkpoint saved", text)
    assert stopped, text
    name = f"step-{int(stopped.group(1)):08d}"
    assert f"stage-out: committed {name}" in text, text
    assert (job.ckpt_dest / name).is_dir()


def test_an_unknown_launcher_fails_before_staging(slurm_cluster, data: Path) -> None:
    """LAUNCHER was checked only at the training step, after stage-in and restore had run."""
    job = _submit(
        slurm_cluster,
        "bad-launcher",
        "train-single-node.sbatch",
        ONE_TASK,
        DATA_SRC=str(data),
        LAUNCHER="torchrn",
    )
    text = _done(slurm_cluster, job, "FAILED", "2:0")
    assert "error: LAUNCHER=torchrn: give srun or torchrun" in text, text
    assert "stage-in:" not in text, text
