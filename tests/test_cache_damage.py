"""The node cache damaged, stopped or left half-done: each is passed by or repaired, in one line.

What a cache holds outlives jobs, versions of stager and kills; a damaged part of it must cost
at most a copy from the source, never a job (tests/test_cache.py holds the rest of the cache's
promises).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stager.cache.store import ShardCache
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .inproc import clean_process_env, run_main
from .test_fanout_procs import _assert_identical

SPEC = SyntheticSpec(num_shards=4, samples_per_shard=6, image_bytes=800, seed=9)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


def _stage(capsys, src: Path, dest: Path, cache: Path, *extra: str) -> tuple[int, dict, str]:
    report = dest.parent / f"{dest.name}.report.json"
    argv = ["stage-in", str(src), "--dest", str(dest), "--cache", str(cache), "--quiet"]
    result = run_main(capsys, *argv, "--jitter-max", "0", "--report", str(report), *extra)
    payload = json.loads(report.read_text()) if report.exists() else {}
    return result.returncode, payload, result.stderr


def _dataset_record(cache: Path) -> Path:
    (record,) = (cache / "datasets").glob("*.json")
    return record


def _cached_once(capsys, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A dataset staged once through a cache: its source, the cache, the dataset's record."""
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    assert _stage(capsys, src, tmp_path / "job1", cache)[0] == 0
    return src, cache, _dataset_record(cache)


def test_a_dataset_record_of_another_shape_is_no_record(capsys, tmp_path: Path) -> None:
    """Valid JSON that is not this version's record (damaged, or another version's) is passed
    by as no record: stage-in, `stager ls` and `stager clean --cache` ended in a TypeError."""
    src, cache, record = _cached_once(capsys, tmp_path)
    payload = json.loads(record.read_text())
    payload["shards"] = {relpath: entry[1] for relpath, entry in payload["shards"].items()}
    record.write_text(json.dumps(payload))

    code, report, stderr = _stage(capsys, src, tmp_path / "job2", cache)
    assert code == 0, stderr
    _assert_identical(src, tmp_path / "job2" / "ds")
    record.write_text(json.dumps(payload))  # (job2 wrote a good one)
    listed = run_main(capsys, "stager", "ls", "--cache", str(cache))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    cleaned = run_main(capsys, "stager", "clean", "--cache", str(cache))
    assert cleaned.returncode == 0 and "Traceback" not in cleaned.stderr, cleaned.stderr
    code, report, stderr = _stage(capsys, src, tmp_path / "job3", cache)
    assert code == 0, stderr
    _assert_identical(src, tmp_path / "job3" / "ds")


@pytest.mark.parametrize("where", ["object record", "dataset record"])
@pytest.mark.parametrize("samples", ["ten", -3, 2.5, True])
def test_an_object_record_edited_to_another_type_is_no_record(
    capsys, tmp_path: Path, where: str, samples: object
) -> None:
    """A sample count edited by hand in a cached shard's record (or in the copy a dataset's
    record keeps of it): the shard is copied again, the manifest counts what the tar holds.
    It was served: "ten" ended the run in a traceback (exit 1), -3 staged a manifest the
    loader refused."""
    src, cache, record = _cached_once(capsys, tmp_path)
    payload = json.loads(record.read_text())
    key = sorted(payload["known"])[0]
    payload["known"][key][2] = samples
    if where == "object record":
        del payload["known"][key]  # (read from the object's own record)
        path = cache / "objects" / key[:2] / f"{key}.json"
        edited = json.loads(path.read_text()) | {"samples": samples}
        path.write_text(json.dumps(edited))
    record.write_text(json.dumps(payload))

    code, report, stderr = _stage(capsys, src, tmp_path / "job2", cache)
    assert code == 0 and "Traceback" not in stderr, stderr
    # (the dataset record's copy refused, the object's own record serves it)
    assert report["files_from_cache"] == SPEC.num_shards - (where == "object record")
    _assert_identical(src, tmp_path / "job2" / "ds")
    manifest = json.loads((tmp_path / "job2" / "ds" / ".stager" / "manifest.json").read_text())
    assert [s["samples"] for s in manifest["shards"]] == SPEC.shard_sizes()


# -- a fill lock held by a process that makes no progress ----------------------------------
def test_a_fill_that_makes_progress_is_waited_for_and_a_stalled_one_is_not(
    tmp_path: Path,
) -> None:
    from stager.cache.fillwait import wait_for_fill
    from stager.cache.locks import FileLock

    group = tmp_path / "objects" / "ab"
    group.mkdir(parents=True)
    holder = FileLock(tmp_path / "ab.lock")
    assert holder.acquire()
    partial = group / "abcd.partial"
    partial.write_bytes(b"")
    looks = []

    def filler_writes(_seconds: float) -> None:  # each pause of the waiter: the filler writes
        looks.append(1)
        with partial.open("ab") as out:
            out.write(b"x")
        if len(looks) == 5:
            holder.release()  # its copy is done

    waiter = FileLock(tmp_path / "ab.lock")
    assert wait_for_fill(waiter, group, timeout_s=None, stall_s=0.0, sleep=filler_writes)
    assert waiter.held and len(looks) == 5
    waiter.release()

    assert holder.acquire()  # now a holder that writes nothing
    stalled = FileLock(tmp_path / "ab.lock")
    assert not wait_for_fill(stalled, group, timeout_s=None, stall_s=0.0, sleep=lambda _s: None)
    assert not stalled.held
    holder.release()


def test_a_shard_whose_fill_lock_is_held_by_a_stalled_job_is_copied_past_the_cache(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job holding the fill locks, stopped (Slurm's suspend, Ctrl-Z): its shards were
    failed as source errors after --lock-timeout (an hour); they are copied past the cache."""
    from stager.cache import fillwait
    from stager.cache.locks import FileLock
    from stager.cache.paths import FILL_LOCK_CHARS

    monkeypatch.setattr(fillwait, "FILL_STALL_S", 0.2)
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    ShardCache.open(cache)  # (a cache of its own, its lock files made)
    held = []
    for group in range(16**FILL_LOCK_CHARS):  # (every group: whichever the shards' keys are)
        lock = FileLock(cache / "locks" / "fill" / f"{group:0{FILL_LOCK_CHARS}x}.lock")
        assert lock.acquire(blocking=False)
        held.append(lock)
    try:
        # (--lock-timeout: without the stall watch this waited for the lock's timeout)
        code, report, stderr = _stage(capsys, src, tmp_path / "job1", cache, "--lock-timeout", "60")
    finally:
        for lock in held:
            lock.release()
    assert code == 0, stderr
    _assert_identical(src, tmp_path / "job1" / "ds")
    assert stderr.count("holds a fill lock of the cache and wrote nothing") == 1, stderr
    assert report["files_from_cache"] == 0
    # Once the locks are free, the next job fills the cache, and the one after reads from it.
    assert _stage(capsys, src, tmp_path / "job2", cache)[0] == 0
    code, report, stderr = _stage(capsys, src, tmp_path / "job3", cache)
    assert code == 0 and report["files_from_cache"] == SPEC.num_shards, stderr


# -- objects damaged into something else ---------------------------------------------------
@pytest.mark.parametrize("damage", ["object is a directory", "group is a file"])
def test_an_object_or_group_damaged_into_another_kind_is_replaced_by_the_next_fill(
    capsys, tmp_path: Path, damage: str
) -> None:
    """A directory where a cached object was (or a file where its group directory was) failed
    every later job (exit 5 'a directory has that name (made in scratch?)', or exit 3), and
    `stager clean --cache` said it removed it but left it."""
    import shutil

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    assert _stage(capsys, src, tmp_path / "job1", cache)[0] == 0
    obj = sorted(p for p in (cache / "objects").rglob("*") if p.is_file() and "." not in p.name)[0]
    if damage == "object is a directory":
        obj.chmod(0o644)
        obj.unlink()
        (obj / "inside").mkdir(parents=True)
    else:
        shutil.rmtree(obj.parent)
        obj.parent.write_text("junk")
    for job in ("job2", "job3"):
        code, report, stderr = _stage(capsys, src, tmp_path / job, cache)
        assert code == 0, stderr
        _assert_identical(src, tmp_path / job / "ds")
    assert report["files_from_cache"] == SPEC.num_shards  # (job2 filled it again)

    # clean --cache removes such damage where nothing names it
    if damage == "object is a directory":
        obj.chmod(0o644)
        obj.unlink()
        obj.mkdir()
    else:
        shutil.rmtree(obj.parent)
        obj.parent.write_text("junk")
    for record in (cache / "datasets").glob("*.json"):
        record.unlink()  # (nothing names it now)
    cleaned = run_main(capsys, "stager", "clean", "--cache", str(cache))
    assert cleaned.returncode == 0, cleaned.stderr
    assert not obj.exists() and (not obj.parent.exists() or obj.parent.is_dir())


def test_clean_cache_on_a_read_only_filesystem_is_one_line(capsys, tmp_path: Path) -> None:
    """It ended in a traceback (OSError on the cache lock), exit 1, --dry-run too."""
    import subprocess

    from .conftest import mount_tmpfs

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    with mount_tmpfs(tmp_path / "fs", "4m") as fs:
        assert _stage(capsys, src, tmp_path / "job1", fs / "cache")[0] == 0
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        for extra in ([], ["--dry-run"]):
            cleaned = run_main(capsys, "stager", "clean", "--cache", str(fs / "cache"), *extra)
            assert cleaned.returncode == 5, cleaned.stderr
            assert "Traceback" not in cleaned.stderr
            assert cleaned.stderr.count("\n") == 1 and "Read-only file system" in cleaned.stderr


@pytest.mark.parametrize("fsync", [False, True])
def test_a_cached_shard_copied_into_scratch_reaches_the_disk_with_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    """--fsync made no fsync for shards served from a cache on another filesystem (copied)."""
    import hashlib
    import os as os_module

    from stager.cache import place

    synced: list[int] = []
    real_fsync = os_module.fsync
    monkeypatch.setattr(place.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    cached = tmp_path / "object"
    cached.write_bytes(b"shard bytes" * 100)
    digest = "sha256:" + hashlib.sha256(cached.read_bytes()).hexdigest()
    final = tmp_path / "scratch" / "x.tar"
    final.parent.mkdir()
    method = place.place_file(str(cached), str(final), digest=digest, link=False, fsync=fsync)
    assert method in (place.COPY, place.REFLINK) and final.read_bytes() == cached.read_bytes()
    assert len(synced) == (1 if fsync else 0)


# -- bytes named but never filled, and what a kill in the middle leaves ---------------------
def _register(cache: ShardCache, dkey: str, key: str, *, fill: bool) -> frozenset[str]:
    bypassed = cache.register(
        dkey, spec=dkey, name=dkey, source="", shards={"x.tar": (key, 60)},
        missing=[(key, 60)], job_id=None,
    ).bypassed  # fmt: skip
    if fill and key not in bypassed:
        cache.object_path(key).parent.mkdir(parents=True, exist_ok=True)
        cache.object_path(key).write_bytes(b"x" * 60)
    return bypassed


@pytest.mark.parametrize("listing", [False, True])
def test_shards_a_failed_run_named_but_never_filled_evict_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listing: bool
) -> None:
    """A run names its shards when it starts; one that failed or was killed before filling
    them left bytes in the count that do not exist, and the next job evicted a real dataset.
    (Found by a stat of each object named, or for many, one listing of the objects.)"""
    from stager.cache import paths
    from stager.node.jobs import JobStates

    monkeypatch.setattr(paths, "STATS_BEFORE_LISTING", 0 if listing else 10**9)

    cache = ShardCache.open(
        tmp_path / "cache", limit_bytes=150, job_states=lambda: JobStates(frozenset())
    )
    _register(cache, "a", "aa01", fill=True)
    _register(cache, "b", "bb01", fill=False)  # (its run failed before filling)
    assert _register(cache, "c", "cc01", fill=True) == frozenset()
    assert sorted(d.key for d in cache.datasets()) == ["a", "b", "c"]  # a kept, nothing evicted
    shards = {d.key: list(d.shards) for d in cache.datasets()}
    assert shards == {"a": ["x.tar"], "b": [], "c": ["x.tar"]}  # (b's phantom dropped alone)


def test_a_kill_inside_an_eviction_leaves_no_uncounted_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the evicted dataset's record went and before its objects did, objects
    stayed that nothing named or counted, over the cap for good. Objects go first now: a kill
    leaves a record naming what is gone, which the next eviction counts and drops."""
    from stager.node.jobs import JobStates

    cache = ShardCache.open(
        tmp_path / "cache", limit_bytes=100, job_states=lambda: JobStates(frozenset())
    )
    _register(cache, "a", "aa01", fill=True)

    def killed(dkey: str) -> None:
        raise KeyboardInterrupt  # (the kill, between the objects and the record)

    monkeypatch.setattr(cache, "forget_dataset", killed)
    with pytest.raises(KeyboardInterrupt):
        _register(cache, "b", "bb01", fill=True)  # evicts a
    monkeypatch.undo()
    assert not cache.object_path("aa01").exists()  # the objects went first
    _register(cache, "c", "cc01", fill=True)
    objects = [p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()]
    named = {k for d in cache.datasets() for k in d.objects}
    assert {p.name for p in objects} <= named  # nothing on disk that no record names


def test_a_dead_fillers_partial_is_removed_by_the_next_fill_of_its_group(tmp_path: Path) -> None:
    """kill -9 during a fill left <object>.partial; where that shard changed (another key) no
    fill ever overwrote it, and it outlived every clean rerun, uncounted."""
    cache = ShardCache.open(tmp_path / "cache")
    dead = cache.object_path("ab" + "0" * 62).with_name("ab" + "0" * 62 + ".partial")
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"half a shard")
    key = "ab" + "1" * 62  # (another shard of the same group: its fill lock is the same)
    with cache.fill_lock(key):
        cache.clear_way(key)
    assert not dead.exists()


@pytest.mark.parametrize("damage", ["objects unreadable", "fill locks read-only"])
def test_a_part_of_the_cache_it_may_not_use_is_passed_by_not_the_jobs_failure(
    tmp_path: Path, damage: str
) -> None:
    """Run as a user is (root without its permission override): an unreadable objects group
    failed the job as a read-only destination (exit 5), read-only fill locks as a source error
    after retries (exit 3); a read-only cache filesystem was already passed by."""
    import os
    import shutil
    import subprocess

    from .conftest import BIN, clean_env

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without the permission override")
    as_a_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"

    def stage(dest: str) -> subprocess.CompletedProcess[str]:
        argv = [str(BIN / "stage-in"), str(src), "--dest", str(tmp_path / dest), "--quiet"]
        argv += ["--cache", str(cache), "--jitter-max", "0"]
        return subprocess.run(as_a_user + argv, env=clean_env(), capture_output=True, text=True)

    assert stage("job1").returncode == 0
    if damage == "objects unreadable":
        paths = list((cache / "objects").iterdir())
        for path in paths:
            path.chmod(0)
    else:
        src = tmp_path / "nfs" / "other"  # (every shard a miss: each fill needs its lock)
        write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4, seed=3))
        paths = [cache / "locks" / "fill"]
        for lock in paths[0].iterdir():
            lock.unlink()
        paths[0].chmod(0o555)
    try:
        result = stage("job2")
    finally:
        for path in paths:
            path.chmod(0o700)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the cache refused a shard") == 1, result.stderr
    _assert_identical(src, tmp_path / "job2" / src.name)


def test_a_record_of_a_large_inode_or_an_old_time_is_well_formed() -> None:
    """The type check refuses what no stat gives, never what one does: an inode number past
    2^63 (st_ino is unsigned) or a time before 1970 would have made every run copy again."""
    from stager.cache.records import ObjectRecord

    record = ObjectRecord("k" * 32, "file:///x.tar", 10, "xxh3_64:00", 3, None, 1 << 63, -5, 0.0)
    assert record.well_formed()
    again = ObjectRecord.from_compact(record.key, record.url, record.compact())
    assert again is not None and again.compact() == record.compact()
    for ino, mtime_ns in ((1, True), (1.5, 0), (-1, 0), (1 << 64, 0)):
        values = [10, "xxh3_64:00", 3, None, ino, mtime_ns]
        assert ObjectRecord.from_compact(record.key, record.url, values) is None
