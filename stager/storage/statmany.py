"""``stat`` a run of local paths for one release of the interpreter lock, where the compiled
helper (``stager/storage/_statmany.c``) was built; the same contract in Python where not.

Why: every ``os.stat`` hands the interpreter lock back and must win it again, and a thread doing
only stats beside busy copy threads waits for it after each one. stage-in's size probe stats
every walked shard while the copies run: on tmpfs its threads took 1.0-1.5 s for 10,000 stats
that take ~40 ms alone, and the copies waited on them. Statted in runs, the lock changes hands
once per run.

``STAGER_NATIVE_STAT=0`` turns the helper off; ``=1`` makes its absence an import error (the
test suite sets it, as it does ``STAGER_NATIVE_TAR`` for the tar walk).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from stager.native import load_optional

__all__ = [
    "StatRow",
    "available",
    "key_stats",
    "key_stats_joined",
    "key_stats_runs",
    "stat_many",
    "stat_many_python",
]

#: ``(st_mode, st_size, st_ino, st_mtime_ns, st_ctime_ns, st_nlink)`` of one successful stat.
StatRow = tuple[int, int, int, int, int, int]


_module: Any = load_optional("stager.storage._statmany", "STAGER_NATIVE_STAT")
if _module is not None and getattr(_module, "ROW_FIELDS", 5) != 6:
    _module = None  # built from an older source (rows without st_nlink): not used


def available() -> bool:
    """Whether the compiled helper is built and enabled."""
    return _module is not None


def stat_many(paths: list[str], budget_s: float) -> tuple[list[StatRow | int], float]:
    """Stat ``paths`` in order, following symlinks, until ``budget_s`` seconds have been spent
    (at least one): ``(results, seconds spent)``, a result per path of the prefix done, each a
    :data:`StatRow` or the ``errno`` of a failed stat."""
    if _module is not None:
        return _module.stat_many(paths, budget_s)
    return stat_many_python(paths, budget_s)


def key_stats(paths: list[str]) -> bytes | None:
    """The loader index key's ``(size, changed_ns)`` of each path as native int64 pairs
    (:func:`stager.shards.indexkey.changed_ns`), stat'ed with the lock released once and no
    Python object made per path; None where the helper is not built (or older), a stat
    failed or a time does not fit in 64 bits: then the caller stats the Python way."""
    compiled = getattr(_module, "key_stats", None)
    return None if compiled is None else compiled(paths)


def key_stats_joined(prefix: bytes, joined: bytes, count: int) -> bytes | None:
    """:func:`key_stats` of ``prefix + name`` for the ``count`` names of ``joined`` (encoded as
    the filesystem encodes them, separated by one NUL, none after the last), without a Python
    object per name; None where :func:`key_stats` gives None, or the helper lacks this call."""
    compiled = getattr(_module, "key_stats_joined", None)
    return None if compiled is None else compiled(prefix, joined, count)


def key_stats_runs(runs: Sequence[tuple[bytes, bytes, int]]) -> bytes | None:
    """:func:`key_stats_joined` of each run, end to end: on a thread each where there are
    several (the stats release the interpreter lock, so a start on idle cores spreads them);
    None where any run gives None."""
    if len(runs) == 1:
        return key_stats_joined(*runs[0])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(runs), thread_name_prefix="stager-stat") as pool:
        parts = list(pool.map(lambda run: key_stats_joined(*run), runs))
    done = [part for part in parts if part is not None]
    return b"".join(done) if len(done) == len(parts) else None


def stat_many_python(
    paths: list[str], budget_s: float, stat: Callable[[str], os.stat_result] = os.stat
) -> tuple[list[StatRow | int], float]:
    """:func:`stat_many` with ``os.stat`` (or ``stat``) one path at a time."""
    results: list[StatRow | int] = []
    started = time.monotonic()
    for path in paths:
        try:
            st = stat(path)
        except OSError as exc:
            results.append(exc.errno or errno.EIO)
        else:
            row = (st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
            results.append(row)
        if time.monotonic() - started >= budget_s:
            break
    return results, time.monotonic() - started
