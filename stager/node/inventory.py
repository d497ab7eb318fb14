"""What is on this node: jobs' scratch directories and the user's cache, as frozen values.

Jobs' scratch directories are ``ROOT/<job id>/`` (``ROOT``: ``$STAGER_SCRATCH_ROOT`` or
``/scratch``, see :func:`stager.storage.dest.scratch_root`); only names that are job ids count,
so a cache or anything else kept under ``ROOT`` is never taken for a job. Inside one, a staged
dataset is a directory with stager's bookkeeping (``NAME/.stager/``); anything else (a
checkpoint directory, the user's own files) is listed by its top-level name. Sizes are apparent
sizes; a file with several links (a shard hard-linked from the cache) is counted in each place
it appears, and once in :attr:`NodeInventory.total_bytes`.

Reading only: nothing here creates, locks for long, or removes anything.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stager.cache.locks import lock_is_held
from stager.cache.paths import CacheLayout
from stager.cache.records import DatasetRecord
from stager.cache.store import ShardCache
from stager.errors import StagerError
from stager.layout import PARTIAL_SUFFIX, StagedDataset, is_bookkeeping
from stager.node.jobs import JobStates
from stager.shards.manifest import Manifest

__all__ = [
    "Usage",
    "ScratchItem",
    "JobDir",
    "CachedDataset",
    "CacheInventory",
    "NodeInventory",
    "is_job_id",
    "scan_job_dir",
    "scan_scratch",
    "scan_cache",
    "take_inventory",
]

_JOB_ID = re.compile(r"^[0-9]+$")


def is_job_id(name: str) -> bool:
    """True for a directory name that is a Slurm job id (what ``SLURM_JOB_ID`` holds)."""
    return bool(_JOB_ID.match(name))


@dataclass
class Usage:
    """Bytes and files under a directory, and when anything in it last changed."""

    size_bytes: int = 0
    files: int = 0
    newest_mtime: float = 0.0
    linked_bytes: int = 0  # of size_bytes: files with other links (shared with the cache)
    readable: bool = True
    locks: list[Path] = field(default_factory=list)  # *.lock files found (held or not)
    inodes: dict[tuple[int, int], int] = field(default_factory=dict)  # (dev, ino) -> size

    def add(self, other: Usage) -> None:
        self.size_bytes += other.size_bytes
        self.files += other.files
        self.newest_mtime = max(self.newest_mtime, other.newest_mtime)
        self.linked_bytes += other.linked_bytes
        self.readable = self.readable and other.readable
        self.locks += other.locks
        self.inodes.update(other.inodes)


def _walk(path: Path) -> Usage:
    """The usage of ``path`` (a file or a directory tree), never following symlinks."""
    usage = Usage()
    try:
        st = os.lstat(path)
    except OSError:
        usage.readable = False
        return usage
    usage.newest_mtime = st.st_mtime
    if not stat.S_ISDIR(st.st_mode):
        _count_file(usage, path.name, str(path), st)
        return usage
    pending = [str(path)]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        usage.readable = False
                        continue
                    usage.newest_mtime = max(usage.newest_mtime, est.st_mtime)
                    if stat.S_ISDIR(est.st_mode):
                        pending.append(entry.path)
                    else:
                        _count_file(usage, entry.name, entry.path, est)
        except OSError:
            usage.readable = False
    return usage


def _count_file(usage: Usage, name: str, path: str, st: os.stat_result) -> None:
    usage.files += 1
    usage.size_bytes += st.st_size
    usage.inodes[(st.st_dev, st.st_ino)] = st.st_size
    if st.st_nlink > 1:
        usage.linked_bytes += st.st_size
    if name.endswith(".lock"):
        usage.locks.append(Path(path))


@dataclass(frozen=True)
class ScratchItem:
    """A top-level entry of a job's scratch directory: a staged dataset or anything else."""

    name: str
    path: Path
    kind: str  # "dataset", "staging" (no manifest yet: in progress or killed) or "other"
    size_bytes: int
    files: int
    newest_mtime: float
    source: str = ""  # a dataset's source URL, from its staged manifest
    shards: int = 0


@dataclass(frozen=True)
class JobDir:
    """One job's scratch directory on this node."""

    job_id: str
    path: Path
    owner_uid: int
    readable: bool  # False: another user's private directory (sizes unknown)
    items: tuple[ScratchItem, ...]
    size_bytes: int
    files: int
    linked_bytes: int
    newest_mtime: float
    locks_held: tuple[Path, ...]  # lock files in it that a live process holds right now
    inodes: Mapping[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def age_s(self, now: float) -> float:
        """Seconds since anything in the directory last changed."""
        return max(0.0, now - self.newest_mtime)


def _item(path: Path, usage: Usage) -> ScratchItem:
    staged = StagedDataset(path.parent, path.name) if not is_bookkeeping(path.name) else None
    kind, source, shards = "other", "", 0
    if staged is not None and path.is_dir() and staged.meta_dir.is_dir():
        kind = "staging"
        if staged.manifest_path.is_file():
            try:
                manifest = Manifest.read(staged.manifest_path)
                kind, source, shards = (
                    "dataset",
                    str(manifest.meta.get("source", "")),
                    len(manifest.entries),
                )
            except (StagerError, OSError):
                pass
    return ScratchItem(
        path.name, path, kind, usage.size_bytes, usage.files, usage.newest_mtime, source, shards
    )


def scan_job_dir(path: Path, job_id: str | None = None) -> JobDir:
    """What one job's scratch directory holds (``job_id`` defaults to its name)."""
    st = os.lstat(path)
    total = Usage(newest_mtime=st.st_mtime)
    items: list[ScratchItem] = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
        total.readable = False
    for name in names:
        usage = _walk(path / name)
        total.add(usage)
        if not is_bookkeeping(name) and not name.endswith(PARTIAL_SUFFIX):
            items.append(_item(path / name, usage))
    held = tuple(p for p in total.locks if lock_is_held(p))
    return JobDir(
        job_id or path.name,
        path,
        st.st_uid,
        total.readable,
        tuple(items),
        total.size_bytes,
        total.files,
        total.linked_bytes,
        total.newest_mtime,
        held,
        total.inodes,
    )


def scan_scratch(root: Path) -> list[JobDir]:
    """Every job directory under the scratch ``root`` (none if it does not exist)."""
    try:
        names = sorted(os.listdir(root), key=lambda n: (len(n), n))
    except OSError:
        return []
    out = []
    for name in names:
        path = root / name
        try:
            is_dir = stat.S_ISDIR(os.lstat(path).st_mode)  # a symlink is never a job's directory
        except OSError:
            continue
        if is_dir and is_job_id(name):
            out.append(scan_job_dir(path))
    return out


@dataclass(frozen=True)
class CachedDataset:
    """One dataset in the cache, and whether eviction must keep it."""

    record: DatasetRecord
    in_use: bool
    jobs_running: tuple[str, ...]  # its jobs Slurm lists as not ended (all, if it cannot tell)
    #: Of its shards, those whose object is in the cache, and their bytes (each object once):
    #: a run killed or failed before filling what it named leaves the rest only named
    shards_cached: int = 0
    size_bytes: int = 0


@dataclass(frozen=True)
class CacheInventory:
    """The user's cache: its datasets, and what its files take on disk."""

    root: Path
    datasets: tuple[CachedDataset, ...]
    size_bytes: int  # every file under objects/, datasets/ (orphans and index included)
    files: int
    owner_uid: int
    inodes: Mapping[tuple[int, int], int] = field(default_factory=dict, repr=False)


def scan_cache(root: Path, states: JobStates) -> CacheInventory | None:
    """The cache at ``root``, or None when there is none (nothing is created)."""
    layout = CacheLayout(root)
    if not (root / "CACHEDIR.TAG").is_file():
        return None
    cache = ShardCache(layout, limit_bytes=0)
    present = layout.object_keys()
    datasets = []
    for record in cache.datasets():
        running = tuple(j for j in record.jobs if states.may_run(j))
        cached = sum(str(key) in present for key, _size in record.shards.values())
        size = sum(n for key, n in record.objects.items() if key in present)
        datasets.append(CachedDataset(record, cache.in_use(record, states), running, cached, size))
    usage = Usage()
    for sub in (layout.objects_dir, layout.datasets_dir):
        usage.add(_walk(sub))
    return CacheInventory(
        root,
        tuple(datasets),
        usage.size_bytes,
        usage.files,
        os.lstat(root).st_uid,
        usage.inodes,
    )


@dataclass(frozen=True)
class NodeInventory:
    """Everything :func:`scan_scratch` and :func:`scan_cache` found, with the job states."""

    node: str
    scratch_root: Path
    jobs: tuple[JobDir, ...]
    cache: CacheInventory | None
    states: JobStates
    scanned_at: float = field(default_factory=time.time)

    @property
    def total_bytes(self) -> int:
        """Bytes of all of it, a file with several links counted once (readable parts only)."""
        sizes: dict[tuple[int, int], int] = {}
        for job in self.jobs:
            sizes.update(job.inodes)
        if self.cache is not None:
            sizes.update(self.cache.inodes)
        return sum(sizes.values())


def take_inventory(
    *, node: str, scratch: Path, cache: Path | None, states: JobStates, job: str | None = None
) -> NodeInventory:
    """Scan this node: every job directory under ``scratch`` (or only ``job``'s), and ``cache``."""
    if job is not None:
        path = scratch / job
        jobs = [scan_job_dir(path)] if is_job_id(job) and _is_dir(path) else []
    else:
        jobs = scan_scratch(scratch)
    found = scan_cache(cache, states) if cache is not None else None
    return NodeInventory(node, scratch, tuple(jobs), found, states)


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
