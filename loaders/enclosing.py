"""A staged copy of a directory above the loader's SOURCE: ``stage-in /nfs/ds`` once, then
``ShardedLoader("/nfs/ds/train")`` and ``ShardedLoader("/nfs/ds/val/*.tar")``.

Why: the loader looks a source's staged copy up by the name stage-in gives that source (its
root's basename, ``train``), while a dataset staged whole, its train and validation directories
inside, is under the name of the directory above (``ds``). Every rank then read every shard from
the shared filesystem, with one warning, while the copy sat on scratch. Where the source's own
name finds nothing, each directory above its root is tried, nearest first, by the name stage-in
gives it: one ``stat`` on scratch each, nothing of the source. A copy counts only where its
manifest records that very directory as its source, staged whole (a part, such as a glob,
cannot answer for another selection), and it holds a shard the SOURCE selects
(:mod:`loaders.selection`). Sources with a hidden part below such a directory are not looked
for there: stage-in of a directory leaves hidden names out.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Sequence
from pathlib import Path

from stager.errors import UsageError
from stager.layout import StagedDataset, canonical_root, is_remote_url, source_root

from .selection import is_whole_directory

__all__ = ["MOST_LEVELS", "enclosing_copies", "staged_whole_from"]

#: How many directories above the source's root are tried, at most.
MOST_LEVELS = 16


def enclosing_copies(root: Path, spec: str | Sequence[str]) -> Iterator[tuple[StagedDataset, str]]:
    """The staged datasets under ``root`` that the directories above ``spec``'s root would be
    staged as, nearest first, each with that directory as a staged manifest records a source
    (``file:///nfs/ds``, ``s3://bucket/ds``); only those with a manifest."""
    first = spec if isinstance(spec, str) else next(iter(spec), "")
    scheme = first.split("://", 1)[0] if is_remote_url(first) else "file"
    parts = source_root(spec).rstrip("/").split("/")
    lowest = max(0, len(parts) - 1 - MOST_LEVELS)
    for depth in range(len(parts) - 1, lowest, -1):
        if any(part.startswith(".") for part in parts[depth:]):
            return  # (left out of a copy of any directory above it)
        directory = "/".join(parts[:depth])
        name = posixpath.basename(directory)
        if not name:
            return
        try:
            staged = StagedDataset(root, name)
        except UsageError:  # (a name stage-in never stages under)
            continue
        if staged.manifest_path.is_file():
            yield staged, f"{scheme}://{directory}"


def staged_whole_from(meta: dict[str, str], directory: str) -> bool:
    """Whether a staged manifest's ``meta`` records ``directory`` (as :func:`enclosing_copies`
    gives it), staged whole, as its source."""
    source, spec = meta.get("source", ""), meta.get("spec", "")
    if not source or not spec or not is_whole_directory(spec):
        return False
    return canonical_root(source) == directory
