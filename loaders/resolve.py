"""Find the shards to read: the staged copy when there is one, the source only for what is missing.

The staged copy is found under the name stage-in gives the source (:mod:`stager.layout`), and
its manifest (``<dataset>/.stager/manifest.json``) is authoritative: when it is complete, the
source is never listed nor read, so a loader on 1,000 nodes puts no load on NFS. A shard whose
local copy is missing, or that stage-in failed to copy, is read from the source instead, at the
absolute source root the manifest records (never resolved against this process's working
directory), and one warning says how many shards that was. A shard stage-in found corrupt
(its bytes differ from the manifest, or its tar cannot be read) is never read from the source:
that raises :class:`~stager.errors.IntegrityError`, or with ``on_error="skip"`` leaves it out
with a warning. A staged copy of another source under the same name is refused.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import numpy as np

from stager.errors import IntegrityError, SourceError, UsageError
from stager.layout import StagedDataset, dataset_name, is_remote_url
from stager.shards.digests import DigestColumn
from stager.shards.indexkey import changed_ns
from stager.shards.manifest import ManifestColumns
from stager.shards.manifestcolumns import cached_columns
from stager.shards.packedstrings import PackedStrings
from stager.shards.tarindex import any_compressed
from stager.slurm import usable_cpus
from stager.stagein.status import PlanFacts
from stager.storage.dest import resolve_dest_root
from stager.storage.sources import SourceSet, resolve_source
from stager.storage.statmany import key_stats, key_stats_runs

from .enclosing import copy_above, part_of_a_copy
from .failed import recorded_corrupt, recorded_failures
from .selection import staged_selection, url_prefix
from .sourcecounts import source_samples
from .spelling import check_same_root, is_local_spec, real_spelling, spelled_from

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
    # size and last change (changed_ns) when resolving stat'ed the staged copy (index keys)
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

    relpaths: Sequence[str]  # a PackedStrings: see stager.shards.packedstrings for why
    locations: Sequence[str]  # a local path, or a URL for a shard read from a remote source
    local: np.ndarray  # bool per shard: a plain local file (random access possible)
    from_source_flags: np.ndarray  # bool per shard: read from the source, not a staged copy
    samples: list[int | None]  # from a manifest; None means "count by reading headers"
    subset: str  # "all" or "node" (from the staged manifest)
    staged_dir: Path | None
    # (size, mtime_ns) per shard of the staged copies as resolved, -1 where not stat'ed: the
    # dataset index is keyed by them, so resolving and indexing stat each shard once
    stats: np.ndarray | None = None
    # the plan of this node's stage-in --background, if the copy was made by one, and whether
    # it is still being made (read by stager_loaders.staging.StagingReader)
    staging: PlanFacts | None = None
    growing: bool = False
    # while it is being made, each shard's digest in that plan, kept compact: a reader that
    # copies a shard itself verifies it against them (stager_loaders.waiting.ShardGate)
    hashes: DigestColumn | None = None
    # shards stage-in found corrupt, left out with on_error="skip" (the loader's skipped_shards)
    left_out: tuple[str, ...] = ()

    @classmethod
    def from_refs(
        cls, refs: Sequence[ShardRef], subset: str, staged_dir: Path | None
    ) -> DatasetShards:
        stats = np.asarray([r.stat or (-1, -1) for r in refs], dtype=np.int64).reshape(-1, 2)
        return cls(
            PackedStrings([r.relpath for r in refs]),
            PackedStrings([r.location for r in refs]),
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

    @property
    def random_access(self) -> bool:
        """True when every shard is a local uncompressed tar (the fast path applies)."""
        return bool(self.local.all()) and not any_compressed(self.locations)

    @property
    def from_source(self) -> int:
        return int(self.from_source_flags.sum())


def _source_refs(source: SourceSet, samples: dict[str, int | None]) -> dict[str, ShardRef]:
    local = source.is_local
    return {
        s.relpath: ShardRef(
            s.relpath, s.path if local else s.url, local, True, samples.get(s.relpath)
        )
        for s in source.shards
    }


def _from_source(root: str, relpath: str, samples: int | None) -> ShardRef:
    """A shard read at the absolute source root the staged manifest records."""
    url = url_prefix(root) + relpath
    return ShardRef(relpath, url, not is_remote_url(root), True, samples)


def _staged_mtimes(locations: Sequence[str], sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """Each staged copy's key time (:func:`changed_ns`; -1 where the copy is missing or not
    whole), and those positions.

    One ``stat`` per shard, the floor of a start. Where the compiled helper is built, runs of
    them for one release of the interpreter lock each, on a few threads for a large copy, and
    no Python object per shard (:func:`~stager.storage.statmany.key_stats_joined`): 4.5 s ->
    ~0.8 s at 1e6 shards on two cores, one ``os.stat`` and one ``stat_result`` at a time
    before. Any failed stat (a copy not there) sends the whole list the Python way, which
    tells the missing ones apart.
    """
    runs = None
    if isinstance(locations, PackedStrings):
        runs = locations.native_paths(_stat_threads(len(locations)))
    if runs is None:
        packed = key_stats(locations if isinstance(locations, list) else list(locations))
    else:
        packed = key_stats_runs(runs)
    if packed is not None:
        try:
            recorded = np.asarray(sizes, dtype=np.int64)
        except OverflowError:  # a recorded size no file has: the Python way says not whole
            packed = None
    if packed is not None:
        rows = np.frombuffer(packed, dtype=np.int64).reshape(-1, 2)
        whole = rows[:, 0] == recorded
        return np.where(whole, rows[:, 1], -1), np.flatnonzero(~whole).tolist()
    stat = os.stat
    mtimes: list[int] = []
    missing: list[int] = []
    for i, (path, size) in enumerate(zip(locations, sizes, strict=True)):
        try:
            one = stat(path)
        except FileNotFoundError:
            one = None
        if one is not None and one.st_size == size:
            mtimes.append(changed_ns(one))  # what the index key is made of
        else:
            mtimes.append(-1)
            missing.append(i)
    return np.asarray(mtimes, dtype=np.int64).reshape(-1), missing


#: Shards a thread of stats takes at least: the stats release the interpreter lock, so a start
#: on a node of idle cores (a job's start) spreads them; a few thousand are not worth a thread.
_STATS_PER_THREAD = 50_000


def _stat_threads(count: int) -> int:
    return max(1, min(8, usable_cpus(), count // _STATS_PER_THREAD))


class NothingSelected(SourceError):
    """The SOURCE selects no shard of a staged copy (nor names one it lacks)."""


def _from_staged(
    dataset_dir: Path,
    spec: str | list[str] | None,
    on_error: str = "raise",
    enclosing: ManifestColumns | None = None,
) -> DatasetShards:
    """``spec``'s shards in the staged copy ``dataset_dir``, read from the source where missing.
    ``enclosing``: its manifest, read by :mod:`loaders.enclosing` (a copy of a directory above
    ``spec``'s root, not of its root)."""
    staged = StagedDataset.of(dataset_dir)
    columns = enclosing or cached_columns(staged.manifest_path, staged.index_dir)
    if enclosing is None:
        check_same_root(columns.meta, spec, dataset_dir)
    subset = columns.meta.get("subset", "all")
    root = columns.meta.get("source", "")
    failures = recorded_failures(dataset_dir)
    failures += recorded_corrupt(columns.meta, failures)
    # (an enclosing copy is another directory than the root; not respelled to it)
    asked = spelled_from(spec, root) if spec is not None and root and not enclosing else spec
    selection = staged_selection(columns.meta.get("spec"), root, asked, dataset_dir)
    unstaged: list[str] = []  # named by the SOURCE (a file, a list), not in the staged copy
    if selection is not None:
        columns, failures, unstaged = selection.apply(columns, failures, root)
        if not columns.relpaths and not unstaged and not failures:
            raise NothingSelected(f"no shard of the staged copy {dataset_dir} matches {spec}")
    # str concatenation: pathlib costs ~30 us per shard and os.path.join ~3 us (0.3 s at 100k);
    # relpaths are canonical and relative (checked by read_columns, or by the columns file's
    # reader)
    prefix = os.fspath(dataset_dir).rstrip("/") + "/"
    locations = PackedStrings.prefixed(prefix, columns.relpaths)
    mtimes, missing = _staged_mtimes(locations, columns.sizes)
    if not missing and not failures and not unstaged:
        count = len(locations)
        return DatasetShards(
            PackedStrings(columns.relpaths),  # (the same buffer where it is packed already)
            locations,
            np.ones(count, dtype=bool),
            np.zeros(count, dtype=bool),
            columns.samples,
            subset,
            dataset_dir,
            np.column_stack([np.asarray(columns.sizes, np.int64), mtimes]),
        )
    absolute_root = "://" in root or root.startswith("/")
    gone = set(missing)
    if (gone or unstaged) and not absolute_root:
        raise SourceError(
            f"{dataset_dir}: {len(gone) + len(unstaged)} shard(s) are not in the staged copy "
            "and the manifest names no absolute source to read them from; re-run stage-in"
        )
    refs = [
        _from_source(root, rel, n) if i in gone else ShardRef(rel, loc, True, False, n, size, mtime)
        for i, (rel, loc, n, size, mtime) in enumerate(
            zip(
                columns.relpaths,
                locations,
                columns.samples,
                columns.sizes,
                mtimes.tolist(),
                strict=True,
            )
        )
    ]
    if unstaged:
        refs += [_from_source(root, rel, None) for rel in unstaged]
        refs.sort(key=attrgetter("relpath"))
    return _merge_failures(
        refs, failures, root if absolute_root else "", subset, dataset_dir, on_error
    )


def _merge_failures(
    refs: list[ShardRef],
    failures: list[dict[str, str]],
    root: str,
    subset: str,
    dataset_dir: Path,
    on_error: str,
) -> DatasetShards:
    """Shards stage-in failed: corrupt ones refused (or left out), the others read from source."""
    corrupt = [f["url"] for f in failures if f.get("kind") == "corrupt"]
    retry = [f["url"] for f in failures if f.get("kind") != "corrupt"]
    if corrupt and on_error != "skip":
        raise IntegrityError(
            f"stage-in found {len(corrupt)} shard(s) of {dataset_dir} corrupt (first: "
            f"{corrupt[0]}): their bytes differ from the manifest or their tar cannot be read "
            "(stage-in's FAILED lines say which). Fix the source and re-run stage-in, or pass "
            "on_error='skip' to train without them"
        )
    if corrupt:
        log.warning("leaving out %d shard(s) stage-in found corrupt: %s", len(corrupt), corrupt[:5])
    prefix = url_prefix(root)
    left_out = tuple(url.removeprefix(prefix) if root else url for url in corrupt)
    if subset == "all" and root:
        known = {r.relpath for r in refs}
        for url in retry:  # failed after retries: still part of the dataset, read from the source
            relpath = url[len(prefix) :] if url.startswith(prefix) else None
            if relpath and relpath not in known:
                refs.append(_from_source(root, relpath, None))
                known.add(relpath)
        refs.sort(key=lambda r: r.relpath)
    count = sum(r.from_source for r in refs)
    if count:
        log.warning(
            "%d of %d shard(s) are read from the source %s because their staged copy in %s is "
            "missing; re-run stage-in to read them locally",
            count,
            len(refs),
            root,
            dataset_dir,
        )
    return dataclasses.replace(
        DatasetShards.from_refs(refs, subset, dataset_dir), left_out=left_out
    )


def _staged_copy(
    staged: StagedDataset, spec: str | list[str], on_error: str
) -> tuple[DatasetShards | None, UsageError | None]:
    """The staged copy of ``spec`` under ``staged``, or why the one there is another's."""
    from .staging import resolve_staging  # imports this module

    try:
        found = resolve_staging(staged, spec, on_error)
        if found is None and staged.manifest_path.is_file():
            found = _from_staged(staged.dir, spec, on_error)
    except UsageError as exc:  # (another dataset under this name: check_same_root)
        return None, exc
    return found, None


def resolve_dataset(
    source: str | os.PathLike[str] | Sequence[str],
    *,
    dest: str | None = None,
    name: str | None = None,
    on_error: str = "raise",
) -> DatasetShards:
    """Resolve what the loader was given into shards, preferring the node-local staged copy.

    ``source`` is what stage-in was given (directory, glob, brace pattern, URL, or a list of
    shard URLs as in ``--from-list``), or a staged dataset directory itself. The staged copy is
    looked up under :func:`stager.layout.dataset_name` of it, the name stage-in staged it under.
    """
    spec: str | list[str] = (
        os.fspath(source)
        if isinstance(source, (str, os.PathLike))
        else [os.fspath(u) for u in source]
    )
    from .staging import resolve_staging  # imports this module

    # The node-local copy of this very source first: once it is staged, nothing is asked of
    # the shared filesystem (each loader stat'ed the source: three round trips per rank). A
    # copy under that name of another source leaves the choice to the source itself.
    staged = StagedDataset(resolve_dest_root(dest), name or dataset_name(spec))
    found, other = _staged_copy(staged, spec, on_error)
    real = real_spelling(spec) if found is None else None
    if real is not None:  # (loaded through a symlink to what was staged)
        again = StagedDataset(staged.root, name or dataset_name(real))
        found, _ = _staged_copy(again, real, on_error)
    if found is None and name is None and other is None:  # (a copy of the directory above?)
        found = copy_above(staged.root, spec, on_error)
        if found is None and real is not None:
            found = copy_above(staged.root, real, on_error)
    if found is not None:
        return found
    if isinstance(spec, str) and "://" not in spec:
        direct = Path(spec)
        layout = StagedDataset.of(direct)
        if direct.is_dir() and (layout.manifest_path.is_file() or layout.staging_path.is_file()):
            return resolve_staging(layout, None, on_error) or _from_staged(direct, None, on_error)
    inside = part_of_a_copy(spec, on_error) if found is None and name is None else None
    if inside is not None:
        return inside
    if other is not None:
        raise other
    # (a remote glob's shards unsized: their counts come from the manifest beside them, and
    # a HEAD per shard per rank at every start asked the server for sizes nothing used)
    resolved = resolve_source(spec, name=name, stat_listed=is_local_spec(spec))
    refs = list(_source_refs(resolved, source_samples(resolved)).values())
    log.warning(
        "no staged copy of %s under %s: reading all %d shard(s) from the source; "
        "run stage-in first to read them locally",
        spec if isinstance(spec, str) else f"{len(spec)} listed shards",
        staged.dir,
        len(refs),
    )
    return DatasetShards.from_refs(refs, "all", None)
