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
from typing import TextIO

from stager.errors import CheckpointError, DestinationError, IntegrityError, SourceError
from stager.signalevent import SignalSafeEvent
from stager.stageout.outcome import Outcome
from stager.stageout.run import StageOutOptions, stage_out

__all__ = ["watch", "stop_on_signals", "SayOnce", "STOP_SIGNALS", "WATCH_INTERVAL_S"]

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


class SayOnce:
    """Prints a pass's report lines, less those the pass before said too.

    A pass every minute for a day repeated every line each time: "already committed" for each
    kept checkpoint, and the same FAILED line for one that cannot succeed (1,440 a day each).
    Now a line is said when it first appears, and again only after a pass without it (a
    checkpoint that failed, then committed, then fails again is said each time); news (a
    commit, a cleanup, a prune) is always said.
    """

    def __init__(self, log: TextIO) -> None:
        self.log = log
        self.before: set[str] = set()
        self.now: set[str] = set()

    def __call__(self, line: str, news: bool = False) -> None:
        """Print ``line`` unless the last pass (or this one) said it too and it is not
        ``news``: a commit is an event each time, even in the same words as the last."""
        if news or (line not in self.before and line not in self.now):
            print(line, file=self.log, flush=True)
        self.now.add(line)

    def next_pass(self) -> None:
        self.before, self.now = self.now, set()


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
    say = SayOnce(log)
    passes = 0
    while not stop.is_set():
        try:
            outcomes = stage_out(list_ckpts(), dest_url, options, stop=stop, say=say)
        except (DestinationError, SourceError, IntegrityError, CheckpointError) as exc:
            why = " ".join(str(exc).split())
            say(f"stage-out: watch pass failed: {why}; retrying in {interval_s:g} s")
            outcomes = []
        say.next_pass()
        passes += 1
        if on_pass is not None:
            on_pass(outcomes)
        stop.wait(interval_s)
    print(
        f"stage-out: watch stopped after {passes} pass(es); nothing in flight", file=log, flush=True
    )
    return passes
