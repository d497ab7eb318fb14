"""An event a signal handler may set while the main thread waits on it.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread is.
``threading.Event`` guards its flag with a plain (non-reentrant) lock, and ``Event.wait`` runs
Python code while holding it (``Condition.wait`` re-takes the lock, then removes its waiter).
A handler that calls ``set()`` at that moment blocks on a lock its own thread holds: the process
hangs until it is killed. stage-out ``--watch`` waits on its stop event between passes, so a
SIGTERM now and then (1 in a few hundred, by the timing) hung it instead of ending the watch
cleanly; a flood of signals reproduces it within seconds (tests/test_signalevent.py).

:class:`SignalSafeEvent` is an ``Event`` whose lock is reentrant: the handler, on the thread that
holds it, takes it again, sets the flag and wakes every waiter. Other threads see an ordinary
``Event``.

Its :meth:`~SignalSafeEvent.wait` also wakes at least every quarter second to look at the
flag: a handler that runs after ``wait`` has read the flag but before it has registered as a
waiter sets the flag and notifies no one, and a plain wait then sleeps its whole timeout
(up to a minute in ``--watch``).
"""

from __future__ import annotations

import threading
import time

__all__ = ["SignalSafeEvent"]


class SignalSafeEvent(threading.Event):
    """A ``threading.Event`` that a signal handler may ``set()`` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        # Event's methods all go through ``_cond`` (CPython 3.8 to 3.14); only its lock changes.
        self._cond = threading.Condition(threading.RLock())

    def wait(self, timeout: float | None = None) -> bool:
        """``Event.wait``, in slices of at most :data:`WAKE_S` (see the module doc)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
            if left <= 0:
                return self.is_set()
            if super().wait(left):
                return True


#: The longest one slice of :meth:`SignalSafeEvent.wait` sleeps.
WAKE_S = 0.25
