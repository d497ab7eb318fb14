"""Planning a million shards without the cyclic garbage collector in the way.

Listing a source and planning a run build one or two small objects per shard and free almost
nothing; CPython's collector still runs a full pass each time enough objects were allocated, and
every pass walks all that were built so far: at a million shards the passes cost more than the
work (a 1M-entry manifest read in 4.7 s instead of 2.0 s). These objects hold no reference
cycles, so nothing is lost by pausing collection while they are built. Only the command line
freezes them (``gc.freeze``) on the way out, and only while its command runs
(:func:`freezing_after_pauses`): stage-in also runs inside a user's process (the Python API)
and the loader always does, where freezing would keep every cycle of theirs alive; there, after
the pause, a full pass comes once the heap has grown by a quarter (CPython's rule).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collection_paused", "freezing_after_pauses"]

_freeze = False


@contextmanager
def freezing_after_pauses() -> Iterator[None]:
    """For a command-line run of stage-in: freeze what each pause inside the block built.

    After a pause the collector's next full pass would still walk every object built in it
    (0.6 s at a million shards, right as the copies start); frozen (``gc.freeze``), they are
    left out of every pass. Only the command line asks for this, and only while its command
    runs: a user's program calling the Python API, or a loader created after a command was run
    in the same process, keeps its collector as it was.
    """
    global _freeze
    previous, _freeze = _freeze, True
    try:
        yield
    finally:
        _freeze = previous


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause automatic garbage collection inside the block (a no-op where it was off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
