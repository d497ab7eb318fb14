"""stage-in --checkpoint: newest committed wins, damaged ones are skipped, ranks restore once."""

from __future__ import annotations

import subprocess
from pathlib import Path

from stager.errors import EXIT_CHECKPOINT
from stager.stageout.store import META_DIR

from .conftest import BIN, clean_env
from .test_stageout import (
    restore,
    restore_here,
    same_tree,
    set_mtime,
    stage,
    write_ckpt_dir,
    write_ckpt_file,
)


def _two_committed(tmp_path: Path) -> tuple[Path, Path, Path]:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    old = write_ckpt_dir(scratch / "step-1", seed=1)
    new = write_ckpt_dir(scratch / "step-2", seed=2)
    set_mtime(old, 1_700_000_000)
    set_mtime(new, 1_700_000_100)
    assert stage(dest, old, new) == ["committed", "committed"]
    return old, new, dest


def test_restores_the_newest_by_checkpoint_time_not_commit_time(tmp_path: Path) -> None:
    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    new = write_ckpt_file(scratch / "b.pt", seed=2)
    set_mtime(new, 1_700_000_100)
    old = write_ckpt_file(scratch / "a.pt", seed=1)
    set_mtime(old, 1_700_000_000)
    assert stage(dest, new) == ["committed"]
    assert stage(dest, old) == ["committed"]  # committed last, but older
    got = restore(dest, tmp_path / "local")
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).name == "b.pt"


def test_a_damaged_newest_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    old, new, dest = _two_committed(tmp_path)
    victim = next(p for p in (dest / "step-2").rglob("*.bin"))
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, wrong bytes (bit rot)
    got = restore(dest, tmp_path / "local")
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).name == "step-1"
    assert same_tree(old, Path(got.stdout.strip()))
    assert "step-2" in got.stderr and "trying the next newest" in got.stderr
    assert not (tmp_path / "local" / "step-2").exists()  # nothing half restored

    (dest / "step-1" / "meta.json").unlink()
    got = restore(dest, tmp_path / "local2")
    assert got.returncode == EXIT_CHECKPOINT
    assert got.stdout == "" and "none could be restored whole" in got.stderr


def test_uncommitted_data_is_never_restored(tmp_path: Path) -> None:
    old, new, dest = _two_committed(tmp_path)
    (dest / META_DIR / "commits" / "step-2.json").unlink()  # as if killed before the record
    assert restore_here(dest, tmp_path / "local").name == "step-1"


def test_restore_again_is_a_no_op_and_replaces_a_stale_local_copy(tmp_path: Path) -> None:
    old, new, dest = _two_committed(tmp_path)
    path = restore_here(dest, tmp_path / "local")
    marker = path / "meta.json"
    before = marker.stat().st_mtime_ns
    assert restore_here(dest, tmp_path / "local") == path
    assert marker.stat().st_mtime_ns == before  # not copied again
    (path / "part-0.bin").write_bytes(b"local edits")  # a local copy that no longer matches
    assert restore_here(dest, tmp_path / "local") == path and same_tree(new, path)
    # changed in place at the same size: trusted by its size before, and loaded damaged
    data = bytearray((path / "part-0.bin").read_bytes())
    data[0] ^= 0xFF
    with open(path / "part-0.bin", "r+b") as damaged:
        damaged.write(bytes(data[:1]))
    assert restore_here(dest, tmp_path / "local") == path and same_tree(new, path)


def test_all_ranks_restoring_at_once_copy_once_and_print_one_path(tmp_path: Path) -> None:
    old, new, dest = _two_committed(tmp_path)
    local = tmp_path / "local"
    procs = [
        subprocess.Popen(
            [str(BIN / "stage-in"), "--checkpoint", str(dest), "--dest", str(local)],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    assert len({out for out, _ in outs}) == 1
    assert same_tree(new, Path(outs[0][0].strip()))
    assert not list(local.glob(".stager-restore-*"))


def test_a_sigterm_mid_restore_is_one_line_exit_130_and_leaves_nothing_partial(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """scancel or a requeue during restore: the process died by the signal (exit 143, no
    line) and left its staging directory with a ``.partial`` in it. The signal now stops the
    copy as in stage-in: one line, exit 130, nothing partial; a rerun restores whole."""
    import os
    import signal

    import stager.stageout.restore as restore_module
    from stager.errors import EXIT_INTERRUPTED

    from .inproc import clean_process_env, run_main

    clean_process_env(monkeypatch)
    _, new, dest = _two_committed(tmp_path)
    real = restore_module.copy_file

    def signalled_mid_copy(*args, **kwargs):  # (the signal arrives with the first bytes)
        kwargs["on_bytes"] = lambda _n: os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "copy_file", signalled_mid_copy)
    local = tmp_path / "local"
    result = run_main(capsys, "stage-in", "--checkpoint", str(dest), "--dest", str(local))
    assert result.returncode == EXIT_INTERRUPTED, result.stderr
    assert result.stderr.strip().splitlines() == [
        "stage-in: interrupted (SIGTERM); rerun to resume"
    ]
    assert sorted(p.name for p in local.iterdir()) == [".stager-restore.lock"]
    monkeypatch.setattr(restore_module, "copy_file", real)
    assert same_tree(new, restore_here(dest, local))


def test_a_commit_killed_after_the_old_record_went_is_not_a_first_start(tmp_path: Path) -> None:
    """``last.pt`` re-committed each epoch: a kill -9 between the old record's removal and the new
    record's write (the job's KillWait running out in the TERM trap's stage-out) left the new
    data at DEST/last.pt, no record, and a dead attempt. Restore said "no committed checkpoint
    yet" (exit 9), which the templates take for a first start: the requeued job trained from
    step 0 and then committed over the only checkpoint. It is exit 7 now, naming it."""
    import json
    import os

    scratch, dest = tmp_path / "scratch", tmp_path / "persist"
    last = write_ckpt_file(scratch / "last.pt", seed=1)
    assert stage(dest, last) == ["committed"]
    (dest / META_DIR / "commits" / "last.pt.json").unlink()  # the window's state, as killed:
    attempt = dest / META_DIR / "staging" / "node1__999999__0badf00d"  # (a dead attempt)
    attempt.mkdir(parents=True)
    intent = {"name": "last.pt", "host": "node1", "pid": 999999, "started_at": 1.0}
    (attempt / "intent.json").write_text(json.dumps(intent))
    result = subprocess.run(
        [str(BIN / "stage-in"), "--checkpoint", str(dest), "--dest", str(tmp_path / "r")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_CHECKPOINT, result.stderr
    assert f"{dest}/last.pt has no commit record" in result.stderr
    assert result.stdout == "" and os.path.exists(dest / "last.pt")
