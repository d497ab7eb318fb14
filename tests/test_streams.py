"""The stream controller: more streams when per-file latency dominates, few when bytes do."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.stagein.streams import StreamController
from stager.storage.bytepath import FIRST_READ_BYTES
from stager.storage.copy import copy_file

from .inproc import clean_process_env, run_main


def _feed(
    ctl: StreamController,
    first_byte_s: float,
    last_byte_s: float,
    n: int = 40,
    cores_used: float | None = None,
) -> None:
    for _ in range(n):
        ctl.acquire()
        ctl.release(first_byte_s, last_byte_s, cores_used)


def test_latency_bound_small_files_raise_streams_to_the_ceiling() -> None:
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.010, last_byte_s=0.0101)  # 10 ms round trips, 0.1 ms of bytes
    assert ctl.limit == 32 and ctl.peak == 32


def test_moderate_latency_gives_the_ratio() -> None:
    ctl = StreamController(64, floor=1)
    _feed(ctl, first_byte_s=0.002, last_byte_s=0.003)  # L = 2 ms, T = 1 ms -> 3 streams
    assert ctl.limit == 3


def test_bandwidth_bound_large_files_stay_at_the_floor() -> None:
    ctl = StreamController(32, floor=4, cores=16)
    _feed(ctl, first_byte_s=0.0002, last_byte_s=0.5)
    assert ctl.limit == 4


def test_copies_that_saturate_the_cores_use_no_more_streams_than_cores() -> None:
    """Files that are mostly transfer, copied while the process keeps its 2 cores busy (a
    memory-speed source): the floor of 4 gives way to 2. The same files waiting on a server
    (the cores idle: NFS reads), or files that are mostly latency, keep the floor and the
    ratio."""
    saturated = StreamController(32, floor=4, cores=2)
    _feed(saturated, first_byte_s=0.0002, last_byte_s=0.05, cores_used=1.9)
    assert saturated.limit == 2
    one_core = StreamController(32, floor=4, cores=1)
    _feed(one_core, first_byte_s=0.0002, last_byte_s=0.05, cores_used=1.0)
    assert one_core.limit == 2  # the model's ratio is never below 2
    waiting = StreamController(32, floor=4, cores=2)
    _feed(waiting, first_byte_s=0.0002, last_byte_s=0.05, cores_used=0.3)
    assert waiting.limit == 4
    unknown = StreamController(32, floor=4, cores=2)
    _feed(unknown, first_byte_s=0.0002, last_byte_s=0.05)
    assert unknown.limit == 4
    latency_bound = StreamController(32, floor=4, cores=2)
    _feed(latency_bound, first_byte_s=0.010, last_byte_s=0.012, cores_used=1.9)  # L=10, T=2 ms
    assert latency_bound.limit == 6
    slow_start = StreamController(32, floor=4, cores=2)
    _feed(slow_start, first_byte_s=0.003, last_byte_s=0.005, cores_used=1.9)  # L > T
    assert slow_start.limit == 4


def _feed_running(
    ctl: StreamController,
    running: int,
    first_byte_s: float,
    last_byte_s: float,
    cores_used: float,
    n: int = 40,
) -> None:
    """``n`` copies that each end while ``running`` copies are in flight (each thread starts
    its next file at once), as many copy threads report them."""
    for _ in range(running):
        ctl.acquire()  # the caller keeps ``running`` within the limit
    for _ in range(n):
        ctl.release(first_byte_s, last_byte_s, cores_used)
        with ctl._cond:  # the thread's next file: in flight again without waiting for a slot
            ctl._active += 1
    with ctl._cond:
        ctl._active -= running


def test_copies_that_keep_a_core_busy_per_stream_grow_to_the_cores() -> None:
    """Large files from a memory-speed source on 16 cores: four streams keep four cores busy,
    so each is bound by its CPU and the limit rises to the cores (not past --jobs), and holds
    when a stream per core shares the memory bus (each busy less than a whole core). When the
    copies then wait on a server (a core's fifth each), the latency model decides again.
    Streams that wait on reads stay at the floor; so does a copier that must leave the cores
    to training (``grow_to_cores=False``)."""
    many = StreamController(64, floor=4, cores=16)
    _feed_running(many, 4, first_byte_s=0.0002, last_byte_s=0.05, cores_used=3.9)
    assert many.limit == 16 and many.cpu_bound
    _feed_running(many, 16, first_byte_s=0.0002, last_byte_s=0.05, cores_used=11.0)
    assert many.limit == 16  # 0.7 core a stream: held
    _feed_running(many, 16, first_byte_s=0.0002, last_byte_s=0.5, cores_used=3.0)
    assert many.limit == 4 and not many.cpu_bound
    capped = StreamController(8, floor=4, cores=16)
    _feed_running(capped, 4, first_byte_s=0.0002, last_byte_s=0.05, cores_used=3.9)
    assert capped.limit == 8
    waiting = StreamController(64, floor=4, cores=16)
    _feed_running(waiting, 4, first_byte_s=0.0002, last_byte_s=0.05, cores_used=1.2)
    assert waiting.limit == 4 and not waiting.cpu_bound
    beside_training = StreamController(64, floor=4, cores=16, grow_to_cores=False)
    _feed_running(beside_training, 4, first_byte_s=0.0002, last_byte_s=0.05, cores_used=3.9)
    assert beside_training.limit == 4
    latency_bound = StreamController(64, floor=4, cores=16)
    _feed_running(latency_bound, 4, first_byte_s=0.010, last_byte_s=0.012, cores_used=3.9)
    assert latency_bound.limit == 6 and not latency_bound.cpu_bound
    # Many copies in flight (small files behind latency pushed the limit up), then large
    # server-bound ones: four cores busy over 20 copies is a fifth of a core each, not CPU-bound.
    after_small = StreamController(64, floor=4, cores=16)
    _feed_running(after_small, 4, first_byte_s=0.010, last_byte_s=0.0105, cores_used=0.5)
    assert after_small.limit == 21
    _feed_running(after_small, 20, first_byte_s=0.0002, last_byte_s=0.5, cores_used=4.0)
    assert not after_small.cpu_bound and after_small.limit == 4
    # No more cores than the floor: nothing to grow to, so nothing latched; copies that wait
    # on a server later in the run go back to the floor.
    few = StreamController(64, floor=4, cores=2)
    _feed_running(few, 2, first_byte_s=0.0002, last_byte_s=0.05, cores_used=1.9)
    assert few.limit == 2 and not few.cpu_bound
    _feed_running(few, 2, first_byte_s=0.0002, last_byte_s=0.05, cores_used=0.3)
    assert few.limit == 4
    # Whole files in the first read (tiny shards): no transfer to time, no growth; their cost
    # is the interpreter's, which more threads only pass around (the rate search decides).
    tiny = StreamController(64, floor=4, cores=16)
    _feed_running(tiny, 4, first_byte_s=0.00003, last_byte_s=0.00003, cores_used=3.9)
    assert not tiny.cpu_bound


def test_a_copy_reports_the_cores_the_process_kept_busy(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(8 << 20))
    result = copy_file(None, str(big), tmp_path / "out" / "big.bin")
    assert result.process_cpu_s > 0
    assert 0 < result.cores_used <= len(os.sched_getaffinity(0)) + 0.5


def test_the_default_cores_are_the_process_affinity() -> None:
    assert StreamController(8).cores == len(os.sched_getaffinity(0))


def test_fixed_mode_and_failures_do_not_adapt() -> None:
    ctl = StreamController(8, adaptive=False)
    assert ctl.limit == 8
    _feed(ctl, 0.01, 0.0101)
    assert ctl.limit == 8
    adaptive = StreamController(8, floor=2)
    _feed(adaptive, None, None)  # type: ignore[arg-type]
    assert adaptive.limit == 2


class _Occupancy:
    """Counts the threads inside a copy at once, and the most there ever were."""

    def __init__(self) -> None:
        self.active, self.peak, self._lock = 0, 0, threading.Lock()

    def copy(self, seconds: float) -> None:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(seconds)
        with self._lock:
            self.active -= 1


def _run_threads(work, count: int) -> None:
    threads = [threading.Thread(target=work) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_limit_bounds_concurrency() -> None:
    ctl = StreamController(3, floor=3)
    occupancy = _Occupancy()

    def work() -> None:
        ctl.acquire()
        occupancy.copy(0.01)
        ctl.release()

    _run_threads(work, 12)
    assert occupancy.peak == 3


def test_transfer_time_stops_at_the_last_byte_read(tmp_path: Path) -> None:
    """Local work after the last read (here a slow rename) is not the link's transfer time.

    The controller sets streams from (latency + transfer) / transfer; counting a slow local
    rename as transfer made small files look bandwidth-bound and the limit sag.
    """
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"y" * (3 * FIRST_READ_BYTES))

    def slow_publish(partial: str, final: str) -> None:
        time.sleep(0.05)
        os.replace(partial, final)

    one_read = copy_file(None, str(small), tmp_path / "out" / "small.bin", publish=slow_publish)
    assert one_read.last_byte_s == one_read.first_byte_s  # all bytes came with the first read
    assert one_read.seconds >= 0.05 > one_read.last_byte_s
    several = copy_file(None, str(big), tmp_path / "out" / "big.bin")
    assert 0 < several.first_byte_s < several.last_byte_s <= several.seconds


def test_stage_in_reports_transfer_without_the_local_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stage-in hands the controller the time to the last byte, not the whole copy: a slow
    local rename (a busy scratch disk, or dozens of threads sharing the interpreter) must not
    read as a slow link and lower the stream count."""
    import stager.storage.copy

    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=2))
    timings: list[tuple[float, float]] = []
    real_record, real_replace = StreamController._record, os.replace

    def record(
        self: StreamController, first: float | None, last: float | None, *rest: float
    ) -> None:
        if first is not None and last is not None:  # once per file, or per run of small files
            files = int(rest[2]) if len(rest) > 2 else 1  # (cores_used, running, files)
            timings.extend([(first, last)] * files)
        real_record(self, first, last, *rest)

    def slow_replace(partial: str | Path, final: str | Path) -> None:
        if str(partial).endswith(".tar.partial"):
            time.sleep(0.05)
        real_replace(partial, final)

    monkeypatch.setattr(StreamController, "_record", record)
    monkeypatch.setattr(stager.storage.copy.os, "replace", slow_replace)
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), "--jitter-max", "0", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    assert len(timings) == 3
    assert all(last - first < 0.05 for first, last in timings)


def test_files_whole_in_their_first_read_start_from_the_ratio() -> None:
    """No transfer time to measure (T = 0): the rate search starts from the ratio with T taken
    as 0.1 ms, which behind 10 ms round trips is the ceiling; local files start low."""
    for cores in (2, 16):
        remote = StreamController(32, floor=4, cores=cores)
        _feed(remote, first_byte_s=0.010, last_byte_s=0.010)
        assert remote.limit == 32
    local = StreamController(32, floor=4, cores=16)
    _feed(local, first_byte_s=0.0002, last_byte_s=0.0002)
    assert local.limit == 4  # floor: (0.2 + 0.1) / 0.1 rounds up to 3
    # below the floor where the cores are fewer than it: (0.2 + 0.1) / 0.1, not 4
    for cores, start in ((1, 3), (2, 3)):
        few = StreamController(32, floor=4, cores=cores)
        _feed(few, first_byte_s=0.0002, last_byte_s=0.0002)
        assert few.limit == start, cores
    fastest = StreamController(32, floor=4, cores=2)  # (a tmpfs: the ratio asks for 2)
    _feed(fastest, first_byte_s=0.00002, last_byte_s=0.00002)
    assert fastest.limit == 2


def test_a_kept_slot_never_exceeds_the_limit() -> None:
    """Threads that keep their slot from file to file (``finished`` True) still run at most
    ``limit`` at once, and give the slot back when the limit falls below their number."""
    ctl = StreamController(3, floor=3)
    occupancy = _Occupancy()

    def work() -> None:
        held = False
        for _ in range(5):
            if not held:
                ctl.acquire()
            occupancy.copy(0.002)
            held = ctl.finished()
        if held:
            ctl.release()

    _run_threads(work, 8)
    assert occupancy.peak == 3 and ctl._active == 0
    for _ in range(3):
        ctl.acquire()
    ctl.limit = 1  # as the search would set it
    kept_after_cut = [ctl.finished() for _ in range(3)]
    assert kept_after_cut == [False, False, True] and ctl._active == 1


def test_a_kept_slot_is_checked_again_before_the_next_file() -> None:
    """The limit can fall between a thread keeping its slot and starting its next file
    (another file's end lowered it): the slots over the limit go back before any file starts."""
    ctl = StreamController(3, floor=3)
    for _ in range(3):
        ctl.acquire()
    assert [ctl.finished() for _ in range(3)] == [True, True, True]
    ctl.limit = 1  # as another thread's finished file would set it
    assert [ctl.still_kept() for _ in range(3)] == [False, False, True]
    assert ctl._active == 1
    ctl.release()
    assert ctl._active == 0


class _TwoOfEight(StreamController):
    """Eight threads allowed, two streams at a time, whatever the timings say."""

    def __init__(self, ceiling: int, **_: object) -> None:
        super().__init__(8, floor=2, cores=2)

    def _record(self, *timings: float | None) -> None:
        pass


def test_a_thread_that_keeps_its_slot_copies_the_next_shard_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With eight threads allowed and two streams, twelve shards (named by a brace pattern:
    listed and sized before the copies) are copied by two threads: a thread that finishes a
    file takes the next one. Threads used to take their item before
    waiting for a slot, so every file ran on a thread of its own (its buffer faulted in
    afresh, its caches cold): 16 x 64 MB from a tmpfs copied ~45% slower than at a fixed
    count."""
    import stager.stagein.copier as copier
    import stager.stagein.oneshard as oneshard

    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=12, samples_per_shard=2))
    threads: set[str] = set()
    real_copy = oneshard.copy_file

    def copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        time.sleep(0.02)  # a copy long enough for idle threads to start and queue up
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(oneshard, "copy_file", copy)
    monkeypatch.setattr(copier, "StreamController", _TwoOfEight)
    brace = "{" + ",".join(sorted(p.name for p in src.glob("*.tar"))) + "}"
    result = run_main(capsys, "stage-in", f"{src}/{brace}", "--dest", str(tmp_path / "dst"))
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "dst").glob("*/*.tar"))) == 12
    assert 1 <= len(threads) <= 2, sorted(threads)
