"""A user's own data and training script in the unmodified templates, on the real test cluster.

The data is what users have: JPEG + ``.cls`` shards written by webdataset's ``ShardWriter``,
37 classes, images of several sizes, shards of uneven sample counts. Only environment
variables and sbatch's sizes change between jobs, never the templates.

* the example trainer finds the image member, the class count and its worker count itself,
  with two tasks per node (stage-in must still run once per node);
* the ~40-line script of docs/jobs.md saves ``last.pt`` (no ``step-*`` name): it is committed,
  and a second job resumes from it;
* a script that saves ``$CKPT_DIR/last.pt`` through the environment is committed too, and one
  that saves nothing where the template looks fails the job loudly (issue 19, item 5).

The jobs are submitted together and kept small (a few hundred KB, a dozen steps).
"""

from __future__ import annotations

import json
import re
import shlex
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .cluster.procs import free_ports
from .imagedata import write_image_dataset

pytestmark = pytest.mark.slurm

JOBS = Path(__file__).resolve().parent.parent / "jobs"
NUM_CLASSES = 37
#: A stand-in for a user's script that saves through the environment, not the arguments.
ENV_SAVER = """import os, sys
path = os.path.join(os.environ["CKPT_DIR"], "last.pt")
assert sys.argv[1:3] == ["--data", os.environ["DATA_DIR"]], sys.argv
if int(os.environ["SLURM_PROCID"]) == 0:
    with open(path + ".tmp", "w") as f:
        f.write("weights")
    os.replace(path + ".tmp", path)
print("saved", path, flush=True)
"""
#: ...and one that saves where the template does not look: the job must not end "successfully".
ELSEWHERE_SAVER = """import os, sys
os.makedirs(sys.argv[-1], exist_ok=True)
open(os.path.join(sys.argv[-1], "last.pt"), "w").write("weights")
print("saved", sys.argv[-1], flush=True)
"""

#: ...and one that saves, then fails: what it saved is still committed, and the job fails.
CRASHER = """import os, sys
path = os.path.join(os.environ["CKPT_DIR"], "last.pt")
with open(path + ".tmp", "w") as f:
    f.write("weights")
os.replace(path + ".tmp", path)
print("saved, then failing", flush=True)
sys.exit(3)
"""

#: ...and one whose rank 1 fails while rank 0 trains on: srun stops rank 0 (SIGTERM).
ONE_RANK_FAILS = """import os, sys, time
if os.environ["SLURM_PROCID"] == "1":
    sys.exit(5)
time.sleep(120)
"""

#: ...and one that saves, then trains on until the job is cancelled (global rank 0 saves:
#: torchrun's RANK, else the srun task's).
SAVER_THEN_SLEEPER = """import os, time
path = os.path.join(os.environ["CKPT_DIR"], "last.pt")
if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
    with open(path + ".tmp", "w") as f:
        f.write("weights")
    os.replace(path + ".tmp", path)
print("saved, training on", flush=True)
time.sleep(600)
"""


#: One task on one GPU with one CPU, per node.
ONE_TASK = ("--ntasks-per-node=1", "--cpus-per-task=1", "--gres=gpu:1")


def _script(cluster, name: str, text: str) -> Path:
    """A stand-in training script ``name`` on the shared filesystem."""
    scripts = cluster.shared_dir / "byo" / "scripts"
    scripts.mkdir(parents=True, exist_ok=True)
    (scripts / name).write_text(text)
    return scripts / name


@dataclass(frozen=True)
class Job:
    job_id: str
    output: Path
    ckpt_dest: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""


def _submit(cluster, name: str, template: str, sbatch_args: tuple[str, ...], **env: str) -> Job:
    base = cluster.shared_dir / "byo" / name
    base.mkdir(parents=True, exist_ok=True)
    ckpt_dest = Path(env.pop("CKPT_DEST", str(base / "ckpt")))
    output = base / f"job-{len(list(base.glob('job-*.out')))}.out"
    job_id = cluster.sbatch(
        JOBS / template,
        *sbatch_args,
        f"--output={output}",
        f"--job-name={name}",
        env={"CKPT_DEST": str(ckpt_dest), "MASTER_PORT": str(free_ports(1)[0]), **env},
    )
    return Job(job_id, output, ckpt_dest)


def _done(cluster, job: Job, state: str = "COMPLETED", exit_code: str = "0:0") -> str:
    record = cluster.wait_job(job.job_id, timeout_s=300, output=job.output)
    if (record["JobState"], record["ExitCode"]) != (state, exit_code):
        # the whole output: an assertion's repr would cut it to its first and last lines
        pytest.fail(
            f"job {job.job_id}: {record['JobState']} {record['ExitCode']}, wanted {state} "
            f"{exit_code}\n--- output ---\n{job.text()}",
            pytrace=False,
        )
    return job.text()


def _committed(job: Job) -> dict[str, dict]:
    commits = job.ckpt_dest / ".stager" / "commits"
    return {p.stem: json.loads(p.read_text()) for p in commits.glob("*.json")}


@pytest.fixture(scope="module")
def photos(slurm_cluster) -> Path:
    data = slurm_cluster.shared_dir / "datasets" / "photos"
    shards = write_image_dataset(data, num_samples=200, num_classes=NUM_CLASSES, seed=21)
    counts = set()
    for shard in shards:
        with tarfile.open(shard) as tar:
            counts.add(len(tar.getnames()) // 2)
    assert len(shards) >= 4 and len(counts) > 1  # uneven shards
    return data


@pytest.fixture(scope="module")
def jobs(slurm_cluster, photos: Path) -> dict[str, Job]:
    env_saver = _script(slurm_cluster, "env_saver.py", ENV_SAVER)
    elsewhere_saver = _script(slurm_cluster, "elsewhere_saver.py", ELSEWHERE_SAVER)
    crasher = _script(slurm_cluster, "crasher.py", CRASHER)
    one_fails = _script(slurm_cluster, "one_rank_fails.py", ONE_RANK_FAILS)
    one_per_node = ("--nodes=2", *ONE_TASK)
    return {
        # Two tasks per node, two CPUs each: one loader worker per rank, from the allocation.
        "example": _submit(
            slurm_cluster,
            "example",
            "train-multi-node.sbatch",
            ("--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2", "--gres=gpu:2"),
            DATA_SRC=str(photos),
            TRAIN_ARGS="--steps 12 --ckpt-every 6 --batch-size 8 --log-every 6",
        ),
        "minimal": _submit(
            slurm_cluster,
            "minimal",
            "train-multi-node.sbatch",
            one_per_node,
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(JOBS / "examples" / "minimal_train.py"),
            TRAIN_ARGS="--steps 12",
        ),
        "env-saver": _submit(
            slurm_cluster,
            "env-saver",
            "train-single-node.sbatch",
            ("--ntasks-per-node=2", "--cpus-per-task=1", "--gres=gpu:2"),
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(env_saver),
        ),
        "crasher": _submit(
            slurm_cluster,
            "crasher",
            "train-single-node.sbatch",
            ONE_TASK,
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(crasher),
        ),
        "one-fails": _submit(
            slurm_cluster,
            "one-fails",
            "train-multi-node.sbatch",
            one_per_node,
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(one_fails),
            REQUIRE_CHECKPOINT="0",
        ),
        "elsewhere": _submit(
            slurm_cluster,
            "elsewhere",
            "train-multi-node.sbatch",
            one_per_node,
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(elsewhere_saver),
            TRAIN_ARGS=shlex.quote(str(slurm_cluster.shared_dir / "byo" / "elsewhere" / "mine")),
        ),
    }


def test_example_trainer_runs_unmodified_on_a_jpg_dataset(slurm_cluster, jobs) -> None:
    import torch

    job = jobs["example"]
    text = _done(slurm_cluster, job)
    # One stage-in per node although the job has two tasks per node.
    for node in ("node1", "node2"):
        assert len(re.findall(rf"\[{node}\] stage-in: ", text)) == 1, text
    assert f"images from .jpg/.jpeg/.png/.webp, labels from .cls, {NUM_CLASSES} classes" in text
    assert "1 loader workers per rank" in text  # --cpus-per-task=2, one core for the loop
    assert "train: rank 0 of 4" in text and "done at step 12" in text
    committed = _committed(job)
    assert {"step-00000006", "step-00000012"} <= set(committed), text
    state = torch.load(job.ckpt_dest / "step-00000012" / "state.pt", weights_only=False)
    image_key = "jpg;jpeg;png;webp"  # (each sample's own format)
    assert state["data"] == {"image_key": image_key, "label_key": "cls", "num_classes": NUM_CLASSES}
    assert state["model"]["head.2.weight"].shape[0] == NUM_CLASSES


def test_minimal_script_from_the_docs_commits_last_pt_and_resumes(
    slurm_cluster, jobs, photos: Path
) -> None:
    job = jobs["minimal"]
    text = _done(slurm_cluster, job)
    assert "rank 0: done at step 12" in text and "rank 1: done at step 12" in text
    assert "stage-out: committed last.pt" in text, text
    assert "error" not in text, text  # (node 2, without a checkpoint, said "error: no checkpoint")
    assert set(_committed(job)) == {"last.pt"}
    # A second job of the series restores last.pt and continues from its step.
    again = _submit(
        slurm_cluster,
        "minimal",
        "train-multi-node.sbatch",
        ("--nodes=2", *ONE_TASK),
        DATA_SRC=str(photos),
        CKPT_DEST=str(job.ckpt_dest),
        TRAIN_SCRIPT=str(JOBS / "examples" / "minimal_train.py"),
        TRAIN_ARGS="--steps 20",
        RESUME="always",
    )
    text = _done(slurm_cluster, again)
    assert re.search(rf"restored checkpoint: /scratch/{again.job_id}/restore/last\.pt\b", text)
    assert "rank 0: done at step 20" in text, text
    record = _committed(again)["last.pt"]
    assert record["job_id"] == again.job_id


def test_a_checkpoint_saved_under_any_name_through_the_environment_is_committed(
    slurm_cluster, jobs
) -> None:
    job = jobs["env-saver"]
    text = _done(slurm_cluster, job)
    assert "stage-out: committed last.pt" in text, text
    assert (job.ckpt_dest / "last.pt").read_text() == "weights"


def test_a_script_that_fails_after_saving_has_its_checkpoint_committed(slurm_cluster, jobs) -> None:
    """Under set -e the template ended at the failed training step: every checkpoint of the
    run stayed on scratch, and no line said so. What it saved is committed, the job fails with
    training's exit code, and the log says both."""
    job = jobs["crasher"]
    text = _done(slurm_cluster, job, state="FAILED", exit_code="3:0")
    assert "saved, then failing" in text
    assert "error: training exited with 3; staging out the checkpoints it left" in text, text
    assert "stage-out: committed last.pt" in text and "finished" not in text, text
    assert (job.ckpt_dest / "last.pt").read_text() == "weights"


def test_one_failing_rank_of_several_is_said_not_taken_for_a_signal(slurm_cluster, jobs) -> None:
    """srun's exit code is the highest of its tasks': 143 for the rank it stopped after
    another failed, which read as a SIGTERM or a preemption. The line says what happened."""
    job = jobs["one-fails"]
    text = _done(slurm_cluster, job, state="FAILED", exit_code="143:0")
    assert "task 1: Exited with exit code 5" in text, text
    assert "training exited with 143 (srun stopped the other ranks after one failed" in text


def test_a_script_that_saves_elsewhere_fails_the_job_loudly(slurm_cluster, jobs) -> None:
    job = jobs["elsewhere"]
    text = _done(slurm_cluster, job, state="FAILED", exit_code="9:0")
    assert "saved" in text
    assert "error: training ended without leaving a checkpoint in" in text, text
    assert "nothing committed to" in text and "finished" not in text
    assert not job.ckpt_dest.exists()


@pytest.mark.parametrize(
    ("template", "launcher"),
    [
        ("train-single-node.sbatch", "srun"),
        ("train-multi-node.sbatch", "srun"),
        ("train-multi-node.sbatch", "torchrun"),
    ],
)
def test_a_plain_scancel_stages_out_what_training_saved(
    slurm_cluster, photos: Path, template: str, launcher: str
) -> None:
    """scancel (or scontrol requeue, or a preemption that sends only SIGTERM) ended the job
    within KillWait with every checkpoint since the last commit left on scratch, so a requeued
    run started over. The TERM trap commits what training saved before the job ends.

    On two nodes the trap reaches the batch node's scratch only (an ending job starts no
    step), so global rank 0 must run there: with torchrun's c10d rendezvous it ran on either
    node (ranked by host name and process id), and nothing was committed about half the time."""
    import time

    script = _script(slurm_cluster, "saver_then_sleeper.py", SAVER_THEN_SLEEPER)
    nodes = ("--nodes=2",) if "multi" in template else ()
    job = _submit(
        slurm_cluster,
        f"cancelled-{template.split('-')[1]}-{launcher}",
        template,
        (*nodes, *ONE_TASK),
        DATA_SRC=str(photos),
        TRAIN_SCRIPT=str(script),
        LAUNCHER=launcher,
    )
    deadline = time.monotonic() + 240
    while "saved, training on" not in job.text():
        assert time.monotonic() < deadline, job.text()
        time.sleep(0.5)
    slurm_cluster.run(["scancel", job.job_id])
    slurm_cluster.wait_job(job.job_id, timeout_s=120, output=job.output)
    text = job.text()
    assert "SIGTERM at" in text and "committed what training saved" in text, text
    assert (job.ckpt_dest / "last.pt").read_text() == "weights"


def test_usr1_after_training_ended_lets_the_final_stage_out_finish_without_a_requeue(
    slurm_cluster, photos: Path
) -> None:
    """The pre-timeout USR1 arriving during the final stage-out ran the trap after it: a second
    stage-out and a requeue of a job that had finished training, whose rerun then failed
    (minimal_train.py resumed at its last step). It now lets the stage-out finish and ends."""
    import time

    job = _submit(
        slurm_cluster,
        "usr1-late",
        "train-single-node.sbatch",
        ONE_TASK,
        DATA_SRC=str(photos),
        TRAIN_SCRIPT=str(JOBS / "examples" / "minimal_train.py"),
        TRAIN_ARGS="--steps 2",
        STAGE_OUT_ARGS="--bw-limit 0.002",  # (a few seconds for last.pt: the signal's window)
    )
    staging = job.ckpt_dest / ".stager" / "staging"
    deadline = time.monotonic() + 240
    while not (staging.is_dir() and any(staging.iterdir())):  # (the final stage-out copies)
        assert time.monotonic() < deadline, job.text()
        time.sleep(0.1)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.job_id])
    record = slurm_cluster.wait_job(job.job_id, timeout_s=240, output=job.output)
    text = job.text()
    assert (record["JobState"], record.get("Restarts", "0")) == ("COMPLETED", "0"), text
    assert "after training ended: the final stage-out goes on; not requeued" in text, text
    assert "stage-out: committed last.pt" in text and f"job {job.job_id} finished" in text


JOB_SAVER = """import os
name = "ckpt-" + os.environ["SLURM_JOB_ID"] + ".pt"
with open(os.path.join(os.environ["CKPT_DIR"], name), "w") as f:
    f.write("weights")
print("saved", name, flush=True)
"""


def test_jobs_sharing_a_stager_dest_commit_only_their_own_checkpoints(
    slurm_cluster, photos: Path
) -> None:
    """STAGER_DEST set to a root jobs share (to reuse staged data): its checkpoints directory
    was shared too, so the next job on the node committed the last job's checkpoints to its
    own CKPT_DEST (and two at once overwrote each other's). Each job now has its own."""
    script = _script(slurm_cluster, "job_saver.py", JOB_SAVER)
    node = slurm_cluster.node_names[0]
    done = []
    for name in ("shared-a", "shared-b"):
        job = _submit(
            slurm_cluster,
            name,
            "train-single-node.sbatch",
            (f"--nodelist={node}", *ONE_TASK),
            DATA_SRC=str(photos),
            TRAIN_SCRIPT=str(script),
            STAGER_DEST="/scratch/shared-dest",
        )
        _done(slurm_cluster, job)
        done.append(job)
    for job in done:
        assert set(_committed(job)) == {f"ckpt-{job.job_id}.pt"}, job.text()
    assert (slurm_cluster.scratch(node) / "shared-dest" / "photos").is_dir()  # (data reused)
    assert not list((slurm_cluster.scratch(node) / "shared-dest").glob("job-*"))  # (cleaned)


def test_stager_scratch_root_is_where_the_template_stages_and_cleans(
    slurm_cluster, photos: Path
) -> None:
    """With STAGER_SCRATCH_ROOT set, the template staged into /scratch/$SLURM_JOB_ID and its
    clean step (stager clean, which honours the variable) looked in the other root: the job's
    scratch was left behind. Both now use it."""
    script = _script(slurm_cluster, "job_saver.py", JOB_SAVER)
    node = slurm_cluster.node_names[1]
    job = _submit(
        slurm_cluster,
        "scratch-root",
        "train-single-node.sbatch",
        (f"--nodelist={node}", *ONE_TASK),
        DATA_SRC=str(photos),
        TRAIN_SCRIPT=str(script),
        STAGER_SCRATCH_ROOT="/scratch/alt",
    )
    text = _done(slurm_cluster, job)
    assert f"/scratch/alt/{job.job_id}/photos" in text, text
    assert set(_committed(job)) == {f"ckpt-{job.job_id}.pt"}
    scratch = slurm_cluster.scratch(node)
    assert not (scratch / job.job_id).exists() and not (scratch / "alt" / job.job_id).exists()
