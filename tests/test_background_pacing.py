"""The background copier's pacing (stager.stagein.pacing): --bw-limit handed out in copy order,
and a stop that unwinds every copy. Threads and a real clock, but no timing thresholds: what is
checked is an order, and that a stop ends a copy that would otherwise sleep for minutes."""

from __future__ import annotations

import threading

import pytest

from stager.stagein.pacing import CopierStopped, OrderedThrottle


def _copy(throttle: OrderedThrottle, priority: int, blocks: int, block: int, done: list) -> None:
    throttle.begin(priority)
    try:
        for _ in range(blocks):
            throttle.consume(block)
    finally:
        throttle.end()
    done.append(priority)


def test_shards_finish_in_copy_order_whatever_order_their_streams_start() -> None:
    # No burst, and a grace far longer than a copy thread ever takes between two blocks: only
    # the earliest shard in flight gets bytes, so shards land one after another, in order.
    throttle = OrderedThrottle(2e6, threading.Event(), grace_s=30.0, burst_s=0.0)
    done: list[int] = []
    start = threading.Barrier(4)

    def stream(priority: int) -> None:
        start.wait()
        _copy(throttle, priority, blocks=8, block=10_000, done=done)

    threads = [threading.Thread(target=stream, args=(p,)) for p in (3, 1, 0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert done == [0, 1, 2, 3]


def test_a_later_shard_uses_the_link_when_the_earlier_one_leaves_it_idle() -> None:
    throttle = OrderedThrottle(1e7, threading.Event(), grace_s=0.0, burst_s=0.0)
    throttle.begin(0)
    throttle.consume(1000)  # shard 0 holds the link, then goes quiet (no end())
    done: list[int] = []
    later = threading.Thread(target=_copy, args=(throttle, 5, 3, 1000, done))
    later.start()
    later.join(timeout=60)
    assert done == [5]


def test_stop_unwinds_a_copy_sleeping_on_its_reservation() -> None:
    stop = threading.Event()
    throttle = OrderedThrottle(1000.0, stop, burst_s=0.0)  # 1 kB/s: a 1 MB block is 17 minutes
    failures: list[BaseException] = []

    def stream() -> None:
        try:
            _copy(throttle, 0, blocks=1, block=1_000_000, done=[])
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            failures.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], CopierStopped)


def test_without_a_rate_every_block_still_checks_the_stop() -> None:
    stop = threading.Event()
    throttle = OrderedThrottle(None, stop)
    throttle.consume(10**9)  # no limit: returns at once
    stop.set()
    with pytest.raises(CopierStopped):
        throttle.consume(1)
    assert not isinstance(CopierStopped(), Exception)  # no retry loop or handler swallows it
