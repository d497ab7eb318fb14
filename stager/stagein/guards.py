"""Refusals before anything is copied: a destination inside the source, a staged copy of
another source under the same name, and not enough free space. Each names what it refused and
what to do, and raises before the first byte moves, so a refusal leaves nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from stager.errors import ScratchFull, StagerError, UsageError
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest
from stager.stagein.options import StageInOptions
from stager.storage.paths import within
from stager.storage.sources import SourceSet
from stager.units import human_bytes

__all__ = ["check_outside_source", "check_same_source", "free_bytes", "preflight", "space_error"]


def check_outside_source(staged: StagedDataset, source: SourceSet) -> None:
    """Refuse a staged copy and a local source that overlap: a destination inside the source
    (every rerun would stage the copy again), or a source inside the staged copy's directory
    (staging would write over the source's files and delete its ``*.partial`` ones).

    A source whose shards are all named (a list, braces, one file) gains no file a rerun could
    find, so only a named shard inside the staged copy is refused: a list spanning two
    top-level directories has ``/`` as its root, and every destination was "inside" it."""
    if not source.is_local:
        return
    root = os.path.realpath(source.root_url)
    dest = os.path.realpath(staged.dir)
    if source.named:  # no rerun finds the copies; only a shard inside the copy is a danger
        # a realpath per directory, not per shard (a list may name a million)
        dirs = {os.path.dirname(shard.path) for shard in source.shards}
        into = {d for d in dirs if within(os.path.realpath(d), dest)}
        inside = [s.url for s in source.shards if os.path.dirname(s.path) in into]
        if inside:
            raise UsageError(
                f"the source shard {inside[0]} is inside the staged copy's directory "
                f"{staged.dir}: staging would write over it; pass --dest (or --name) so that "
                "DEST/NAME holds no source shard"
            )
        return
    if within(dest, root):
        raise UsageError(
            f"the destination {staged.dir} is inside the source {source.root_url}: each run "
            "would stage its own copy again; pass --dest outside the source"
        )
    if within(root, dest):
        raise UsageError(
            f"the source {source.root_url} is inside the staged copy's directory {staged.dir}: "
            "staging would write over the source's own files; pass --dest (or --name) so "
            "that DEST/NAME does not hold the source"
        )


def check_same_source(staged: StagedDataset, source: SourceSet) -> None:
    """Refuse to stage ``source`` where a copy of another source (or spec) already lives.

    Two datasets under one name would mix: the rerun would keep the other one's shards of the
    same names and its manifest would claim them for this source.
    """
    if not staged.manifest_path.is_file():
        return
    try:
        meta = Manifest.read(staged.manifest_path).meta
    except StagerError:
        return  # a damaged staged manifest: every shard is verified again anyway
    before = meta.get("spec")
    if before and source.spec and before != source.spec:
        raise UsageError(
            f"{staged.dir} holds a staged copy of {before!r}, not of {source.spec!r}; pass "
            "--name to stage this one beside it, or remove the old copy (rm -r it)"
        )


def free_bytes(path: Path) -> int:
    """The bytes a writer without root's reserve may still use on ``path``'s filesystem:
    ``shutil.disk_usage(path).free``, without importing shutil (~3 ms of every start)."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def preflight(dataset_dir: Path, needed: int, options: StageInOptions, node: str) -> int:
    """Refuse if ``needed`` bytes (plus ``--min-free``) do not fit; return the free bytes."""
    free = free_bytes(dataset_dir)
    if needed + options.min_free_bytes > free:
        raise space_error(
            dataset_dir, needed + options.min_free_bytes, free, node, options.min_free_bytes
        )
    return free


def space_error(
    dataset_dir: Path | str, needed: int, free: int, node: str, reserve: int = 0
) -> ScratchFull:
    kept = f", of which --min-free keeps {human_bytes(reserve)}" if reserve else ""
    return ScratchFull(
        f"[{node}] not enough space on {dataset_dir}: need {human_bytes(needed)} ({needed} bytes"
        f"{kept}), free {human_bytes(free)} ({free} bytes); nothing was copied. Free space, stage "
        "a subset (--subset node) or pass --dest to a larger filesystem",
        needed_bytes=needed,
        free_bytes=free,
        where=str(dataset_dir),
    )
