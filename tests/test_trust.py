"""A staged file is the source's current bytes, or the run fails: one test per reported defect.

Each test is named after the numbered defect it reproduces (see docs/reliability.md); each
failed on the code before the fix. The property test over random trees and runs is in
tests/test_trust_property.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from stager.errors import (
    EXIT_DEST,
    EXIT_FULL,
    EXIT_INTEGRITY,
    EXIT_LOCK,
    EXIT_SOURCE,
    EXIT_USAGE,
    IntegrityError,
    UsageError,
)
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sourceset import SourceShard, unique_shards

from .conftest import BIN, clean_env, mount_tmpfs, run_cli
from .inproc import clean_process_env, run_main
from .trees import tar_bytes

FAST = ["--jitter-max", "0", "--quiet", "--retry-delay", "0.01"]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


def write_shard(path: Path, fill: bytes, samples: int = 3, size: int = 600) -> Path:
    """A real tar shard whose members are all ``fill`` bytes (so two shards tell apart)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            data = fill * size
            info = tarfile.TarInfo(f"{path.stem}-{i:04d}.bin")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())
    return path


def staged_manifest(dataset_dir: Path) -> Manifest:
    return Manifest.read(StagedDataset.of(dataset_dir).manifest_path)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if "error:" in line]


# -- 1. two shards mapping to one path; duplicates ------------------------------------------------
def test_1_backslash_and_slash_names_stay_two_shards(tmp_path: Path, capsys) -> None:
    a = write_shard(tmp_path / "coll" / "x\\y.tar", b"A")
    b = write_shard(tmp_path / "coll" / "x" / "y.tar", b"B")
    dest = tmp_path / "d4"
    for _ in range(2):  # and the rerun keeps both as they are
        result = run_main(capsys, "stage-in", str(tmp_path / "coll"), "--dest", str(dest), *FAST)
        assert result.returncode == 0, result.stderr
    staged = dest / "coll"
    assert (staged / "x\\y.tar").read_bytes() == a.read_bytes()
    assert (staged / "x" / "y.tar").read_bytes() == b.read_bytes()
    assert sorted(e.relpath for e in staged_manifest(staged).entries) == ["x/y.tar", "x\\y.tar"]


@pytest.mark.parametrize("how", ["list", "brace"])
def test_1_a_shard_named_twice_is_staged_and_served_once(tmp_path: Path, capsys, how: str) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    for i in (0, 1):
        write_shard(tmp_path / "big" / f"s{i}.tar", bytes([65 + i]))
    if how == "list":
        listing = tmp_path / "list.txt"
        s0, s1 = tmp_path / "big" / "s0.tar", tmp_path / "big" / "s1.tar"
        listing.write_text(f"{s0}\n{s0}\n{s1}\n")
        spec = ["--from-list", str(listing)]
        urls: list[str] | str = [str(s0), str(s0), str(s1)]
    else:
        spec = [str(tmp_path / "big" / "s{0,0,1}.tar")]
        urls = spec[0]
    dest = tmp_path / "scratch"
    for _ in range(2):
        result = run_main(capsys, "stage-in", *spec, "--dest", str(dest), *FAST)
        assert result.returncode == 0 and "FAILED" not in result.stderr, result.stderr
    assert [e.relpath for e in staged_manifest(dest / "big").entries] == ["s0.tar", "s1.tar"]
    loader = ShardedLoader(
        urls, batch_size=2, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
    )
    keys = [k for (batch,) in loader for k in batch]
    assert len(keys) == 6 == len(set(keys))  # 3 samples per shard, each served once


def test_1_two_files_landing_on_one_path_are_refused_naming_both() -> None:
    a = SourceShard("/r/a/./x.tar", "/r/a/./x.tar", "a/x.tar", 1)
    same = SourceShard("/r/a/x.tar", "/r/a/x.tar", "a/x.tar", 1)
    other = SourceShard("/r/b/x.tar", "/r/b/x.tar", "a/x.tar", 1)
    assert unique_shards([a, same]) == (a,)  # one file named twice: one shard
    with pytest.raises(UsageError, match=r"/r/a/\./x\.tar.*/r/b/x\.tar"):
        unique_shards([a, other])
    # An object store's keys are exact: "r/a/./x.tar" and "r/a/x.tar" are two objects
    with pytest.raises(UsageError, match=r"/r/a/\./x\.tar.*/r/a/x\.tar"):
        unique_shards([a, same], exact=True)
    # ... and a key can name a file another key needs as a directory
    inner = SourceShard("s3://b/a/x.tar/y.tar", "b/a/x.tar/y.tar", "a/x.tar/y.tar", 1)
    with pytest.raises(UsageError, match=r"'a/x\.tar' would be a file and a directory"):
        unique_shards([same, inner], exact=True)


# -- 2. a staged copy is recognised by its identity, not its name ---------------------------------
def _two_sources(tmp_path: Path) -> tuple[Path, Path]:
    for name, fill in (("A", b"a"), ("B", b"b")):
        for i in range(4):
            write_shard(tmp_path / name / "train" / f"train-{i}.tar", fill + bytes([48 + i]))
    return tmp_path / "A" / "train", tmp_path / "B" / "train"


def test_2_another_source_under_the_same_name_is_refused(tmp_path: Path, capsys) -> None:
    a, b = _two_sources(tmp_path)
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(a), "--dest", str(dest), *FAST).returncode == 0
    result = run_main(capsys, "stage-in", str(b), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_USAGE
    (line,) = error_lines(result.stderr)
    assert str(a) in line and str(b) in line and "--name" in line
    for i in range(4):  # A's copy stays A's, and says so
        name = f"train-{i}.tar"
        assert (dest / "train" / name).read_bytes() == (a / name).read_bytes()
    assert staged_manifest(dest / "train").meta["source"] == str(a)


def test_2_a_task_waiting_on_another_sources_copier_does_not_adopt_its_result(
    tmp_path: Path,
) -> None:
    a, b = _two_sources(tmp_path)
    dest = tmp_path / "scratch"
    slow = subprocess.Popen(
        [str(BIN / "stage-in"), str(a), "--dest", str(dest), "--bw-limit", "0.002", *FAST],
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    lock = StagedDataset(dest, "train").lock_path
    deadline = time.monotonic() + 30
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    waiter = run_cli("stage-in", str(b), "--dest", str(dest), *FAST, timeout=120)
    slow.communicate(timeout=120)
    assert slow.returncode == 0
    assert waiter.returncode == EXIT_USAGE, (
        waiter.stderr
    )  # it waited, then refused; adopted nothing
    assert all(
        (dest / "train" / f"train-{i}.tar").read_bytes() == (a / f"train-{i}.tar").read_bytes()
        for i in range(4)
    )


def test_2_restaging_a_subset_under_the_same_name_is_refused(tmp_path: Path, capsys) -> None:
    a, _ = _two_sources(tmp_path)
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(a), "--dest", str(dest), *FAST).returncode == 0
    subset = run_main(capsys, "stage-in", f"{a}/train-{{0,1}}.tar", "--dest", str(dest), *FAST)
    assert subset.returncode == EXIT_USAGE, subset.stderr
    assert len(staged_manifest(dest / "train").entries) == 4  # not silently replaced by 2


def test_2_a_shard_rewritten_at_the_same_size_and_mtime_is_copied_again(
    tmp_path: Path, capsys
) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4))
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    victim = src / "train-000001.tar"
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload: same size, other bytes
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p / rsync -a would
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    assert (dest / "ds" / victim.name).read_bytes() == bytes(data)


def test_2_a_shard_published_but_not_recorded_by_a_killed_run_goes_once_the_source_drops_it(
    tmp_path: Path, capsys
) -> None:
    """A kill between a run's renames and its journal line leaves final-named shards no record
    names. Once the source dropped them, a rerun left them staged for good (only recorded
    files were removed): final-named files that are no source shard's bytes. Now a rerun
    removes staged shards that neither a record nor the source names; other names stay."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4))
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    staged = dest / "ds"
    dropped = staged / "sub" / "train-000009.tar"  # (as a killed run's rename left it)
    dropped.parent.mkdir()
    shutil.copyfile(src / "train-000001.tar", dropped)
    (staged / "notes.txt").write_text("not a shard: never touched")
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    assert not dropped.exists()
    assert (staged / "notes.txt").exists()
    assert sorted(p.name for p in staged.glob("*.tar")) == sorted(p.name for p in src.glob("*.tar"))


def test_2_outside_a_job_stage_in_says_where_it_staged(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    env = clean_env(TMPDIR=str(tmp_path))
    result = run_cli("stage-in", str(src), "--quiet", env=env)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "note:" in line]
    from stager.storage.dest import _user  # ($USER, else $LOGNAME, else the login name)

    expected = tmp_path / f"stager-{_user(env)}"
    assert len(notes) == 1 and str(expected) in notes[0], (notes, expected)
    assert "outlives this run" in notes[0]


# -- 3. the loader reads the dataset it was staged from, whatever its working directory ------------
def test_3_a_missing_staged_shard_is_read_from_the_staged_source_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stager_loaders import ShardedLoader

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    write_synthetic_dataset(here / "ds1", SyntheticSpec(num_shards=3, samples_per_shard=4, seed=1))
    write_synthetic_dataset(
        elsewhere / "ds1", SyntheticSpec(num_shards=3, samples_per_shard=4, seed=2, prefix="train")
    )
    dest = tmp_path / "scratch"
    result = run_cli("stage-in", "ds1", "--dest", str(dest), *FAST, cwd=here)
    assert result.returncode == 0, result.stderr
    (dest / "ds1" / "train-000002.tar").unlink()
    monkeypatch.chdir(elsewhere)  # its own ds1/ must not be read
    loader = ShardedLoader(str(dest / "ds1"), batch_size=4, decode="rgb8", to_tuple=("npy",))
    missing = [s for s in loader.shards.shards if s.from_source]
    assert [s.location for s in missing] == [str(here / "ds1" / "train-000002.tar")]


# -- 4. stage-out decides "same content" from the bytes ------------------------------------------
def test_4_a_checkpoint_rewritten_at_the_same_size_and_mtime_is_committed_anew(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "scratch" / "step-1"
    ckpt.mkdir(parents=True)
    weights = ckpt / "weights.bin"
    weights.write_bytes(b"old" * 1000)
    dest = tmp_path / "persist"
    assert run_cli("stage-out", str(ckpt), str(dest)).returncode == 0
    before = weights.stat()
    weights.write_bytes(b"new" * 1000)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = run_cli("stage-out", str(ckpt), str(dest))
    assert again.returncode == 0, again.stderr
    assert "already committed" not in again.stderr
    assert (dest / "step-1" / "weights.bin").read_bytes() == b"new" * 1000
    fresh = run_cli("stage-out", str(ckpt), str(tmp_path / "fresh"))
    assert fresh.returncode == 0, fresh.stderr
    assert (tmp_path / "fresh" / "step-1" / "weights.bin").read_bytes() == b"new" * 1000


# -- 5. the template cannot lose a checkpoint without a word: tests/test_slurm_byo.py -------------


# -- 6. every check that exists is applied -------------------------------------------------------
def _indexed(tmp_path: Path, num_shards: int = 3) -> Path:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=num_shards, samples_per_shard=5))
    assert run_cli("stager", "index", str(src)).returncode == 0
    return src


def test_6_a_manifest_entry_missing_from_the_source_fails_naming_it(tmp_path: Path, capsys) -> None:
    src = _indexed(tmp_path)
    (src / "train-000001.tar").unlink()
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == EXIT_SOURCE
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "train-000001.tar" in failed[0] and "manifest" in failed[0]


@pytest.mark.parametrize("cache", [False, True])
def test_6_a_source_changed_after_indexing_fails_a_rerun_as_it_fails_a_first_run(
    tmp_path: Path, capsys, cache: bool
) -> None:
    """With a manifest, a rerun compared the staged copy with the manifest's hash only: a
    source rewritten since (a plain cp over it, same size) left the old bytes staged, exit 0,
    where a first run of the same source fails the shard (exit 4). A staged copy is kept only
    while its source is the version it was copied from: the rerun fails it too, and the stale
    copy is gone."""
    src = _indexed(tmp_path)
    extra = ["--cache", str(tmp_path / "cache")] if cache else []
    dest = tmp_path / "s"
    first = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST, *extra)
    assert first.returncode == 0, first.stderr
    for shard in src.glob("*.tar"):  # (a chmod keeps the bytes: nothing is copied again)
        shard.chmod(0o640)
    report = tmp_path / "r.json"
    again = run_main(
        capsys, "stage-in", str(src), "--dest", str(dest), *FAST, *extra, "--report", str(report)
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(report.read_text())["files_copied"] == 0
    victim = src / "train-000000.tar"
    shutil.copyfile(src / "train-000001.tar", victim)  # (the same size: synthetic shards are)
    for target in (dest, tmp_path / "fresh"):
        result = run_main(capsys, "stage-in", str(src), "--dest", str(target), *FAST, *extra)
        assert result.returncode == EXIT_INTEGRITY, result.stderr
        failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
        assert len(failed) == 1 and victim.name in failed[0], result.stderr
        assert not (target / "ds" / victim.name).exists()
        kept = target / "ds" / "train-000002.tar"
        assert kept.read_bytes() == (src / "train-000002.tar").read_bytes()


def test_6_a_wrong_sample_count_fails_stage_in_and_the_loader_keeps_the_good_shards(
    tmp_path: Path, capsys
) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    src = _indexed(tmp_path)
    manifest = src / "stager-manifest.json"
    payload = json.loads(manifest.read_text())
    payload["shards"][1]["samples"] = 2  # the shard holds 5
    manifest.write_text(json.dumps(payload))
    dest = tmp_path / "s"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_INTEGRITY
    assert "train-000001.tar" in result.stderr and "5 samples" in result.stderr
    assert not (dest / "ds" / "train-000001.tar").exists()  # never published under its name
    with pytest.raises(IntegrityError, match="corrupt"):
        ShardedLoader(
            str(src), batch_size=5, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
        )
    skip = LoaderOptions(dest=str(dest), on_error="skip")
    loader = ShardedLoader(str(src), batch_size=5, to_tuple=("__key__",), options=skip)
    assert sum(len(b) for (b,) in loader) == 10  # the two good shards, whole


def test_6_a_shard_that_failed_its_hash_is_not_read_from_the_source(tmp_path: Path, capsys) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    src = _indexed(tmp_path)
    victim = src / "train-000002.tar"
    data = bytearray(victim.read_bytes())
    data[700] ^= 0xFF
    victim.write_bytes(bytes(data))
    dest = tmp_path / "s"
    assert (
        run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode
        == EXIT_INTEGRITY
    )
    with pytest.raises(IntegrityError, match="on_error='skip'"):
        ShardedLoader(
            str(src), batch_size=5, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
        )
    loader = ShardedLoader(
        str(src),
        batch_size=5,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(dest), on_error="skip"),
    )
    assert loader.shards.from_source == 0 and len(loader.shards.shards) == 2


def test_6_a_corrupt_shard_stays_refused_after_a_later_run_fails_early(
    tmp_path: Path, capsys
) -> None:
    """The record that a shard was corrupt lived only in the last result file: a run that then
    failed before copying (scratch too full) rewrote it without the shard, and the loader
    trained on the rest without a word."""
    from stager_loaders import LoaderOptions, ShardedLoader

    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=5))
    with open(src / "train-000001.tar", "r+b") as handle:
        handle.truncate(9000)
    dest = tmp_path / "s"
    stage = ["stage-in", str(src), "--dest", str(dest), *FAST]
    assert run_main(capsys, *stage).returncode == EXIT_INTEGRITY
    assert run_main(capsys, *stage, "--min-free", "100000T").returncode == EXIT_FULL
    with pytest.raises(IntegrityError, match="train-000001.tar"):
        ShardedLoader(str(src), batch_size=5, options=LoaderOptions(dest=str(dest)))
    skip = LoaderOptions(dest=str(dest), on_error="skip")
    loader = ShardedLoader(str(src), batch_size=5, to_tuple=("__key__",), options=skip)
    assert loader.skipped_shards == ["train-000001.tar"] and loader.shards.from_source == 0
    (src / "train-000001.tar").unlink()  # fixed at the source: the next run clears the record
    write_synthetic_dataset(tmp_path / "fixed", SyntheticSpec(num_shards=3, samples_per_shard=5))
    shutil.copy(tmp_path / "fixed" / "train-000001.tar", src / "train-000001.tar")
    assert run_main(capsys, *stage).returncode == 0
    loader = ShardedLoader(str(src), batch_size=5, options=LoaderOptions(dest=str(dest)))
    assert loader.skipped_shards == [] and len(loader.shards.relpaths) == 3


# -- 7. no hang ---------------------------------------------------------------------------------
def test_7_a_fifo_named_like_a_shard_is_skipped_with_a_warning(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    os.mkfifo(src / "pipe.tar")
    for extra in ([], ["--subset", "node"]):  # walked without and with sizes first
        result = run_cli(
            "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST, *extra, timeout=60
        )
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "warning" in line]
        assert (
            len(warnings) == 1 and "pipe.tar" in warnings[0] and "not a regular file" in warnings[0]
        )
    assert not (tmp_path / "s" / "ds" / "pipe.tar").exists()


def test_7_a_source_of_only_fifos_and_broken_links_is_no_shards_not_success(
    tmp_path: Path,
) -> None:
    """Staging nothing and exiting 0 looked like success; `stager index` refused the same."""
    src = tmp_path / "ds"
    src.mkdir()
    os.symlink(tmp_path / "nowhere.tar", src / "gone.tar")
    os.mkfifo(src / "pipe.tar")
    listed = tmp_path / "list.txt"
    listed.write_text(f"{src / 'gone.tar'}\n{src / 'pipe.tar'}\n")
    named = {
        "directory, streamed first run": [str(src)],
        "glob": [str(src / "*.tar")],
        "list": ["--from-list", str(listed)],
        "directory, sized first (--subset node)": [str(src), "--subset", "node"],
        "directory, a staged copy there": [str(src)],  # listed before copying
    }
    for n, (how, spec) in enumerate(named.items()):
        dest = tmp_path / f"s{n}"
        if how == "directory, a staged copy there":  # staged, then the shard broke
            shutil.move(src / "gone.tar", tmp_path / "gone.tar.away")
            write_synthetic_dataset(tmp_path / "one", SyntheticSpec(num_shards=1))
            shutil.copy(tmp_path / "one" / "train-000000.tar", src / "gone.tar")
            assert run_cli("stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
            (src / "gone.tar").unlink()
            shutil.move(tmp_path / "gone.tar.away", src / "gone.tar")
        result = run_cli("stage-in", *spec, "--dest", str(dest), *FAST, timeout=60)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert result.returncode == EXIT_SOURCE, (how, result.stderr)
        assert len(errors) == 1 and "no shards to stage" in errors[0], (how, result.stderr)
        assert "gone.tar" in errors[0] and "1 more are not regular files" in errors[0], how
        if how != "directory, a staged copy there":
            assert not list(dest.rglob("*.tar*")), how
    (src / "gone.tar").unlink()
    os.symlink(tmp_path / "nowhere.tar", src / "gone.tar")
    indexed = run_cli("stager", "index", str(src), timeout=60)
    assert indexed.returncode == EXIT_SOURCE, indexed.stderr
    assert "gone.tar' and 1 more are not regular files" in indexed.stderr


def test_7_a_hung_lock_holder_makes_waiters_exit_8(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    dest = tmp_path / "s"
    lock = StagedDataset(dest, "ds").lock_path
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = run_cli("stage-in", str(src), "--dest", str(dest), *FAST, "--lock-timeout", "1")
    finally:
        holder.kill()
        holder.communicate()
    assert result.returncode == EXIT_LOCK
    (line,) = error_lines(result.stderr)
    assert "without progress" in line and "--lock-timeout" in line


def test_7_a_copier_shows_progress_within_one_slow_shard(tmp_path: Path) -> None:
    """Waiters (``--lock-timeout``, the loader's ``copier_stall_s``) take a lock file untouched
    for long for a hung copier. It was touched only when a shard was done, so one large shard
    copied at a capped rate looked hung for as long as it took: its lock is touched while its
    bytes arrive, before the shard has its final name."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "big.tar").write_bytes(tar_bytes([("s0.bin", os.urandom(12 << 20))]))
    dest = tmp_path / "s"
    staged = StagedDataset(dest, "ds")
    final, partial = staged.dir / "big.tar", staged.dir / "big.tar.partial"
    copier = subprocess.Popen(
        [str(BIN / "stage-in"), str(src), "--dest", str(dest), "--bw-limit", "3", *FAST],
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    touched_before_publish = False
    try:
        deadline = time.monotonic() + 60
        while not partial.exists() and not final.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        started = staged.lock_path.stat().st_mtime_ns  # (the copy has begun)
        while copier.poll() is None and time.monotonic() < deadline:
            touched = staged.lock_path.stat().st_mtime_ns != started
            if touched and not final.exists():  # (read in this order: touched before publish)
                touched_before_publish = True
                break
            time.sleep(0.05)
        _, err = copier.communicate(timeout=120)
    finally:
        if copier.poll() is None:
            copier.kill()
            copier.communicate()
    assert copier.returncode == 0, err
    assert touched_before_publish
    assert final.read_bytes() == (src / "big.tar").read_bytes()


# -- 8. numbers that are not numbers ------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["stage-out", "ck", "dest", "--watch", "--interval", "nan"],
        ["stage-in", "ds", "--jitter-max", "nan"],
        ["stage-in", "ds", "--jitter-max", "inf"],
        ["stage-in", "ds", "--bw-limit", "nan"],
        ["stage-in", "ds", "--bw-limit", "1e-300"],
        ["stage-in", "ds", "--min-free", "-1"],
        ["stage-out", "ck", "dest", "--deadline-s", "inf"],
        ["stage-in", "ds", "--lock-timeout", "0"],
    ],
)
def test_8_non_numbers_and_absurd_values_are_usage_errors_at_parse_time(
    tmp_path: Path, argv: list[str]
) -> None:
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == EXIT_USAGE
    assert len(result.stderr.strip().splitlines()) == 1 and argv[-2] in result.stderr


# -- 9. one line and the documented code, never a traceback --------------------------------------
def test_9_report_on_a_full_scratch_keeps_exit_6_and_leaves_no_partial(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=4, samples_per_shard=20, image_bytes=20_000)
    )
    with mount_tmpfs(tmp_path / "tmpfs", "512k") as scratch:
        fd = os.open(scratch / "filler", os.O_WRONLY | os.O_CREAT)  # another writer took it all
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        result = run_cli(
            "stage-in",
            str(src),
            "--dest",
            str(scratch / "job"),
            *FAST,
            "--report",
            str(scratch / "r.json"),
        )
        assert result.returncode == EXIT_FULL
        assert len(error_lines(result.stderr)) == 1
        assert not [p for p in scratch.rglob("*") if p.name.endswith(".partial")]


def test_9_report_naming_a_directory_is_one_line(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    result = run_main(
        capsys,
        "stage-in",
        str(src),
        "--dest",
        str(tmp_path / "s"),
        *FAST,
        "--report",
        str(tmp_path),
    )
    assert result.returncode == EXIT_DEST
    (line,) = error_lines(result.stderr)
    assert "report" in line and str(tmp_path) in line


def test_9_a_read_only_destination(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    with mount_tmpfs(tmp_path / "tmpfs", "4m") as scratch:
        assert run_cli("stage-in", str(src), "--dest", str(scratch), *FAST).returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(scratch)], check=True)
        # Everything is staged: the read-only copy is verified and used as it is.
        again = run_cli("stage-in", str(src), "--dest", str(scratch), *FAST)
        assert again.returncode == 0, again.stderr
        # Something to copy: one line, exit 5.
        write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=2))
        more = run_cli("stage-in", str(src), "--dest", str(scratch), *FAST)
        assert more.returncode == EXIT_DEST
        assert len(error_lines(more.stderr)) == 1
        restore = run_cli(
            "stage-in", "--checkpoint", str(tmp_path / "ckpts"), "--dest", str(scratch)
        )
        assert restore.returncode in (EXIT_DEST, 9), restore.stderr  # never a traceback
        assert "Traceback" not in restore.stderr


def test_9_a_source_directory_named_like_a_partial_file(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src / "x.partial", SyntheticSpec(num_shards=2, samples_per_shard=2))
    for _ in range(2):
        result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
        assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "s" / "ds" / "x.partial").glob("*.tar"))) == 2


# -- 10. smaller --------------------------------------------------------------------------------
def test_10_a_loader_index_that_does_not_fit_leaves_no_partial(tmp_path: Path) -> None:
    import numpy as np

    from stager.shards.arrayfile import write_arrays

    with mount_tmpfs(tmp_path / "tmpfs", "256k") as scratch:
        with pytest.raises(OSError):
            write_arrays(
                scratch / "index" / "dataset.index", {"a": np.zeros(1 << 20, np.uint8)}, {}
            )
        assert [p.name for p in scratch.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("streaming", [False, True])
def test_10_a_member_named_twice_in_one_sample_is_refused_not_dropped(
    tmp_path: Path, capsys, streaming: bool
) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    src = tmp_path / "ds"
    write_shard(src / "good.tar", b"g")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for fill in (b"1", b"2"):  # two members called k0.bin in the one sample k0
            info = tarfile.TarInfo("k0.bin")
            info.size = 600
            tar.addfile(info, io.BytesIO(fill * 600))
    (src / "twice.tar").write_bytes(buffer.getvalue())
    # the loader reading the source refuses it, naming the member
    with pytest.raises(IntegrityError, match=r"twice.tar.*k0\.bin.*twice"):
        source = LoaderOptions(dest=str(tmp_path / "none"), force_streaming=streaming)
        list(ShardedLoader(str(src), batch_size=2, to_tuple=("__key__",), options=source))
    # stage-in fails it as corrupt (exit 4), as the loader would, and stages the other
    dest = tmp_path / "s"
    staged = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert staged.returncode == EXIT_INTEGRITY
    assert "member 'k0.bin' appears twice in one sample" in staged.stderr
    options = LoaderOptions(dest=str(dest), force_streaming=streaming)
    with pytest.raises(IntegrityError, match=r"twice.tar"):
        list(ShardedLoader(str(src), batch_size=2, to_tuple=("__key__",), options=options))
    skip = LoaderOptions(dest=str(dest), force_streaming=streaming, on_error="skip")
    loader = ShardedLoader(str(src), batch_size=2, to_tuple=("__key__",), options=skip)
    assert sorted(k for (batch,) in loader for k in batch) == [f"good-{i:04d}" for i in range(3)]


def test_10_a_destination_inside_the_source_is_refused_before_anything_is_created(
    tmp_path: Path, capsys
) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    result = run_main(capsys, "stage-in", str(src), "--dest", str(src / "scratch"), *FAST)
    assert result.returncode == EXIT_USAGE
    assert not (src / "scratch").exists()


def test_10_a_name_with_a_newline_cannot_split_a_message(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=1, samples_per_shard=2))
    os.mkfifo(src / "odd\nname.tar")
    result = run_cli("stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert sum("warning" in line for line in lines) == 1
    assert not any(line.startswith("name.tar") for line in lines)


def test_10_min_free_refusals_say_what_is_needed(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=1, samples_per_shard=2))
    free = shutil.disk_usage(tmp_path).free
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST, "--min-free", str(free)
    )
    assert result.returncode == EXIT_FULL
    assert "need 0 B" not in result.stderr and "need " in result.stderr


def test_10_an_unknown_hash_algorithm_in_a_manifest_is_a_usage_error(
    tmp_path: Path, capsys
) -> None:
    src = _indexed(tmp_path)
    manifest = src / "stager-manifest.json"
    payload = json.loads(manifest.read_text())
    payload["shards"][0]["hash"] = "md7:abcd"
    manifest.write_text(json.dumps(payload))
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == EXIT_USAGE
    (line,) = error_lines(result.stderr)
    assert str(manifest) in line and "md7" in line


def test_10_an_existing_destination_keeps_its_mode(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=1, samples_per_shard=2))
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert run_main(capsys, "stage-in", str(src), "--dest", str(shared), *FAST).returncode == 0
    assert shared.stat().st_mode & 0o7777 == 0o1777
