"""SIGTERM handled as Ctrl-C, for a command that cleans up on KeyboardInterrupt.

Slurm ends a step (``scancel``, the time limit, a requeue) with SIGTERM, and SIGKILL
``KillWait`` seconds later (30 by default). Python's default for SIGTERM is to die at once,
wherever its threads are: a foreground stage-in left a ``.partial`` for every copy in flight
(the next run deleted them, but a job that ends there leaves them on scratch). Raised as the
KeyboardInterrupt that Ctrl-C raises, it unwinds as Ctrl-C does: the copies in flight stop at
their next block and delete their ``.partial``, and the command exits 130 with one line.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sigterm_interrupts"]


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt on the main thread.

    Only where SIGTERM still has its default action, on the main thread (where Python runs
    handlers): a program that calls stage-in through the API and handles SIGTERM itself keeps
    its handler.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
