"""stage-out through the real console scripts: round trips, skipping, --keep, errors, concurrency.

The helpers at the top are shared by the other ``test_stageout_*``/``test_restore*`` modules.
"""

from __future__ import annotations

import filecmp
import io
import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from stager.errors import EXIT_CHECKPOINT, EXIT_DEST, EXIT_NO_CHECKPOINT, EXIT_USAGE
from stager.stageout.record import CommitRecord
from stager.stageout.store import META_DIR
from stager.storage.hashing import hash_file

from .conftest import BIN, clean_env, run_cli


# -- helpers shared by the stage-out and restore tests ---------------------------------------
def write_ckpt_dir(path: Path, *, files: int = 4, size: int = 20_000, seed: int = 0) -> Path:
    """A checkpoint directory with nested files of random bytes (distinct per seed)."""
    rng = random.Random(seed)
    (path / "optim").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        sub = path / "optim" if i % 2 else path
        (sub / f"part-{i}.bin").write_bytes(rng.randbytes(size + i))
    (path / "meta.json").write_text(json.dumps({"seed": seed}))
    return path


def write_ckpt_file(path: Path, *, size: int = 50_000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def set_mtime(path: Path, when: float) -> None:
    """Give a checkpoint (every file in it) a definite age, so "newest" is unambiguous."""
    targets = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] + [path]
    for target in targets:
        os.utime(target, (when, when))


def records(dest: Path) -> dict[str, CommitRecord]:
    commits = dest / META_DIR / "commits"
    if not commits.is_dir():
        return {}
    return {
        p.name[: -len(".json")]: CommitRecord.from_json(p.read_text(), where=str(p))
        for p in commits.glob("*.json")
    }


def assert_committed_whole(dest: Path) -> dict[str, CommitRecord]:
    """Every record's files exist at DEST with the recorded size and hash (no half checkpoint)."""
    found = records(dest)
    for record in found.values():
        for entry in record.entries:
            path = dest / entry.relpath
            assert path.is_file(), f"{record.name}: {entry.relpath} missing"
            assert path.stat().st_size == entry.size
            assert hash_file(path, entry.hash.split(":")[0]) == entry.hash
    return found


def same_tree(a: Path, b: Path) -> bool:
    if a.is_file() or b.is_file():
        return a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    if filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[1:] != ([], []):
        return False
    return all(same_tree(a / d, b / d) for d in cmp.common_dirs)


def staging_entries(dest: Path) -> list[str]:
    staging = dest / META_DIR / "staging"
    return sorted(os.listdir(staging)) if staging.is_dir() else []


def restore(dest: Path, local: Path) -> subprocess.CompletedProcess:
    return run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(local))


def stage(dest: Path, *ckpts: Path, **options) -> list[str]:
    """In-process stage-out for test setup (saves a process start); returns the statuses."""
    from stager.stageout.run import StageOutOptions, stage_out

    outcomes = stage_out(list(ckpts), str(dest), StageOutOptions(log=io.StringIO(), **options))
    return [o.status for o in outcomes]


def restore_here(dest: Path, local: Path) -> Path:
    """In-process restore for checks that do not concern the CLI's stdout."""
    from stager.stageout.restore import restore_checkpoint

    return restore_checkpoint(str(dest), local, log=io.StringIO())


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_round_trip_is_byte_identical(tmp_path: Path, kind: str) -> None:
    ckpt = (
        write_ckpt_dir(tmp_path / "scratch" / "step-100")
        if kind == "dir"
        else write_ckpt_file(tmp_path / "scratch" / "step-100.pt")
    )
    dest = tmp_path / "persist"
    out = run_cli("stage-out", str(ckpt), str(dest))
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert "committed step-100" in out.stderr
    assert same_tree(ckpt, dest / ckpt.name)
    assert list(assert_committed_whole(dest)) == [ckpt.name]
    assert staging_entries(dest) == []

    got = restore(dest, tmp_path / "restored")
    assert got.returncode == 0, got.stderr
    restored = Path(got.stdout.strip())
    assert got.stdout == f"{restored}\n" and restored.is_absolute()
    assert restored == (tmp_path / "restored" / ckpt.name).resolve()
    assert same_tree(ckpt, restored)


def test_all_stages_every_checkpoint_and_rerun_skips_unchanged(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    for i in range(3):
        set_mtime(write_ckpt_dir(scratch / f"step-{i}", seed=i), 1_700_000_000 + i)
    (scratch / "step-9.partial").write_bytes(b"being written")  # temp names are not checkpoints
    dest = tmp_path / "persist"
    first = run_cli("stage-out", "--all", str(scratch), str(dest))
    assert first.returncode == 0, first.stderr
    assert set(assert_committed_whole(dest)) == {"step-0", "step-1", "step-2"}
    # Newest first: the one most worth saving when time is short.
    order = [line.split()[2] for line in first.stderr.splitlines() if " committed " in line]
    assert order == ["step-2", "step-1", "step-0"]

    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()}
    again = run_cli("stage-out", "--all", str(scratch), str(dest))
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already committed with the same content") == 3
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file()} == before


def test_all_with_nothing_to_stage_says_so_with_exit_9(tmp_path: Path) -> None:
    """A job script must be able to tell "the trainer saved nothing" from "all committed"."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "last.pt.tmp").write_bytes(b"a save that never finished")
    (scratch / ".hidden").mkdir()
    out = run_cli("stage-out", "--all", str(scratch), str(tmp_path / "persist"))
    assert out.returncode == EXIT_NO_CHECKPOINT, out.stderr
    assert out.stderr.count("\n") == 1 and f"no checkpoint in {scratch}" in out.stderr
    assert not (tmp_path / "persist").exists()
    # Any name is a checkpoint: a trainer's last.pt is committed as it is.
    (scratch / "last.pt").write_bytes(b"weights")
    out = run_cli("stage-out", "--all", str(scratch), str(tmp_path / "persist"))
    assert out.returncode == 0 and "committed last.pt" in out.stderr, out.stderr
    assert (tmp_path / "persist" / "last.pt").read_bytes() == b"weights"


def test_changed_content_under_the_same_name_is_recommitted(tmp_path: Path) -> None:
    ckpt = write_ckpt_file(tmp_path / "scratch" / "last.pt", seed=1)
    dest = tmp_path / "persist"
    assert stage(dest, ckpt) == ["committed"]
    write_ckpt_file(ckpt, seed=2, size=60_000)
    out = run_cli("stage-out", str(ckpt), str(dest))
    assert out.returncode == 0, out.stderr
    assert "committed last.pt" in out.stderr
    assert (dest / "last.pt").read_bytes() == ckpt.read_bytes()
    assert records(dest)["last.pt"].entries[0].size == 60_000


def test_keep_prunes_older_checkpoints_and_never_the_newest(tmp_path: Path) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    for i in range(4):
        set_mtime(write_ckpt_dir(scratch / f"step-{i}", seed=i, files=1), 1_700_000_000 + i)
    assert stage(dest, *scratch.iterdir()) == ["committed"] * 4

    out = run_cli("stage-out", "--all", "--keep", "2", str(scratch), str(dest))
    assert out.returncode == 0, out.stderr
    assert "pruned step-0" in out.stderr and "pruned step-1" in out.stderr
    assert set(assert_committed_whole(dest)) == {"step-2", "step-3"}
    assert not (dest / "step-0").exists() and not (dest / "step-1").exists()

    # A new checkpoint: committed, the oldest kept one pruned; the old ones still on scratch
    # are not copied again only to be pruned (what --watch --keep would do every pass).
    set_mtime(write_ckpt_dir(scratch / "step-4", seed=4, files=1), 1_700_000_004)
    out = run_cli("stage-out", "--all", "--keep", "2", str(scratch), str(dest))
    assert out.returncode == 0, out.stderr
    assert "committed step-4" in out.stderr and "pruned step-2" in out.stderr
    assert "step-0" not in out.stderr and "step-1" not in out.stderr
    assert set(assert_committed_whole(dest)) == {"step-3", "step-4"}

    # --keep 1 keeps exactly the newest, even when asked to stage an older checkpoint.
    out = run_cli("stage-out", "--keep", "1", str(scratch / "step-0"), str(dest))
    assert out.returncode == 0, out.stderr
    assert set(assert_committed_whole(dest)) == {"step-4"}

    bad = run_cli("stage-out", "--keep", "0", str(scratch / "step-0"), str(dest))
    assert bad.returncode == EXIT_USAGE and "newest" in bad.stderr
    assert set(records(dest)) == {"step-4"}


@pytest.mark.parametrize("how", ["under-a-file", "read-only-dir"])
def test_unwritable_destination_is_one_clear_line(tmp_path: Path, how: str) -> None:
    ckpt = write_ckpt_file(tmp_path / "scratch" / "step-1.pt")
    immutable = False
    if how == "under-a-file":
        (tmp_path / "afile").write_text("not a directory")
        dest = tmp_path / "afile" / "persist"
    else:
        dest = tmp_path / "ro"
        dest.mkdir(mode=0o500)
        if os.geteuid() == 0:  # root ignores mode bits; an immutable directory stops root too
            immutable = (
                subprocess.run(["chattr", "+i", str(dest)], capture_output=True).returncode == 0
            )
            if not immutable:
                pytest.skip("running as root and chattr +i is unavailable here")
    try:
        out = run_cli("stage-out", str(ckpt), str(dest))
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(dest)], check=True)
    assert out.returncode == EXIT_DEST
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("stage-out: error: destination ") and str(dest) in lines[0]
    assert "pass a writable DEST" in lines[0] or "pass another DEST" in lines[0]


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    out = run_cli("stage-out", str(tmp_path / "nope"), str(tmp_path / "persist"))
    assert out.returncode == EXIT_CHECKPOINT
    assert "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_concurrent_stage_out_of_one_checkpoint_copies_once(tmp_path: Path) -> None:
    ckpt = write_ckpt_dir(tmp_path / "scratch" / "step-7", files=8, size=250_000)
    dest = tmp_path / "persist"
    procs = [
        subprocess.Popen(
            [str(BIN / "stage-out"), "--bw-limit", "8", str(ckpt), str(dest)],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert [rc for rc, _ in results] == [0, 0, 0, 0], results
    copied = [err for _, err in results if "committed step-7 (" in err]
    assert len(copied) == 1, results
    assert sum("already committed" in err for _, err in results) == 3
    assert same_tree(ckpt, dest / "step-7")
    assert staging_entries(dest) == []


def test_deadline_too_short_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    set_mtime(write_ckpt_file(scratch / "old.pt", seed=1), 1_700_000_000)
    assert stage(dest, scratch / "old.pt") == ["committed"]
    big = write_ckpt_file(scratch / "new.pt", size=3_000_000, seed=2)
    out = run_cli("stage-out", "--deadline-s", "2", "--assume-mbps", "1", str(big), str(dest))
    assert out.returncode == EXIT_CHECKPOINT
    assert "not enough time to stage out new.pt" in out.stderr
    assert set(assert_committed_whole(dest)) == {"old.pt"}
    assert not (dest / "new.pt").exists() and staging_entries(dest) == []


def test_deadline_reached_mid_copy_abandons_atomically(tmp_path: Path) -> None:
    dest = tmp_path / "persist"
    ckpt = write_ckpt_dir(tmp_path / "scratch" / "step-1", files=4, size=1_000_000)
    # The estimate (fast) says yes; the copy (throttled to 1 MB/s) runs past the deadline.
    out = run_cli(
        "stage-out",
        "--deadline-s",
        "1.5",
        "--bw-limit",
        "1",
        "--assume-mbps",
        "1000",
        str(ckpt),
        str(dest),
    )
    assert out.returncode == EXIT_CHECKPOINT, out.stderr
    assert "reached while copying step-1" in out.stderr
    assert records(dest) == {} and not (dest / "step-1").exists() and staging_entries(dest) == []


def test_deadline_from_slurm_end_time_via_squeue(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 5))
    (fake / "squeue").write_text(f"#!/bin/sh\necho {end}\n")
    (fake / "squeue").chmod(0o755)
    ckpt = write_ckpt_file(tmp_path / "scratch" / "step-1.pt", size=2_000_000)
    env = clean_env(SLURM_JOB_ID="4242")
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    out = run_cli(
        "stage-out",
        "--assume-mbps",
        "0.1",
        "--deadline-margin-s",
        "1",
        str(ckpt),
        str(tmp_path / "persist"),
        env=env,
    )
    assert out.returncode == EXIT_CHECKPOINT, out.stderr
    assert "slurm end time" in out.stderr


def test_interrupted_attempt_is_cleaned_on_the_next_run(tmp_path: Path) -> None:
    dest = tmp_path / "persist"
    ckpt = write_ckpt_file(tmp_path / "scratch" / "step-1.pt")
    assert stage(dest, ckpt) == ["committed"]
    # What a kill -9 leaves: a staging attempt by a pid that no longer exists on this host,
    # and (after the rename, before the record) an uncommitted NAME.
    token = f"{socket.gethostname().split('.')[0]}__999999__deadbeef"
    (dest / META_DIR / "staging" / token / "data").mkdir(parents=True)
    (dest / META_DIR / "staging" / token / "intent.json").write_text(
        json.dumps({"name": "step-2.pt"})
    )
    (dest / "step-2.pt").write_bytes(b"half")
    got = restore(dest, tmp_path / "local")
    assert got.returncode == 0 and got.stdout.strip().endswith(
        "step-1.pt"
    )  # the orphan is invisible
    out = run_cli("stage-out", str(ckpt), str(dest))
    assert out.returncode == 0, out.stderr
    assert "cleaned an interrupted stage-out of step-2.pt" in out.stderr
    assert staging_entries(dest) == [] and not (dest / "step-2.pt").exists()


def test_no_checkpoint_yet_has_its_own_exit_code_and_empty_stdout(tmp_path: Path) -> None:
    for dest in (tmp_path / "missing", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        out = restore(dest, tmp_path / "local")
        assert out.returncode == EXIT_NO_CHECKPOINT, out.stderr
        assert out.stdout == ""
        assert "no committed checkpoint" in out.stderr


def test_memory_url_round_trip_uses_the_commit_marker(tmp_path: Path) -> None:
    """An object store without rename (fsspec memory://), in-process: marker mode end to end."""
    import fsspec

    from stager.stageout.restore import restore_checkpoint
    from stager.stageout.run import StageOutOptions, stage_out

    url = f"memory://stageout-test-{os.getpid()}/run"
    log = open(os.devnull, "w")  # noqa: SIM115
    try:
        a = write_ckpt_dir(tmp_path / "scratch" / "step-1", seed=1)
        set_mtime(a, 1_700_000_000)
        b = write_ckpt_file(tmp_path / "scratch" / "step-2.pt", seed=2)
        outcomes = stage_out([a, b], url, StageOutOptions(log=log))
        assert [o.status for o in outcomes] == ["committed", "committed"]
        fs = fsspec.filesystem("memory")
        root = f"/stageout-test-{os.getpid()}/run"
        assert fs.exists(f"{root}/.stager/commits/step-2.pt.json")
        restored = restore_checkpoint(url, tmp_path / "local", log=log)
        assert restored.name == "step-2.pt" and same_tree(b, restored)
        fs.rm_file(f"{root}/.stager/commits/step-2.pt.json")  # un-committed: invisible
        restored = restore_checkpoint(url, tmp_path / "local", log=log)
        assert restored.name == "step-1" and same_tree(a, restored)
        assert [o.status for o in stage_out([a], url, StageOutOptions(keep=1, log=log))] == [
            "already"
        ]
    finally:
        log.close()
        fsspec.filesystem("memory").rm(f"/stageout-test-{os.getpid()}", recursive=True)


def test_import_stager_stageout_does_not_import_torch() -> None:
    code = (
        "import sys, stager, stager.stageout.run, stager.stageout.restore, "
        "stager.cli.commands.stage_out; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [str(BIN / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=clean_env(),
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_memory_url_abandoned_upload_leaves_no_keys(tmp_path: Path) -> None:
    """Marker mode uploads to final keys: an abandoned attempt must remove them again."""
    import fsspec

    from stager.stageout.deadline import Deadline
    from stager.stageout.run import StageOutOptions, stage_out

    root = f"/stageout-abandon-{os.getpid()}"
    try:
        ckpt = write_ckpt_dir(tmp_path / "scratch" / "step-1", files=4, size=400_000)
        options = StageOutOptions(
            deadline=Deadline.in_s(1.3, "--deadline-s"),
            bw_limit_mbps=1,
            assume_mbps=1000,
            log=io.StringIO(),
        )
        assert [o.status for o in stage_out([ckpt], f"memory://{root}", options)] == [
            "skipped-deadline"
        ]
        fs = fsspec.filesystem("memory")
        assert not fs.exists(f"{root}/step-1")
        assert not fs.exists(f"{root}/.stager/staging") or fs.ls(f"{root}/.stager/staging") == []
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_checkpoint_changing_during_the_copy_is_not_committed(tmp_path: Path) -> None:
    dest = tmp_path / "persist"
    ckpt = write_ckpt_dir(tmp_path / "scratch" / "step-1", files=6, size=300_000)
    proc = subprocess.Popen(
        [str(BIN / "stage-out"), "--bw-limit", "2", str(ckpt), str(dest)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = time.monotonic()
    while not staging_entries(dest) and proc.poll() is None and time.monotonic() - started < 20:
        time.sleep(0.01)
    with open(ckpt / "meta.json", "a") as handle:  # the trainer is still writing
        handle.write(" ")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CHECKPOINT, err
    assert "step-1 changed while it was copied" in err
    assert records(dest) == {} and not (dest / "step-1").exists() and staging_entries(dest) == []
    out = run_cli("stage-out", str(ckpt), str(dest))  # once it is stable, it goes through
    assert out.returncode == 0 and same_tree(ckpt, dest / "step-1")


def test_keep_says_when_it_skips_the_newest_checkpoint_here(tmp_path: Path) -> None:
    """A checkpoint committed with files dated in the future (a clock ahead) ranks first: a
    later ``--keep 1`` skipped every newer checkpoint without a line, under exit 0."""
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    skewed = write_ckpt_dir(scratch / "step-100", seed=1)
    set_mtime(skewed, time.time() + 3600)
    assert stage(dest, skewed, keep=1) == ["committed"]
    later = write_ckpt_dir(scratch / "step-200", seed=2)
    log = io.StringIO()
    from stager.stageout.run import StageOutOptions, stage_out

    outcomes = stage_out([str(later)], str(dest), StageOutOptions(log=log, keep=1))
    assert [o.status for o in outcomes] == ["skipped-keep"]
    warning = [line for line in log.getvalue().splitlines() if "warning" in line]
    assert len(warning) == 1 and "step-200" in warning[0] and "step-100 (" in warning[0], log
    assert "dated in the future" in warning[0]


_TRACED = "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat"


def _traced_stage_out(ckpt: Path, dest: Path, log: Path) -> list[tuple[str, list[str]]]:
    """Run the real ``stage-out`` under strace; its ``(call, [paths])`` in order: the durable
    order of a commit is only seen in the system calls (a test of the outcome cannot tell a
    record written before its data, or data never fsynced, until a crash comes)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    cmd = [strace, "-f", "-qq", "-e", "signal=none", "-y", "-s", "4096", "-e", f"trace={_TRACED}"]
    out = subprocess.run(
        [*cmd, "-o", str(log), str(BIN / "stage-out"), str(ckpt), str(dest)],
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    if "PTRACE" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(f"strace cannot trace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    calls = []
    for line in log.read_text().splitlines():
        match = re.match(r"\d+\s+(\w+)\((.*)\)\s+=\s+0\b", line)
        if match:  # quoted paths, and the paths -y shows for descriptors (fsync(5</a/b>))
            paths = re.findall(r'"((?:[^"\\]|\\.)*)"|<(/[^>]*)>', match.group(2))
            calls.append((match.group(1), [q or d for q, d in paths]))
    return calls


def test_a_commit_fsyncs_every_file_moves_the_data_in_then_writes_the_record(
    tmp_path: Path,
) -> None:
    """The order that makes a commit durable and atomic (store_posix): every file's bytes are
    fsynced before the checkpoint is renamed to ``DEST/NAME``, the old record goes before the
    new data takes its place, and the new record lands last. Recommitting a changed ``step-1``
    exercises all three."""
    dest = tmp_path / "persist"
    ckpt = write_ckpt_dir(tmp_path / "scratch" / "step-1", seed=1)
    assert stage(dest, ckpt) == ["committed"]
    write_ckpt_dir(ckpt, seed=2)  # the same name, other bytes
    calls = _traced_stage_out(ckpt, dest, tmp_path / "strace.log")

    target = os.path.realpath(dest / ckpt.name)
    record = os.path.realpath(dest / META_DIR / "commits" / f"{ckpt.name}.json")

    def first(found: list[int], what: str) -> int:
        assert found, f"no {what} in the trace: {calls}"
        return found[0]

    data_in = first(
        [i for i, (c, p) in enumerate(calls) if c.startswith("rename") and p[-1] == target],
        f"rename to {target}",
    )
    record_in = first(
        [i for i, (c, p) in enumerate(calls) if c.startswith("rename") and p[-1] == record],
        f"rename to {record}",
    )
    old_record_out = first(
        [i for i, (c, p) in enumerate(calls) if c.startswith("unlink") and p[-1] == record],
        f"unlink of {record}",
    )
    assert old_record_out < data_in < record_in, "the record must be removed first, written last"
    synced = {
        os.path.basename(p[0]).removesuffix(".partial")
        for c, p in calls[:data_in]
        if c in ("fsync", "fdatasync") and p and "/data/" in p[0]
    }
    files = {p.name for p in ckpt.rglob("*") if p.is_file()}
    assert files <= synced, f"not fsynced before the commit: {sorted(files - synced)}"
    assert same_tree(ckpt, dest / ckpt.name) and list(assert_committed_whole(dest)) == ["step-1"]
