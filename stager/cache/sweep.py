"""``stager clean --cache``: evict every cached dataset nothing uses, then what no dataset names.

Apart from :mod:`stager.cache.store` because it runs on demand, never inside a stage-in: the
same rules decide what stays (:meth:`ShardCache.keep_reason`), under the same cache lock.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from stager.cache.paths import RECORD_SUFFIX, remove_any
from stager.cache.records import DatasetRecord
from stager.cache.store import ShardCache
from stager.node.jobs import JobStates
from stager.units import human_duration

__all__ = ["CacheSweep", "sweep"]


@dataclass(frozen=True)
class CacheSweep:
    """What :func:`sweep` removed (or would, ``dry_run``), and what it kept and why."""

    evicted: tuple[DatasetRecord, ...]
    kept: tuple[tuple[DatasetRecord, str], ...]
    objects_removed: int
    bytes_removed: int


def sweep(
    cache: ShardCache,
    *,
    states: JobStates,
    older_than_s: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> CacheSweep:
    """Evict every dataset not in use (and unused for ``older_than_s``), then orphans.

    A dataset a job used is kept while Slurm lists the job, or cannot be asked and no
    ``older_than_s`` was given (see :meth:`ShardCache.keep_reason`).

    Orphans are objects no dataset names and what a killed filler left (``.partial``
    files, objects without a record); each is removed only while its fill lock is free.
    """
    now = time.time() if now is None else now
    with cache.cache_lock():
        kept: list[tuple[DatasetRecord, str]] = []
        victims: list[DatasetRecord] = []
        for record in cache.datasets():
            age_s = now - record.last_used
            reason = cache.keep_reason(record, states, unknown_ok=older_than_s is not None)
            if reason is None and older_than_s is not None and age_s < older_than_s:
                reason = f"used {human_duration(age_s)} ago"
            if reason is None:
                victims.append(record)
            else:
                kept.append((record, reason))
        named = {k for record, _ in kept for k in record.objects}
        if not dry_run:
            for record in victims:
                cache.forget_dataset(record.key)
        count, nbytes = _orphans(cache, named, remove=not dry_run)
    return CacheSweep(tuple(victims), tuple(kept), count, nbytes)


def _orphans(cache: ShardCache, named: set[str], *, remove: bool) -> tuple[int, int]:
    """Remove (or count) object files no kept dataset names; returns (count, bytes)."""
    count = nbytes = 0
    for directory in sorted(cache.layout.objects_dir.glob("*")):
        if not directory.is_dir() or directory.is_symlink():  # (damage: a file in a group's place)
            if remove:
                with contextlib.suppress(OSError):
                    remove_any(directory)
            continue
        for path in sorted(directory.iterdir()):
            key = path.name.split(".", 1)[0]
            if key in named and path.name in (key, f"{key}{RECORD_SUFFIX}"):
                continue
            lock = cache.fill_lock(key)
            if not lock.acquire(blocking=False):
                continue  # a filler is at work on it (or on a key sharing its lock)
            try:
                size = path.lstat().st_size
                if remove:
                    remove_any(path)  # (a directory in an object's place too: damage)
                if path.name == key:
                    count += 1
                nbytes += size
            except OSError:
                continue
            finally:
                lock.release()
    return count, nbytes
