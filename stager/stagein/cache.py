"""stage-in's side of the node cache (``--cache``): serve planned shards from it, fill it on a miss.

For one run, after planning: :meth:`StageCache.start` opens the cache and holds the dataset's
lock (shared) until :meth:`StageCache.close`; :meth:`StageCache.register` names each planned
shard's key in the dataset's record (evicting if the cache is over its cap) and says how many
bytes scratch still needs; then the copier asks :meth:`StageCache.claim` for each shard:

* a hit is placed in scratch at once (hard link, reflink or a verified copy) and costs no
  source read;
* a miss comes back with the fill lock held and the cache object as the copy's target: the
  copier's usual copy (retries, bandwidth cap, size and hash checks, samples counted in flight)
  writes it there, then :meth:`Claim.publish` records it and places it in scratch. Another job
  wanting the same shard waits on the lock meanwhile, then finds it cached;
* a shard without a trustworthy identity, or left out to respect the cap, is copied straight
  to scratch as without a cache.

Every way ends with the shard's final name in scratch holding verified bytes of the source's
current version; :mod:`stager.stagein.finish` writes the manifest and index as for any run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from stager.cache.fillwait import wait_for_fill
from stager.cache.keys import dataset_key, shard_key
from stager.cache.locks import FileLock
from stager.cache.records import ObjectRecord
from stager.cache.store import ShardCache
from stager.errors import DestinationError, HashMismatch, ScratchFull, one_line
from stager.layout import StagedDataset
from stager.stagein import cachespace
from stager.stagein.cachespace import cache_refusal, free_bytes_or_0, same_fs, unfit
from stager.stagein.options import StageInOptions
from stager.stagein.plan import CopyItem, LocalPlan
from stager.stagein.report import StageInReport
from stager.storage.copy import CopyResult
from stager.storage.paths import discard
from stager.storage.sources import SourceSet
from stager.units import human_bytes

__all__ = ["StageCache", "Claim"]


class Claim:
    """How one planned shard reaches scratch with a cache: served, filled, or copied past it."""

    def __init__(
        self,
        item: CopyItem,
        *,
        served: CopyResult | None = None,
        samples: int | None = None,
        fill: tuple[StageCache, str, FileLock] | None = None,
    ):
        self.item = item
        self.served = served  # placed from the cache already: no copy to make
        self.samples = samples
        self._fill = fill
        #: Where the copier writes the source's bytes: the cache object on a fill, else scratch.
        self.target = fill[0].store.object_path(fill[1]) if fill is not None else item.final

    def publish(self, result: CopyResult, samples: int | None) -> CopyResult:
        """After the copier's verified copy to :attr:`target`: record it, place it in scratch."""
        if self._fill is None:
            return result
        cache, key, _lock = self._fill
        item = self.item
        listed = item.shard.version
        if result.version is not None and listed is not None and result.version != listed:
            # The source changed between the listing and the copy: these bytes are the source's
            # current ones (the copy checked that), but not those of the key; never cache them.
            try:
                cache.store.place(_unrecorded(key, result), item.final, fsync=cache.fsync)
            finally:
                discard(self.target)
            return result
        try:
            record = cache.store.keep(
                key,
                url=item.shard.url,
                size=result.size,
                digest=result.hash,
                samples=samples,
                version=listed,
            )
        except OSError as exc:  # the record cannot be written: stage the bytes, uncached
            cache._warn(f"{item.shard.url} not cached: {exc.strerror or one_line(exc)}")
            try:
                cache.store.place(_unrecorded(key, result), item.final, fsync=cache.fsync)
            finally:
                cache.store.drop(key)
            return result
        method = cache.store.place(record, item.final, fsync=cache.fsync)
        cache.count_placed(method, filled=True, size=result.size, record=record)
        return result

    def release(self) -> None:
        if self._fill is not None:
            self._fill[2].release()


def _unusable(root: Path, exc: OSError) -> str:
    """The warning of a cache its filesystem refuses (read-only, full): the run goes on without."""
    why = exc.strerror or one_line(exc)
    return f"the cache at {root} cannot be used ({why}): copying without it"


def _unrecorded(key: str, result: CopyResult) -> ObjectRecord:
    return ObjectRecord(key, "", result.size, result.hash, None, None, 0, 0, 0.0)


def _by_url(plan: LocalPlan, shards: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """The planned shards' (key, size) by their source URL."""
    return {i.shard.url: shards[i.shard.relpath] for i in plan.to_copy if i.shard.relpath in shards}


@dataclass
class _Counts:
    served: int = 0
    served_bytes: int = 0
    filled: int = 0
    methods: dict[str, int] | None = None


class StageCache:
    """One stage-in run's use of the node cache (see the module doc)."""

    def __init__(
        self,
        store: ShardCache,
        source: SourceSet,
        staged: StagedDataset,
        report: StageInReport,
        log: TextIO,
        *,
        job_id: str | None,
    ):
        self.store = store
        self.source, self.staged, self.report, self.log = source, staged, report, log
        self.job_id = job_id
        self.dkey = dataset_key(source.spec or source.root_url)
        self.keys: dict[str, str] = {}  # relpath -> object key, for the shards to cache
        self.present: dict[str, ObjectRecord] = {}  # object key -> record, as registered
        self.same_fs = False  # the cache and scratch share a filesystem (hard links)
        self._lock = self.store.dataset_lock(self.dkey)
        self._count_lock = threading.Lock()
        self.counts = _Counts(methods={})
        self.used: list[ObjectRecord] = []  # records of what this run served or filled
        self.filled_up = False  # the cache's filesystem ran out of space: copy past it
        self.fsync = False  # --fsync: copies placed in scratch reach the disk before renaming
        self.stalled_groups: set[Path] = set()  # fill locks' groups whose holder stalled
        self._said: set[str] = set()  # topics of the warnings said once a run (_warn)

    @classmethod
    def start(
        cls,
        options: StageInOptions,
        source: SourceSet,
        staged: StagedDataset,
        report: StageInReport,
        log: TextIO,
        *,
        job_id: str | None,
    ) -> StageCache | None:
        """Open ``options.cache_dir`` (set: the caller imports this module only with
        ``--cache``) and hold the dataset's lock; None, said in a warning, where the cache's
        filesystem refuses it (read-only, full): the run stages without it, as it does when
        registering fails."""
        assert options.cache_dir is not None
        try:
            store = ShardCache.open(
                options.cache_dir,
                limit_bytes=options.cache_limit_bytes,
                lock_timeout_s=options.lock_timeout_s,
            )
            cache = cls(store, source, staged, report, log, job_id=job_id)
            cache.fsync = options.fsync
            cache._lock.acquire()
        except (OSError, DestinationError) as exc:
            cause = exc.__cause__ if isinstance(exc, DestinationError) else exc
            if not isinstance(cause, OSError):
                raise  # a refusal of the directory itself (not a directory, unsafe): said
            print(
                f"[{report.node}] warning: {_unusable(options.cache_dir, cause)}",
                file=log,
                flush=True,
            )
            return None
        return cache

    def close(self) -> None:
        self._lock.release()

    def _warn(self, message: str, once: str | None = None) -> None:
        """Say ``message``; with ``once``, only the first time a copy thread meets that topic."""
        with self._count_lock:
            said = once in self._said
            if once is not None:
                self._said.add(once)
        if not said:
            print(f"[{self.report.node}] warning: {message}", file=self.log, flush=True)

    def register(self, plan: LocalPlan, min_free: int = 0) -> int:
        """Name the planned shards in the cache; return the bytes scratch needs free for them
        (besides ``min_free``, --min-free: part of the room a shared filesystem must make)."""
        shards: dict[str, tuple[str, int]] = {}
        for item in plan.to_copy:
            key = shard_key(item.shard.url, item.size, item.shard.version, item.want_hash)
            if key is not None and item.size is not None:
                shards[item.shard.relpath] = (key, item.size)
        unkeyed = len(plan.to_copy) - len(shards)
        if unkeyed:
            self._warn(
                f"{unkeyed} shard(s) have neither a version from the source nor a hash in a "
                "manifest, so a change could not be told: they are copied, not cached. Run "
                "`stager index` on the source to cache them"
            )
        urls = {key: url for url, (key, _size) in _by_url(plan, shards).items()}
        self.present = self.store.lookup_many(self.dkey, urls)
        missing = [(key, size) for key, size in shards.values() if key not in self.present]
        self.same_fs = same_fs(root := self.store.layout.root, self.staged.dir)
        if not self.same_fs:  # scratch gets copies; the cache's own disk must hold the fills
            left_out = unfit(missing, free_bytes_or_0(self.store.layout.root))
            if left_out:
                self._warn(
                    "not enough free space on the cache's filesystem for "
                    f"{len(left_out)} shard(s): they are copied to scratch without being cached"
                )
                shards = {r: (k, s) for r, (k, s) in shards.items() if k not in left_out}
                missing = [(k, s) for k, s in missing if k not in left_out]
        try:
            registration = self.store.register(
                self.dkey,
                spec=self.source.spec,
                name=self.staged.name,
                source=self.source.root_url,
                shards=shards,
                missing=missing,
                job_id=self.job_id,
                free_bytes=(lambda: free_bytes_or_0(root)) if self.same_fs else None,
                reserve_bytes=min_free + cachespace.uncached_bytes(plan.to_copy, shards),
            )
        except OSError as exc:  # a full or read-only cache disk: stage as without a cache
            self._warn(_unusable(self.store.layout.root, exc))
            self.keys, self.present = {}, {}
            return plan.bytes_to_copy
        for evicted in registration.evicted:
            self._warn(cachespace.evicted_message(evicted, registration.for_space))
        if registration.bypassed:
            self._warn(
                f"cache at its limit ({human_bytes(registration.limit_bytes)}) with datasets in "
                f"use: {len(registration.bypassed)} shard(s) are copied to scratch without "
                "being cached. Raise --cache-limit or clean the cache (stager clean --cache)"
            )
        self.keys = {r: k for r, (k, _s) in shards.items() if k not in registration.bypassed}
        return self._scratch_bytes(plan)

    def _scratch_bytes(self, plan: LocalPlan) -> int:
        """Bytes the plan needs free in scratch: only the new ones when links share them."""
        if not self.same_fs:
            return plan.bytes_to_copy
        return sum(
            item.size or 0
            for item in plan.to_copy
            if self.keys.get(item.shard.relpath) not in self.present
        )

    def misses(self, plan: LocalPlan) -> int:
        """How many planned shards were not in the cache when the run registered."""
        return sum(self.keys.get(i.shard.relpath) not in self.present for i in plan.to_copy)

    def claim(self, item: CopyItem) -> Claim:
        """How ``item`` reaches scratch (see :class:`Claim`); waits while another job fills it.
        Where the cache refuses it (a part of it unreadable, not writable), copied past it."""
        try:
            return self._claim(item)
        except OSError as exc:
            if not self.refused(exc):
                raise
            return Claim(item)

    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cache's own refusal (a path of it unreadable, not writable,
        not a directory): the shard is then copied past the cache, said in one warning, where
        it failed the job as a destination or source error."""
        why = cache_refusal(exc, self.store.layout.root)
        if why is not None:
            self._warn(
                f"the cache refused a shard ({why}): copying such shards without it", "refused"
            )
        return why is not None

    def _claim(self, item: CopyItem) -> Claim:
        key = self.keys.get(item.shard.relpath)
        if key is None or self.filled_up:
            return Claim(item)
        record = self.present.get(key)  # a miss at registration goes straight to the lock
        served = self._serve(item, record) if record is not None else None
        if served is not None:
            return served
        lock = self.store.fill_lock(key)
        group_dir = self.store.object_path(key).parent
        if group_dir in self.stalled_groups:  # (its holder stalled: no second wait, until it
            got = lock.acquire(blocking=False)  # lets go, which ends the group's stall)
            if got:
                self.stalled_groups.discard(group_dir)
        else:
            got = wait_for_fill(lock, group_dir, timeout_s=self.store.lock_timeout_s)
        if not got:
            self._passed_a_stalled_fill(group_dir)
            return Claim(item)  # (from the source straight to scratch)
        try:
            record = self.store.lookup(key)  # filled by another job while we waited?
            served = self._serve(item, record) if record is not None else None
        except BaseException:
            lock.release()
            raise
        if served is not None:
            lock.release()
            return served
        try:
            self.store.clear_way(key)  # (what cannot go from the object's place: refused)
        except BaseException:
            lock.release()
            raise
        return Claim(item, fill=(self, key, lock))

    def _passed_a_stalled_fill(self, group_dir: Path) -> None:
        self.stalled_groups.add(group_dir)
        self._warn(
            "another process of yours holds a fill lock of the cache and wrote nothing "
            "for a while (a suspended or stopped job? a hung read?): the shards it holds "
            "up are copied to scratch without the cache",
            once="stalled",
        )

    def ran_out_of_space(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the cache's own filesystem filling up during a fill; then the
        rest of the run (this shard again, too) copies past the cache, said in one warning.
        It failed the job (exit 6, "free space or pass --dest") with scratch half empty, where
        a cache full from the start is passed by with a warning."""
        if not isinstance(exc, ScratchFull) or not exc.where:
            return False
        root = str(self.store.layout.root).rstrip("/") + "/"
        if not (exc.where.rstrip("/") + "/").startswith(root):
            return False  # (scratch's own: the job's error)
        self.filled_up = True
        self._warn(f"the cache at {root.rstrip('/')} is full: copying the rest without it", "full")
        return True

    def _serve(self, item: CopyItem, record: ObjectRecord) -> Claim | None:
        """Place a cached shard; None when it vanished or proved damaged (copy it instead)."""
        try:
            method = self.store.place(record, item.final, fsync=self.fsync)
        except FileNotFoundError:
            return None  # evicted or replaced since it was looked up
        except HashMismatch as exc:
            self._warn(one_line(exc))
            self.store.drop(record.key)
            return None
        self.count_placed(method, filled=False, size=record.size, record=record)
        result = CopyResult(
            size=record.size, hash=record.hash, bytes_read=0, version=record.version
        )
        return Claim(item, served=result, samples=record.samples)

    def count_placed(
        self, method: str, *, filled: bool, size: int, record: ObjectRecord | None = None
    ) -> None:
        with self._count_lock:
            if record is not None:
                self.used.append(record)
            assert self.counts.methods is not None
            self.counts.methods[method] = self.counts.methods.get(method, 0) + 1
            if filled:
                self.counts.filled += 1
            else:
                self.counts.served += 1
                self.counts.served_bytes += size
                self.report.files_from_cache += 1
                self.report.bytes_from_cache += size

    # -- the loader index --------------------------------------------------------------------
    def restore_index(self) -> None:
        """Before the run's ending: the index kept by the last staging, if the copy lacks one."""
        self.store.restore_index(self.dkey, self.staged.index_dir)

    def keep(self) -> None:
        """After a successful ending: keep the index it wrote, and the records it used, for the
        next staging (best effort: without them it only costs that staging more reads)."""
        self.store.keep_index(self.dkey, self.staged.index_dir)
        try:
            self.store.remember(self.dkey, self.used)
        except OSError as exc:
            self._warn(f"the cache's dataset record was not updated ({one_line(exc)})")
