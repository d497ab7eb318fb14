"""The sbatch script docs/stage-out.md shows, as written, on the real test cluster (two nodes).

A hostile review ran it: the job never ended after training (a bare ``wait`` waited for the
watcher too), a USR1 after training requeued the finished job again and again, and a resumed
two-node run failed on the second node (the checkpoint was restored on the first only). Only
the paths and the training command are put in; a stand-in trainer saves a checkpoint every 4
steps on rank 0 and resumes from ``--resume`` on every rank.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

DOC = Path(__file__).resolve().parent.parent / "docs" / "stage-out.md"
STEPS = 40

TRAINER = """import argparse, os, time
parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir")
parser.add_argument("--resume")
args = parser.parse_args()
rank = int(os.environ["SLURM_PROCID"])
start = 0
if args.resume:
    with open(os.path.join(args.resume, "step")) as f:
        start = int(f.read())
    print(f"rank {rank} resumed at {start} on {os.uname().nodename}", flush=True)
for step in range(start + 1, STEPS + 1):
    time.sleep(0.25)
    if rank == 0 and step % 4 == 0:
        final = os.path.join(args.ckpt_dir, f"step-{step:04d}")
        os.makedirs(final + ".tmp")
        with open(os.path.join(final + ".tmp", "step"), "w") as f:
            f.write(str(step))
        os.replace(final + ".tmp", final)
        print(f"saved {step}", flush=True)
print(f"rank {rank} done", flush=True)
"""


def _doc_script() -> str:
    text = DOC.read_text()
    block = re.search(r"```bash norun\n(#SBATCH --signal=B:USR1@120.*?)```", text, re.S)
    assert block, "the sbatch example of docs/stage-out.md"
    return block.group(1)


def test_the_stage_out_docs_sbatch_example_requeues_resumes_on_both_nodes_and_ends(
    slurm_cluster,
) -> None:
    base = slurm_cluster.shared_dir / "docs-sbatch"
    base.mkdir(parents=True)
    trainer = base / "train.py"
    trainer.write_text(TRAINER.replace("STEPS", str(STEPS)))
    persist = base / "persist"
    body = _doc_script()
    assert "/nfs/runs/exp1" in body and "python train.py" in body
    body = body.replace("/nfs/runs/exp1", str(persist))
    body = body.replace(
        "python train.py", f"{shlex.quote(sys.executable)} {shlex.quote(str(trainer))}"
    )
    script = base / "job.sbatch"
    script.write_text("#!/bin/bash\n" + body)
    output = base / "job.out"
    job_id = slurm_cluster.sbatch(
        script,
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--open-mode=append",
        f"--output={output}",
    )
    deadline = time.monotonic() + 240
    while "saved 12" not in (output.read_text() if output.exists() else ""):
        assert time.monotonic() < deadline, output.read_text() if output.exists() else ""
        time.sleep(0.5)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    record = slurm_cluster.wait_job(job_id, timeout_s=300, output=output)
    text = output.read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, text)
    assert record["Restarts"] == "1", text  # (requeued once, by the USR1; not after training)
    resumed = re.findall(r"rank (\d) resumed at (\d+)", text)
    assert sorted(rank for rank, _ in resumed) == ["0", "1"], text  # (both nodes restored it)
    assert len({step for _, step in resumed}) == 1 and int(resumed[0][1]) >= 12, text
    assert "rank 0 done" in text and "rank 1 done" in text, text
    committed = sorted(p.name for p in persist.iterdir() if not p.name.startswith("."))
    assert committed[-1] == f"step-{STEPS:04d}" and len(committed) <= 3, committed  # (--keep 3)
