"""Run a function over many items on a fixed set of threads, in order of the items.

Why not ``ThreadPoolExecutor.map``: it creates a future (a lock, a condition, a result slot)
per item up front, which costs ~25 us of CPU per item under the GIL; at tens of thousands of
small shards that is seconds of the CPU a latency-bound copy needs for its streams. Here each
thread pulls the next item from a shared iterator and keeps nothing per item.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["map_in_threads", "run_in_threads"]

T = TypeVar("T")
R = TypeVar("R")


def run_in_threads(
    fn: Callable[[T], object],
    items: Iterable[T],
    threads: int,
    *,
    name: str = "worker",
    on_exit: Callable[[], object] | None = None,
    before_take: Callable[[], object] | None = None,
    on_interrupt: Callable[[], object] | None = None,
) -> None:
    """Call ``fn(item)`` for every item on up to ``threads`` threads; return when all are done.

    The first exception raised by ``fn`` stops the other threads from taking new items and is
    re-raised here once they have finished their current one. ``on_exit()`` runs on each
    thread as it stops taking items (to give back what the thread held between items).
    ``before_take()`` runs on a thread before it takes its next item (to wait for a stream
    slot first: a thread that waits while holding an item keeps it from a thread that is free).
    ``on_interrupt()``: when given, an exception raised on the calling thread while it waits
    (a KeyboardInterrupt: Ctrl-C, or SIGTERM where a handler turns it into one) stops the
    threads from taking items and calls it (to abandon the items in progress); the threads are
    then waited for, and the exception re-raised, so that none outlives the call half-way
    through an item. A second one while they are waited for is raised at once. Without it,
    the exception leaves at once and the (daemon) threads die with the process wherever they
    are.

    Threads start as they are needed, not all at once: one keeps looking for the next item
    while the others work, and a thread that takes an item while none is looking starts
    another, up to ``threads``. Why: a thread costs ~0.5-1 ms to start on a small VM, and 64
    of them were a fixed ~60 ms before the first copy of a run that needed two; with a
    ``before_take`` that waits for a stream slot, the pool stays one above the streams in use.
    """
    source = iter(items)
    take = threading.Lock()
    failures: list[BaseException] = []
    count = max(1, threads)
    pool: list[threading.Thread] = []
    looking = [0]  # threads between finishing an item (or starting) and taking the next
    ended = [0]  # threads that have left ``loop``
    # Held until the last thread has left ``loop``, which releases it. The caller waits by
    # acquiring it: a C-level lock it never has to release. (A Condition on ``take`` was
    # tried: a signal landing inside its Python-level __enter__ leaked ``take`` and hung
    # every thread; Thread.join interrupted by a signal marks a running thread as stopped.)
    finished = threading.Lock()
    finished.acquire()
    all_ended = [False]

    def loop() -> None:
        try:
            while not failures:
                with take:
                    looking[0] += 1
                try:
                    if before_take is not None:
                        before_take()
                    with take:
                        looking[0] -= 1
                        item = next(source, _DONE) if not failures else _DONE
                        if item is _DONE:
                            return
                        if not looking[0] and len(pool) < count:
                            _start_spare()  # this thread took the last that was looking
                    fn(item)  # type: ignore[arg-type]
                except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                    failures.append(exc)
                    return
        finally:
            try:
                if on_exit is not None:
                    on_exit()
            finally:
                with take:
                    ended[0] += 1
                    last = ended[0] == len(pool)  # pool grows only under take, by the living
                if last:
                    all_ended[0] = True
                    finished.release()

    def _start_spare() -> None:
        """Start another thread (under ``take``: it is in ``pool`` before any thread can
        count itself ended, so no thread sees ``ended == len(pool)`` too early)."""
        spare = threading.Thread(target=loop, name=f"{name}-{len(pool)}", daemon=True)
        spare.start()
        pool.append(spare)

    if count == 1:
        pool.append(threading.current_thread())  # nothing to grow into
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - outside fn (on_exit), as if in it
            failures.append(exc)
        if on_interrupt is not None and failures and not isinstance(failures[0], Exception):
            on_interrupt()  # a KeyboardInterrupt raised on this thread, in an item or between
    else:
        first = threading.Thread(target=loop, name=f"{name}-0", daemon=True)
        with take:
            pool.append(first)
        interrupted: BaseException | None = None
        starting = True
        # The start and the whole wait, the loop's jumps included, are inside the try, so a
        # signal handled at any of their bytecodes is caught here. all_ended is set before
        # ``finished`` is released: a signal landing after the acquire returned cannot make
        # it wait again.
        while True:
            try:
                if starting:
                    starting = False
                    first.start()
                while not all_ended[0]:
                    finished.acquire(timeout=_SIGNAL_CHECK_S)
                break
            except BaseException as exc:
                if on_interrupt is None or interrupted is not None:
                    raise
                interrupted = _stop_taking(exc, failures, on_interrupt)
                if first.ident is None:
                    # Not running yet, and maybe never created. If it was, it ends at once
                    # (failures is set, so it takes nothing) and releases ``finished``.
                    finished.acquire(timeout=1.0)
                    raise
        for thread in pool:
            thread.join()  # each has left loop(): only its last bytecodes remain
        if interrupted is not None:
            raise interrupted
    if failures:
        raise failures[0]


def _stop_taking(
    exc: BaseException, failures: list[BaseException], on_interrupt: Callable[[], object]
) -> BaseException:
    """The waiting thread was interrupted by ``exc``: no thread takes another item, and the
    items in progress are told (``on_interrupt``)."""
    failures.append(exc)
    on_interrupt()
    return exc


def map_in_threads(
    fn: Callable[[T], R], items: Sequence[T], threads: int, *, name: str = "worker"
) -> list[R]:
    """``[fn(item) for item in items]`` computed on up to ``threads`` threads."""
    results: list[R | None] = [None] * len(items)

    def one(position: int) -> None:
        results[position] = fn(items[position])

    run_in_threads(one, range(len(items)), min(threads, len(items)), name=name)
    return results  # type: ignore[return-value]


_DONE = object()

#: The longest the caller blocks in one wait for the threads. A signal that arrives just
#: before a blocking wait (after the interpreter's last check, before the lock's wait begins)
#: does not interrupt it, and its handler runs only when the wait returns: without a timeout,
#: Ctrl-C was then not seen until every thread had finished (reproduced: 1 run in ~600).
_SIGNAL_CHECK_S = 0.25
