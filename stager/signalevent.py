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
"""

from __future__ import annotations

import threading

__all__ = ["SignalSafeEvent"]


class SignalSafeEvent(threading.Event):
    """A ``threading.Event`` that a signal handler may ``set()`` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        # Event's methods all go through ``_cond`` (CPython 3.8 to 3.14); only its lock changes.
        self._cond = threading.Condition(threading.RLock())
