"""The stream controller: more streams when per-file latency dominates, few when bytes do."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from stager.copy import FIRST_READ_BYTES, copy_file
from stager.streams import StreamController


def _feed(ctl: StreamController, first_byte_s: float, last_byte_s: float, n: int = 40) -> None:
    for _ in range(n):
        ctl.acquire()
        ctl.release(first_byte_s, last_byte_s)


def test_latency_bound_small_files_raise_streams_to_the_ceiling() -> None:
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.010, last_byte_s=0.0101)  # 10 ms round trips, 0.1 ms of bytes
    assert ctl.limit == 32 and ctl.peak == 32


def test_moderate_latency_gives_the_ratio() -> None:
    ctl = StreamController(64, floor=1)
    _feed(ctl, first_byte_s=0.002, last_byte_s=0.003)  # L = 2 ms, T = 1 ms -> 3 streams
    assert ctl.limit == 3


def test_bandwidth_bound_large_files_stay_at_the_floor() -> None:
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.0002, last_byte_s=0.5)
    assert ctl.limit == 4


def test_fixed_mode_and_failures_do_not_adapt() -> None:
    ctl = StreamController(8, adaptive=False)
    assert ctl.limit == 8
    _feed(ctl, 0.01, 0.0101)
    assert ctl.limit == 8
    adaptive = StreamController(8, floor=2)
    _feed(adaptive, None, None)  # type: ignore[arg-type]
    assert adaptive.limit == 2


def test_limit_bounds_concurrency() -> None:
    ctl = StreamController(3, floor=3)
    active, peak, lock = [0], [0], threading.Lock()

    def work() -> None:
        ctl.acquire()
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1
        ctl.release()

    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 3


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


def test_small_files_with_slow_local_work_keep_the_ceiling() -> None:
    """10 ms to the first byte, which was also the last: latency-bound, however long the rest took."""
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.010, last_byte_s=0.010)
    assert ctl.limit == 32
