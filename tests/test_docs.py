"""The documentation cannot drift: generated pages are fresh and every runnable block runs.

* docs/cli.md is regenerated from the argument parsers and compared;
* docs/api.md is regenerated from the docstrings and compared, and every public name has one;
* every ```bash and ```python block of README.md and docs/*.md runs against a small synthetic
  dataset. Paths under /nfs and /scratch are redirected into a temporary directory, blocks run
  as if in a one-node allocation (``SLURM_NNODES=1``) and ``srun`` runs its command once as
  that node's task. Blocks marked ``norun`` (installs, sbatch
  submissions, multi-node launches) are left to the Slurm tier, which runs the templates.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .conftest import BIN, REPO, clean_env

GENERATED = {"cli.md", "api.md", "benchmarks.md"}
FENCE = re.compile(r"^```([a-z]+)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUNNABLE = {"bash": "bash", "sh": "bash", "python": "python"}


def _blocks() -> list[tuple[str, str, str]]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for page in pages:
        if page.name in GENERATED:
            continue
        text = page.read_text()
        for match in FENCE.finditer(text):
            lang, info, body = match.group(1), match.group(2), match.group(3)
            if lang in RUNNABLE and "norun" not in info:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(REPO)}:{line}", RUNNABLE[lang], body))
    return found


BLOCKS = _blocks()

SRUN_SHIM = """#!/usr/bin/env bash
# docs-test srun: drop srun's options, run the command once as task 0 of a one-node job
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
export SLURM_JOB_ID=4321 SLURM_NODEID=0 SLURM_JOB_NUM_NODES=1 SLURM_JOB_NODELIST=node1 \\
    SLURMD_NODENAME=node1 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1
exec "$@"
"""


@pytest.fixture(scope="module")
def docs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    write_synthetic_dataset(
        root / "nfs" / "datasets" / "mydata", SyntheticSpec(num_shards=4, samples_per_shard=40)
    )
    shims = root / "shims"
    shims.mkdir()
    (shims / "srun").write_text(SRUN_SHIM)
    (shims / "srun").chmod(0o755)
    (root / "tmp").mkdir()
    return root


def _localise(body: str, root: Path) -> str:
    """The docs' /nfs and /scratch paths under ``root``, which the test runs from: relative,
    so a temporary directory whose path holds a space or quote does not split the commands."""
    del root  # (the blocks run with cwd=root)
    return body.replace("/nfs/", "./nfs/").replace("/scratch/", "./scratch/")


@pytest.mark.parametrize(("where", "lang", "body"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_block_runs(where: str, lang: str, body: str, docs_root: Path) -> None:
    env = clean_env(
        PATH=f"{docs_root / 'shims'}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        STAGER_DEST=str(docs_root / "scratch" / "docs"),
        SLURM_NNODES="1",
        TMPDIR=str(docs_root / "tmp"),
        PYTHONPATH=str(REPO),
    )
    code = _localise(body, docs_root)
    argv = (
        ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    )
    result = subprocess.run(
        argv, cwd=docs_root, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, (
        f"{where} failed:\n{code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def test_there_are_runnable_blocks() -> None:
    assert len(BLOCKS) >= 10


def test_cli_reference_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "stager.cli.clidoc", "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_api_reference_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "apidoc.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("package", ["stager_loaders", "stager"])
def test_every_public_name_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    api = (REPO / "docs" / "api.md").read_text()
    for name in module.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(module, name)
        assert inspect.getdoc(obj), f"{package}.{name} has no docstring"
        assert f"`{package}.{name}" in api, f"{package}.{name} is missing from docs/api.md"


def test_jobs_md_shows_the_tested_minimal_script_verbatim() -> None:
    """docs/jobs.md quotes jobs/examples/minimal_train.py, which the Slurm tier runs."""
    text = (REPO / "docs" / "jobs.md").read_text()
    quoted = [m.group(3) for m in FENCE.finditer(text) if "minimal_train.py" in m.group(2)]
    assert quoted == [(REPO / "jobs" / "examples" / "minimal_train.py").read_text()]
