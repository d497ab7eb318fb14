"""Another spelling of a local source: its root resolved through symlinks.

stage-in and the loader name a dataset, and tell a staged copy of it from another one's, by
the text of the source (no I/O: every rank, every node, alike). A source reached through a
symlink (``/data/ds`` linking to ``/nfs/proj/ds``) staged under one spelling and loaded under
the other was either not found, and every shard read from the source, or refused as "another
dataset". Where the plain lookup finds nothing, the loader tries the source's real path once
(a few metadata calls on the source's filesystem, only then).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from stager.errors import UsageError
from stager.layout import canonical_root, is_remote_url, source_path, source_root

__all__ = ["check_same_root", "is_local_spec", "real_spelling", "same_local_root", "spelled_from"]


def real_spelling(spec: str | Sequence[str]) -> str | list[str] | None:
    """``spec`` with its local root resolved through symlinks; None where that changes nothing
    or the source is not local."""
    if not is_local_spec(spec):
        return None
    root = source_root(spec)
    real = os.path.realpath(root)
    if real == root:
        return None
    if isinstance(spec, str):
        return real + source_path(spec)[len(root) :]
    return [real + source_path(u)[len(root) :] for u in spec]


def same_local_root(staged_root: str, spec: str | Sequence[str]) -> bool:
    """Whether a staged copy's recorded root and ``spec``'s are one directory by their real
    paths (both local)."""
    if not is_local_spec(spec) or is_remote_url(staged_root):
        return False
    mine = os.path.realpath(source_root(spec))
    return os.path.realpath(source_path(staged_root)) == mine


def is_local_spec(spec: str | Sequence[str]) -> bool:
    """Whether ``spec`` (a SOURCE, or a list's first URL) names local paths."""
    return not is_remote_url(spec if isinstance(spec, str) else next(iter(spec), ""))


def spelled_from(spec: str | Sequence[str], staged_root: str) -> str | list[str]:
    """``spec`` with its root spelled as a staged copy records it, where the two are one local
    directory by another spelling (:func:`same_local_root`): a glob, a file or a list through
    a symlink then selects the staged relpaths, which hang from the recorded spelling."""
    if not is_local_spec(spec) or is_remote_url(staged_root):
        return spec if isinstance(spec, str) else list(spec)
    root, recorded = source_root(spec), source_path(staged_root)
    if root == recorded:
        return spec if isinstance(spec, str) else list(spec)
    if isinstance(spec, str):
        return recorded + source_path(spec)[len(root) :]
    return [recorded + source_path(u)[len(root) :] for u in spec]


def check_same_root(meta: dict[str, str], spec: str | list[str] | None, where: Path) -> None:
    """Refuse a staged copy of another source that happens to have the name ``spec`` gives."""
    staged_root = meta.get("source", "")
    if spec is None or ("://" not in staged_root and not staged_root.startswith("/")):
        return  # given the staged directory itself, or a manifest of an older stager
    if canonical_root(staged_root) != canonical_root(spec) and not same_local_root(
        staged_root, spec
    ):
        raise UsageError(
            f"{where} holds a staged copy of {staged_root}, not of {spec}: another dataset "
            "under the same name; pass options=LoaderOptions(name=...) as stage-in's --name"
        )
