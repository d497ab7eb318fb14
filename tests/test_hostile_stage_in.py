"""Defects a hostile review of stage-in found (2026-11-28), each as it was reported: a source
inside the staged copy's directory, a read-only scratch holding a leftover ``.partial``, a NUL
byte in a list, a SOURCE naming no path, a refused rerun leaving a stale final file, a waiting
task after the copier was interrupted, warnings printed twice, a symlink to nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stager.errors import (
    EXIT_DEST,
    EXIT_FULL,
    EXIT_INTEGRITY,
    EXIT_INTERRUPTED,
    EXIT_SOURCE,
    EXIT_USAGE,
    IntegrityError,
)
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .conftest import BIN, clean_env, mount_tmpfs, run_cli
from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--quiet", "--retry-delay", "0.01"]
LOUD = ["--jitter-max", "0", "--retry-delay", "0.01"]  # warnings and the summary shown


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _rewrite_in_place(path: Path) -> bytes:
    """Flip a payload byte, keeping the size and the mtime (as ``cp -p`` or ``rsync -a``)."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[700] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return bytes(data)


@pytest.mark.parametrize("extra", [[], ["--subset", "node"], ["--background"]])
def test_a_source_inside_the_staged_copys_directory_is_refused_and_left_alone(
    tmp_path: Path, capsys, extra: list[str]
) -> None:
    dest = tmp_path / "scratch"
    src = dest / "ds" / "sub"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=3, seed=1))
    write_synthetic_dataset(src / "sub", SyntheticSpec(num_shards=2, samples_per_shard=3, seed=2))
    (src / "notes.partial").write_text("the user's own file\n")
    before = _snapshot(src)
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(dest), "--name", "ds", *FAST, *extra
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "inside the staged copy's directory" in result.stderr
    assert _snapshot(src) == before  # not one byte of the source written or deleted


def test_a_read_only_scratch_with_a_leftover_partial_still_serves_its_staged_copy(
    tmp_path: Path, capsys
) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=3))
    with mount_tmpfs(tmp_path / "ro", "8m") as scratch:
        assert run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST).returncode == 0
        (scratch / "ds" / "train-000001.tar.partial").write_bytes(b"what a kill -9 left")
        subprocess.run(["mount", "-o", "remount,ro", str(scratch)], check=True)
        result = run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr


def test_a_nul_byte_in_a_list_file_is_a_usage_error_naming_the_line(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=1, samples_per_shard=2))
    listing = tmp_path / "list.txt"
    listing.write_bytes(f"{src / 'train-000000.tar'}\n\0bin\n".encode())
    result = run_main(
        capsys, "stage-in", "--from-list", str(listing), "--dest", str(tmp_path / "s"), *FAST
    )
    assert result.returncode == EXIT_USAGE
    assert "line 2" in result.stderr and "NUL" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("spec", ["", "   ", "file://", "s3://"])
def test_a_source_naming_no_path_is_a_usage_error_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, spec: str
) -> None:
    write_synthetic_dataset(tmp_path / "cwd", SyntheticSpec(num_shards=1, samples_per_shard=2))
    monkeypatch.chdir(tmp_path / "cwd")
    result = run_main(capsys, "stage-in", spec, "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == EXIT_USAGE
    assert "names no path" in result.stderr
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("*.tar"))


def test_a_rerun_refused_for_space_leaves_no_stale_final_file(tmp_path: Path, capsys) -> None:
    """A changed shard's old copy goes before the refusal: its final name never holds bytes the
    source no longer has (the review's run kept them and exited 6)."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4))
    with mount_tmpfs(tmp_path / "small", "1m") as scratch:
        assert run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST).returncode == 0
        free = os.statvfs(scratch)
        (scratch / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 4096))
        victim = src / "train-000001.tar"
        current = _rewrite_in_place(victim)
        result = run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST)
        staged = scratch / "ds" / victim.name
        if result.returncode == 0:  # the stale copy's room was enough for the new one
            assert staged.read_bytes() == current
        else:
            assert result.returncode == EXIT_FULL, result.stderr
            assert not staged.exists() or staged.read_bytes() == current
        for other in ("train-000000.tar", "train-000002.tar"):
            assert (scratch / "ds" / other).read_bytes() == (src / other).read_bytes()
        (scratch / "filler").unlink()
        assert run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST).returncode == 0
        assert staged.read_bytes() == current


def test_a_task_waiting_on_an_interrupted_copier_finishes_the_staging_itself(
    tmp_path: Path,
) -> None:
    """The copier's SIGTERM is not the waiter's: the waiter takes the lock and stages the rest
    (the review saw it exit 1, the code of a bug)."""
    src = tmp_path / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=12, samples_per_shard=10, image_bytes=20_000)
    )
    dest = tmp_path / "scratch"
    argv = [str(BIN / "stage-in"), str(src), "--dest", str(dest), "--bw-limit", "1", *FAST]
    env = clean_env()
    copier = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not list(dest.glob("ds/*.tar")) and time.monotonic() < deadline:
        time.sleep(0.02)  # the copier holds the lock and has published a first shard
    waiter = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the waiter is queued on the node lock (2.4 MB at 1 MB/s: still copying)
    copier.send_signal(signal.SIGTERM)
    _, said = copier.communicate(timeout=30)
    assert copier.returncode == EXIT_INTERRUPTED, said
    _, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    for shard in sorted(src.glob("*.tar")):
        assert (dest / "ds" / shard.name).read_bytes() == shard.read_bytes()
    assert not list(dest.rglob("*.partial"))


def test_a_corrupt_shard_fails_the_run_with_exit_4_once_per_run(tmp_path: Path) -> None:
    """A shard whose tar cannot be read is corrupt at its source: exit 4 with one FAILED line,
    as `stager index` says it (a warning under "0 failed" and exit 0 let a job go on to fail in
    its loader), the shard not staged, the others staged; a rerun says it again."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4))
    with open(src / "train-000001.tar", "r+b") as handle:
        handle.truncate(9000)
    dest = tmp_path / "s" / "ds"
    for _ in range(2):  # the first run and a rerun that keeps the good ones
        result = run_cli("stage-in", str(src), "--dest", str(tmp_path / "s"), *LOUD)
        assert result.returncode == EXIT_INTEGRITY, result.stderr
        lines = result.stderr.splitlines()
        assert not [line for line in lines if "warning" in line], result.stderr
        failed = [line for line in lines if line.startswith("FAILED")]
        assert len(failed) == 1 and "train-000001.tar" in failed[0], result.stderr
        assert "corrupt tar header" in failed[0] and "re-create this shard" in failed[0]
        assert sorted(p.name for p in dest.glob("*.tar")) == [
            "train-000000.tar",
            "train-000002.tar",
        ]
        assert not list(dest.rglob("*.partial"))
    from stager_loaders import LoaderOptions, ShardedLoader

    where = str(tmp_path / "s")
    with pytest.raises(IntegrityError, match="train-000001.tar"):
        ShardedLoader(src, batch_size=2, options=LoaderOptions(dest=where))
    skip = LoaderOptions(dest=where, on_error="skip")
    loader = ShardedLoader(src, batch_size=2, to_tuple=("__key__",), options=skip)
    assert loader.skipped_shards == ["train-000001.tar"]
    assert {k[:6] for (batch,) in loader for k in batch} == {"s00000", "s00002"}
    for name in ("train-000000.tar", "train-000002.tar"):  # every shard corrupt: no empty loader
        with open(src / name, "r+b") as handle:
            handle.truncate(9000)
    assert run_cli("stage-in", str(src), "--dest", where, *LOUD).returncode == EXIT_INTEGRITY
    with pytest.raises(IntegrityError, match="every shard .* was left out as corrupt"):
        ShardedLoader(src, batch_size=2, options=skip)


def test_a_shard_that_is_a_symlink_to_nothing_is_warned_about(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    dest = tmp_path / "s"
    assert run_cli("stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    (src / "train-000000.tar").unlink()
    (src / "train-000000.tar").symlink_to(tmp_path / "nowhere.tar")
    for target in (dest, tmp_path / "fresh"):  # a rerun, and a first run
        result = run_cli("stage-in", str(src), "--dest", str(target), *LOUD)
        assert result.returncode == 0, result.stderr
        warned = [line for line in result.stderr.splitlines() if "train-000000.tar" in line]
        assert len(warned) == 1 and "symlink to nothing" in warned[0], result.stderr
        assert not (target / "ds" / "train-000000.tar").exists()


def test_a_shard_whose_temporary_name_is_a_source_directory_is_named_not_an_errno(
    tmp_path: Path, capsys
) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src / "a.tar.partial", SyntheticSpec(num_shards=1, samples_per_shard=2))
    write_synthetic_dataset(tmp_path / "one", SyntheticSpec(num_shards=1, samples_per_shard=3))
    (tmp_path / "one" / "train-000000.tar").rename(src / "a.tar")
    dest = tmp_path / "s"
    run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)  # either may win the name
    run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    current = _rewrite_in_place(src / "a.tar")
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_DEST, result.stderr
    assert "a directory has that name" in result.stderr and "Errno" not in result.stderr
    staged = dest / "ds" / "a.tar"
    assert not staged.exists() or staged.read_bytes() == current


@pytest.mark.parametrize("where", ["final name", "temporary name"])
def test_a_directory_in_the_way_in_scratch_fails_that_shard_alone_as_scratch_s(
    tmp_path: Path, where: str
) -> None:
    """A directory in scratch with a shard's final name: its rename failed, which was taken
    for the source's fault, retried and reported as exit 3 with an errno. It is scratch's:
    exit 5, one line naming the path; the other shards are staged (a scratch that is unusable
    stops every copy, one blocked name does not)."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=6, samples_per_shard=3))
    blocked = tmp_path / "s" / "ds" / "train-000002.tar"
    if where == "temporary name":
        blocked = blocked.with_name(blocked.name + ".partial")
    (blocked / "in-the-way").mkdir(parents=True)
    result = run_cli("stage-in", str(src), "--dest", str(tmp_path / "s"), "--jobs", "1", *FAST)
    assert result.returncode == EXIT_DEST, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(blocked) in errors[0], result.stderr
    assert "a directory has that name" in errors[0] and "Errno" not in result.stderr
    for shard in sorted(src.glob("*.tar")):
        if shard.name != "train-000002.tar":
            assert (tmp_path / "s" / "ds" / shard.name).read_bytes() == shard.read_bytes()
    assert not list((tmp_path / "s").rglob("*.tar.partial")) or where == "temporary name"


@pytest.mark.parametrize("manifest", [False, True])
@pytest.mark.parametrize("change", ["replaced", "written in place", "linked, then written"])
def test_a_staged_file_changed_after_its_record_is_not_trusted_by_its_name(
    tmp_path: Path, capsys, change: str, manifest: bool
) -> None:
    """The review replaced a staged shard (a new inode, the same size and mtime) and flipped a
    byte of another in place with its mtime put back: both were kept by the rerun."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=10))
    if manifest:
        assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    dest = tmp_path / "s"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    manifest_path = dest / "ds" / ".stager" / "manifest.json"
    old = time.time() - 3600  # the record an hour old: a change now is after it, on any clock
    os.utime(manifest_path, (old, old))
    victim = dest / "ds" / "train-000000.tar"
    if change == "replaced":
        other = dest / "x"
        other.write_bytes((dest / "ds" / "train-000001.tar").read_bytes())
        st = victim.stat()
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        other.replace(victim)
    else:
        if change.startswith("linked"):  # a second name: not a --cache copy for all that
            os.link(victim, tmp_path / "backup.tar")
        _rewrite_in_place(victim)
    assert victim.read_bytes() != (src / victim.name).read_bytes()
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    for shard in src.glob("*.tar"):
        assert (dest / "ds" / shard.name).read_bytes() == shard.read_bytes()
    again = run_main(
        capsys,
        "stage-in",
        str(src),
        "--dest",
        str(dest),
        "--report",
        str(tmp_path / "r.json"),
        *FAST,
    )
    assert again.returncode == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["files_copied"] == 0  # once made right, the copy is trusted again


def test_a_list_read_from_standard_input_or_a_pipe_stages_and_restages(tmp_path: Path) -> None:
    """``--from-list -`` and ``--from-list <(find ...)``: both failed ("not seekable"). A list
    with no stable place is identified by the shards it names, so a rerun from another pipe
    is the same source."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=2))
    listing = "".join(f"{p}\n" for p in sorted(src.glob("*.tar")))
    dest = tmp_path / "s"
    for _ in range(2):
        result = run_cli(
            "stage-in",
            "--from-list",
            "-",
            "--dest",
            str(dest),
            "--name",
            "ds",
            *FAST,
            input=listing,
        )
        assert result.returncode == 0, result.stderr
    read, write = os.pipe()
    os.write(write, listing.encode())
    os.close(write)
    piped = run_cli(
        "stage-in",
        "--from-list",
        f"/dev/fd/{read}",
        "--dest",
        str(dest),
        "--name",
        "ds",
        *FAST,
        pass_fds=(read,),
    )
    os.close(read)
    assert piped.returncode == 0, piped.stderr
    for shard in src.glob("*.tar"):
        assert (dest / "ds" / shard.name).read_bytes() == shard.read_bytes()


def test_a_min_free_refusal_says_what_min_free_keeps(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=1, samples_per_shard=2))
    with mount_tmpfs(tmp_path / "m", "4m") as scratch:
        result = run_main(
            capsys, "stage-in", str(src), "--dest", str(scratch), *FAST, "--min-free", "5M"
        )
        assert result.returncode == EXIT_FULL
        assert "--min-free keeps 5.0 MB" in result.stderr


def _stage_cached(capsys, src: Path, dest: Path, cache: Path) -> dict:
    report = dest.parent / f"{dest.name}.report.json"
    argv = ["stage-in", str(src), "--dest", str(dest), "--cache", str(cache), "--report"]
    result = run_main(capsys, *argv, str(report), *FAST)
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text())


@pytest.mark.parametrize("manifest", [False, True])
def test_jobs_sharing_cached_copies_do_not_undo_each_other(
    tmp_path: Path, capsys, manifest: bool
) -> None:
    """A --cache copy is a hard link, and each job's link moves the shared inode's ctime: the
    review saw every rerun of one job place every shard again after another job had staged (and
    with a manifest, hash them all), each undoing the other."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=4))
    if manifest:
        assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    cache = tmp_path / "cache"
    a, b = tmp_path / "job-a", tmp_path / "job-b"
    assert _stage_cached(capsys, src, a, cache)["files_copied"] == 4
    assert _stage_cached(capsys, src, b, cache)["files_from_cache"] == 4
    for job in (a, b, a):
        assert _stage_cached(capsys, src, job, cache)["files_copied"] == 0


def test_a_staged_file_whose_ctime_alone_moved_is_checked_once_not_on_every_run(
    tmp_path: Path, capsys
) -> None:
    """chmod moves only the ctime: the kept file is hashed once against the manifest, and the
    manifest is rewritten, so the next run compares with a record newer than the file."""
    from stager.layout import StagedDataset
    from stager.stagein.recorded import RecordTimes

    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=4))
    assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    dest = tmp_path / "s"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    staged = StagedDataset(dest, "ds")
    old = time.time() - 3600  # the record an hour old: any change now is after it
    os.utime(staged.manifest_path, (old, old))
    victim = dest / "ds" / "train-000000.tar"
    victim.chmod(0o600)
    assert RecordTimes.of(staged).changed_since_recorded(victim.name, victim.stat())
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    assert not RecordTimes.of(staged).changed_since_recorded(victim.name, victim.stat())


def test_a_read_only_scratch_keeps_serving_when_a_kept_files_ctime_moved(
    tmp_path: Path, capsys
) -> None:
    """The manifest rewrite that settles a ctime-only change is best effort: on a read-only
    scratch the file is hashed again and the run succeeds (the first fix made it exit 5)."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=4))
    assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    with mount_tmpfs(tmp_path / "ro", "8m") as scratch:
        assert run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST).returncode == 0
        old = time.time() - 3600
        os.utime(scratch / "ds" / ".stager" / "manifest.json", (old, old))
        (scratch / "ds" / "train-000000.tar").chmod(0o600)
        subprocess.run(["mount", "-o", "remount,ro", str(scratch)], check=True)
        for _ in range(2):
            result = run_main(capsys, "stage-in", str(src), "--dest", str(scratch), *FAST)
            assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "digest, why",
    [
        ("xxh3_64:" + "zz" * 8, "not a xxh3_64 digest"),
        ("xxh3_64:1234", "not a xxh3_64 digest"),
        ("sha256:" + "ab" * 8, "not a sha256 digest"),
        ("ab" * 8, "not a sha256 digest"),  # a bare digest is sha256sum's
    ],
)
def test_a_manifest_digest_no_copy_can_match_is_a_usage_error_before_any_copy(
    tmp_path: Path, capsys, digest: str, why: str
) -> None:
    """A non-hex or cut digest is bad input (exit 2, naming the shard), not an integrity
    failure after copying (exit 4, as if the data were damaged)."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    manifest = next(src.glob("*.json"))
    doc = json.loads(manifest.read_text())
    doc["shards"][1]["hash"] = digest
    manifest.write_text(json.dumps(doc))
    dest = tmp_path / "s"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert why in result.stderr and doc["shards"][1]["path"] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not any(dest.rglob("*.tar"))


@pytest.mark.parametrize("spelling", ["same", "another"])
def test_a_manifest_listing_a_shard_twice_is_refused(tmp_path: Path, capsys, spelling) -> None:
    """The last entry silently won for size and hash, and a loader read its samples twice."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=2))
    assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    manifest = next(src.glob("*.json"))
    doc = json.loads(manifest.read_text())
    again = dict(doc["shards"][0])
    if spelling == "another":
        again["path"] = "./" + again["path"]
    doc["shards"].append(again)
    manifest.write_text(json.dumps(doc))
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "listed more than once" in result.stderr and doc["shards"][0]["path"] in result.stderr
    from stager.shards.manifest import read_columns

    with pytest.raises(Exception, match="listed more than once"):
        read_columns(manifest)  # the loader's reader refuses it too


def test_a_list_spanning_two_top_level_directories_is_staged(tmp_path: Path, capsys) -> None:
    """Its root is ``/``, and every destination was refused as "inside the source" (exit 2).
    A list gains no file on a rerun, so only a listed shard inside the copy is a danger."""
    import shutil
    import tempfile

    places = ("/var/tmp", "/dev/shm", "/tmp", os.path.expanduser("~"))
    apart = [
        p for p in places if Path(p).parts[1:2] != tmp_path.parts[1:2] and os.access(p, os.W_OK)
    ]
    if not apart:
        pytest.skip("no writable directory under another top-level directory than the tests'")
    other = Path(tempfile.mkdtemp(dir=apart[0]))
    try:
        here = write_synthetic_dataset(tmp_path / "a", SyntheticSpec(num_shards=1, seed=1))
        there = write_synthetic_dataset(other / "b", SyntheticSpec(num_shards=1, seed=2))
        assert here[0].parts[1] != there[0].parts[1]  # two top-level directories
        listing = tmp_path / "list.txt"
        listing.write_text(f"{here[0]}\n{there[0]}\n")
        dest = tmp_path / "scratch"
        argv = ["--from-list", str(listing), "--dest", str(dest), "--name", "ds", *FAST]
        result = run_main(capsys, "stage-in", *argv)
        assert result.returncode == 0, result.stderr
        staged = [p.read_bytes() for p in (dest / "ds").rglob("*.tar")]
        assert sorted(staged) == sorted([here[0].read_bytes(), there[0].read_bytes()])
    finally:
        shutil.rmtree(other)


def test_a_listed_shard_inside_the_staged_copy_is_refused_and_left_alone(
    tmp_path: Path, capsys
) -> None:
    dest = tmp_path / "scratch"
    shards = write_synthetic_dataset(dest / "ds" / "in", SyntheticSpec(num_shards=2))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in shards))
    before = _snapshot(dest)
    argv = ["--from-list", str(listing), "--dest", str(dest), "--name", "ds", *FAST]
    result = run_main(capsys, "stage-in", *argv)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "is inside the staged copy's directory" in result.stderr
    assert _snapshot(dest) == before


@pytest.mark.parametrize("how", ["list", "directory"])
def test_a_source_shard_linked_to_its_own_staged_file_is_refused_not_deleted(
    tmp_path: Path, capsys, how: str
) -> None:
    """A listed (or walked) shard that is a symlink to the staged file it would replace: the
    plan deleted that file as stale, the source's only bytes, then failed 'not found'."""
    dest = tmp_path / "dest"
    data = write_synthetic_dataset(tmp_path / "made", SyntheticSpec(num_shards=2, seed=3))
    (dest / "ds").mkdir(parents=True)
    only_copy = dest / "ds" / data[0].name
    data[0].rename(only_copy)
    src = tmp_path / "src"
    src.mkdir()
    (src / data[0].name).symlink_to(only_copy)
    data[1].rename(src / data[1].name)
    before = only_copy.read_bytes()
    if how == "list":
        listing = tmp_path / "list.txt"
        listing.write_text("".join(f"{src / p.name}\n" for p in data))
        argv = ["--from-list", str(listing)]
    else:
        argv = [str(src)]
    result = run_main(capsys, "stage-in", *argv, "--dest", str(dest), "--name", "ds", *FAST)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "is the staged file" in result.stderr
    assert only_copy.read_bytes() == before


def test_a_shard_corrupted_after_a_manifest_without_hashes_fails_with_exit_4(
    tmp_path: Path,
) -> None:
    """A source manifest may give sizes and sample counts without hashes: a shard whose header
    was damaged since (same size) passed as staged, its count taken from the manifest."""
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4))
    shards = sorted(src.glob("*.tar"))
    described = [{"path": p.name, "size": p.stat().st_size, "samples": 4} for p in shards]
    manifest = {"format": "stager-manifest", "version": 1, "meta": {}, "shards": described}
    (src / "stager-manifest.json").write_text(json.dumps(manifest))
    with open(shards[1], "r+b") as handle:  # the second member's header, same size
        handle.seek(1024)
        handle.write(b"\xff" * 100)
    result = run_cli("stage-in", str(src), "--dest", str(tmp_path / "s"), *LOUD)
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and shards[1].name in failed[0], result.stderr
    staged = sorted(p.name for p in (tmp_path / "s" / "ds").glob("*.tar"))
    assert staged == [shards[0].name, shards[2].name]


def test_a_run_with_a_corrupt_and_a_missing_shard_counts_each_kind() -> None:
    """Exit 4 wins (docs/stage-in.md), and the summary no longer calls both shards corrupt."""
    from stager.errors import ShardFailure, shard_failures

    error = shard_failures(
        [ShardFailure("/d/a.tar", "truncated", "corrupt"), ShardFailure("/d/b.tar", "not found")]
    )
    assert error.exit_code == EXIT_INTEGRITY
    assert str(error).startswith(
        "1 shard(s) differ from their manifest or are corrupt and 1 other(s) failed after retries"
    )


@pytest.fixture(params=["1", "0"])
def either_walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test once with the compiled tar walk and once with the Python one."""
    monkeypatch.setenv("STAGER_NATIVE_TAR", request.param)


def _shards_dir(src: Path, shards: dict[str, list[tuple[str, bytes]]], suffix: str) -> Path:
    """``src`` holding a shard ``<name><suffix>`` of each member list, gzipped unless .tar."""
    import gzip

    from .trees import tar_bytes

    src.mkdir()
    for name, members in shards.items():
        data = tar_bytes(members)
        (src / f"{name}{suffix}").write_bytes(gzip.compress(data) if suffix != ".tar" else data)
    return src


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_member_twice_in_one_sample_fails_that_shard_as_the_loader_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], either_walk: None, suffix: str
) -> None:
    """``k.jpg`` twice (or ``k.jpg`` and ``k.JPG``) in one sample: the loader refuses the
    shard, as webdataset does. stage-in said it as a warning ("no loader index written") under
    exit 0, and `stager index` counted it; both now fail it with exit 4 and one FAILED line,
    and stage-in keeps the other shards staged, as for any corrupt shard."""
    shards = {
        "a": [("k1.jpg", b"a"), ("k1.jpg", b"b"), ("k2.jpg", b"c")],
        "b": [("m1.jpg", b"a"), ("m1.cls", b"1"), ("m2.jpg", b"b")],
        "c": [("n1.jpg", b"a"), ("n1.JPG", b"b")],
        "d": [("p1.jpg", b"a"), ("p2.jpg", b"b"), ("p1.jpg", b"c")],  # (two samples named p1)
    }
    src = _shards_dir(tmp_path / "ds", shards, suffix)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *LOUD)
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    failed = sorted(line for line in result.stderr.splitlines() if line.startswith("FAILED"))
    assert len(failed) == 2, result.stderr
    assert f"a{suffix}: member 'k1.jpg' appears twice in one sample" in failed[0]
    assert f"c{suffix}: member 'n1.jpg' appears twice in one sample" in failed[1]
    staged = tmp_path / "s" / "ds"
    assert sorted(p.name for p in staged.iterdir() if p.is_file()) == [f"b{suffix}", f"d{suffix}"]
    assert not list(staged.rglob("*.partial"))
    indexed = run_main(capsys, "stager", "index", str(src))
    assert indexed.returncode == EXIT_INTEGRITY, indexed.stderr
    assert "appears twice in one sample" in indexed.stderr
    assert not list(src.glob("stager-manifest.*"))


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_sample_whose_members_lie_apart_fails_that_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], either_walk: None, suffix: str
) -> None:
    """GNU tar of a directory stores files in the order the directory lists them: k1.jpg,
    k2.jpg, k1.cls. Read as webdataset reads it, k1 is two samples, each missing a member:
    `stager index` counted them, and the loader gave half-samples (or a KeyError mid-epoch).
    Now stage-in fails that shard (exit 4, one FAILED line naming the sample), as `stager
    index` and the loader do; a sample stored twice whole is two samples, as before."""
    from stager_loaders import LoaderOptions, ShardedLoader

    shards = {
        "apart": [("k1.jpg", b"a"), ("k2.jpg", b"b"), ("k1.cls", b"1"), ("k2.cls", b"2")],
        "whole": [("m1.jpg", b"a"), ("m1.cls", b"1"), ("m2.jpg", b"b"), ("m2.cls", b"2")],
        "twice": [("p1.jpg", b"a"), ("p2.jpg", b"b"), ("p1.jpg", b"c")],
    }
    src = _shards_dir(tmp_path / "ds", shards, suffix)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *LOUD)
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and f"apart{suffix}: the members of sample 'k1'" in failed[0]
    staged = tmp_path / "s" / "ds"
    assert sorted(p.name for p in staged.iterdir() if p.is_file()) == [
        f"twice{suffix}",
        f"whole{suffix}",
    ]
    indexed = run_main(capsys, "stager", "index", str(src))
    assert indexed.returncode == EXIT_INTEGRITY and "sample 'k1'" in indexed.stderr
    with pytest.raises(IntegrityError, match="the members of sample 'k1' are not next to"):
        options = LoaderOptions(dest=str(tmp_path / "n"))  # (nothing staged: the source read)
        list(ShardedLoader(str(src / f"apart{suffix}"), batch_size=1, options=options))


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_tar_header_after_the_end_block_fails_that_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    """Two tars joined with cat, or zero blocks inside an archive: tar, tarfile and webdataset
    stop at the first end block and lose the samples after it with no word, and so did
    stage-in (exit 0), `stager index` and the loader. Now each names the header it found after
    the end (exit 4; the loader raises IntegrityError). Junk after the end is no header and
    loses nothing: still staged."""
    import gzip
    import io
    import tarfile

    from stager_loaders import LoaderOptions, ShardedLoader

    from .trees import tar_bytes, v7_bytes

    first = tar_bytes([(f"a{i:03d}.jpg", bytes([i]) * 700) for i in range(6)])
    # over 1 MiB of large members: walked header by header, not read whole (a review found the
    # scanner vouching for it there, the headers after the end never seen)
    big = tar_bytes([(f"c{i:03d}.jpg", bytes([i]) * 400_000) for i in range(3)])
    second = tar_bytes([(f"b{i:03d}.jpg", bytes([i]) * 700) for i in range(6)])
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        fourth = tar.getmembers()[3].offset
    shards = {
        "joined": first + second,
        "joinedbig": big + big,
        "joinedv7": first + v7_bytes([("v000.jpg", b"v" * 700)]),  # (no ustar magic)
        "zeroed": first[:fourth] + bytes(1024) + first[fourth:],
        "lone": first[:fourth] + bytes(512) + first[fourth:],  # (GNU tar: "A lone zero block")
        "junk": first + b"\x01not a header" * 100,
        "plain": second,
    }
    src = tmp_path / "ds"
    src.mkdir()
    for name, data in shards.items():
        (src / f"{name}{suffix}").write_bytes(gzip.compress(data) if suffix != ".tar" else data)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *LOUD)
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    failed = sorted(line for line in result.stderr.splitlines() if line.startswith("FAILED"))
    assert [line.split(": ")[0].rsplit("/", 1)[1] for line in failed] == [
        f"{name}{suffix}" for name in ("joined", "joinedbig", "joinedv7", "lone", "zeroed")
    ], result.stderr
    assert "a tar header ('b000.jpg') at byte" in failed[0]
    assert all("after the end-of-archive block" in line for line in failed)
    staged = tmp_path / "s" / "ds"
    assert sorted(p.name for p in staged.iterdir() if p.is_file()) == [
        f"junk{suffix}",
        f"plain{suffix}",
    ]
    assert run_main(capsys, "stager", "index", str(src)).returncode == EXIT_INTEGRITY
    for name in ("joined", "joinedbig", "joinedv7"):
        with pytest.raises(IntegrityError, match="after the end-of-archive block"):
            list(ShardedLoader(str(src / f"{name}{suffix}"), batch_size=4, options=LoaderOptions()))


@pytest.mark.parametrize("name", ["ds[1]", "b{x}"])
def test_a_directory_named_like_a_pattern_is_named_in_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A SOURCE with [ or { is read as a pattern, also where a directory has that very name:
    "no file matches" (exit 3) now says that such a path exists and how to name its shards."""
    from .trees import tar_bytes

    src = tmp_path / name
    src.mkdir()
    (src / "s-0.tar").write_bytes(tar_bytes([("k.jpg", b"x")]))
    result = run_main(capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == 3, result.stderr
    assert "a path of that very name exists" in result.stderr and "--from-list" in result.stderr
    listed = tmp_path / "list.txt"
    listed.write_text(f"{src / 's-0.tar'}\n")
    staged = run_main(
        capsys, "stage-in", "--from-list", str(listed), "--dest", str(tmp_path / "s"), *FAST
    )
    assert staged.returncode == 0, staged.stderr


def test_one_file_that_is_no_shard_is_staged_without_an_index_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stage-in notes.md`` stages the file as it is; it is no shard, so no loader index is
    tried, and no warning that it is "not a readable tar" (said before, under exit 0)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.md").write_text("not a tar\n")
    result = run_main(
        capsys, "stage-in", str(src / "notes.md"), "--dest", str(tmp_path / "s"), *LOUD
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    assert (tmp_path / "s" / "notes.md" / "notes.md").read_text() == "not a tar\n"


#: stage-in in a process that dies as a SIGKILL would, right before its finish (the staged
#: manifest): its copies are renamed and journaled, nothing else.
_DIES_BEFORE_FINISH = """
import os, sys
import stager.stagein.run as run
import stager.stagein.streamed as streamed
import stager.cli.main as cli
run.finish = streamed.finish = lambda staging: os._exit(137)
sys.argv[0] = "stage-in"
sys.exit(cli.stage_in_main())
"""


def test_a_member_twice_in_one_sample_is_refused_after_a_kill_too(tmp_path: Path) -> None:
    """A run killed before its finish journals its copies; a rerun keeps them. A shard with a
    member twice in one sample was journaled with its count, kept without being indexed again,
    and the rerun said it as a warning under exit 0. Its journal line now carries no count, so
    the rerun indexes it and fails it (exit 4)."""
    import sys

    from .trees import tar_bytes

    src = tmp_path / "ds"
    src.mkdir()
    for i in range(40):  # (enough for runs of small shards)
        (src / f"s-{i:03d}.tar").write_bytes(tar_bytes([(f"k{i}.jpg", b"x" * 300)]))
    twice = tar_bytes([("a.jpg", b"1"), ("a.cls", b"2"), ("a.jpg", b"3"), ("b.jpg", b"4")])
    (src / "s-dup.tar").write_bytes(twice)
    dest = tmp_path / "s"
    argv = [sys.executable, "-c", _DIES_BEFORE_FINISH, str(src), "--dest", str(dest), *FAST]
    died = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert died.returncode == 137, died.stderr
    assert (dest / "ds" / "s-dup.tar").read_bytes() == twice  # (staged and journaled)
    rerun = run_cli("stage-in", str(src), "--dest", str(dest), *LOUD)
    assert rerun.returncode == EXIT_INTEGRITY, rerun.stderr
    failed = [line for line in rerun.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "s-dup.tar: member 'a.jpg' appears twice" in failed[0]
    assert not (dest / "ds" / "s-dup.tar").exists()


def test_a_shard_rewritten_behind_an_http_server_is_copied_again(tmp_path: Path) -> None:
    """A server that sends Last-Modified and no ETag (Python's http.server) gave fsspec's info
    no field stage-in took for a version: a shard rewritten at the same size stayed staged,
    "0 copied", exit 0, its bytes no longer the source's."""
    import socket
    import sys

    from .s3server import free_port

    served = tmp_path / "www"
    write_synthetic_dataset(served / "ds", SyntheticSpec(num_shards=2, samples_per_shard=3))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port), "-d", str(served)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        listed = tmp_path / "shards.txt"
        urls = [f"http://127.0.0.1:{port}/ds/train-00000{i}.tar" for i in (0, 1)]
        listed.write_text("\n".join(urls) + "\n")
        argv = ["--from-list", str(listed), "--dest", str(tmp_path / "s"), "--name", "ds", *FAST]
        assert run_cli("stage-in", *argv).returncode == 0
        shard = served / "ds" / "train-000001.tar"
        rewritten = _rewrite_in_place(shard)
        later = shard.stat().st_mtime_ns + 10**10  # (Last-Modified counts whole seconds)
        os.utime(shard, ns=(later, later))
        again = run_cli("stage-in", *argv[: -len(FAST)], "--jitter-max", "0")
        assert again.returncode == 0, again.stderr
        assert "1 copied" in again.stderr, again.stderr
        assert (tmp_path / "s" / "ds" / "train-000001.tar").read_bytes() == rewritten
        # HTTP has no directories: its listing page was staged as a "file" named ds
        page = run_cli("stage-in", f"http://127.0.0.1:{port}/ds", "--dest", str(tmp_path / "p"))
        assert page.returncode == EXIT_SOURCE and "is a web page, not a shard" in page.stderr
        # a glob's links carry no size: every copy was retried, every rerun copied everything
        globbed = (f"http://127.0.0.1:{port}/ds/*.tar", "--dest", str(tmp_path / "g"))
        for copied in ("2 copied", "0 copied"):
            done = run_cli("stage-in", *globbed, "--jitter-max", "0")
            assert done.returncode == 0 and copied in done.stderr, done.stderr
            assert "retry" not in done.stderr, done.stderr
    finally:
        server.terminate()
        server.wait()


@pytest.mark.parametrize("mode", [0o000, 0o600])  # unlistable, or listable but not searchable
def test_a_source_directory_its_user_cannot_read_is_one_line_exit_3(
    tmp_path: Path, mode: int
) -> None:
    """Run as a user is (root without its permission override): the first run of a plain
    directory looked for a manifest beside it to decide whether to stream, and that stat's
    PermissionError was a traceback (exit 1), where ``--subset node``, a glob or ``stager index``
    of the same directory said "source not readable" (exit 3)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without the permission override")
    as_a_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    src = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=3))
    src.chmod(mode)
    try:
        argv = [*as_a_user, str(BIN / "stage-in"), str(src), "--dest", str(tmp_path / "s"), *FAST]
        result = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120)
    finally:
        src.chmod(0o755)
    assert result.returncode == EXIT_SOURCE, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert "not readable" in result.stderr
