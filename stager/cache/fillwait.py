"""Wait for another job's fill of the cache, as long as that job makes progress.

Why: a shard is copied into the cache by one process at a time, and the others wait on its fill
lock to take it from the cache afterwards. The holder of that lock may be a job Slurm has
suspended, a process stopped by Ctrl-Z, or a read hung on the source: waiting for the lock's
timeout (an hour by default) then failed the shard as a source error in every other job on the
node, where the source was fine. A waiter now watches what the fills of the lock's group write
(their ``.partial`` files grow, objects and records appear) and, when nothing moved for
:data:`FILL_STALL_S`, or its lock timeout passes, stops waiting: the shard is copied past the
cache, from the source straight to scratch, as a shard the cache has no room for is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from stager.cache.locks import FileLock
from stager.layout import PARTIAL_SUFFIX

__all__ = ["FILL_STALL_S", "wait_for_fill"]

#: How long the fills of a lock's group may write nothing before a waiter stops waiting: far
#: longer than a copy stalls on a busy shared filesystem, far shorter than a suspended job.
FILL_STALL_S = 120.0
#: The longest pause between two looks at the lock.
_MOST_PAUSE_S = 0.5


def wait_for_fill(
    lock: FileLock,
    group_dir: Path,
    *,
    timeout_s: float | None,
    stall_s: float | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> bool:
    """Take ``lock``, waiting while the fills writing into ``group_dir`` make progress; False
    where they made none for ``stall_s`` (default :data:`FILL_STALL_S`), or ``timeout_s``
    passed (the lock is not held)."""
    stall_s = FILL_STALL_S if stall_s is None else stall_s
    if lock.acquire(blocking=False):
        return True
    started = changed = time.monotonic()
    seen = _activity(group_dir)
    pause_s = 0.005
    while True:
        sleep(pause_s)
        pause_s = min(pause_s * 2, _MOST_PAUSE_S)
        if lock.acquire(blocking=False):
            return True
        now = time.monotonic()
        activity = _activity(group_dir)
        if activity != seen:
            seen, changed = activity, now
        if now - changed > stall_s or (timeout_s is not None and now - started > timeout_s):
            return False


def _activity(group_dir: Path) -> tuple[int, int, int]:
    """What the fills of one group have written: the directory's change time (a file created,
    renamed or removed in it) and the bytes its partial files hold."""
    try:
        mtime = os.stat(group_dir).st_mtime_ns
        partial_bytes = partials = 0
        with os.scandir(group_dir) as entries:
            for entry in entries:
                if entry.name.endswith(PARTIAL_SUFFIX):
                    partials += 1
                    partial_bytes += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return (-1, -1, -1)
    return (mtime, partials, partial_bytes)
