"""Defects a hostile review of stage-out and restore found (2026-11-28), each as it was
reported: an empty step directory committed as the newest checkpoint (and the only real one
pruned); one unreadable checkpoint aborting the whole ``--all`` run; a symlinked directory
dropped; a FIFO hanging the run; a name that is not UTF-8 giving a traceback and an orphan; a
DEST inside the checkpoints' directory; damaged or junk records read as "nothing committed";
leftovers of a full DEST and of a killed record write."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from stager.errors import EXIT_CHECKPOINT, EXIT_DEST, EXIT_NO_CHECKPOINT, EXIT_USAGE

from .conftest import mount_tmpfs, run_cli


def _write(path: Path, size: int = 20_000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size) if seed < 0 else bytes((seed + i) % 251 for i in range(size)))
    return path


def _committed(dest: Path) -> list[str]:
    commits = dest / ".stager" / "commits"
    return (
        sorted(p.name[: -len(".json")] for p in commits.glob("*.json")) if commits.is_dir() else []
    )


def _leftovers(dest: Path) -> list[str]:
    """What is at DEST besides committed checkpoints and the empty .stager directories."""
    committed = set(_committed(dest))
    out = [p.name for p in dest.iterdir() if p.name != ".stager" and p.name not in committed]
    stager = dest / ".stager"
    out += [str(p.relative_to(dest)) for p in stager.rglob("*") if p.is_file()]
    out = [x for x in out if x != ".stager/commit.lock"]  # the commit lock stays, empty
    return sorted(x for x in out if not x.endswith(".json") or ".partial" in x)


@pytest.mark.parametrize("committed_before", [True, False])
def test_an_empty_newer_step_directory_is_not_a_checkpoint(
    tmp_path: Path, committed_before: bool
) -> None:
    """The trainer has just made step-2000 when the USR1 lands. Before, it was committed as the
    newest checkpoint and --keep 1 pruned the only real one (restore: an empty directory, exit
    0); or, step-1000 not committed yet, --keep ranked the empty one first and nothing was
    committed (restore: exit 9, training from scratch)."""
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1000" / "model.pt")
    if committed_before:
        assert run_cli("stage-out", "--all", "--keep", "1", str(ckpt), str(dest)).returncode == 0
    (ckpt / "step-2000").mkdir()
    os.utime(ckpt / "step-2000", ns=(2**62, 2**62))  # newest by far
    result = run_cli("stage-out", "--all", "--keep", "1", str(ckpt), str(dest))
    assert result.returncode == 0, result.stderr
    assert _committed(dest) == ["step-1000"]
    restored = run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(tmp_path / "r"))
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip().endswith("step-1000")
    named = run_cli("stage-out", str(ckpt / "step-2000"), str(dest))  # named on its own
    assert named.returncode == EXIT_CHECKPOINT  # (not committed: said, not exit 0)
    assert "skipped step-2000: an empty directory" in named.stderr
    assert _committed(dest) == ["step-1000"]


def test_a_directory_of_empty_step_directories_has_no_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    (ckpt / "step-1").mkdir(parents=True)
    result = run_cli("stage-out", "--all", str(ckpt), str(tmp_path / "dest"))
    assert result.returncode == EXIT_NO_CHECKPOINT, result.stderr


def test_one_unreadable_checkpoint_does_not_stop_the_others(tmp_path: Path) -> None:
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1" / "model.pt", seed=1)
    _write(ckpt / "step-3" / "model.pt", seed=3)
    bad = ckpt / "step-2" / os.fsdecode(b"sub\xffdir")
    _write(bad / "f", seed=2)
    result = run_cli("stage-out", "--all", str(ckpt), str(dest))
    assert result.returncode == EXIT_CHECKPOINT, result.stderr
    assert "Traceback" not in result.stderr
    assert "not valid UTF-8" in result.stderr and "sub\\xffdir" in result.stderr
    assert _committed(dest) == ["step-1", "step-3"]
    assert _leftovers(dest) == []  # no orphan under the bad name


def test_a_symlinked_directory_is_staged_and_a_fifo_or_dangling_link_skipped(
    tmp_path: Path,
) -> None:
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1" / "model.pt", seed=1)
    _write(tmp_path / "elsewhere" / "optim" / "state.pt", seed=2)
    (ckpt / "step-1" / "optim").symlink_to(tmp_path / "elsewhere" / "optim")
    os.mkfifo(ckpt / "step-1" / "fifo")
    (ckpt / "step-1" / "gone").symlink_to(tmp_path / "nowhere")
    result = run_cli("stage-out", str(ckpt / "step-1"), str(dest), timeout=60)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warned) == 2 and "'step-1/fifo'" in warned[0] + warned[1]
    restored = run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(tmp_path / "r"))
    assert restored.returncode == 0, restored.stderr
    back = Path(restored.stdout.strip())
    assert (back / "optim" / "state.pt").read_bytes() == (
        tmp_path / "elsewhere" / "optim" / "state.pt"
    ).read_bytes()
    assert sorted(p.name for p in back.iterdir()) == ["model.pt", "optim"]


def test_a_directory_loop_is_refused_in_one_line(tmp_path: Path) -> None:
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1" / "model.pt")
    (ckpt / "step-1" / "again").symlink_to(ckpt / "step-1")
    result = run_cli("stage-out", str(ckpt / "step-1"), str(dest))
    assert result.returncode == EXIT_CHECKPOINT, result.stderr
    assert "symlink loop" in result.stderr and "Traceback" not in result.stderr
    assert _committed(dest) == []


@pytest.mark.parametrize("where", ["ck", "ck/persist", "ck/step-1/inner"])
def test_a_dest_inside_the_checkpoints_directory_is_refused(tmp_path: Path, where: str) -> None:
    ckpt = tmp_path / "ck"
    _write(ckpt / "step-1" / "model.pt")
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    single = where.endswith("inner")
    argv = [str(ckpt / "step-1")] if single else ["--all", str(ckpt)]
    result = run_cli("stage-out", *argv, str(tmp_path / where))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "the checkpoints are" in result.stderr
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before


def test_a_damaged_record_is_not_read_as_nothing_committed(tmp_path: Path) -> None:
    """Exit 9 tells the template to start from scratch: over a damaged record that would lose
    the run. Exit 7 says committed checkpoints exist but none is whole."""
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1.pt")
    assert run_cli("stage-out", str(ckpt / "step-1.pt"), str(dest)).returncode == 0
    record = dest / ".stager" / "commits" / "step-1.pt.json"
    record.write_bytes(record.read_bytes()[:20])
    result = run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(tmp_path / "r"))
    assert result.returncode == EXIT_CHECKPOINT, result.stderr


def test_junk_in_the_commits_directory_is_skipped_with_a_warning(tmp_path: Path) -> None:
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1.pt")
    assert run_cli("stage-out", str(ckpt / "step-1.pt"), str(dest)).returncode == 0
    (dest / ".stager" / "commits" / "junk.json").mkdir()
    result = run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    assert "junk.json is a directory" in result.stderr
    pruned = run_cli("stage-out", "--keep", "1", str(ckpt / "step-1.pt"), str(dest))
    assert pruned.returncode == 0, pruned.stderr


def test_a_record_temp_file_of_a_dead_writer_is_cleaned(tmp_path: Path) -> None:
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1.pt")
    commits = dest / ".stager" / "commits"
    commits.mkdir(parents=True)
    host = socket.gethostname().split(".")[0].replace("__", "_")
    dead = commits / f"step-1.pt.json.{host}__{2**22 + 12345}.partial"  # past pid_max
    dead.write_text("{")
    assert run_cli("stage-out", str(ckpt / "step-1.pt"), str(dest)).returncode == 0
    assert not dead.exists()
    assert _leftovers(dest) == []


def test_a_dest_full_at_the_commit_leaves_nothing_uncommitted(tmp_path: Path) -> None:
    """Room for the data but not for its record: before, the data stayed at DEST/NAME with no
    record and no attempt that a later run would clean."""
    ckpt = tmp_path / "ck"
    data = _write(ckpt / "step-9.pt", size=1 << 20, seed=-1)
    with mount_tmpfs(tmp_path / "small", "2m") as fs:
        dest = fs / "dest"
        (dest / ".stager" / "commits").mkdir(parents=True)
        (dest / ".stager" / "staging").mkdir()
        free = os.statvfs(fs)
        (fs / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - (1 << 20) - 4096))
        result = run_cli("stage-out", str(data), str(dest))
        assert result.returncode == EXIT_DEST, result.stderr
        assert "Traceback" not in result.stderr
        assert _committed(dest) == [] and _leftovers(dest) == []
        (fs / "filler").unlink()
        assert run_cli("stage-out", str(data), str(dest)).returncode == 0
        assert (dest / "step-9.pt").read_bytes() == data.read_bytes()
        assert _leftovers(dest) == []


def test_a_newer_directory_of_only_a_dangling_link_is_not_a_checkpoint(tmp_path: Path) -> None:
    """``has_files`` counted what the snapshot skips (a symlink to nothing, a FIFO): --keep 1
    then ranked that directory newest and committed nothing."""
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1000" / "model.pt")
    (ckpt / "step-2000").mkdir()
    (ckpt / "step-2000" / "model.pt").symlink_to(tmp_path / "not-yet")
    os.utime(ckpt / "step-2000", ns=(2**62, 2**62))
    result = run_cli("stage-out", "--all", "--keep", "1", str(ckpt), str(dest))
    assert result.returncode == 0, result.stderr
    assert _committed(dest) == ["step-1000"]


def _at_once(target, argsets: list[tuple], timeout_s: float) -> None:  # noqa: ANN001
    """``target(barrier, *args, errors)`` in one forked process per ``args``, released together
    by the barrier; fails with the first error a process reported."""
    import multiprocessing as mp

    context = mp.get_context("fork")
    barrier, errors = context.Barrier(len(argsets)), context.Queue()
    workers = [context.Process(target=target, args=(barrier, *a, errors)) for a in argsets]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=timeout_s)
    assert errors.empty(), errors.get()


def _stage_out_after(barrier, source: str, dest: str, errors) -> None:  # noqa: ANN001 - mp types
    import io

    from stager.stageout.run import StageOutOptions, stage_out

    barrier.wait()
    try:
        stage_out([source], dest, StageOutOptions(log=io.StringIO()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(exc).__name__}: {exc}")


def test_two_stage_outs_of_one_name_with_different_bytes_leave_a_true_record(
    tmp_path: Path,
) -> None:
    """From two scratch directories their node-local locks differ: the commits interleaved,
    and a record could describe the other copy's bytes (the tester: 20 of 300 trials, and
    false 'not usable' errors). The commit of a name holds a lock at DEST."""
    import json

    from stager.storage.hashing import hash_file

    dest = tmp_path / "dest"
    for trial in range(40):
        sources = []
        for tag in "ab":  # new files each trial: a rewrite within a clock tick looks unchanged
            sources.append(
                str(_write(tmp_path / f"{tag}{trial}" / "last.pt", size=65_536, seed=-1))
            )
        _at_once(_stage_out_after, [(s, str(dest)) for s in sources], timeout_s=60)
        record = json.loads((dest / ".stager" / "commits" / "last.pt.json").read_text())
        described = record["files"][0]["hash"]
        assert hash_file(dest / "last.pt") == described, f"trial {trial}"
        assert described in {hash_file(s) for s in sources}


def _copy_after(barrier, src: str, dst: str, errors) -> None:  # noqa: ANN001 - mp types
    from stager.storage.copy import copy_file

    barrier.wait()
    try:
        for _ in range(3):
            copy_file(None, src, dst)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(exc).__name__}: {exc}")


def test_processes_forked_after_a_copy_do_not_share_its_buffer(tmp_path: Path) -> None:
    """The copy buffer was a shared anonymous mapping (mmap's default): processes forked after
    a copy (DataLoader workers, multiprocessing children) wrote into one another's bytes. The
    race test above found it as a hash mismatch of a source nobody changed."""
    from stager.storage.copy import copy_file

    first = _write(tmp_path / "warm.bin", size=1 << 20, seed=-1)
    copy_file(None, str(first), tmp_path / "warm.copy")  # this process's buffer exists now
    sources = [_write(tmp_path / f"s{i}.bin", size=12 << 20, seed=-1) for i in range(2)]
    _at_once(_copy_after, [(str(s), str(s) + ".copy") for s in sources], timeout_s=120)
    for source in sources:
        assert Path(str(source) + ".copy").read_bytes() == source.read_bytes()


def test_watch_says_each_line_once_not_every_pass(tmp_path: Path) -> None:
    """A pass a minute for a day printed every line each time ("already committed" per kept
    checkpoint, the same FAILED line for one that cannot succeed). Each is said once; a
    checkpoint that is mended is then said as committed."""
    import io
    import threading

    from stager.signalevent import SignalSafeEvent
    from stager.stageout.run import StageOutOptions
    from stager.stageout.snapshot import list_checkpoints
    from stager.stageout.watch import watch

    ckpts = tmp_path / "ck"
    (ckpts / "step-1").mkdir(parents=True)
    (ckpts / "step-1" / "model.pt").write_bytes(b"weights")
    bad = ckpts / "step-2" / os.fsdecode(b"opt\xff.pt")
    bad.parent.mkdir()
    bad.write_bytes(b"state")
    log = io.StringIO()
    stop = SignalSafeEvent()
    passes: list[int] = []
    mended = threading.Event()

    def on_pass(_outcomes: object) -> None:
        passes.append(1)
        if len(passes) == 4:
            bad.rename(bad.with_name("opt.pt"))  # the user renames it
            mended.set()
        if len(passes) == 7:
            stop.set()

    options = StageOutOptions(log=log, settle_s=0)
    watch(
        lambda: list_checkpoints(ckpts), str(tmp_path / "out"), options,
        interval_s=0.01, stop=stop, on_pass=on_pass,
    )  # fmt: skip
    lines = log.getvalue().splitlines()
    assert sum("not valid UTF-8" in line for line in lines) == 1, lines
    assert sum("step-1 already committed" in line for line in lines) == 1, lines
    assert sum("committed step-2" in line for line in lines) == 1, lines
    assert lines[-1].startswith("stage-out: watch stopped after 7 pass(es)")


def test_watch_says_every_commit_even_in_the_same_words(tmp_path: Path) -> None:
    """A fixed-name checkpoint (Lightning's last.ckpt) rewritten each pass is committed each
    pass, and its commit lines read the same (size, time, rate): each must still be said."""
    import io

    from stager.signalevent import SignalSafeEvent
    from stager.stageout.run import StageOutOptions
    from stager.stageout.watch import watch

    ckpt = tmp_path / "ck" / "last.ckpt"
    ckpt.parent.mkdir()
    log = io.StringIO()
    stop = SignalSafeEvent()
    passes: list[int] = []

    def listing() -> list[Path]:
        passes.append(1)
        ckpt.write_bytes(b"v%03d" % len(passes))  # new bytes, same size, every pass
        if len(passes) == 5:
            stop.set()  # (this pass commits nothing: stop is checked before each checkpoint)
        return [ckpt]

    options = StageOutOptions(log=log, settle_s=0)
    watch(listing, str(tmp_path / "out"), options, interval_s=0.01, stop=stop)
    commits = [line for line in log.getvalue().splitlines() if "committed last.ckpt" in line]
    assert len(commits) == 4, log.getvalue()
    assert (tmp_path / "out" / "last.ckpt").read_bytes() == b"v004"


@pytest.mark.parametrize("store", ["posix", "object"])
def test_a_file_gone_mid_copy_skips_its_checkpoint_and_the_rest_of_all_is_committed(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of a checkpoint removed while the checkpoint was copied (a trainer replacing
    it) ended the whole --all run in stage-in's words (`source shard not found`, exit 3, and
    for an object store a destination error), the other checkpoints uncommitted. It is a
    checkpoint that changed: its own line, the others committed, exit 7 (docs/stage-out.md)."""
    import io

    from stager.stageout import store_object, store_posix
    from stager.stageout.outcome import CHANGED, COMMITTED, check_outcomes
    from stager.stageout.run import StageOutOptions, stage_out

    from .test_stageout import write_ckpt_dir

    ckpts = tmp_path / "ck"
    settled = write_ckpt_dir(ckpts / "step-1", seed=1)
    moving = write_ckpt_dir(ckpts / "step-2", seed=2)
    os.utime(settled, (1_700_000_000, 1_700_000_000))
    cls = store_posix.LocalCommitStore if store == "posix" else store_object.ObjectCommitStore
    real = cls.put_file

    def trainer_removes_a_file(self, attempt, src, relpath, *args, **kwargs):
        if relpath.startswith("step-2/"):
            (moving / "optim" / "part-3.bin").unlink(missing_ok=True)
        return real(self, attempt, src, relpath, *args, **kwargs)

    monkeypatch.setattr(cls, "put_file", trainer_removes_a_file)
    dest = str(tmp_path / "dest") if store == "posix" else f"memory://gone-{os.getpid()}/run"
    log = io.StringIO()
    outcomes = stage_out([settled, moving], dest, StageOutOptions(log=log))
    assert {o.name: o.status for o in outcomes} == {"step-1": COMMITTED, "step-2": CHANGED}
    with pytest.raises(Exception) as raised:
        check_outcomes(outcomes)
    assert getattr(raised.value, "exit_code", None) == EXIT_CHECKPOINT


def test_a_checkpoint_file_its_user_cannot_read_is_one_line_and_the_rest_committed(
    tmp_path: Path,
) -> None:
    """Run as a user is (root without its permission override): a checkpoint file the job's user
    cannot read (a root-owned file the trainer's container left, mode 000) was listed, then its
    hash raised PermissionError: a traceback, exit 1, and with --all nothing else committed at
    the job's end."""
    import shutil
    import subprocess

    from .conftest import BIN, clean_env

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without the permission override")
    as_a_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    ckpt, dest = tmp_path / "ck", tmp_path / "dest"
    _write(ckpt / "step-1.pt", seed=1)
    os.utime(ckpt / "step-1.pt", ns=(10**18, 10**18))
    _write(ckpt / "step-2" / "model.pt", seed=2)
    _write(ckpt / "step-2" / "optim.pt", seed=3).chmod(0)

    def stage_out(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [*as_a_user, str(BIN / "stage-out"), *args]
        return subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120)

    one = stage_out(str(ckpt / "step-2"), str(dest))
    assert one.returncode == EXIT_CHECKPOINT, one.stderr
    assert "Traceback" not in one.stderr and len(one.stderr.splitlines()) == 1, one.stderr
    assert "optim.pt: Permission denied" in one.stderr
    every = stage_out("--all", str(ckpt), str(dest))
    assert every.returncode == EXIT_CHECKPOINT, every.stderr
    assert "Traceback" not in every.stderr
    assert _committed(dest) == ["step-1.pt"]
    assert _leftovers(dest) == []


def test_all_commits_the_older_checkpoints_that_fit_when_the_newest_fills_dest(
    tmp_path: Path,
) -> None:
    """A full DEST failed the whole ``--all`` at the newest checkpoint (often the largest: the
    one with the optimizer state), though its attempt was removed and the older ones fit: the
    job's end then committed nothing, and a requeue trained from scratch. Now each that fits
    is committed, and the run still exits 5 naming the one that did not."""
    ckpt = tmp_path / "ck"
    _write(ckpt / "step-1.pt", size=1 << 20, seed=1)
    os.utime(ckpt / "step-1.pt", ns=(10**18, 10**18))
    _write(ckpt / "step-2.pt", size=6 << 20, seed=2)  # newest: does not fit in 4 MiB
    with mount_tmpfs(tmp_path / "small", "4m") as fs:
        dest = fs / "dest"
        result = run_cli("stage-out", "--all", str(ckpt), str(dest))
        assert result.returncode == EXIT_DEST, result.stderr
        assert "Traceback" not in result.stderr
        assert "is full while writing step-2.pt" in result.stderr.splitlines()[-1]
        assert _committed(dest) == ["step-1.pt"] and _leftovers(dest) == []
        restored = run_cli("stage-in", "--checkpoint", str(dest), "--dest", str(tmp_path / "r"))
        assert restored.returncode == 0 and restored.stdout.strip().endswith("step-1.pt")
