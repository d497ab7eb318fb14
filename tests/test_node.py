"""``stager ls``, ``stager du`` and ``stager clean`` off the cluster: a fake ``squeue`` on PATH.

The real-Slurm check (``stager clean`` beside a running job) is in tests/test_slurm_cache.py;
here every rule of :mod:`stager.node.clean` is exercised against a scripted squeue, another
user's directory, a held lock, a symlink and read-only hard links from the cache.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stager.cache.keys import dataset_key
from stager.cache.locks import FileLock
from stager.cache.paths import CacheLayout
from stager.errors import EXIT_USAGE
from stager.node.clean import choose_job_dirs
from stager.node.inventory import JobDir, is_job_id, scan_scratch
from stager.node.jobs import JobStates, parse_squeue
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.units import human_duration, parse_duration

from .conftest import BIN
from .inproc import clean_process_env, run_main

SPEC = SyntheticSpec(num_shards=3, samples_per_shard=5, image_bytes=500, seed=2)

FAKE_SQUEUE = """#!/bin/sh
# the test's squeue: prints what the test wrote, exits as it says (PATH holds no cat)
/bin/cat "$FAKE_SQUEUE_OUT"
exit "${FAKE_SQUEUE_RC:-0}"
"""


@pytest.fixture()
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A scratch root, a cache, a dataset, and a scripted squeue first on PATH."""
    clean_process_env(monkeypatch)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "squeue").write_text(FAKE_SQUEUE)
    (fake / "squeue").chmod(0o755)
    out = tmp_path / "squeue.out"
    out.write_text("")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{BIN}")
    monkeypatch.setenv("FAKE_SQUEUE_OUT", str(out))
    monkeypatch.setenv("STAGER_SCRATCH_ROOT", str(tmp_path / "scratch"))
    monkeypatch.setenv("STAGER_CACHE", str(tmp_path / "scratch" / "cache-me"))
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SPEC)
    return {"scratch": tmp_path / "scratch", "src": src, "squeue": out, "fake": fake}


def _squeue(node: dict[str, Path], **states: str) -> None:
    node["squeue"].write_text("".join(f"{job} {state}\n" for job, state in states.items()))


def _stage(capsys, node: dict[str, Path], job: str, monkeypatch) -> Path:
    monkeypatch.setenv("SLURM_JOB_ID", job)
    try:
        result = run_main(capsys, "stage-in", str(node["src"]), "--quiet", "--jitter-max", "0")
    finally:
        monkeypatch.delenv("SLURM_JOB_ID")
    assert result.returncode == 0, result.stderr
    return node["scratch"] / job


def _stager(capsys, *args: str):
    import sys

    capsys.readouterr()
    from stager.cli.main import main

    code = main(list(args))
    out = capsys.readouterr()
    sys.stdout.flush()
    return code, out.out, out.err


def test_ls_lists_datasets_checkpoints_and_the_cache_per_job(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    running = _stage(capsys, node, "101", monkeypatch)
    (running / "checkpoints").mkdir()
    (running / "checkpoints" / "last.pt").write_bytes(b"x" * 1000)
    _stage(capsys, node, "102", monkeypatch)
    _squeue(node, **{"101": "RUNNING", "102": "COMPLETED"})
    code, out, _err = _stager(capsys, "ls")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "JOB", "STATE", "OWNER", "AGE", "SIZE", "NAME", "DETAIL"]
    assert all(line.startswith("node7 ") for line in lines[1:])
    table = [line.split() for line in lines[1:]]
    assert [(r[1], r[2], r[-1 if r[1] == "cache" else 7]) for r in table] == [
        ("101", "running", "checkpoints"),
        ("101", "running", "ds"),
        ("102", "ended", "ds"),
        ("cache", "in", "101)"),  # "in use", "used by job 101)"
    ]
    assert f"{node['src']} (3 shards" in out
    # The cache under the scratch root is not a job: only job ids are.
    assert "cache-me" not in {r[1] for r in table}
    code, out, _err = _stager(capsys, "ls", "--json", "--job", "102")
    rows = [json.loads(line) for line in out.splitlines()]
    ds = next(r for r in rows if r["where"] == "102")
    assert ds["kind"] == "dataset" and ds["shards"] == 3 and ds["state"] == "ended"
    assert ds["size_bytes"] >= sum(p.stat().st_size for p in node["src"].glob("*.tar"))


def test_cache_dataset_used_by_a_running_job_is_in_use(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    _stage(capsys, node, "101", monkeypatch)
    _squeue(node, **{"101": "RUNNING"})
    code, out, _err = _stager(capsys, "ls", "--json")
    cached = [json.loads(line) for line in out.splitlines() if '"cache"' in line]
    assert [(r["state"], r["jobs"]) for r in cached] == [("in use", ["101"])]
    _squeue(node, **{"101": "COMPLETED"})
    code, out, _err = _stager(capsys, "ls", "--json")
    cached = [json.loads(line) for line in out.splitlines() if '"cache"' in line]
    assert [(r["state"], r["jobs"]) for r in cached] == [("idle", [])]


def test_du_counts_hard_links_once_in_the_total(capsys, node: dict[str, Path], monkeypatch) -> None:
    one = _stage(capsys, node, "101", monkeypatch)
    _stage(capsys, node, "102", monkeypatch)
    _squeue(node)
    code, out, _err = _stager(capsys, "du", "--json")
    rows = {r["where"]: r for r in map(json.loads, out.splitlines())}
    shards = sum(p.stat().st_size for p in node["src"].glob("*.tar"))
    job = rows[str(one)]
    assert shards <= job["linked_bytes"] < job["size_bytes"]  # shards and index, linked
    assert rows[str(node["scratch"] / "cache-me")]["size_bytes"] > shards
    # Two jobs and the cache hold the same shard bytes: counted once in the total.
    assert rows["total"]["size_bytes"] < 2 * shards + rows[str(one)]["size_bytes"]
    assert rows["total"]["size_bytes"] >= shards
    code, out, _err = _stager(capsys, "du")
    assert out.splitlines()[-1].startswith("node7  total")


def test_clean_removes_ended_jobs_only(capsys, node: dict[str, Path], monkeypatch) -> None:
    running = _stage(capsys, node, "101", monkeypatch)
    ended = _stage(capsys, node, "102", monkeypatch)
    pending = _stage(capsys, node, "103", monkeypatch)  # requeued: pending, same id
    forgotten = _stage(capsys, node, "104", monkeypatch)  # gone from squeue altogether
    theirs = node["scratch"] / "105"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 4242, 4242)
    (node["scratch"] / "not-a-job").mkdir()
    (node["scratch"] / "106").symlink_to(ended)
    _squeue(node, **{"101": "RUNNING", "102": "COMPLETED", "103": "PENDING", "105": "FAILED"})
    code, out, err = _stager(capsys, "clean", "--dry-run")
    assert code == 0, err
    assert running.exists() and ended.exists() and forgotten.exists()
    assert f"would remove {ended} " in out and f"would remove {forgotten} " in out
    code, out, err = _stager(capsys, "clean")
    assert code == 0, err
    assert not ended.exists() and not forgotten.exists()  # read-only hard links: no obstacle
    assert running.is_dir() and pending.is_dir() and (node["scratch"] / "not-a-job").is_dir()
    assert f"kept {running}: job 101 is still running" in out
    assert f"kept {pending}: job 103 is still running" in out
    if os.geteuid() == 0:
        assert theirs.is_dir() and f"kept {theirs}: owned by uid 4242" in out
    assert (node["scratch"] / "106").is_symlink()  # never followed, never a job
    assert (node["scratch"] / "cache-me" / "CACHEDIR.TAG").is_file()  # the cache is not a job


def test_clean_keeps_a_directory_whose_lock_is_held(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    staged = _stage(capsys, node, "102", monkeypatch)
    _squeue(node)  # Slurm forgot the job, but a stage-in is running there right now
    with FileLock(staged / ".stager-ds.lock"):
        code, out, _err = _stager(capsys, "clean")
    assert code == 0 and staged.is_dir()
    assert "in use: .stager-ds.lock is locked by a running process" in out
    assert _stager(capsys, "clean")[0] == 0 and not staged.exists()


def test_without_slurm_nothing_goes_unless_older_than_says(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    staged = _stage(capsys, node, "102", monkeypatch)
    monkeypatch.setenv("FAKE_SQUEUE_RC", "1")  # squeue: cannot contact the controller
    code, _out, err = _stager(capsys, "clean")
    assert code == EXIT_USAGE and "cannot tell which jobs still run" in err and staged.is_dir()
    (node["fake"] / "squeue").unlink()  # no squeue at all
    code, _out, err = _stager(capsys, "clean")
    assert code == EXIT_USAGE and "squeue is not on PATH" in err and staged.is_dir()
    code, out, _err = _stager(capsys, "clean", "--older-than", "1h")
    assert code == 0 and staged.is_dir() and "Slurm cannot be asked" in out
    old = time.time() - 7200
    for path in [staged, *staged.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    code, out, _err = _stager(capsys, "clean", "--older-than", "1h")
    assert code == 0 and not staged.exists() and "unused for 2h" in out


def test_a_job_cleans_its_own_scratch_but_no_one_a_running_one(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    mine = _stage(capsys, node, "101", monkeypatch)
    other = _stage(capsys, node, "102", monkeypatch)
    _squeue(node, **{"101": "RUNNING", "102": "RUNNING"})
    code, _out, err = _stager(capsys, "clean", "--job", "102")
    assert code == EXIT_USAGE and "job 102 is still running" in err and other.is_dir()
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    code, out, _err = _stager(capsys, "clean", "--job", "101")
    assert code == 0 and not mine.exists() and "removed at its own request" in out
    code, out, _err = _stager(capsys, "clean", "--job", "101")
    assert code == 0 and "nothing to clean" in out
    assert _stager(capsys, "clean", "--job", "x1")[0] == EXIT_USAGE


def test_clean_cache_evicts_what_no_running_job_uses(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    _stage(capsys, node, "101", monkeypatch)
    other = node["src"].parent / "other"
    write_synthetic_dataset(other, SPEC)
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert run_main(capsys, "stage-in", str(other), "--quiet").returncode == 0
    monkeypatch.delenv("SLURM_JOB_ID")
    cache = node["scratch"] / "cache-me"
    # Debris of a killed filler: counted and removed with the evicted datasets' shards.
    (cache / "objects" / "ab").mkdir(exist_ok=True)
    (cache / "objects" / "ab" / ("ab" * 32 + ".partial")).write_bytes(b"half")
    _squeue(node, **{"101": "RUNNING"})
    code, out, err = _stager(capsys, "clean", "--cache")
    assert code == 0, err
    assert "evicted 'other' from the cache" in out
    assert "kept 'ds' in the cache: job 101, which staged it, is still running" in out
    assert "removed 3 cached shard(s)" in out
    objects = [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert len(objects) == 6  # ds's 3 shards and their records
    # Its stage-in holding it keeps a dataset too, whatever Slurm says.
    _squeue(node)
    layout = CacheLayout(cache)
    with FileLock(layout.dataset_lock(dataset_key(f"file://{node['src']}")), shared=True):
        code, out, _err = _stager(capsys, "clean", "--cache")
    assert "kept 'ds' in the cache: a stage-in is using it now" in out
    code, out, _err = _stager(capsys, "clean", "--cache")
    assert "evicted 'ds'" in out and not [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert _stager(capsys, "clean", "--cache", "--job", "1")[0] == EXIT_USAGE


# -- the pure parts ------------------------------------------------------------------------
def _job(job_id: str, *, uid: int = 1000, age_s: float = 0.0, locked: bool = False) -> JobDir:
    return JobDir(
        job_id,
        Path(f"/scratch/{job_id}"),
        uid,
        True,
        (),
        0,
        0,
        0,
        1_000_000.0 - age_s,
        (Path("/scratch/x.lock"),) if locked else (),
    )


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("older_than", [None, 3600.0])
@pytest.mark.parametrize("age_s", [60.0, 7200.0])
@pytest.mark.parametrize("state", ["running", "ended"])
@pytest.mark.parametrize("uid", [1000, 2000])
@pytest.mark.parametrize("locked", [False, True])
def test_clean_rules_over_every_combination(
    known: bool, older_than: float | None, age_s: float, state: str, uid: int, locked: bool
) -> None:
    states = (
        JobStates(frozenset({"1"} if state == "running" else set()))
        if known
        else JobStates(None, "no squeue")
    )
    [choice] = choose_job_dirs(
        [_job("1", uid=uid, age_s=age_s, locked=locked)],
        states=states,
        uid=1000,
        now=1_000_000.0,
        older_than_s=older_than,
    )
    may_run = not known or state == "running"
    want = (
        uid == 1000
        and not locked
        and (not known or state == "ended")
        and (older_than is None or age_s >= older_than)
        and (known or older_than is not None)
    )
    assert choice.remove == want, choice
    if may_run and known:
        assert not choice.remove  # a running job's data: never


def test_own_job_by_name_only() -> None:
    states = JobStates(frozenset({"1", "2"}))
    jobs = [_job("1"), _job("2")]
    kw = {"states": states, "uid": 1000, "now": 1_000_000.0, "own_job": "1"}
    assert [c.remove for c in choose_job_dirs(jobs, **kw)] == [False, False]
    assert [c.remove for c in choose_job_dirs(jobs, only_job="1", **kw)] == [True]
    assert [c.remove for c in choose_job_dirs(jobs, only_job="2", **kw)] == [False]


def test_squeue_output_durations_and_job_ids() -> None:
    alive = parse_squeue("1 RUNNING\n2 COMPLETED\n3 PENDING\n4 CANCELLED+\n5 COMPLETING\n6 WEIRD\n")
    assert alive == {"1", "3", "5", "6"}  # an unknown state is not an ended one
    assert JobStates(alive).running("2") is False and JobStates(None).running("2") is None
    assert parse_duration("2d") == 172800 and parse_duration("90") == 90
    assert parse_duration("1.5h") == 5400 and human_duration(7300) == "2h"
    for bad in ("2 days", "-1h", "nan", "1y", ""):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert is_job_id("1234") and not is_job_id("12a") and not is_job_id("cache")


def test_scan_ignores_what_is_not_a_job(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "ds").mkdir()
    (tmp_path / "12" / "ds" / "x.tar").write_bytes(b"1234")
    (tmp_path / "stager-cache").mkdir()
    (tmp_path / "7").write_text("a file")
    [job] = scan_scratch(tmp_path)
    assert job.job_id == "12" and job.size_bytes == 4
    assert [(i.name, i.kind) for i in job.items] == [("ds", "other")]
    assert scan_scratch(tmp_path / "missing") == []


def test_ls_counts_a_cached_dataset_by_the_objects_it_has(
    capsys, node: dict[str, Path], monkeypatch
) -> None:
    """A run names its shards when it starts; one killed or failed before filling them showed
    its dataset at full size, as if cached, until an eviction. ls now says what is there."""
    _stage(capsys, node, "101", monkeypatch)
    _squeue(node, **{"101": "COMPLETED"})
    cache = node["scratch"] / "cache-me"
    objects = sorted(p for p in (cache / "objects").rglob("*") if p.is_file() and "." not in p.name)
    assert len(objects) == 3
    full = next(
        json.loads(line)["size_bytes"]
        for line in _stager(capsys, "ls", "--json")[1].splitlines()
        if '"cache"' in line
    )
    gone = objects[0].stat().st_size
    objects[0].unlink()  # (as a fill that never happened)
    code, out, _err = _stager(capsys, "ls", "--json")
    [row] = [json.loads(line) for line in out.splitlines() if '"cache"' in line]
    assert (row["shards"], row["shards_cached"]) == (3, 2)
    assert row["size_bytes"] == full - gone
    code, out, _err = _stager(capsys, "ls")
    assert "(2 of 3 shards)" in out


@pytest.mark.parametrize("command", ["ls", "du", "clean"])
def test_a_scratch_root_that_is_not_there_is_said_and_a_file_refused(
    capsys, tmp_path: Path, command: str
) -> None:
    """A mistyped --scratch-root listed nothing, silently, with exit 0 (``clean`` asked Slurm
    first): now one line says there is no scratch root there, and a file there is exit 2."""
    missing = tmp_path / "scrach"
    extra = ["--older-than", "1d"] if command == "clean" else []
    code, out, err = _stager(capsys, command, "--scratch-root", str(missing), *extra)
    assert code == 0 and f"no scratch root at {missing}" in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    (tmp_path / "afile").write_text("")
    code, _, err = _stager(capsys, command, "--scratch-root", str(tmp_path / "afile"), *extra)
    assert code == EXIT_USAGE and "is not a directory" in err, err
