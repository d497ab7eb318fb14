"""The rate search for files too small to time: it finds the stream count that completes files
fastest, on simulated sources (no clock, no threads), and follows a source that changes."""

from __future__ import annotations

from collections.abc import Callable

from stager.stagein.rateprobe import RateProbe


def _run(probe: RateProbe, rate_at: Callable[[int], float], seconds: float) -> list[int]:
    """Complete files at ``rate_at(limit)`` per second for ``seconds``; the limits seen."""
    now, seen = 0.0, []
    while now < seconds:
        now += 1.0 / rate_at(probe.limit)
        seen.append(probe.completed(now))
    return seen


def _interpreter_bound(limit: int) -> float:
    return 4000.0 / (1 + 0.1 * (limit - 1))  # each extra stream adds thread switches


def _latency_bound(limit: int) -> float:
    return 100.0 * limit  # 10 ms per file, streams overlap it


def test_an_interpreter_bound_source_ends_at_one_stream() -> None:
    probe = RateProbe(64)
    probe.start(10)
    assert _run(probe, _interpreter_bound, 5.0)[-1] == 1


def test_a_latency_bound_source_stays_at_the_ceiling() -> None:
    probe = RateProbe(64)
    probe.start(64)
    seen = _run(probe, _latency_bound, 20.0)
    assert seen[-1] == 64
    assert seen.count(16) < len(seen) // 10  # one window tried lower, then back


def test_the_search_settles_at_the_best_limit_it_tried() -> None:
    def peaked(limit: int) -> float:  # best at 4-8 streams, as on a fast LAN
        return 1000.0 * min(limit, 8) / max(1.0, limit / 8)

    probe = RateProbe(64)
    probe.start(64)
    settled = _run(probe, peaked, 3.0)[-1]
    assert peaked(settled) >= 0.9 * max(peaked(n) for n in (64, 16, 4, 1))
    assert settled in (4, 16)


def test_a_source_that_slows_down_is_followed_back_up() -> None:
    """Held at one stream on a fast source, the search looks up again after ``hold_windows``
    and climbs when the source turns latency-bound (a cache gone cold, NFS busy)."""
    probe = RateProbe(64, hold_windows=4)
    probe.start(8)
    assert _mostly(_run(probe, _interpreter_bound, 8.0), 1)
    assert _mostly(_run(probe, _latency_bound, 30.0), 64)


def _mostly(limits: list[int], limit: int) -> bool:
    """Whether the second half of the run spent 80% of its files at ``limit`` (the rest is
    the search looking again)."""
    late = limits[len(limits) // 2 :]
    return late.count(limit) >= 0.8 * len(late)


def test_a_window_needs_both_time_and_files() -> None:
    probe = RateProbe(64, window_s=0.5, min_files=32)
    probe.start(64)
    for i in range(20):  # 20 files over 2 s: time enough, files not
        probe.completed(i * 0.1)
    assert probe.limit == 64
    for i in range(20, 40):
        probe.completed(i * 0.1)
    assert probe.limit == 16  # the first judgement: try fewer


def test_a_run_of_files_counts_as_that_many() -> None:
    """A copy thread reports a run of small shards once (stager/stagein/smallruns.py): the
    window counts its files, not one."""
    probe = RateProbe(64, window_s=0.5, min_files=32)
    probe.start(64)
    probe.completed(0.0)
    probe.completed(0.6, files=31)
    assert probe.limit == 64  # 31 files: not yet a window
    probe.completed(0.7, files=1)
    assert probe.limit == 16


def test_looks_that_change_nothing_come_ever_more_rarely() -> None:
    """On a steady latency-bound source each look below the ceiling costs a slow window; the
    wait between looks doubles, so over a long run almost every file runs at the ceiling."""
    probe = RateProbe(64)
    probe.start(64)
    seen = _run(probe, _latency_bound, 600.0)
    assert seen.count(64) >= 0.99 * len(seen)
