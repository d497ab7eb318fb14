"""Pick the commit store for a destination URL: rename-based for local paths, marker-based else.

A module of its own so that the store base (:mod:`stager.stageout.store`) and its two backends
import in one direction only: the backends import the base, this module imports the backends.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from stager.errors import DestinationError
from stager.stageout.store import CommitStore
from stager.stageout.store_object import ObjectCommitStore
from stager.stageout.store_posix import LocalCommitStore

__all__ = ["open_store"]


def open_store(url: str, *, stale_s: float = 6 * 3600) -> CommitStore:
    """The store for ``url``: rename-based for local paths, marker-based for everything else."""
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise DestinationError(
            f"cannot open destination {url}: {exc}; check the URL (and install s3fs for s3://)"
        ) from exc
    if isinstance(fs, LocalFileSystem):
        return LocalCommitStore(url, fs, os.path.abspath(root), stale_s=stale_s)
    return ObjectCommitStore(url, fs, root, stale_s=stale_s)
