"""Ctrl-C and SIGTERM during a foreground stage-in: the copies in flight stop at their next
block and delete their ``.partial``, the run exits 130 with one line, and a rerun completes.

(SIGKILL cannot be handled: tests/test_faults.py checks that what it leaves is never trusted.)
"""

from __future__ import annotations

import dis
import filecmp
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stager.errors import EXIT_INTERRUPTED
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.workers import run_in_threads

from .conftest import BIN, clean_env, run_cli


class _Interrupted(Exception):
    pass


def test_an_interrupt_stops_the_items_in_progress_and_outlives_no_thread() -> None:
    """The caller's thread is interrupted while it waits: ``on_interrupt`` runs once, no item
    is taken after it, and the exception comes out only after every thread has finished."""
    told = threading.Event()
    started: list[int] = []
    finished: list[int] = []

    def raise_here(_signum: int, _frame: object) -> None:
        raise _Interrupted

    def work(item: int) -> None:
        started.append(item)
        if item == 0:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
        assert told.wait(30), "on_interrupt never ran"
        time.sleep(0.05)  # still working after the interrupt: the caller must wait for this
        finished.append(item)

    previous = signal.signal(signal.SIGUSR1, raise_here)
    try:
        with pytest.raises(_Interrupted):
            run_in_threads(work, range(100), 4, on_interrupt=told.set)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert told.is_set()
    assert sorted(finished) == sorted(started)  # nothing was left half-way
    assert len(started) <= 4  # only the items in progress when it came; none after


def test_an_interrupt_at_any_bytecode_of_the_wait_leaves_no_item_running() -> None:
    """A signal's handler runs between two bytecodes of the waiting thread; which ones may
    check for it differs between CPython versions. So raise at each bytecode of
    run_in_threads from the first thread's start on (a trace hook): no item may finish after
    the call has ended, and whenever items were still in progress, on_interrupt ran. (In the
    version before, at six such points the exception left before the threads were told, and
    they ran on.)"""
    code = run_in_threads.__code__
    instructions = list(dis.get_instructions(code))
    first_start = min(i.offset for i in instructions if i.argval == "start")
    tried = 0
    for target in [i.offset for i in instructions if i.offset >= first_start]:
        fired: list[int] = []
        told: list[bool] = []
        done: list[int] = []

        def work(item: int, done: list[int] = done) -> None:
            time.sleep(0.02)
            done.append(item)

        def tracer(frame, event, _arg, target=target, fired=fired, done=done):  # noqa: ANN001, ANN202
            if frame.f_code is not code:
                return None
            frame.f_trace_opcodes = True
            if event == "opcode" and frame.f_lasti == target and not fired:
                fired.append(len(done))
                raise _Interrupted
            return tracer

        sys.settrace(tracer)
        try:
            run_in_threads(work, range(6), 3, on_interrupt=lambda told=told: told.append(True))
        except _Interrupted:
            pass
        finally:
            sys.settrace(None)
        if not fired:
            continue  # a branch this run does not take
        tried += 1
        ended_with = len(done)
        time.sleep(0.1)
        assert len(done) == ended_with, f"offset {target}: items finished after the call ended"
        if ended_with < 6:
            assert told, f"offset {target}: items were stopped without on_interrupt"
    assert tried >= 10


@pytest.mark.parametrize("started", [True, False], ids=["after-start", "before-start"])
def test_an_interrupt_while_the_first_thread_starts(
    monkeypatch: pytest.MonkeyPatch, started: bool
) -> None:
    """Interrupted inside the first ``Thread.start``: if the thread began, its item is told
    and waited for; if it never began, nothing is taken. Either way the exception comes out."""
    original = threading.Thread.start
    taken: list[int] = []
    finished: list[int] = []
    told = threading.Event()

    def interrupted_start(thread: threading.Thread) -> None:
        if threading.current_thread() is threading.main_thread():
            if started:
                original(thread)
            raise _Interrupted
        original(thread)

    def work(item: int) -> None:
        taken.append(item)
        told.wait(30)
        finished.append(item)

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(_Interrupted):
        run_in_threads(work, range(100), 4, on_interrupt=told.set)
    assert told.is_set()
    assert sorted(finished) == sorted(taken)
    assert len(taken) <= 4 if started else taken == []


def test_on_one_thread_an_interrupt_in_an_item_calls_on_interrupt_too() -> None:
    """With one thread the items run on the caller's: a KeyboardInterrupt raised in one is
    the interrupt (held copies must still be deleted), an ordinary error is not."""
    told: list[bool] = []
    seen: list[int] = []

    def work(item: int) -> None:
        seen.append(item)
        if item == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_in_threads(work, range(10), 1, on_interrupt=lambda: told.append(True))
    assert told == [True] and seen == [0, 1, 2, 3]

    def fail(item: int) -> None:
        raise ValueError(item)

    told.clear()
    with pytest.raises(ValueError):
        run_in_threads(fail, range(10), 1, on_interrupt=lambda: told.append(True))
    assert told == []


def _restore_default_signals() -> None:
    """A test runner started in the background (``cmd &``) ignores SIGINT, and a child would
    inherit that; a job step's processes start with the defaults."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 shards of ~2 MB: at --bw-limit 2 the run takes ~4 s, so a signal finds copies in
    flight."""
    src = tmp_path_factory.mktemp("interrupt") / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=4, samples_per_shard=20, image_bytes=100_000)
    )
    return src


def _launch(argv: list[object]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(a) for a in argv],
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_restore_default_signals,
    )


def _start(source: Path, dest: Path) -> subprocess.Popen[str]:
    argv = [BIN / "stage-in", source, "--dest", dest, "--bw-limit", "2", "--jobs", "2"]
    return _launch([*argv, "--progress", "none", "--jitter-max", "0"])


def _await_partials(dest: Path, count: int) -> None:
    """Until ``count`` copies are in flight (or held) under ``dest``; fails after 30 s."""
    deadline = time.monotonic() + 30
    while len(list(dest.rglob("*.partial"))) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(list(dest.rglob("*.partial"))) >= count, "the copies were not caught in flight"


def _check_left(source: Path, dest: Path) -> None:
    """Nothing partial anywhere; every file under a shard's final name is that shard."""
    assert not [p for p in dest.rglob("*.partial")], "a .partial was left behind"
    for staged in (dest / "ds").glob("*.tar") if (dest / "ds").exists() else []:
        assert filecmp.cmp(staged, source / staged.name, shallow=False), staged.name


def _rerun_completes(source: Path, dest: Path) -> None:
    result = run_cli("stage-in", str(source), "--dest", str(dest), "--quiet", "--jitter-max", "0")
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in source.glob("*.tar"))
    assert sorted(p.name for p in (dest / "ds").glob("*.tar")) == names
    _check_left(source, dest)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("manifest", [False, True], ids=["walked", "manifest"])
def test_a_signal_mid_copy_leaves_no_partial_and_exits_130(
    source: Path, tmp_path: Path, sig: int, manifest: bool
) -> None:
    if manifest:
        src = tmp_path / "src" / "ds"
        src.mkdir(parents=True)
        for shard in source.glob("*.tar"):
            (src / shard.name).write_bytes(shard.read_bytes())
        assert run_cli("stager", "index", str(src)).returncode == 0
    else:
        src = source
    dest = tmp_path / "scratch"
    proc = _start(src, dest)
    _await_partials(dest, 1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last and "rerun" in last, err
    if sig == signal.SIGTERM:
        assert "SIGTERM" in last
    assert "Traceback" not in err
    _check_left(src, dest)
    _rerun_completes(src, dest)


def _signal_trial(source: Path, tmp_path: Path, seed: int) -> None:
    """SIGTERM or SIGINT at a random moment once staging began (locking, listing, copies, the
    finish): the run ends 0 or 130 with one line, never leaves a .partial or a wrong final
    file, and a rerun completes. (Before that, the interpreter is still importing: Python's
    own Ctrl-C traceback, or SIGTERM's default death, and nothing on scratch yet.)"""
    rng = random.Random(seed)
    dest = tmp_path / f"run{seed}"
    proc = _start(source, dest)
    deadline = time.monotonic() + 30
    while not (dest / "ds").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 4.5))  # the whole run takes ~4 s
    proc.send_signal(rng.choice([signal.SIGINT, signal.SIGTERM]))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, EXIT_INTERRUPTED), f"seed {seed}: {err}"
    assert "Traceback" not in err, f"seed {seed}: {err}"
    _check_left(source, dest)
    _rerun_completes(source, dest)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_signal_at_a_random_moment_leaves_nothing_partial(
    source: Path, tmp_path: Path, seed: int
) -> None:
    _signal_trial(source, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_a_signal_at_a_random_moment_leaves_nothing_partial_many(
    source: Path, tmp_path: Path, seed: int
) -> None:
    _signal_trial(source, tmp_path, seed)


# The listing of a walked source, slowed as NFS would (50 ms a directory): copies finish while
# the walk goes on, and are held as .partial until the last size is in (the free-space check).
_SLOW_WALK = """
import sys, time
import stager.storage.listing as listing
walk_one = listing._list_dir
def slow(*args, **kwargs):
    time.sleep(0.05)
    return walk_one(*args, **kwargs)
listing._list_dir = slow
from stager.cli.main import stage_in_main
sys.exit(stage_in_main(sys.argv[1:]))
"""


@pytest.mark.parametrize("jobs", ["1", "4"])
def test_copies_held_for_the_free_space_check_are_deleted_on_sigterm(
    tmp_path: Path, jobs: str
) -> None:
    flat = tmp_path / "flat"
    write_synthetic_dataset(flat, SyntheticSpec(num_shards=80, samples_per_shard=2))
    source = tmp_path / "ds"
    for number, shard in enumerate(sorted(flat.glob("*.tar"))):
        (source / f"d{number:03d}").mkdir(parents=True)
        shard.rename(source / f"d{number:03d}" / shard.name)
    dest = tmp_path / "scratch"
    argv = [str(source), "--dest", str(dest), "--jobs", jobs, "--progress", "none"]
    proc = _launch([sys.executable, "-c", _SLOW_WALK, *argv, "--jitter-max", "0"])
    _await_partials(dest, 3)  # held: the walk is far from its end
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "interrupted (SIGTERM)" in err.strip().splitlines()[-1]
    assert not list(dest.rglob("*.partial")), "held copies were left behind"
    assert not list(dest.rglob("*.tar")), "a held copy was published without the verdict"


def test_a_signal_ends_the_bandwidth_caps_sleep_not_after_it(tmp_path: Path) -> None:
    """Under ``--bw-limit`` a copy sleeps off its share of the cap: 8 streams of 2 MB at
    0.1 MB/s owe ~160 s between them once their second blocks are read. A signal must end
    those sleeps, not wait them out (this run took over 30 s before): Slurm's SIGKILL follows
    SIGTERM after 30 s by default."""
    source = tmp_path / "ds"
    write_synthetic_dataset(
        source, SyntheticSpec(num_shards=8, samples_per_shard=20, image_bytes=100_000)
    )
    dest = tmp_path / "scratch"
    argv = [BIN / "stage-in", source, "--dest", dest, "--bw-limit", "0.1", "--jobs", "8"]
    proc = _launch([*argv, "--fixed-jobs", "--progress", "none", "--jitter-max", "0"])
    _await_partials(dest, 8)
    time.sleep(3.0)  # streams have read their second block and sleep off the cap
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("stage-in waited out the --bw-limit sleeps after SIGTERM")
    assert proc.returncode == EXIT_INTERRUPTED, err
    _check_left(source, dest)


def test_a_halt_ends_a_pause_at_once_and_follows_a_given_stop() -> None:
    """Halt.pause is the --bw-limit sleep and a retry's back-off: a stop ends it (background
    stage-in hands its own stop event in, so its back-offs end on SIGTERM too)."""
    from stager.stagein.pacing import CopierStopped, Halt

    stop = threading.Event()
    halt = Halt(stop)
    halt.check()
    halt.pause(0)  # not stopped: sleeps, returns
    outcome: list[str] = []

    def pause() -> None:
        try:
            halt.pause(600)
            outcome.append("slept it out")
        except CopierStopped:
            outcome.append("stopped")

    sleeper = threading.Thread(target=pause)
    sleeper.start()
    stop.set()
    sleeper.join(30)
    assert outcome == ["stopped"]
    with pytest.raises(CopierStopped):
        halt.check()


@pytest.mark.parametrize("entry", ["stage-in", "stager"])
def test_an_interrupt_while_the_command_imports_is_one_line_and_its_code(
    entry: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in the first ~0.1 s, while the command's modules import, printed Python's
    traceback and exited 1; now one line and exit 130, as during the run."""
    from stager.cli import main as cli

    def interrupted(_module: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_command_module", interrupted)
    if entry == "stager":
        code = cli.main(["stage-in", "/nowhere", "--dest", "/nowhere2"])
    else:
        code = cli.stage_in_main(["/nowhere", "--dest", "/nowhere2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_INTERRUPTED
    assert err == [f"{entry}: interrupted while starting; nothing was done"]


@pytest.mark.parametrize("script", ["stage-in", "stage-out", "stager"])
def test_an_interrupt_while_the_cli_itself_imports_is_one_line_and_its_code(script: str) -> None:
    """The console scripts import their entry's module before calling it: with the entry in
    stager.cli.main, a Ctrl-C in its 10-50 ms of imports printed Python's traceback. The
    entries (stager.cli.entry) import it themselves; the script pip writes is run here as it
    is, with that import interrupted."""
    from stager.cli import entry

    assert entry.EXIT_INTERRUPTED == EXIT_INTERRUPTED
    function = {"stage-in": "stage_in", "stage-out": "stage_out", "stager": "main"}[script]
    code = (
        "import sys\n"
        "class Interrupting:\n"  # the import of stager.cli.main meets a Ctrl-C
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'stager.cli.main':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupting())\n"
        f"from stager.cli.entry import {function}\n"
        f"sys.exit({function}())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == EXIT_INTERRUPTED, result.stderr
    assert result.stderr.splitlines() == [f"{script}: interrupted while starting; nothing was done"]
