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
