"""Helpers the benchmark scripts share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["scratch_root"]


def scratch_root(prefix: str) -> tuple[Path, str]:
    """A fresh work directory on tmpfs when there is one, and the condition to report with it.

    This machine evicts clean page-cache pages within seconds, so only tmpfs gives a
    reproducible warm condition; elsewhere the figures include disk reads, and say so.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm)), "tmpfs (/dev/shm, page-cache warm)"
    return Path(tempfile.mkdtemp(prefix=prefix)), "local disk (NOT tmpfs: figures include disk reads)"
