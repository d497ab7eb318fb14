"""Find the shards to read: the staged copy when there is one, the source only for what is missing.

The staged copy is found the way stage-in places it (``stager.storage.dest.resolve_dest_root``
plus the dataset name), and its manifest (``<dataset>/.stager/manifest.json``) is
authoritative: when it is complete, the source is never listed nor read, so a loader on 1,000
nodes puts no load on NFS. A shard whose local copy is missing (or that stage-in reported as
failed) is read from the source instead, and one warning says how many shards that was.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from braceexpand import braceexpand

from stager.errors import SourceError, StagerError
from stager.shards.manifest import Manifest, find_manifest, read_columns
from stager.shards.tarindex import is_compressed
from stager.stagein.run import staged_manifest_path
from stager.storage.dest import resolve_dest_root
from stager.storage.sources import SourceSet, resolve_source

__all__ = ["ShardRef", "DatasetShards", "resolve_dataset"]

log = logging.getLogger("stager_loaders")


@dataclass(frozen=True, slots=True)  # slots: 100k of these, ~60% less memory each
class ShardRef:
    """One shard: its dataset-relative path and where this process reads it from."""

    relpath: str
    location: str  # a local path, or a URL for a shard read from a remote source
    local: bool  # a plain local file (random access possible)
    from_source: bool  # read from the source, not from a staged copy
    samples: int | None  # from a manifest; None means "count by reading headers"
    # size and mtime when resolving stat'ed the staged copy: the index stamp reuses them
    size: int | None = None
    mtime_ns: int | None = None

    @property
    def stat(self) -> tuple[int, int] | None:
        """``(size, mtime_ns)`` of the staged copy as resolved, or None."""
        if self.size is None or self.mtime_ns is None:
            return None
        return self.size, self.mtime_ns


@dataclass(frozen=True)
class DatasetShards:
    """The resolved dataset: its shards in order, as columns, and how it was staged.

    Columns rather than an object per shard: at 100k shards, building a :class:`ShardRef` each
    cost ~0.2 s of the loader's start, and their memory in the training process is shared into
    every forked worker's PSS. :attr:`shards` builds the objects on demand, for tools and tests.
    """

    relpaths: list[str]
    locations: list[str]  # a local path, or a URL for a shard read from a remote source
    local: np.ndarray  # bool per shard: a plain local file (random access possible)
    from_source_flags: np.ndarray  # bool per shard: read from the source, not a staged copy
    samples: list[int | None]  # from a manifest; None means "count by reading headers"
    subset: str  # "all" or "node" (from the staged manifest)
    staged_dir: Path | None
    # (size, mtime_ns) per shard of the staged copies as resolved, -1 where not stat'ed: the
    # dataset index is keyed by them, so resolving and indexing stat each shard once
    stats: np.ndarray | None = None

    @classmethod
    def from_refs(
        cls, refs: Sequence[ShardRef], subset: str, staged_dir: Path | None
    ) -> DatasetShards:
        stats = np.asarray([r.stat or (-1, -1) for r in refs], dtype=np.int64).reshape(-1, 2)
        return cls(
            [r.relpath for r in refs],
            [r.location for r in refs],
            np.asarray([r.local for r in refs], dtype=bool),
            np.asarray([r.from_source for r in refs], dtype=bool),
            [r.samples for r in refs],
            subset,
            staged_dir,
            stats,
        )

    def __len__(self) -> int:
        return len(self.relpaths)

    @property
    def shards(self) -> tuple[ShardRef, ...]:
        """One :class:`ShardRef` per shard (built on each call)."""
        stats = self.stats if self.stats is not None else np.full((len(self), 2), -1)
        return tuple(
            ShardRef(rel, loc, bool(local), bool(remote), n, *(None if v < 0 else v for v in st))
            for rel, loc, local, remote, n, st in zip(
                self.relpaths,
                self.locations,
                self.local.tolist(),
                self.from_source_flags.tolist(),
                self.samples,
                stats.tolist(),
                strict=True,
            )
        )

    def stat_list(self) -> list[tuple[int, int] | None]:
        """``(size, mtime_ns)`` per shard, None where resolving did not stat it."""
        if self.stats is None:
            return [None] * len(self)
        return [None if m < 0 else (s, m) for s, m in self.stats.tolist()]

    @property
    def random_access(self) -> bool:
        """True when every shard is a local uncompressed tar (the fast path applies)."""
        return bool(self.local.all()) and not any(map(is_compressed, self.locations))

    @property
    def from_source(self) -> int:
        return int(self.from_source_flags.sum())


def _dataset_name(spec: str) -> str:
    """The name stage-in gives ``spec`` (basename of its root), computed without any I/O."""
    path = spec.split("://", 1)[-1]
    if "{" in path and "}" in path:
        dirs = [posixpath.dirname(p) for p in braceexpand(path)]
        root = (
            posixpath.commonpath(dirs)
            if all(d.startswith("/") for d in dirs)
            else posixpath.dirname(dirs[0])
        )
    elif any(c in path for c in "*?["):
        fixed = path[: min(path.index(c) for c in "*?[" if c in path)]
        root = fixed if fixed.endswith("/") else posixpath.dirname(fixed)
    elif path.endswith((".tar", ".tgz", ".tar.gz")):
        root = posixpath.dirname(path)
    else:
        root = path.rstrip("/")
    return posixpath.basename(root.rstrip("/")) or "dataset"


def _failed_urls(dataset_dir: Path) -> set[str]:
    """URLs stage-in reported as failed in its last result for this dataset on this node."""
    result = dataset_dir.parent / f".stager-{dataset_dir.name}.result.json"
    try:
        payload = json.loads(result.read_text())
        return {f["url"] for f in payload["report"].get("failures", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _source_refs(source: SourceSet, samples: dict[str, int | None]) -> dict[str, ShardRef]:
    local = source.is_local
    return {
        s.relpath: ShardRef(
            s.relpath, s.path if local else s.url, local, True, samples.get(s.relpath)
        )
        for s in source.shards
    }


def _source_samples(source: SourceSet) -> dict[str, int | None]:
    if not source.is_local or not source.shards:
        return {}
    first = source.shards[0]
    found = find_manifest(first.path[: len(first.path) - len(first.relpath)])
    if found is None:
        return {}
    try:
        return {e.relpath: e.samples for e in Manifest.read(found).entries}
    except StagerError:
        return {}


def _from_staged(dataset_dir: Path, spec: str | None) -> DatasetShards:
    columns = read_columns(staged_manifest_path(dataset_dir))
    subset = columns.meta.get("subset", "all")
    # str concatenation: pathlib costs ~30 us per shard and os.path.join ~3 us (0.3 s at 100k);
    # relpaths are canonical and relative (checked by read_columns)
    prefix = os.fspath(dataset_dir).rstrip("/") + "/"
    locations = [prefix + rel for rel in columns.relpaths]
    mtimes: list[int] = []
    missing: list[int] = []
    stat = os.stat
    for i, (path, size) in enumerate(zip(locations, columns.sizes, strict=True)):
        try:
            found = stat(path)
        except FileNotFoundError:
            found = None
        if found is not None and found.st_size == size:
            mtimes.append(found.st_mtime_ns)
        else:
            mtimes.append(-1)
            missing.append(i)
    failed = _failed_urls(dataset_dir)
    if not missing and not failed:
        count = len(locations)
        return DatasetShards(
            columns.relpaths,
            locations,
            np.ones(count, dtype=bool),
            np.zeros(count, dtype=bool),
            columns.samples,
            subset,
            dataset_dir,
            np.column_stack([np.asarray(columns.sizes, np.int64), np.asarray(mtimes, np.int64)]),
        )
    gone = set(missing)
    refs = [
        ShardRef(rel, "", False, True, n)
        if i in gone
        else ShardRef(rel, loc, True, False, n, size, mtime)
        for i, (rel, loc, n, size, mtime) in enumerate(
            zip(columns.relpaths, locations, columns.samples, columns.sizes, mtimes, strict=True)
        )
    ]
    return _merge_source(
        refs,
        [columns.relpaths[i] for i in missing],
        bool(failed),
        spec or columns.meta.get("source"),
        subset,
        dataset_dir,
    )


def _merge_source(
    refs: list[ShardRef],
    missing: list[str],
    failed: bool,
    spec: str | None,
    subset: str,
    dataset_dir: Path,
) -> DatasetShards:
    if not spec:
        raise SourceError(
            f"{dataset_dir}: {len(missing)} staged shard(s) are missing and no source is known; "
            "re-run stage-in"
        )
    source = resolve_source(spec)
    by_rel = _source_refs(source, {r.relpath: r.samples for r in refs})
    merged = []
    for ref in refs:
        if ref.relpath in missing:
            if ref.relpath not in by_rel:
                raise SourceError(
                    f"shard {ref.relpath} is neither staged in {dataset_dir} nor in {spec}; "
                    "re-run stage-in"
                )
            merged.append(by_rel[ref.relpath])
        else:
            merged.append(ref)
    if failed and subset == "all":
        # stage-in left out the shards it failed to copy; they are still part of the dataset
        known = {r.relpath for r in refs}
        merged.extend(r for rel, r in by_rel.items() if rel not in known)
        merged.sort(key=lambda r: r.relpath)
    count = sum(r.from_source for r in merged)
    if count:
        log.warning(
            "%d of %d shard(s) are read from the source %s because their staged copy in %s is "
            "missing; re-run stage-in to read them locally",
            count,
            len(merged),
            spec,
            dataset_dir,
        )
    return DatasetShards.from_refs(merged, subset, dataset_dir)


def resolve_dataset(
    source: str | os.PathLike[str], *, dest: str | None = None, name: str | None = None
) -> DatasetShards:
    """Resolve what the loader was given into shards, preferring the node-local staged copy."""
    spec = os.fspath(source)
    direct = Path(spec)
    if "://" not in spec and direct.is_dir() and staged_manifest_path(direct).is_file():
        return _from_staged(direct, None)
    dataset_dir = resolve_dest_root(dest) / (name or _dataset_name(spec))
    if staged_manifest_path(dataset_dir).is_file():
        return _from_staged(dataset_dir, spec)
    resolved = resolve_source(spec, name=name)
    refs = list(_source_refs(resolved, _source_samples(resolved)).values())
    log.warning(
        "no staged copy of %s under %s: reading all %d shard(s) from the source; "
        "run stage-in first to read them locally",
        spec,
        dataset_dir,
        len(refs),
    )
    return DatasetShards.from_refs(refs, "all", None)
