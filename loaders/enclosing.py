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

The same part may be named by its path on scratch: the templates hand a script the staged copy
(``$DATA_DIR``), and a script loads ``$DATA_DIR/train``. That was read as a plain directory as
it stood: while ``stage-in --background`` still copied it, a part of the shards, and the job
trained on them and ended well. :func:`staged_dir_above` finds the copy it lies in (by its
``.stager`` directory), and :func:`respelled` names the same part under the copy's source, so
the shards come from the copy's manifest as for the source's spelling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import StagerError, UsageError
from stager.layout import (
    StagedDataset,
    canonical_root,
    is_remote_url,
    source_path,
    source_root,
)
from stager.shards.manifest import ManifestColumns
from stager.shards.manifestcolumns import cached_columns
from stager.shards.packedstrings import PackedStrings

from .selection import is_whole_directory
from .spelling import is_local_spec

if TYPE_CHECKING:
    from .resolve import DatasetShards

__all__ = [
    "MOST_LEVELS",
    "copy_above",
    "part_of_a_copy",
    "enclosing_copies",
    "respelled",
    "staged_dir_above",
    "staged_whole_from",
]

#: How many directories above the source's root are tried, at most.
MOST_LEVELS = 16


def _directories_above(spec: str | Sequence[str]) -> Iterator[tuple[str, list[str]]]:
    """Each directory above ``spec``'s root, nearest first, at most :data:`MOST_LEVELS` and
    never the filesystem's (or a bucket list's) root; with the parts of the root below it."""
    parts = source_root(spec).rstrip("/").split("/")
    for depth in range(len(parts) - 1, max(0, len(parts) - 1 - MOST_LEVELS), -1):
        directory = "/".join(parts[:depth])
        if not posixpath.basename(directory):
            return
        yield directory, parts[depth:]


def enclosing_copies(root: Path, spec: str | Sequence[str]) -> Iterator[tuple[StagedDataset, str]]:
    """The staged datasets under ``root`` that the directories above ``spec``'s root would be
    staged as, nearest first, each with that directory as a staged manifest records a source
    (``file:///nfs/ds``, ``s3://bucket/ds``); only those with a manifest."""
    first = spec if isinstance(spec, str) else next(iter(spec), "")
    scheme = first.split("://", 1)[0] if is_remote_url(first) else "file"
    for directory, below in _directories_above(spec):
        if any(part.startswith(".") for part in below):
            return  # (left out of a copy of any directory above it)
        try:
            staged = StagedDataset(root, posixpath.basename(directory))
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


def staged_dir_above(spec: str | Sequence[str]) -> StagedDataset | None:
    """The staged copy whose directory holds ``spec``'s root strictly below it (a local path
    on scratch), found by its ``.stager`` directory with a manifest, a plan or a journal in
    it; None for anything else."""
    if not spec or not is_local_spec(spec):
        return None
    for directory, _ in _directories_above(spec):
        try:
            staged = StagedDataset.of(directory)
        except UsageError:  # (no dataset's name)
            continue
        made = (staged.manifest_path, staged.staging_path, staged.journal_path)
        if staged.meta_dir.is_dir() and any(path.exists() for path in made):
            return staged  # (a stage-out destination has a .stager too: its commits)
    return None


def respelled(spec: str | Sequence[str], staged_dir: str, recorded: str) -> str | list[str]:
    """``spec``, a path inside ``staged_dir``, as the same place under the source the copy
    records (``recorded``: ``file:///nfs/ds``, ``s3://bucket/ds``)."""
    base = recorded.removeprefix("file://").rstrip("/")

    def one(path: str) -> str:
        return base + source_path(path)[len(staged_dir.rstrip("/")) :]

    return one(spec) if isinstance(spec, str) else [one(u) for u in spec]


def copy_above(root: Path, spec: str | list[str], on_error: str) -> DatasetShards | None:
    """``spec``'s shards in a copy under ``root`` of a directory above its root, staged whole,
    or None."""
    from .resolve import NothingSelected  # (it imports this module)

    for staged, directory in enclosing_copies(root, spec):
        try:
            columns = cached_columns(staged.manifest_path, staged.index_dir)
        except StagerError:  # (unreadable: the source is read, as without a copy)
            continue
        if staged_whole_from(columns.meta, directory):
            with contextlib.suppress(NothingSelected):
                return _part(staged.dir, spec, directory, on_error, columns)
    return None


def _part(
    dataset_dir: Path, spec: str | list[str], root: str, on_error: str, columns: ManifestColumns
) -> DatasetShards:
    """What ``spec`` selects of the copy of ``root`` (a directory above its root), named from
    ``spec``'s root, as its own copy or the source names them: the fingerprint a resumed
    state is checked with is made of these names."""
    from .resolve import _from_staged

    found = _from_staged(dataset_dir, spec, on_error, columns)
    cut = len(source_root(spec)) - len(source_path(root))
    return dataclasses.replace(
        found,
        relpaths=PackedStrings([r[cut:] for r in found.relpaths]),
        left_out=tuple(r[cut:] for r in found.left_out),
    )


def part_of_a_copy(spec: str | list[str], on_error: str) -> DatasetShards | None:
    """``spec`` inside a staged copy's directory, by its path on scratch (``$DATA_DIR/train``):
    the copy's shards it selects, from its manifest, not the directory as it happens to be
    while a copier fills it."""
    from .staging import resolve_staging  # (it imports this module)

    staged = staged_dir_above(spec)
    if staged is None:
        return None
    whole = resolve_staging(staged, None, on_error)  # (waits for a copier's first word)
    if whole is not None and whole.growing:
        raise UsageError(
            f"{spec} is a part of {staged.dir}, which stage-in --background is still copying: "
            f"a part cannot be read while it is copied; load {staged.dir} itself, or stage in "
            "the foreground (STAGE_BACKGROUND=0)"
        )
    if not staged.manifest_path.is_file():
        raise UsageError(
            f"{spec} is a part of {staged.dir}, whose stage-in has not finished (no manifest): "
            "rerun stage-in to finish the copy"
        )
    columns = cached_columns(staged.manifest_path, staged.index_dir)
    recorded = columns.meta.get("source", "")
    if not recorded or not staged_whole_from(columns.meta, canonical_root(recorded)):
        return None  # (a copy of a glob or a list: its directory is read as it is, as before)
    asked = respelled(spec, str(staged.dir), recorded)
    return _part(staged.dir, asked, canonical_root(recorded), on_error, columns)
