"""The node cache: shard bytes filed by identity, datasets that name them, eviction under a cap.

Concurrency (every lock is an ``flock``, released by the kernel when its holder dies):

* A shard is copied into the cache by one process at a time: the filler holds the shard's fill
  lock, writes ``<object>.partial``, renames it to the object, then writes the record. Others
  wanting the shard wait on the lock and then find the record: each shard is read from the
  source once per node, whatever the number of jobs. A kill leaves a ``.partial`` or an object
  without a record; neither is ever served (the next fill of the group removes a partial).
* A stage-in holds its dataset's lock shared from before it registers until it ends, and
  registers (names its shards, adds its job, evicts if over the cap) under the cache lock.
  Eviction runs under the cache lock too, and skips a dataset whose lock anyone holds or whose
  jobs Slurm does not say have ended. So no dataset is evicted between a run's registration
  and its last placement, nor while a job that staged it runs.
* Serving is lock-free: a record is read, the object is checked against it (inode, size,
  mtime) and placed (:mod:`stager.cache.place`). An object removed meanwhile makes the
  placement fail, and the shard is copied from the source instead: never wrong bytes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from stager.cache import room
from stager.cache.evict import DatasetUsage, cache_bytes, plan_eviction, shards_over_limit
from stager.cache.locks import FileLock, lock_is_held
from stager.cache.mirror import mirror_files
from stager.cache.paths import RECORD_SUFFIX, CacheLayout, default_limit_bytes, remove_any
from stager.cache.place import place_file
from stager.cache.records import DatasetRecord, ObjectRecord
from stager.layout import PARTIAL_SUFFIX
from stager.node.jobs import JobStates, query_job_states
from stager.storage.paths import discard

__all__ = ["ShardCache", "Registration"]

#: A dataset record keeps at most this many job leases before ended jobs are pruned from it.
_MAX_LEASES = 32


@dataclass(frozen=True)
class Registration:
    """What registering a run did: shards it must not cache, datasets evicted for it."""

    bypassed: frozenset[str]  # object keys copied straight to scratch (the cache is at its cap)
    evicted: tuple[DatasetRecord, ...]
    total_bytes: int
    limit_bytes: int
    #: keys of the evicted datasets that went for the free space of a filesystem shared with
    #: scratch (the others went for the cap)
    for_space: frozenset[str] = frozenset()


class ShardCache:
    """One user's node cache (see the module doc); :meth:`open` it, then look up, fill, place."""

    def __init__(
        self,
        layout: CacheLayout,
        *,
        limit_bytes: int,
        lock_timeout_s: float | None = None,
        job_states: Callable[[], JobStates] = query_job_states,
    ):
        self.layout = layout
        self.limit_bytes = limit_bytes
        self.lock_timeout_s = lock_timeout_s
        self._job_states = job_states
        self._swept_groups: set[Path] = set()  # groups whose dead fillers' partials are gone

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        *,
        limit_bytes: int | None = None,
        lock_timeout_s: float | None = None,
        job_states: Callable[[], JobStates] = query_job_states,
    ) -> ShardCache:
        """The cache at ``root``, created private if missing (see :meth:`CacheLayout.open`)."""
        layout = CacheLayout(Path(root)).open()
        limit = default_limit_bytes(layout.root) if limit_bytes is None else limit_bytes
        return cls(layout, limit_bytes=limit, lock_timeout_s=lock_timeout_s, job_states=job_states)

    # -- objects ----------------------------------------------------------------------------
    def lookup(self, key: str) -> ObjectRecord | None:
        """The record of a cached shard whose bytes are in place and unchanged, else None."""
        record = ObjectRecord.read(self.layout.record_path(key))
        if record is None or record.key != key:
            return None
        try:
            st = os.stat(self.layout.object_path(key))
        except OSError:
            return None
        return record if record.describes(st) else None

    def lookup_many(self, dkey: str, urls: Mapping[str, str]) -> dict[str, ObjectRecord]:
        """:meth:`lookup` of each key in ``urls`` (key -> source URL) that is cached.

        The copies dataset ``dkey``'s record keeps (:attr:`DatasetRecord.known`) are checked
        with one stat of each object; only keys without one cost a record file read.
        """
        record = DatasetRecord.read(self.layout.dataset_path(dkey))
        known = record.known if record is not None else {}
        out = {}
        for key, url in urls.items():
            found = None
            if key in known:
                found = ObjectRecord.from_compact(key, url, known[key])
                try:
                    st = os.stat(self.layout.object_path(key))
                except OSError:
                    found = None
                else:
                    found = found if found is not None and found.describes(st) else None
            found = found or self.lookup(key)
            if found is not None:
                out[key] = found
        return out

    def remember(self, dkey: str, used: Sequence[ObjectRecord]) -> None:
        """Keep copies of the records a run used in its dataset's record (:meth:`lookup_many`)."""
        with self.cache_lock():
            record = DatasetRecord.read(self.layout.dataset_path(dkey))
            if record is None:
                return  # evicted meanwhile
            named = set(record.objects)
            record.known.update({r.key: r.compact() for r in used if r.key in named})
            record.known = {k: v for k, v in record.known.items() if k in named}
            record.write(self.layout.dataset_path(dkey))

    def fill_lock(self, key: str) -> FileLock:
        """The lock a process holds while it copies shard ``key`` into the cache."""
        return FileLock(
            self.layout.fill_lock(key),
            timeout_s=self.lock_timeout_s,
            what=f"the cache's fill lock of a shard ({self.layout.fill_lock(key)})",
        )

    def object_path(self, key: str) -> Path:
        """Where shard ``key``'s bytes go; written only under its lock (the copy that writes
        there creates its directory when missing)."""
        return self.layout.object_path(key)

    def clear_way(self, key: str) -> None:
        """Make room for a fill of ``key`` (under its lock): its group a directory, its object's
        place free of anything that is no file (a directory or link put there by hand or by
        damage), so the fill's rename lands. ``OSError`` where that cannot be done: the shard
        is then copied past the cache (a fill failing there failed the job, exit 5, each time)."""
        path = self.layout.object_path(key)
        for place, wanted in ((path.parent, stat.S_ISDIR), (path, stat.S_ISREG)):
            with contextlib.suppress(FileNotFoundError):
                if not wanted(os.lstat(place).st_mode):
                    remove_any(place)
        if path.parent not in self._swept_groups:  # (once a group a run: a listing each)
            self._swept_groups.add(path.parent)
            # Under the group's lock no fill of it runs: a partial there is a dead filler's
            # (kill -9), whose shard may never be filled again to overwrite it.
            with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
                for entry in entries:
                    if entry.name.endswith(PARTIAL_SUFFIX):
                        discard(entry.path)

    def keep(
        self,
        key: str,
        *,
        url: str,
        size: int,
        digest: str,
        samples: int | None,
        version: str | None,
    ) -> ObjectRecord:
        """Record the verified bytes just renamed to :meth:`object_path`: from now on a hit.

        Read-only first, so that a hard link in some job's scratch cannot be written through.
        """
        path = self.layout.object_path(key)
        os.chmod(path, 0o444)
        st = os.stat(path)
        record = ObjectRecord(
            key, url, size, digest, samples, version, st.st_ino, st.st_mtime_ns, time.time()
        )
        record.write(self.layout.record_path(key))
        return record

    def drop(self, key: str) -> None:
        """Forget shard ``key``: its record first (no reader trusts the bytes after), then them."""
        discard(self.layout.record_path(key))
        discard(self.layout.object_path(key))

    def place(self, record: ObjectRecord, final: Path, *, fsync: bool = False) -> str:
        """Publish a cached shard at ``final`` (:func:`stager.cache.place.place_file`)."""
        path = str(self.layout.object_path(record.key))
        return place_file(path, str(final), digest=record.hash, fsync=fsync)

    # -- datasets ---------------------------------------------------------------------------
    def dataset_lock(self, dkey: str) -> FileLock:
        """Held shared by a stage-in for as long as it places the dataset's shards."""
        return FileLock(self.layout.dataset_lock(dkey), shared=True, timeout_s=self.lock_timeout_s)

    def datasets(self) -> list[DatasetRecord]:
        """Every dataset record (a damaged one is skipped: its objects become orphans)."""
        out = []
        for path in sorted(self.layout.datasets_dir.glob(f"*{RECORD_SUFFIX}")):
            record = DatasetRecord.read(path)
            if record is not None and path.name == f"{record.key}{RECORD_SUFFIX}":
                out.append(record)
        return out

    def in_use(self, record: DatasetRecord, states: JobStates) -> bool:
        """A stage-in holds the dataset's lock, or a job that used it may still run."""
        return self.keep_reason(record, states) is not None

    def cache_lock(self) -> FileLock:
        """Held, briefly, by whatever changes dataset records: registration, eviction, sweeps."""
        return FileLock(
            self.layout.cache_lock, timeout_s=self.lock_timeout_s, what=str(self.layout.cache_lock)
        )

    def register(
        self,
        dkey: str,
        *,
        spec: str,
        name: str,
        source: str,
        shards: Mapping[str, tuple[str, int]],
        missing: Sequence[tuple[str, int]],
        job_id: str | None,
        free_bytes: int | Callable[[], int] | None = None,
        reserve_bytes: int = 0,
    ) -> Registration:
        """Name a run's shards in its dataset's record and make room for the missing ones.

        ``shards``: relpath -> (object key, size) of the shards the run will take from the
        cache or put in it; ``missing``: (key, size) of those not cached yet, in the run's
        order. Over the cap, least recently used datasets not in use are evicted; if that is
        not enough, the returned ``bypassed`` keys are left out of the cache (see
        :func:`stager.cache.evict.shards_over_limit`). ``free_bytes``: the free space (a
        callable: asked under the cache lock) of a filesystem the cache shares with scratch,
        ``reserve_bytes`` kept free there: idle datasets go where that makes the room for the
        missing shards (:mod:`stager.cache.room`), never bypassing. Hold the dataset's lock.
        """
        now = time.time()
        with self.cache_lock():
            records = {r.key: r for r in self.datasets()}
            own = records.get(dkey) or DatasetRecord(dkey, spec)
            before = own.objects
            own.spec, own.name, own.source, own.last_used = spec, name, source, now
            for relpath, (key, size) in shards.items():
                own.shards[relpath] = [key, size]
            if job_id:
                own.jobs.setdefault(job_id, now)
            named_now = own.objects
            own.known = {k: v for k, v in own.known.items() if k in named_now}
            records[dkey] = own
            total = cache_bytes(_usage(r) for r in records.values())
            short = 0
            if free_bytes is not None:
                short = room.shortfall(
                    self.layout, free_bytes, before, records, dkey, missing, reserve_bytes
                )
            states: JobStates | None = None
            evicted: list[DatasetRecord] = []
            bypassed: set[str] = set()
            freed: set[str] = set()
            over = total > self.limit_bytes or short > 0
            if over or any(len(r.jobs) > _MAX_LEASES for r in records.values()):
                states = self._job_states()
            if over and self._forget_phantoms(records, dkey):
                total = cache_bytes(_usage(r) for r in records.values())
            if short > 0:
                assert states is not None
                plan = room.space_plan(
                    self.layout, records, dkey, short, partial(self.in_use, states=states)
                )
                if plan is not None:  # (else it would be evicted for nothing: exit 6)
                    evicted = [records.pop(key) for key in plan.evict]
                    freed.update(plan.freed_objects)
                    total = cache_bytes(_usage(r) for r in records.values())
            for_space = frozenset(r.key for r in evicted)
            if total > self.limit_bytes:
                assert states is not None
                usages = [
                    _usage(r, in_use=key != dkey and self.in_use(r, states))
                    for key, r in records.items()
                ]
                plan = plan_eviction(usages, self.limit_bytes, keep=dkey)
                evicted += [records.pop(key) for key in plan.evict]
                freed.update(plan.freed_objects)
                total = plan.total_bytes
                if total > self.limit_bytes:
                    shared = {
                        k for key, r in records.items() if key != dkey for k in r.objects.keys()
                    }
                    bypassed = shards_over_limit(total, self.limit_bytes, missing, shared=shared)
                    for relpath, (key, _size) in list(own.shards.items()):
                        if key in bypassed:
                            del own.shards[relpath]
                    total -= sum(size for key, size in dict(missing).items() if key in bypassed)
            if states is not None and states.known:
                for record in records.values():
                    record.jobs = {j: t for j, t in record.jobs.items() if states.may_run(j)}
                    if record is not own:
                        record.write(self.layout.dataset_path(record.key))
            own.write(self.layout.dataset_path(dkey))
            # The objects before the records that name them: a kill in between leaves a record
            # naming objects that are gone, which the next eviction counts and drops again,
            # never objects that nothing names and nothing counts.
            named = {k for r in records.values() for k in r.objects}
            for key in freed | (before.keys() - named):
                if key not in named:
                    self.drop(key)
            for record in evicted:
                self.forget_dataset(record.key)
        return Registration(frozenset(bypassed), tuple(evicted), total, self.limit_bytes, for_space)

    def _forget_phantoms(self, records: Mapping[str, DatasetRecord], own: str) -> bool:
        """Before evicting: drop from records no stage-in holds the shards whose objects are
        not there (named by a run that failed or was killed before filling them), so bytes
        that do not exist evict no dataset. Only over the cap: a stat per object named, or for
        many, one listing of the objects (a stat each cost ~1e6 under the cache lock at 1e6)."""
        changed = False
        idle = {
            key: record
            for key, record in records.items()
            if key != own and not lock_is_held(self.layout.dataset_lock(key))
        }  # (a run filling one now: its shards are on their way)
        present = self.layout.present({str(e[0]) for r in idle.values() for e in r.shards.values()})
        for key, record in idle.items():
            there = {
                relpath: entry
                for relpath, entry in record.shards.items()
                if str(entry[0]) in present
            }
            if len(there) != len(record.shards):
                record.shards = there
                record.write(self.layout.dataset_path(key))
                changed = True
        return changed

    def forget_dataset(self, dkey: str) -> None:
        """Drop a dataset's record and kept index (the caller drops objects no one names)."""
        discard(self.layout.dataset_path(dkey))
        shutil.rmtree(self.layout.index_dir(dkey), ignore_errors=True)

    # -- the loader index of a dataset ------------------------------------------------------
    def keep_index(self, dkey: str, index_dir: Path) -> None:
        """Keep the loader index just written beside a staged copy, for the next staging.

        Best effort: the index is only a speed-up, and each of its files says which shard
        files (names, sizes, mtimes) it was built from, so a stale one is rebuilt, never used.
        """
        mirror_files(index_dir, self.layout.index_dir(dkey), replace=True)

    def restore_index(self, dkey: str, index_dir: Path) -> None:
        """Put the kept index beside a staged copy made from the cache (files it lacks only)."""
        mirror_files(self.layout.index_dir(dkey), index_dir, replace=False)

    def keep_reason(
        self, record: DatasetRecord, states: JobStates, *, unknown_ok: bool = False
    ) -> str | None:
        """Why eviction must keep ``record`` (a stage-in holds it, a job may run), or None.

        ``unknown_ok``: a job Slurm cannot be asked about does not keep it (``--older-than``
        was given: the user's word that what was unused that long is not in use).
        """
        if lock_is_held(self.layout.dataset_lock(record.key)):
            return "a stage-in is using it now"
        for job in record.jobs:
            running = states.running(job)
            if running:
                return f"job {job}, which staged it, is still running"
            if running is None and not unknown_ok:
                return (
                    f"cannot ask Slurm whether job {job}, which staged it, still runs "
                    f"({states.error}); pass --older-than to evict what was unused that long"
                )
        return None


def _usage(record: DatasetRecord, *, in_use: bool = False) -> DatasetUsage:
    return DatasetUsage(record.key, record.last_used, record.objects, in_use)
