"""The sbatch templates and scripts quote every expansion: shellcheck finds nothing, info level
included.

SC2086/SC2046 (unquoted expansions) are info-level findings, so the check runs at ``-S info``;
a path with spaces, quotes or newlines passed through DATA_SRC or CKPT_DEST cannot split.
The Slurm tier runs the templates for real with such a path (tests/test_slurm_jobs.py).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .conftest import REPO

SCRIPTS = sorted(
    [*(REPO / "jobs").glob("*.sbatch"), *(REPO / "scripts").glob("*.sh"), REPO / ".ci" / "run"]
)


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck not installed (scripts/setup.sh --test installs it)",
)
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_shellcheck_finds_nothing(script) -> None:
    result = subprocess.run(
        ["shellcheck", "-S", "info", "-s", "bash", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_templates_are_checked() -> None:
    assert {p.name for p in SCRIPTS} >= {"train-single-node.sbatch", "train-multi-node.sbatch"}
