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


@pytest.mark.parametrize("template", ["train-single-node.sbatch", "train-multi-node.sbatch"])
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("TRAIN_ARGS=--steps 6 --tag 'unbalanced", "TRAIN_ARGS is not a list of shell-quoted"),
        ("STAGE_IN_ARGS=--bw-limit 'x", "STAGE_IN_ARGS is not a list of shell-quoted"),
        ("CLEAN_SCRATCH=maybe", "CLEAN_SCRATCH=maybe: give 1 or 0"),
        ("STOP_GRACE_S=2m", "STOP_GRACE_S=2m: give a whole number"),
        ("RESUME=yes", "RESUME=yes: give requeue, always or never"),
    ],
)
def test_a_setting_the_templates_cannot_use_is_one_line_and_exit_2_before_staging(
    template: str, setting: str, says: str, tmp_path
) -> None:
    """An unbalanced quote in TRAIN_ARGS dropped every argument after a Python traceback (the
    job trained with none and ended COMPLETED); CLEAN_SCRATCH=yes failed the job after its
    stage-out under set -u; STOP_GRACE_S=2m gave training no grace. Each is now refused
    before anything is staged."""
    import sys

    name, _, value = setting.partition("=")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "1",
        "PYTHON": sys.executable,
        "DATA_SRC": str(tmp_path / "never-read"),
        name: value,
    }
    result = subprocess.run(
        ["bash", str(REPO / "jobs" / template)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr
    assert not (tmp_path / "never-read").exists() and "stage-in" not in result.stdout


@pytest.mark.parametrize("template", ["train-single-node.sbatch", "train-multi-node.sbatch"])
@pytest.mark.parametrize(
    "spelling",
    ["/nfs/ds", "/nfs/ds/", "/nfs/ds/.", "/nfs/ds/./", "/nfs/ds/./.", "/nfs/ds/train-{0..3}.tar"],
)
def test_the_templates_name_the_copy_as_stage_in_does(template: str, spelling: str) -> None:
    """The templates' DATA_NAME (their default_data_name) is the name stage-in and the loader
    give the source (stager.layout.dataset_name): ``DATA_SRC=/nfs/ds/.`` gave ``.``, which
    stage-in refused as a name (exit 2) although ``stage-in /nfs/ds/.`` alone stages ``ds``."""
    from stager.layout import dataset_name

    text = (REPO / "jobs" / template).read_text()
    function = text[text.index("default_data_name() {") :]
    function = function[: function.index("\n}\n") + 3]
    script = f'{function}default_data_name "$1"\n'
    named = subprocess.run(
        ["bash", "-c", script, "_", spelling], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert named == dataset_name(spelling) == "ds"
