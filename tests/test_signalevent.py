"""SignalSafeEvent: a signal handler that sets the event never hangs the thread waiting on it.

The hang it prevents is a race (the handler must run while ``Event.wait`` holds its lock), so
the test floods the waiting process with signals: with a plain ``threading.Event`` this script
hung or died of RecursionError in 6 of 6 runs (~20,000 signals each), with SignalSafeEvent it
ends.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from stager.signalevent import SignalSafeEvent

from .conftest import clean_env

# The parent waits on the event in a loop while a forked child sends it SIGUSR1 as fast as it
# can; the handler sets the event. It counts handler calls, not seconds, so that a slow machine
# runs as many races as a fast one.
_FLOOD = textwrap.dedent(
    """
    import os, signal, sys, time
    from stager.signalevent import SignalSafeEvent

    want = int(sys.argv[1])
    stop = SignalSafeEvent()
    calls = 0

    def handler(signum, frame):
        global calls
        calls += 1
        stop.set()

    signal.signal(signal.SIGUSR1, handler)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            while True:
                os.kill(parent, signal.SIGUSR1)
                time.sleep(0.00002)
        finally:
            os._exit(0)
    try:
        while calls < want:
            stop.wait(0.0001)
            stop.clear()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    print("ended", calls >= want)
    """
)


def test_a_flood_of_signals_setting_the_event_never_hangs_its_waiter() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _FLOOD, "20000"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,  # a hang, not a slow machine: 20,000 signals take ~2 s here
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ended True"


def test_it_is_an_event_to_every_other_thread() -> None:
    event = SignalSafeEvent()
    assert isinstance(event, threading.Event)
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(event.wait(30)))
    waiter.start()
    assert not event.is_set()
    event.set()
    waiter.join(30)
    assert seen == [True] and event.is_set()
    event.clear()
    assert not event.is_set() and event.wait(0) is False


def test_a_set_between_reading_the_flag_and_waiting_wakes_the_waiter_soon() -> None:
    """The handler runs inside ``wait`` after the flag was read and before the waiter is
    registered (forced here with a trace hook): the set notifies no one, and a plain Event
    would sleep its whole timeout. This one looks again within a quarter second."""
    import os
    import signal
    import time

    event = SignalSafeEvent()
    fired: list[int] = []

    def tracer(frame, event_name, _arg):  # noqa: ANN001, ANN202 - sys.settrace's signature
        if event_name == "call" and frame.f_code is threading.Condition.wait.__code__:
            if not fired:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGUSR1)  # runs at the next bytecode boundary
        return None

    previous = signal.signal(signal.SIGUSR1, lambda *_: event.set())
    try:
        sys.settrace(tracer)
        started = time.monotonic()
        woke = event.wait(60)
        took = time.monotonic() - started
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGUSR1, previous)
    assert fired and woke and event.is_set()
    assert took < 30, f"slept {took:.1f} s of a 60 s timeout after the flag was set"
