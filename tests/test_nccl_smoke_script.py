"""scripts/nccl_smoke.py is run by hand on a GPU machine (CI has none): its ``--cpu`` mode runs
every step on gloo, so the script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_nccl_smoke_script_runs_every_step_on_gloo(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "nccl_smoke.py"),
            "--cpu",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collectives on gloo: ok" in done.stdout
    assert "resumed from" in done.stdout  # the second training run continued the first
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))[-1] == "step-00000030"
