"""Run the CLI in the test process: same code path as the console scripts, minus ~1 s of
interpreter start-up per call (which adds up on a 2-core CI machine)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from stager.cli.main import main, stage_in_main

__all__ = ["CliResult", "run_main", "clean_process_env"]


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stderr: str


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> CliResult:
    """``stage-in ARGS`` or ``stager COMMAND ARGS`` in-process; stderr captured for this call."""
    capsys.readouterr()
    if argv[0] == "stage-in":
        code = stage_in_main(list(argv[1:]))
    else:
        assert argv[0] == "stager", argv
        code = main(list(argv[1:]))
    return CliResult(code, capsys.readouterr().err)


def clean_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop an enclosing job's SLURM_*/STAGER_* variables, as conftest.clean_env does for
    children."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "STAGER_")):
            monkeypatch.delenv(name)
