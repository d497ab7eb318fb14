"""docs/quickstart.md, followed as written on the test cluster: its commands are read from the
page, so the test fails when the page drifts from what works.

Every fenced block of the page is one step, tagged in its info string with where it runs:

* ``login``: on the login node (here: the test host), in the working directory;
* ``salloc``: the allocation request; the ``allocation`` blocks after it run inside it, as
  ``salloc ARGS bash -c BLOCKS`` (what typing them into salloc's shell does);
* ``file=NAME``: saved as ``NAME`` in the working directory;
* ``submit``: an sbatch submission from the root of a clone (the working directory links
  ``jobs/``), waited for until the job ends;
* ``install``: not run (the test venv has the package).

Only two things are added, both through the environment: ``/nfs`` is moved under the cluster's
shared directory, and the submitted job gets ``TRAIN_ARGS`` for a short run and
``SBATCH_OUTPUT`` for its log (environment variables the template and sbatch document).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slurm

PAGE = REPO / "docs" / "quickstart.md"
FENCE = re.compile(r"^```([a-z]+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
WHERE = ("install", "login", "salloc", "allocation", "submit")


def quickstart_steps(text: str) -> list[tuple[str, str]]:
    """``(where, body)`` of every fenced block, in page order; ``where`` from its tags."""
    steps = []
    for match in FENCE.finditer(text):
        tags = match.group(2).split()
        body = match.group(3)
        files = [t.split("=", 1)[1] for t in tags if t.startswith("file=")]
        where = [t for t in tags if t in WHERE]
        if files:
            steps.append((f"file={files[0]}", body))
        elif len(where) == 1:
            steps.append((where[0], body))
        else:
            raise AssertionError(f"quickstart block without one of {WHERE}: {body[:80]!r}")
    return steps


def test_the_page_has_the_steps_the_test_runs() -> None:
    steps = quickstart_steps(PAGE.read_text())
    kinds = [where for where, _ in steps]
    assert kinds.count("salloc") == 1 and kinds.count("submit") == 1
    assert kinds.index("salloc") < kinds.index("allocation")
    salloc = next(body for where, body in steps if where == "salloc")
    assert re.fullmatch(r"salloc [^\n;&|]+\n", salloc), salloc


def _localise(body: str, root: Path) -> str:
    return body.replace("/nfs/", f"{root}/nfs/")


def test_quickstart_as_written(slurm_cluster, tmp_path: Path) -> None:
    root = slurm_cluster.shared_dir / "quickstart"
    work = root / "clone"  # the user's working directory: the root of a clone
    work.mkdir(parents=True)
    (work / "jobs").symlink_to(REPO / "jobs")
    env = {"SBATCH_OUTPUT": str(root / "job-%j.out")}

    def shell(code: str) -> subprocess.CompletedProcess:
        return slurm_cluster.run(["bash", "-euo", "pipefail", "-c", code], cwd=work, env=env)

    steps = quickstart_steps(PAGE.read_text())
    in_allocation: list[str] = []
    salloc = ""
    outputs: list[str] = []
    for where, body in steps:
        body = _localise(body, root)
        if where == "install":
            continue
        if where.startswith("file="):
            (work / where.split("=", 1)[1]).write_text(body)
        elif where == "login":
            outputs.append(shell(body).stdout)
        elif where == "salloc":
            salloc = body.strip()
        elif where == "allocation":
            in_allocation.append(body)
        elif where == "submit":
            # The allocation's blocks run before the submission, as the page orders them.
            allocated = slurm_cluster.run(
                [*salloc.split(), "bash", "-euo", "pipefail", "-c", "\n".join(in_allocation)],
                cwd=work,
                env=env,
                timeout=300,
            )
            allocation_text = allocated.stdout + allocated.stderr
            job_env = {**env, "TRAIN_ARGS": "--steps 6 --ckpt-every 3 --log-every 3"}
            submitted = slurm_cluster.run(
                ["bash", "-euo", "pipefail", "-c", body], cwd=work, env=job_env
            )
            job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)

    # Stage-in ran once per node, inside the allocation, and the loader read the staged copy
    # on every rank: no "no staged copy" / "reading ... from the source" warning.
    assert len(re.findall(r"\[node\d\] stage-in: 8 files, 8 copied", allocation_text)) == 2, (
        allocation_text
    )
    ranks = re.findall(
        r"rank (\d) of 4: torch.uint8 \[32, 18, 18, 3\] 7 batches/epoch", allocation_text
    )
    assert sorted(ranks) == ["0", "1", "2", "3"], allocation_text
    assert "from the source" not in allocation_text and "no staged copy" not in allocation_text
    assert "can't honor" not in allocation_text

    output = root / f"job-{job_id}.out"
    record = slurm_cluster.wait_job(job_id, timeout_s=300, output=output)
    text = output.read_text(errors="replace")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), (record, text)
    assert "train: rank 0 of 4" in text and "done at step 6" in text, text
    assert "3 loader workers per rank" in text  # --cpus-per-task=4, one core for the loop
    commits = root / "nfs" / "ckpt" / "run1" / ".stager" / "commits"
    assert (commits / "step-00000006.json").is_file(), text
