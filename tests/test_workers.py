"""run_in_threads: every item once, threads started only as the work needs them, and every
thread's exit hook run, also after a failure."""

from __future__ import annotations

import threading
import time

import pytest

from stager.storage.workers import map_in_threads, run_in_threads


class _Record:
    """Which thread handled which item, and the most threads inside ``fn`` at once."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.threads: set[str] = set()
        self.inside = self.peak = 0
        self._lock = threading.Lock()

    def enter(self, item: int) -> None:
        with self._lock:
            self.items.append(item)
            self.threads.add(threading.current_thread().name)
            self.inside += 1
            self.peak = max(self.peak, self.inside)

    def leave(self) -> None:
        with self._lock:
            self.inside -= 1


def test_every_item_once_and_the_pool_reaches_the_count_when_work_waits() -> None:
    """Eight items that each wait until eight threads are inside at once: the pool must grow
    to eight (a thread that takes an item with nobody else looking starts another)."""
    record = _Record()
    everyone = threading.Barrier(8, timeout=30)

    def fn(item: int) -> None:
        record.enter(item)
        if item < 8:
            everyone.wait()
        record.leave()

    run_in_threads(fn, range(40), 8, name="w")
    assert sorted(record.items) == list(range(40))
    assert record.peak == 8
    assert record.threads <= {f"w-{i}" for i in range(8)}


def test_threads_wait_for_a_slot_before_taking_an_item() -> None:
    """With ``before_take`` holding a thread until one of two slots is free, no more than
    three threads ever start (two working, one looking), however many are allowed, and a
    thread that keeps its slot takes the next item itself."""
    record = _Record()
    slots = threading.Semaphore(2)
    held = threading.local()

    def before_take() -> None:
        if not getattr(held, "slot", False):
            slots.acquire()
            held.slot = True

    def on_exit() -> None:
        if getattr(held, "slot", False):
            held.slot = False
            slots.release()

    def fn(item: int) -> None:
        record.enter(item)
        time.sleep(0.002)
        record.leave()

    run_in_threads(fn, range(60), 64, name="s", on_exit=on_exit, before_take=before_take)
    assert sorted(record.items) == list(range(60))
    assert record.peak <= 2
    assert len(record.threads) <= 2  # the third only ever looked: the slots were kept


def test_every_started_thread_runs_its_exit_hook_even_after_a_failure() -> None:
    """The copy threads give back a kept stream slot in ``on_exit``; it must run on every
    thread that started, also when an item raised."""
    exits: list[str] = []
    lock = threading.Lock()
    four = threading.Barrier(4, timeout=30)

    def fn(item: int) -> None:
        if item < 4:
            four.wait()  # four threads are running before anything fails
        if item == 5:
            raise ValueError("item 5")

    def on_exit() -> None:
        with lock:
            exits.append(threading.current_thread().name)

    with pytest.raises(ValueError, match="item 5"):
        run_in_threads(fn, range(50), 4, name="t", on_exit=on_exit)
    assert sorted(exits) == [f"t-{i}" for i in range(4)]
    exits.clear()
    with pytest.raises(ValueError, match="item 5"):
        run_in_threads(fn, range(4, 6), 1, on_exit=on_exit)
    assert exits == [threading.current_thread().name]  # one thread: the caller's


def test_a_failing_before_take_is_raised() -> None:
    def before_take() -> None:
        raise RuntimeError("no slot")

    with pytest.raises(RuntimeError, match="no slot"):
        run_in_threads(lambda item: None, range(5), 4, before_take=before_take)


def test_map_in_threads_keeps_the_order() -> None:
    assert map_in_threads(lambda x: x * x, list(range(100)), 8) == [x * x for x in range(100)]
    assert map_in_threads(lambda x: x, [], 8) == []
