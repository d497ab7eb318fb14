"""The stream controller: more streams when per-file latency dominates, few when bytes do."""

from __future__ import annotations

import threading
import time

from stager.streams import StreamController


def _feed(ctl: StreamController, first_byte_s: float, total_s: float, n: int = 40) -> None:
    for _ in range(n):
        ctl.acquire()
        ctl.release(first_byte_s, total_s)


def test_latency_bound_small_files_raise_streams_to_the_ceiling() -> None:
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.010, total_s=0.0101)  # 10 ms round trips, 0.1 ms of bytes
    assert ctl.limit == 32 and ctl.peak == 32


def test_moderate_latency_gives_the_ratio() -> None:
    ctl = StreamController(64, floor=1)
    _feed(ctl, first_byte_s=0.002, total_s=0.003)  # L = 2 ms, T = 1 ms -> 3 streams
    assert ctl.limit == 3


def test_bandwidth_bound_large_files_stay_at_the_floor() -> None:
    ctl = StreamController(32, floor=4)
    _feed(ctl, first_byte_s=0.0002, total_s=0.5)
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
