"""The README's demo (scripts/demo.sh runs this script after setting up) works end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import REPO, clean_env


def test_demo_stages_and_loads(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "jobs" / "examples" / "demo.py"),
            "--workdir",
            str(tmp_path),
            "--batches",
            "3",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stage-in: 8 files, 8 copied" in result.stderr
    assert result.stdout.count("batch ") == 3 and "demo ok" in result.stdout
    assert (tmp_path / "scratch" / "demo" / "demo-ds" / ".stager" / "manifest.json").is_file()
