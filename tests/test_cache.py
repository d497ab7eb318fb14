"""The node cache (``stage-in --cache``): served by identity, filled once, capped, kill-safe.

Source bytes are counted independently of stage-in's report: the source is read through the
``countfile://`` filesystem of test_fanout_procs.py (registered in this process, or loaded
into child processes through PYTHONPATH), which logs every read's byte count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from stager.cache.evict import DatasetUsage, cache_bytes, plan_eviction, shards_over_limit
from stager.cache.keys import dataset_key, shard_key
from stager.cache.locks import FileLock, lock_is_held
from stager.cache.paths import CacheLayout
from stager.cache.store import ShardCache
from stager.errors import EXIT_FULL, EXIT_INTEGRITY, EXIT_USAGE, UnsafePath, UsageError
from stager.node.jobs import JobStates
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .conftest import BIN, clean_env, mount_tmpfs
from .inproc import clean_process_env, run_main
from .test_fanout_procs import SITECUSTOMIZE, _assert_identical, _shards, _total

SPEC = SyntheticSpec(num_shards=6, samples_per_shard=10, image_bytes=2000, uneven=True, seed=4)


@pytest.fixture()
def counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The log every ``countfile://`` read appends its byte count to (this process)."""
    clean_process_env(monkeypatch)
    log = tmp_path / "source-reads.log"
    log.write_text("")
    monkeypatch.setenv("FANOUT_TEST_COUNT_LOG", str(log))
    exec(compile(SITECUSTOMIZE, "sitecustomize", "exec"), {})  # registers countfile://
    return log


def _read_bytes(log: Path) -> int:
    return sum(int(n) for n in log.read_text().split())


def _stage(capsys, src: Path | str, dest: Path, cache: Path, *extra: str) -> dict:
    report = dest.parent / f"{dest.name}.report.json"
    result = run_main(
        capsys,
        "stage-in",
        str(src),
        "--dest",
        str(dest),
        "--cache",
        str(cache),
        "--quiet",
        "--jitter-max",
        "0",
        "--report",
        str(report),
        *extra,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text()) | {"stderr": result.stderr}


def _objects(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "objects").rglob("*") if p.is_file() and "." not in p.name)


# -- what a user sees ----------------------------------------------------------------------
def test_a_second_job_reads_nothing_from_the_source(capsys, tmp_path: Path, counted: Path) -> None:
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    first = _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
    assert _read_bytes(counted) == first["bytes_read_source"] == _total(src)
    assert first["files_from_cache"] == 0
    counted.write_text("")

    second = _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
    assert _read_bytes(counted) == 0 and second["bytes_read_source"] == 0
    assert second["files_from_cache"] == second["files_copied"] == 6
    assert "[cache: 6 from the cache, 0 B read from the source]" in second["stderr"]
    staged = tmp_path / "job2" / "ds"
    _assert_identical(src, staged)
    # Hard links to the cache's read-only objects: no bytes copied, none writable by mistake.
    inodes = {p.stat().st_ino for p in _objects(cache)}
    for rel in _shards(src):
        st = (staged / rel).stat()
        assert st.st_ino in inodes and not st.st_mode & 0o222
    # Written as for any staging: the manifest with the source identity, and the loader index.
    manifest = json.loads((staged / ".stager" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 6 and all(e["version"] for e in manifest["shards"])
    assert list((staged / ".stager" / "index").iterdir())
    # The cache is private.
    assert (cache.stat().st_mode & 0o777) == 0o700
    # Keeping the index of a copy served from the cache (its files the cache's own) leaves no
    # temporary name behind (a rename of a link over the same file does nothing).
    assert not [p for p in cache.rglob("*") if ".partial" in p.name]


def test_the_loader_reads_a_copy_served_from_the_cache(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    clean_process_env(monkeypatch)
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    _stage(capsys, src, tmp_path / "job1", cache)
    _stage(capsys, src, tmp_path / "job2", cache)
    shutil.move(src, tmp_path / "moved-away")  # any read of the source now fails
    loader = ShardedLoader(
        str(src),
        batch_size=4,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path / "job2")),
    )
    assert loader.shards.staged_dir == tmp_path / "job2" / "ds" and loader.shards.from_source == 0
    assert sum(len(b) for (b,) in loader) == sum(SPEC.shard_sizes())


def test_a_changed_shard_is_copied_again_never_served_stale(
    capsys, tmp_path: Path, counted: Path
) -> None:
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
    victim = src / "train-000002.tar"
    data = bytearray(victim.read_bytes())
    data[600:610] = b"0123456789"  # same size, other bytes
    victim.write_bytes(bytes(data))
    counted.write_text("")

    second = _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
    assert _read_bytes(counted) == second["bytes_read_source"] == len(data)
    assert second["files_from_cache"] == 5
    _assert_identical(src, tmp_path / "job2" / "ds")
    # The superseded bytes left the cache; the first job's copy is untouched.
    assert len(_objects(cache)) == 6
    assert (tmp_path / "job1" / "ds" / "train-000002.tar").read_bytes() != bytes(data)


def test_a_manifest_hash_is_part_of_the_identity(capsys, tmp_path: Path, counted: Path) -> None:
    from stager.shards.build import build_manifest, write_manifest
    from stager.storage.sources import resolve_source

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    counted.write_text("")
    _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
    assert _read_bytes(counted) == _total(src)  # other keys: copied again, verified by hash
    counted.write_text("")
    third = _stage(capsys, f"countfile://{src}", tmp_path / "job3", cache)
    assert _read_bytes(counted) == 0 and third["files_from_cache"] == 6


# -- kill -9 and damage: nothing partial or changed is ever served -------------------------
def test_what_a_killed_filler_left_is_never_served(capsys, tmp_path: Path, counted: Path) -> None:
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
    objects = _objects(cache)
    # A fill killed after the rename, before the record: bytes without a record.
    no_record = objects[0]
    Path(f"{no_record}.json").unlink()
    # A fill killed mid-copy: a .partial beside a missing object.
    half = objects[1]
    Path(f"{half}.json").unlink()
    half.unlink()
    Path(f"{half}.partial").write_bytes(b"half a shard")
    # Bytes changed after their record (written through a hard link by someone as root).
    changed = objects[2]
    changed.chmod(0o644)
    with open(changed, "r+b") as handle:
        handle.seek(700)
        handle.write(b"garbage")
    # A run killed while filling never got to copy its records into the dataset's record.
    [dataset] = (cache / "datasets").glob("*.json")
    record = json.loads(dataset.read_text())
    for obj in (no_record, half):
        del record["known"][obj.name]
    dataset.write_text(json.dumps(record))
    counted.write_text("")

    report = _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
    assert report["files_from_cache"] == 3
    want = sum(Path(f"{src}/{rel}").stat().st_size for rel in _rels_of(cache, objects[:3]))
    assert _read_bytes(counted) == report["bytes_read_source"] == want
    _assert_identical(src, tmp_path / "job2" / "ds")
    assert not list(cache.rglob("*.partial"))


def _rels_of(cache: Path, objects: list[Path]) -> list[str]:
    [record] = [json.loads(p.read_text()) for p in (cache / "datasets").glob("*.json")]
    by_key = {key: rel for rel, (key, _size) in record["shards"].items()}
    return [by_key[p.name] for p in objects]


def test_a_cached_copy_that_does_not_hash_right_is_dropped_and_copied_again(
    capsys, tmp_path: Path, counted: Path
) -> None:
    """Across filesystems the cache copies (hashing as it goes): damage is caught there."""
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    with mount_tmpfs(tmp_path / "cachefs", "8m") as cachefs:
        cache = cachefs / "cache"
        _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
        victim = _objects(cache)[0]
        record = json.loads(Path(f"{victim}.json").read_text())
        st = victim.stat()
        victim.chmod(0o644)
        data = bytearray(victim.read_bytes())
        data[700] ^= 0xFF
        victim.write_bytes(bytes(data))  # same inode and size; restore the mtime too
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert victim.stat().st_ino == record["ino"]
        counted.write_text("")
        report = _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
        assert report["files_from_cache"] == 5
        assert _read_bytes(counted) == record["size"]
        assert "is dropped from the cache" in report["stderr"]
        _assert_identical(src, tmp_path / "job2" / "ds")
        staged = tmp_path / "job2" / "ds" / "train-000000.tar"
        assert staged.stat().st_dev != victim.stat().st_dev  # copied, not linked


def test_a_cache_filesystem_filling_up_mid_run_is_passed_by_not_the_jobs_failure(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer fills the cache's filesystem after stage-in checked its free space: the
    fills ran out of space and failed the job (exit 6, "free space or pass --dest") with
    scratch half empty. As a cache full from the start, it is passed by with one warning, and
    every shard (the one whose fill failed, too) is staged whole."""
    import stager.stagein.cache as stage_cache

    clean_process_env(monkeypatch)
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=6, samples_per_shard=8, image_bytes=50_000)
    )
    register = stage_cache.StageCache.register

    def register_then_another_writer_fills(self, plan, *rest):  # noqa: ANN001, ANN002, ANN202
        needed = register(self, plan, *rest)
        filler = self.store.layout.root.parent / "filler"
        with open(filler, "wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * (1 << 20))
        return needed

    monkeypatch.setattr(stage_cache.StageCache, "register", register_then_another_writer_fills)
    with mount_tmpfs(tmp_path / "cachefs", "8m") as cachefs:
        dest = tmp_path / "job"
        argv = ["--dest", str(dest), "--cache", str(cachefs / "cache"), "--jitter-max", "0"]
        result = run_main(capsys, "stage-in", str(src), *argv, "--progress", "none")
        assert result.returncode == 0, result.stderr
        said = [line for line in result.stderr.splitlines() if "is full: copying the rest" in line]
        assert len(said) == 1, result.stderr
        _assert_identical(src, dest / "ds")
        assert not list((cachefs / "cache").rglob("*.partial"))


# -- concurrency ---------------------------------------------------------------------------
def test_four_concurrent_jobs_copy_each_shard_once(tmp_path: Path) -> None:
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "source-reads.log"
    log.write_text("")
    cache = tmp_path / "cache"
    procs = []
    for job in range(4):
        env = clean_env(
            SLURM_JOB_ID=str(100 + job),
            PYTHONPATH=str(tmp_path / "site"),
            FANOUT_TEST_COUNT_LOG=str(log),
            STAGER_CACHE=str(cache),
        )
        # A bandwidth cap stretches each copy so the jobs really overlap.
        argv = [str(BIN / "stage-in"), f"countfile://{src}", "--dest", str(tmp_path / f"j{job}")]
        argv += ["--quiet", "--jitter-max", "0", "--bw-limit", "0.2", "--jobs", "3"]
        argv += ["--report", str(tmp_path / f"r{job}.json")]
        procs.append(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert _read_bytes(log) == _total(src)
    reports = [json.loads((tmp_path / f"r{job}.json").read_text()) for job in range(4)]
    assert sum(r["bytes_read_source"] for r in reports) == _total(src)
    assert sum(r["files_copied"] - r["files_from_cache"] for r in reports) == 6
    for job in range(4):
        _assert_identical(src, tmp_path / f"j{job}" / "ds")
    [record] = [json.loads(p.read_text()) for p in (cache / "datasets").glob("*.json")]
    assert sorted(record["jobs"]) == ["100", "101", "102", "103"]


# -- the cap -------------------------------------------------------------------------------
def _datasets(tmp_path: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for i, name in enumerate(names):
        out[name] = tmp_path / "nfs" / name
        write_synthetic_dataset(
            out[name], SyntheticSpec(num_shards=3, samples_per_shard=4, image_bytes=3000, seed=i)
        )
    return out


def test_eviction_keeps_the_datasets_in_use(capsys, tmp_path: Path, counted: Path) -> None:
    ds = _datasets(tmp_path, ["a", "b", "c"])
    size = _total(ds["a"])
    assert abs(_total(ds["b"]) - size) < size // 4
    cache = tmp_path / "cache"
    limit = str(int(size * 2.5))  # room for two of them
    _stage(capsys, f"countfile://{ds['a']}", tmp_path / "j1", cache, "--cache-limit", limit)
    time.sleep(0.01)
    _stage(capsys, f"countfile://{ds['b']}", tmp_path / "j2", cache, "--cache-limit", limit)
    # a is the least recently used, but a stage-in is placing it right now.
    layout = CacheLayout(cache)
    with FileLock(layout.dataset_lock(dataset_key(f"countfile://{ds['a']}")), shared=True):
        report = _stage(
            capsys, f"countfile://{ds['c']}", tmp_path / "j3", cache, "--cache-limit", limit
        )
    assert "evicted 'b'" in report["stderr"], report["stderr"]
    names = sorted(json.loads(p.read_text())["name"] for p in (cache / "datasets").glob("*.json"))
    assert names == ["a", "c"]
    counted.write_text("")
    again = _stage(capsys, f"countfile://{ds['a']}", tmp_path / "j4", cache, "--cache-limit", limit)
    assert _read_bytes(counted) == 0 and again["files_from_cache"] == 3
    for name, job in (("a", "j1"), ("b", "j2"), ("c", "j3"), ("a", "j4")):
        _assert_identical(ds[name], tmp_path / job / name)  # an eviction touches no scratch


def test_idle_cached_datasets_make_room_on_a_filesystem_shared_with_scratch(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scratch and the cache on one filesystem (docs/cache.md's layout), far under the cap: a
    dataset that does not fit beside the cached ones used to fail the job (exit 6, scratch
    full) with idle, evictable data on the disk. The least recently used idle datasets are
    evicted instead, said in one warning each, until the run's shards fit; a dataset a job
    still uses is not, and then the run fails as before."""
    clean_process_env(monkeypatch)
    spec = SyntheticSpec(num_shards=4, samples_per_shard=4, image_bytes=250_000)
    ds = {name: tmp_path / "nfs" / name for name in ("a", "b", "c")}
    for seed, path in enumerate(ds.values()):
        write_synthetic_dataset(path, dataclasses.replace(spec, seed=seed))
    size = _total(ds["a"])  # ~4 MB each: two fit, not three
    with mount_tmpfs(tmp_path / "disk", f"{(2 * size + size // 2) // 1024}k") as disk:
        cache = disk / "cache"
        for name in ("a", "b"):
            _stage(capsys, ds[name], disk / f"job-{name}", cache, "--cache-limit", "1G")
            shutil.rmtree(disk / f"job-{name}")  # the job ended and cleaned its scratch
            time.sleep(0.01)
        # b is in use (a stage-in holds it): only a may go, and that is enough
        with FileLock(
            CacheLayout(cache).dataset_lock(dataset_key(f"file://{ds['b']}")), shared=True
        ):
            report = _stage(capsys, ds["c"], disk / "job-c", cache, "--cache-limit", "1G")
        said = [line for line in report["stderr"].splitlines() if "evicted" in line]
        assert len(said) == 1 and "short of space: evicted 'a'" in said[0], report["stderr"]
        _assert_identical(ds["c"], disk / "job-c" / "c")
        names = sorted(
            json.loads(p.read_text())["name"] for p in (cache / "datasets").glob("*.json")
        )
        assert names == ["b", "c"]
        # nothing idle is left to evict (b and c in use): the run fails as it did, exit 6
        layout = CacheLayout(cache)
        with contextlib.ExitStack() as held:
            for name in ("b", "c"):
                key = dataset_key(f"file://{ds[name]}")
                held.enter_context(FileLock(layout.dataset_lock(key), shared=True))
            argv = ["--dest", str(disk / "job-a2"), "--cache", str(cache), "--quiet"]
            result = run_main(capsys, "stage-in", str(ds["a"]), *argv, "--jitter-max", "0")
        assert result.returncode == EXIT_FULL, result.stderr
        assert "evicted" not in result.stderr
        assert not list(disk.rglob("*.partial"))


def _names(cache: Path) -> list[str]:
    return sorted(json.loads(p.read_text())["name"] for p in (cache / "datasets").glob("*.json"))


def test_idle_datasets_go_for_space_only_where_that_makes_the_room(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room counted on disk: no dataset goes for a run that would not fit anyway (too large,
    or the idle shards still linked by ended jobs' scratch: evicting freed nothing and each
    failing run emptied the cache a little more); a fully cached run (links) evicts nothing;
    --min-free is part of the room (left out, nothing was evicted and the preflight failed)."""
    clean_process_env(monkeypatch)
    spec = SyntheticSpec(num_shards=4, samples_per_shard=4, image_bytes=120_000)
    ds = {n: tmp_path / "nfs" / n for n in ("a", "b", "c")}
    for seed, path in enumerate(ds.values()):
        write_synthetic_dataset(path, dataclasses.replace(spec, seed=seed))
    big = tmp_path / "nfs" / "big"
    write_synthetic_dataset(big, dataclasses.replace(spec, num_shards=18, seed=9))
    with mount_tmpfs(tmp_path / "disk", "8m") as disk:
        cache = disk / "cache"
        for name in ("a", "b"):  # ended jobs that left their scratch
            _stage(capsys, ds[name], disk / f"job-{name}", cache, "--cache-limit", "1G")
            time.sleep(0.01)
        argv = ["--cache", str(cache), "--quiet", "--jitter-max", "0", "--cache-limit", "1G"]
        result = run_main(capsys, "stage-in", str(big), "--dest", str(disk / "job-big"), *argv)
        assert result.returncode == EXIT_FULL, result.stderr
        assert "evicted" not in result.stderr
        assert {"a", "b"} <= set(_names(cache))
        for name in ("a", "b"):
            shutil.rmtree(disk / f"job-{name}")
        report = _stage(capsys, ds["b"], disk / "job-b2", cache, "--cache-limit", "1G")
        assert report["files_from_cache"] == 4 and "evicted" not in report["stderr"]
        shutil.rmtree(disk / "job-b2")
        result = run_main(
            capsys,
            "stage-in",
            str(ds["c"]),
            "--dest",
            str(disk / "job-c"),
            *argv,
            "--min-free",
            "4M",
        )
        assert result.returncode == 0, result.stderr
        assert "short of space: evicted 'a'" in result.stderr, result.stderr
        _assert_identical(ds["c"], disk / "job-c" / "c")


def test_a_running_jobs_dataset_is_kept_and_an_ended_ones_evicted(tmp_path: Path) -> None:
    """Leases: a job that used a dataset keeps it while Slurm lists it; cannot tell -> keep."""
    states = {"now": JobStates(frozenset({"7"}))}
    cache = ShardCache.open(tmp_path / "cache", limit_bytes=100, job_states=lambda: states["now"])

    def register(dkey: str, key: str, job: str | None) -> frozenset[str]:
        bypassed = cache.register(
            dkey,
            spec=dkey,
            name=dkey,
            source="",
            shards={"x.tar": (key, 60)},
            missing=[(key, 60)],
            job_id=job,
        ).bypassed
        if key not in bypassed:  # (the run fills it: a shard named but never filled is none)
            cache.object_path(key).parent.mkdir(parents=True, exist_ok=True)
            cache.object_path(key).write_bytes(b"x" * 60)
        return bypassed

    assert register("d1", "k1", "7") == frozenset()  # job 7 runs
    assert register("d2", "k2", "8") == frozenset({"k2"})  # d1 is in use: d2 is not cached
    states["now"] = JobStates(None, "squeue is not on PATH")
    assert register("d3", "k3", None) == frozenset({"k3"})  # cannot tell: keep d1 and d2
    states["now"] = JobStates(frozenset())  # every job ended
    assert register("d4", "k4", None) == frozenset()
    assert [d.key for d in cache.datasets()] == ["d4"]


def test_eviction_plan_is_lru_counts_shared_objects_once_and_never_evicts_in_use() -> None:
    a = DatasetUsage("a", 1.0, {"x": 10, "y": 10})
    b = DatasetUsage("b", 2.0, {"y": 10, "z": 10})
    c = DatasetUsage("c", 3.0, {"w": 10}, in_use=True)
    new = DatasetUsage("new", 4.0, {"v": 10})
    assert cache_bytes([a, b, c, new]) == 50
    plan = plan_eviction([a, b, c, new], 40, keep="new")
    assert plan.evict == ("a",) and plan.freed_objects == ("x",) and plan.total_bytes == 40
    plan = plan_eviction([a, b, c, new], 20, keep="new")
    assert plan.evict == ("a", "b") and plan.total_bytes == 20
    plan = plan_eviction([a, b, c, new], 0, keep="new")
    assert plan.evict == ("a", "b") and plan.total_bytes == 20  # c in use, new kept
    assert plan_eviction([a, b], 100).evict == ()
    assert shards_over_limit(45, 20, [("v", 10), ("u", 10), ("s", 10)], shared={"s"}) == {"u", "v"}
    assert shards_over_limit(15, 20, [("v", 10)]) == set()


# -- identity, privacy, refusals -----------------------------------------------------------
def test_shard_keys_change_with_any_part_of_the_identity(tmp_path: Path) -> None:
    base = shard_key(f"{tmp_path}/a.tar", 10, "1:2:3", None)
    assert base == shard_key(f"file://{tmp_path}/x/../a.tar", 10, "1:2:3", None)
    others = {
        shard_key(f"{tmp_path}/b.tar", 10, "1:2:3", None),
        shard_key(f"{tmp_path}/a.tar", 11, "1:2:3", None),
        shard_key(f"{tmp_path}/a.tar", 10, "1:2:4", None),
        shard_key(f"{tmp_path}/a.tar", 10, "1:2:3", "xxh3_64:ab"),
    }
    assert base not in others and len(others) == 4
    assert shard_key("http://h/a.tar", 10, None, None) is None  # nothing would tell a change
    assert shard_key("http://h/a.tar", 10, None, "sha256:00") is not None
    assert shard_key("http://h/a.tar", None, "v", None) is None


def test_the_cache_is_private_and_refuses_what_is_not_its_own(tmp_path: Path) -> None:
    ShardCache.open(tmp_path / "mine")
    assert (tmp_path / "mine" / "CACHEDIR.TAG").is_file()
    (tmp_path / "mine").chmod(0o755)
    ShardCache.open(tmp_path / "mine")  # an existing cache is made private again
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and not a stager cache"):
        ShardCache.open(home)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    with pytest.raises(UnsafePath, match="symlink"):
        ShardCache.open(tmp_path / "link")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 4242, 4242)
        with pytest.raises(UnsafePath, match="owned by uid 4242"):
            ShardCache.open(theirs)


def test_cache_with_fanout_is_refused(capsys, tmp_path: Path, monkeypatch) -> None:
    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SPEC)
    result = run_main(
        capsys,
        "stage-in",
        str(src),
        "--dest",
        str(tmp_path / "d"),
        "--cache",
        str(tmp_path / "c"),
        "--fanout",
    )
    assert result.returncode == EXIT_USAGE and "--cache does not combine with --fanout" in (
        result.stderr
    )


def test_no_cache_ignores_the_environment(capsys, tmp_path: Path, monkeypatch) -> None:
    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SPEC)
    monkeypatch.setenv("STAGER_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("STAGER_CACHE_LIMIT", "banana")  # (not read: no cache is used)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "d"), "--no-cache")
    assert result.returncode == 0 and not (tmp_path / "c").exists()
    monkeypatch.delenv("STAGER_CACHE_LIMIT")
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "e"))
    assert result.returncode == 0 and (tmp_path / "c" / "CACHEDIR.TAG").exists()


def test_locks_shared_exclusive_and_held(tmp_path: Path) -> None:
    path = tmp_path / "l.lock"
    one, two = FileLock(path, shared=True), FileLock(path, shared=True)
    assert one.acquire() and two.acquire(blocking=False)
    assert lock_is_held(path)
    assert not FileLock(path).acquire(blocking=False)
    one.release()
    two.release()
    assert not lock_is_held(path) and not lock_is_held(tmp_path / "missing.lock")
    # A lock file removed while held: a newcomer locks the new file, never the removed one.
    held = FileLock(path)
    held.acquire()
    path.unlink()
    fresh = FileLock(path)
    assert fresh.acquire(blocking=False)
    fresh.release()
    held.release()


# -- a cache that cannot take more never fails a staging -----------------------------------
def test_a_cache_disk_too_small_stages_uncached(capsys, tmp_path: Path, counted: Path) -> None:
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    with mount_tmpfs(tmp_path / "cachefs", "64k") as cachefs:
        report = _stage(capsys, f"countfile://{src}", tmp_path / "job1", cachefs / "cache")
        assert "not enough free space on the cache's filesystem" in report["stderr"]
        assert _read_bytes(counted) == report["bytes_read_source"] == _total(src)
        _assert_identical(src, tmp_path / "job1" / "ds")


def test_a_cache_that_fails_is_left_aside_with_a_warning(
    capsys, tmp_path: Path, counted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    monkeypatch.setattr(ShardCache, "register", full)
    report = _stage(capsys, f"countfile://{src}", tmp_path / "job1", tmp_path / "cache")
    assert "cannot be used (No space left on device): copying without it" in report["stderr"]
    assert report["files_copied"] == 6 and report["files_from_cache"] == 0
    _assert_identical(src, tmp_path / "job1" / "ds")


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_kill_9_while_filling_the_cache_then_a_new_job(
    capsys, tmp_path: Path, counted: Path, seed: int
) -> None:
    """SIGKILL a filling stage-in at a random moment: whatever the cache then serves is whole."""
    import random
    import signal

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    argv = [str(BIN / "stage-in"), str(src), "--dest", str(tmp_path / "killed"), "--quiet"]
    argv += ["--cache", str(cache), "--bw-limit", "0.5", "--jobs", "3", "--jitter-max", "0"]
    proc = subprocess.Popen(argv, env=clean_env(), stderr=subprocess.DEVNULL)
    time.sleep(random.Random(seed).uniform(0.05, 1.2))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Every object the cache would serve (a record that matches it) holds its source's bytes.
    served = {}
    for record_path in (cache / "objects").rglob("*.json") if cache.exists() else []:
        record = json.loads(record_path.read_text())
        obj = record_path.with_suffix("")
        if obj.exists() and obj.stat().st_ino == record["ino"]:
            assert obj.read_bytes() == Path(record["url"]).read_bytes(), f"seed {seed}"
            served[record["url"]] = record["size"]
    report = _stage(capsys, src, tmp_path / "next", cache)
    _assert_identical(src, tmp_path / "next" / "ds")
    assert report["files_from_cache"] == len(served), f"seed {seed}"
    assert report["bytes_read_source"] == _total(src) - sum(served.values()), f"seed {seed}"


def test_a_cached_dataset_is_checked_with_a_stat_per_shard_not_a_record_read(
    capsys, tmp_path: Path, counted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 small record reads from a cold disk cost more than the rest of a cached staging."""
    from stager.cache.records import ObjectRecord

    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    cache = tmp_path / "cache"
    _stage(capsys, f"countfile://{src}", tmp_path / "job1", cache)
    reads = []
    real = ObjectRecord.read.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        ObjectRecord, "read", classmethod(lambda cls, p: reads.append(p) or real(cls, p))
    )
    second = _stage(capsys, f"countfile://{src}", tmp_path / "job2", cache)
    assert second["files_from_cache"] == 6 and reads == []


def test_a_corrupt_shard_served_from_the_cache_leaves_the_report_consistent(
    capsys, tmp_path: Path
) -> None:
    """Unstaged as corrupt, a shard placed from the cache stayed in the report's "from the
    cache" (3 from the cache beside 2 copied)."""
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    victim = sorted(src.glob("*.tar"))[1]
    with open(victim, "r+b") as handle:
        handle.truncate(9000)
    cache = tmp_path / "cache"
    reports = []
    for job in ("job1", "job2"):  # filled by the first, served by the second
        report = tmp_path / f"{job}.json"
        argv = ["stage-in", str(src), "--dest", str(tmp_path / job), "--cache", str(cache)]
        result = run_main(capsys, *argv, "--quiet", "--jitter-max", "0", "--report", str(report))
        assert result.returncode == EXIT_INTEGRITY, result.stderr
        reports.append(json.loads(report.read_text()))
    served = reports[1]
    assert served["files_failed"] == 1 and served["files_copied"] == SPEC.num_shards - 1
    assert served["files_from_cache"] == served["files_copied"]
    assert served["bytes_from_cache"] == served["bytes_copied"]


def test_jobs_opening_a_new_cache_together_do_not_refuse_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job wrote the tag (and its first directories) between this job's look for the
    tag and its look at the root: the root is a cache now, not a foreign directory. (CI caught
    this under load: one of four concurrent jobs refused the cache the others had just made.)"""
    from stager.cache.paths import CacheLayout

    root = tmp_path / "cache"
    real_is_file = Path.is_file
    looks: list[Path] = []

    def first_look_misses(self: Path) -> bool:
        if self.name == "CACHEDIR.TAG" and not looks:
            looks.append(self)
            ShardCache.open(root)  # the other job, in between
            return False
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", first_look_misses)
    root.mkdir(mode=0o700)
    ShardCache.open(root)  # must not raise "not empty and not a stager cache"
    assert looks and CacheLayout(root).objects_dir.is_dir()
