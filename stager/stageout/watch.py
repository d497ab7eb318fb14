"""``stage-out --watch``: stage out each new checkpoint as it appears, until told to stop.

Runs beside training, so a node failure loses at most one interval of work. SIGTERM and
SIGUSR1 (what ``sbatch --signal`` and the end of a job send) ask it to stop: the copy in flight
finishes and commits, then the loop exits 0. A second signal abandons the copy in flight
(atomically: nothing half visible) and exits 130. Problems of one pass (destination briefly
unreachable, a checkpoint changing while copied) are reported and retried on the next pass.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from stager.errors import CheckpointError, DestinationError, IntegrityError, SourceError
from stager.signalevent import SignalSafeEvent
from stager.stageout.run import Outcome, StageOutOptions, stage_out

__all__ = ["watch", "stop_on_signals", "STOP_SIGNALS", "WATCH_INTERVAL_S"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextmanager
def stop_on_signals(
    stop: SignalSafeEvent, signals: Sequence[int] = STOP_SIGNALS, *, graceful: bool = True
) -> Iterator[SignalSafeEvent]:
    """First signal sets ``stop``; a second (or, unless ``graceful``, the first) raises
    KeyboardInterrupt, which abandons the copy in flight atomically.

    ``stop`` is a :class:`SignalSafeEvent`: the watch loop waits on it between passes, and a
    plain ``Event`` set by the handler inside that wait hung the process now and then."""

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set() or not graceful:
            name = signal.Signals(signum).name
            raise KeyboardInterrupt(f"second signal {name}" if stop.is_set() else name)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


#: Seconds between two ``--watch`` passes.
WATCH_INTERVAL_S = 60.0


def watch(
    list_ckpts: Callable[[], Sequence[Path]],
    dest_url: str,
    options: StageOutOptions,
    *,
    interval_s: float,
    stop: SignalSafeEvent,
    on_pass: Callable[[list[Outcome]], None] | None = None,
) -> int:
    """Stage out ``list_ckpts()`` every ``interval_s`` until ``stop`` is set; return passes run."""
    log = options.log or sys.stderr
    passes = 0
    while not stop.is_set():
        try:
            outcomes = stage_out(list_ckpts(), dest_url, options, stop=stop)
        except (DestinationError, SourceError, IntegrityError, CheckpointError) as exc:
            print(
                f"stage-out: watch pass failed: {' '.join(str(exc).split())}; retrying in "
                f"{interval_s:g} s",
                file=log,
                flush=True,
            )
            outcomes = []
        passes += 1
        if on_pass is not None:
            on_pass(outcomes)
        stop.wait(interval_s)
    print(
        f"stage-out: watch stopped after {passes} pass(es); nothing in flight", file=log, flush=True
    )
    return passes
