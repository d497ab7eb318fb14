"""Relative shard paths that can never escape the dataset root.

Every path that comes from a source listing, a list file or a manifest goes through
:func:`safe_relpath` before it touches the destination, so ``../../etc/passwd`` or an absolute
name in a hostile manifest is refused instead of written.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from .errors import UnsafePath

__all__ = ["safe_relpath", "safe_join", "PARTIAL_SUFFIX"]

#: Suffix of a file still being written; never treated as a staged shard.
PARTIAL_SUFFIX = ".partial"


def safe_relpath(relpath: str) -> str:
    """Normalise a POSIX relative path, refusing anything that is absolute or climbs out."""
    if not relpath or "\x00" in relpath:
        raise UnsafePath(f"empty or NUL-containing shard path {relpath!r}; fix the source listing")
    if relpath.startswith("/") or relpath.startswith("\\") or (len(relpath) > 1 and relpath[1] == ":"):
        raise UnsafePath(f"absolute shard path {relpath!r} refused; paths must be relative to the dataset")
    parts = relpath.replace("\\", "/").split("/")
    if any(p == ".." for p in parts):
        raise UnsafePath(f"shard path {relpath!r} contains '..' and could escape the dataset root; refused")
    norm = posixpath.normpath("/".join(p for p in parts if p not in ("", ".")))
    if norm in (".", "") or norm.startswith(".."):
        raise UnsafePath(f"shard path {relpath!r} does not name a file inside the dataset; refused")
    if norm.endswith(PARTIAL_SUFFIX):
        raise UnsafePath(f"shard path {relpath!r} ends with the reserved suffix {PARTIAL_SUFFIX!r}")
    return norm


def safe_join(root: str | os.PathLike[str], relpath: str) -> Path:
    """``root / relpath`` after :func:`safe_relpath`, checked again after resolution."""
    root_path = Path(root)
    target = root_path / safe_relpath(relpath)
    resolved_root = root_path.resolve()
    resolved = target.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePath(f"shard path {relpath!r} resolves outside {root_path} (a symlink?); refused")
    return target
