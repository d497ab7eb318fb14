"""Helpers the benchmark scripts share."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["scratch_root", "in_workdir", "report"]


def scratch_root(prefix: str) -> tuple[Path, str]:
    """A fresh work directory on tmpfs when there is one, and the condition to report with it.

    This machine evicts clean page-cache pages within seconds, so only tmpfs gives a
    reproducible warm condition; elsewhere the figures include disk reads, and say so.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm)), "tmpfs (/dev/shm, page-cache warm)"
    return Path(tempfile.mkdtemp(prefix=prefix)), "local disk (NOT tmpfs: figures include disk reads)"


def in_workdir(workdir: Path | None, prefix: str, run: Callable[[Path], list[dict]], *, parent: str | None = None) -> list[dict]:
    """``run(dir)`` in ``workdir``, or in a fresh temporary directory that is removed afterwards."""
    work = workdir or Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        return run(work)
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def report(rows: list[dict], to_markdown: Callable[[list[dict]], str], json_path: Path | None) -> None:
    """Print the Markdown table, and write the rows as JSON when asked."""
    print(to_markdown(rows))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))
