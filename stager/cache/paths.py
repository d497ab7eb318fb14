"""Where a node cache keeps everything, and opening its root safely.

A cache is one user's (``--cache DIR`` or ``$STAGER_CACHE``) on a node-local disk that
outlives jobs. Under its root::

    CACHE/                          mode 0700; refused when a symlink or another user's
    CACHE/CACHEDIR.TAG              marks it as a cache for backup tools
    CACHE/objects/ab/<key>          a shard's bytes, read-only, published by rename once verified
    CACHE/objects/ab/<key>.json     its record; an object without a matching record is never used
    CACHE/datasets/<dkey>.json      a source spec: its shards' keys, last use, jobs that use it
    CACHE/datasets/<dkey>.index/    the loader index of its last staging, reused while current
    CACHE/locks/cache.lock          exclusive, for a moment: accounting and eviction
    CACHE/locks/<dkey>.lock         shared by every stage-in using the dataset; eviction takes it
                                    exclusive, so it never removes what a stage-in is placing
    CACHE/locks/fill/ab.lock        exclusive while one process copies a shard whose key starts
                                    ``ab`` into the cache; others wanting it wait, then use it

Shard keys and dataset keys are hex (:mod:`stager.cache.keys`), so no name here can collide
with another or escape the root.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from stager.errors import UsageError
from stager.storage.dest import ensure_private_dir, vet_private_dir
from stager.storage.paths import within
from stager.units import parse_size

__all__ = [
    "CacheLayout",
    "check_cache_place",
    "CACHE_ENV",
    "CACHE_LIMIT_ENV",
    "resolve_cache_dir",
    "resolve_cache_limit",
    "default_limit_bytes",
    "remove_any",
]

#: The environment variables that stand for ``--cache`` and ``--cache-limit``.
CACHE_ENV = "STAGER_CACHE"
CACHE_LIMIT_ENV = "STAGER_CACHE_LIMIT"
#: Shard keys share fill locks by their first two characters: at most 256 lock files, ever
#: (each is a file to create on a fresh cache; with 64 streams about 1 in 5 waits on a stripe
#: another shard holds, a wait without a stream slot held).
FILL_LOCK_CHARS = 2
RECORD_SUFFIX = ".json"
_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# A stager node cache (stager stage-in --cache); `stager clean --cache` empties it.\n"
)


#: Objects asked about over which :meth:`CacheLayout.present` lists the objects (256 groups)
#: rather than stat each: at 1e6 objects a stat each ran ~1e6 stats under the cache lock.
STATS_BEFORE_LISTING = 4096


@dataclass(frozen=True)
class CacheLayout:
    """The paths of the cache rooted at ``root`` (see the module doc)."""

    root: Path

    @property
    def objects_dir(self) -> Path:
        return self.root / "objects"

    @property
    def datasets_dir(self) -> Path:
        return self.root / "datasets"

    @property
    def locks_dir(self) -> Path:
        return self.root / "locks"

    @property
    def cache_lock(self) -> Path:
        return self.locks_dir / "cache.lock"

    def object_path(self, key: str) -> Path:
        return self.objects_dir / key[:2] / key

    def record_path(self, key: str) -> Path:
        return self.objects_dir / key[:2] / f"{key}{RECORD_SUFFIX}"

    def fill_lock(self, key: str) -> Path:
        return self.locks_dir / "fill" / f"{key[:FILL_LOCK_CHARS]}.lock"

    def dataset_path(self, dkey: str) -> Path:
        return self.datasets_dir / f"{dkey}{RECORD_SUFFIX}"

    def dataset_lock(self, dkey: str) -> Path:
        return self.locks_dir / f"{dkey}.lock"

    def index_dir(self, dkey: str) -> Path:
        return self.datasets_dir / f"{dkey}.index"

    def present(self, keys: Collection[str]) -> set[str]:
        """Those of ``keys`` whose object is there: a stat each, or for many (over
        :data:`STATS_BEFORE_LISTING`), one :meth:`object_keys` listing."""
        if len(keys) > STATS_BEFORE_LISTING:
            return self.object_keys() & set(keys)
        return {key for key in keys if os.path.isfile(self.object_path(key))}

    def object_keys(self) -> set[str]:
        """The keys of the objects there now: regular files of no suffix (not a record, not a
        partial), by one listing of each group (~4,000 names a group at 1e6 objects) rather
        than a stat of each object named: what a sweep or an inventory of many asks."""
        keys: set[str] = set()
        try:
            groups = list(os.scandir(self.objects_dir))
        except OSError:
            return keys
        for group in groups:
            try:
                with os.scandir(group.path) as entries:
                    keys.update(e.name for e in entries if "." not in e.name and e.is_file())
            except OSError:
                continue  # (not a directory, or unreadable: what it holds is not there)
        return keys

    @staticmethod
    def _refuse_foreign(root: Path) -> None:
        """Refuse a root that holds anything, unless another job made it a cache meanwhile:
        jobs opening a new cache together each saw no tag, then the first job's tag, and all
        but that one refused a cache that was theirs."""
        with os.scandir(root) as entries:
            if next(entries, None) is not None and not (root / "CACHEDIR.TAG").is_file():
                raise UsageError(
                    f"--cache {root} is not empty and not a stager cache; give the cache a "
                    "directory of its own, e.g. /local/$USER/stager-cache"
                )

    def open(self) -> CacheLayout:
        """Create the root (0700) and its directories; refuse a root that is not safely ours.

        The root must be empty or a cache already (its ``CACHEDIR.TAG``): ``--cache $HOME`` or
        ``--cache /tmp`` is refused rather than filled, or made private, by mistake. An existing
        cache that others could enter is made private again: it holds the user's data.
        """
        root = ensure_private_dir(self.root, flag="--cache")
        tag = root / "CACHEDIR.TAG"
        if not tag.is_file():
            self._refuse_foreign(root)
            tag.write_text(_TAG)
        if os.stat(root).st_mode & 0o077:
            os.chmod(root, 0o700)
        for sub in (self.objects_dir, self.datasets_dir, self.locks_dir / "fill"):
            sub.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self


def vet_cache(root: Path) -> None:
    """Refuse an existing ``--cache`` that is not safely ours (a symlink, another user's, a
    directory that is neither empty nor a cache) without writing anything: what
    :meth:`CacheLayout.open` refuses, checked before a run writes its destination."""
    try:
        info = os.lstat(root)
    except OSError:
        return  # not there yet (made by the run), or unreadable: the run says so
    vet_private_dir(root, info, flag="--cache")
    if not (root / "CACHEDIR.TAG").is_file():
        CacheLayout._refuse_foreign(root)


def check_cache_place(
    root: Path, dest_root: Path, dataset_dir: Path | None, source_root: str | None
) -> None:
    """Refuse a cache where it would be taken for staged data or write into the data: the
    destination root itself or a directory holding it, inside this run's staged dataset
    (``dataset_dir``), or inside a local source (its objects, locks and tag were written into
    the dataset on the shared filesystem). A cache in a directory of its own under a shared
    destination root is fine. Checked before anything is written: ``--cache X --dest X`` made
    the destination, then refused X as "not empty"."""
    cache, dest = os.path.realpath(root), os.path.realpath(dest_root)
    inside_copy = dataset_dir is not None and within(cache, os.path.realpath(dataset_dir))
    if within(dest, cache) or inside_copy:
        where = dataset_dir if inside_copy else dest_root
        raise UsageError(
            f"--cache {root} and {where} overlap: the cache needs a directory of its own, "
            "outside the staged datasets (e.g. /scratch/cache-$USER)"
        )
    if source_root is not None and within(cache, os.path.realpath(source_root)):
        raise UsageError(
            f"--cache {root} is inside the source {source_root}: the cache would be written "
            "into the dataset; put it on node-local disk outside the source"
        )


def resolve_cache_dir(flag: str | None, env: Mapping[str, str] | None = None) -> Path | None:
    """``--cache DIR``, else ``$STAGER_CACHE``, else None (no cache)."""
    env = os.environ if env is None else env
    chosen = flag or env.get(CACHE_ENV) or None
    return Path(os.path.expanduser(chosen)) if chosen else None


def resolve_cache_limit(flag: int | None, env: Mapping[str, str] | None = None) -> int | None:
    """``--cache-limit`` in bytes, else ``$STAGER_CACHE_LIMIT``, else None (the default)."""
    env = os.environ if env is None else env
    if flag is not None:
        return flag
    text = env.get(CACHE_LIMIT_ENV)
    return parse_size(text, flag=CACHE_LIMIT_ENV) if text else None


def default_limit_bytes(root: Path) -> int:
    """Without ``--cache-limit``: half the cache's filesystem, so jobs keep room beside it."""
    stats = os.statvfs(root)  # (shutil.disk_usage's total; shutil costs ~3 ms of each start)
    return stats.f_blocks * stats.f_frsize // 2


def remove_any(path: Path) -> None:
    """Remove ``path`` whatever it is (a directory with what it holds; a link, not its target)."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
