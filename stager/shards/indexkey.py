"""The key of a dataset's loader index: what must be unchanged for the saved index to hold.

Every shard's path, size and last change (:func:`changed_ns`), the sample count the manifest
promises, the reader's ``on_error`` and the index file's version. Any difference means the
index is rebuilt, never trusted (see :mod:`stager.shards.loader_index`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stager.storage.paths import nul_joined
from stager.storage.statmany import StatRow, key_stats, stat_many

if TYPE_CHECKING:
    import numpy as np  # imported where a key is made: stage-in imports this module at start

__all__ = ["KEY_FORMAT", "StatsAhead", "changed_ns", "dataset_key", "int_bytes", "is_cache_link"]

KEY_FORMAT = 3  # 3: hashed column by column


def changed_ns(st: os.stat_result) -> int:
    """When a file last changed, for index keys: the later of its mtime and ctime.

    The mtime alone misses a shard rewritten in place at the same size with its mtime put
    back (``cp -p``, ``rsync -a --inplace``): the index would then point into bytes it was not
    built from, and samples would get other samples' keys. Every write and ``utime`` moves the
    ctime, which no call sets back. A ``--cache`` copy (:func:`is_cache_link`, which other jobs
    link too, moving its ctime) is keyed by its mtime alone, as the cache's own record is: else
    an index kept in the cache would never match, and each job's links would make the others'
    indexes stale.
    """
    return _changed(
        (st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)
    )


def is_cache_link(mode: int, links: int) -> bool:
    """Whether a staged file is a ``--cache`` object placed by a hard link: read-only (the
    cache makes its objects 0444 before it links them) with other links. Its ctime moves with
    every job that links it, so it is judged by its mtime, as the cache's record is."""
    return links > 1 and not mode & 0o222


def dataset_key(
    shards: Sequence[str | os.PathLike[str]],
    relpaths: Sequence[str],
    expected: Sequence[int | None],
    on_error: str,
    stats: Sequence[tuple[int, int] | None] | np.ndarray | bytes | None = None,
    *,
    version: int,
) -> bytes:
    """A digest of every shard's path, size, last change and expected count, in whole columns.

    Hashed column by column (the paths joined by NUL, which no path holds; sizes and mtimes as
    int64 arrays, counts as text) rather than one formatted string per shard: ~0.12 s of a
    100k-shard start before.
    ``stats`` rows of ``(size, changed_ns)``; a None row, or -1 in an array, is stat'ed here.
    Or ``bytes``: every row, as :func:`~stager.storage.statmany.key_stats` packs them.
    """
    import hashlib
    import sys

    numpy = sys.modules.get("numpy")  # an array only comes from a caller that imported numpy
    packed: bytes | None = None
    table: list[int] = []
    if isinstance(stats, bytes):  # (before the sequences: bytes is one too)
        packed, rows = stats, len(stats) // 16
        if len(stats) % 16:
            raise ValueError("packed stats are int64 pairs")
    elif numpy is not None and isinstance(stats, numpy.ndarray):
        array = stats.astype(numpy.int64, copy=False).reshape(-1)
        if not (array[1::2] < 0).any():  # a loader's start: every row given, ~1 ms at 1e6
            packed = array.tobytes()
        table = array.tolist() if packed is None else []
        rows = len(array) // 2
    else:
        known = list(stats) if stats is not None else [None] * len(shards)
        table = [v for st in known for v in ((-1, -1) if st is None else st)]
        rows = len(known)
    if not rows == len(expected) == len(relpaths) == len(shards):
        raise ValueError("shards, relpaths, expected counts and stats differ in length")
    if packed is None:
        _stat_missing(shards, table)
        packed = int_bytes(table, 8)
    # counts as decimal text: a manifest may promise any integer, even one past int64
    counts = ",".join(map(str, expected))
    head = f"v{version}.{KEY_FORMAT}|{on_error}|{len(relpaths)}|"
    digest = hashlib.sha256(head.encode())
    digest.update(nul_joined(relpaths).encode("utf-8", "surrogateescape"))
    digest.update(packed)
    digest.update(counts.encode())
    return digest.digest()


def int_bytes(values: list[int], width: int) -> bytes:
    """Native-order integers of ``width`` bytes (4 or 8), as numpy's ``tobytes`` of an int32 or
    int64 array gives them (the keys of indexes written before must still match; the compiled
    join reads them so); without numpy, which stage-in does not import."""
    from array import array

    packed = array("i" if width == 4 else "q", values)
    if packed.itemsize != width:
        raise RuntimeError(f"this platform's array('{packed.typecode}') is not {width} bytes")
    return packed.tobytes()


def _stat_missing(shards: Sequence[str | os.PathLike[str]], table: list[int]) -> None:
    """Fill the rows of ``table`` (flat: size, changed_ns, size, ...) still ``-1`` with their
    shard's ``(size, changed_ns)``.

    In runs of :func:`~stager.storage.statmany.stat_many` (one release of the interpreter lock
    per run where the helper is built): stage-in's finish keys every just-copied shard here,
    and a loader's start every shard it was not given a stat for. On tmpfs 10,000 stats took
    22 ms in runs against 28 ms one ``os.stat`` at a time; each ``os.stat`` is also a point
    where another thread may take the lock. A failed stat raises as ``os.stat`` would.
    """
    missing = [i for i in range(len(table) // 2) if table[2 * i + 1] < 0]
    paths = [os.fspath(shards[i]) for i in missing]  # str: pathlib costs ~25 us per shard
    done, size = 0, 64
    while done < len(paths):
        # stat_many copies and encodes the whole list it is given, before its budget stops
        # it: runs start small and double while stats are fast (slow NFS stats stay short)
        run = paths[done : done + size]
        rows, _ = stat_many(run, _STAT_BUDGET_S)
        if len(rows) == len(run):
            size = min(_RUN, size * 2)
        for k, row in enumerate(rows):
            if isinstance(row, int):
                raise OSError(row, os.strerror(row), run[k])
            at = 2 * missing[done + k]
            table[at], table[at + 1] = row[1], _changed(row)
        done += len(rows)


class StatsAhead:
    """The key's ``(size, changed_ns)`` of ``paths``, stat'ed on a thread of its own while the
    caller goes on: :func:`dataset_key`'s ``stats``.

    Why: stage-in's finish keys every shard it just copied (~25 ms of stats at 10,000 shards)
    right after writing its manifest (~15 ms of Python). The stats release the interpreter
    lock, so on another core they cost the finish nothing, where the compiled helper packs
    them (:func:`~stager.storage.statmany.key_stats`): made into rows of Python ints, they
    held the lock ~8 ms, and the finish waited ~15 ms for them (115 -> 98 ms at 10,000
    shards, medians of 7). A stat that fails, or a thread that cannot start (a job at its
    process limit), leaves every row None: the key then stats again and raises as it would
    have.
    """

    def __init__(self, paths: Sequence[str]) -> None:
        self._rows: list[tuple[int, int] | None] | bytes = [None] * len(paths)
        self._thread: threading.Thread | None = threading.Thread(
            target=self._stat, args=(paths,), daemon=True
        )
        try:
            self._thread.start()
        except RuntimeError:  # "can't start new thread"
            self._thread = None

    def _stat(self, paths: Sequence[str]) -> None:
        try:
            packed = key_stats([os.fspath(path) for path in paths])
        except Exception:  # noqa: BLE001 - (an audit hook, no memory): the Python way below
            packed = None
        if packed is not None:  # no Python per row: it held the lock the finish needed
            self._rows = packed
            return
        table = [-1] * (2 * len(paths))
        try:
            _stat_missing(paths, table)
        except Exception:  # noqa: BLE001 - the key stats again, and raises what it must
            return
        self._rows = list(zip(table[0::2], table[1::2], strict=True))

    def rows(self) -> list[tuple[int, int] | None] | bytes:
        """The rows, once the thread is done: :func:`dataset_key`'s ``stats`` (packed where
        the compiled helper stat'ed them)."""
        if self._thread is not None:
            self._thread.join()
        return self._rows


def _changed(row: StatRow) -> int:
    """:func:`changed_ns` of a :data:`~stager.storage.statmany.StatRow`."""
    mode, _size, _ino, mtime_ns, ctime_ns, links = row
    changed = mtime_ns if is_cache_link(mode, links) else max(mtime_ns, ctime_ns)
    # Keys hold int64: a time past 2262 (`touch -d 2300-01-01`) made every start raise
    # OverflowError. Such times are held at int64's end, where any change of size or a time
    # back inside the range still moves the key.
    return min(max(changed, _INT64_MIN), _INT64_MAX)


_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)


#: Paths handed to one stat_many call, at most.
_RUN = 4096
#: Seconds of stats per release of the interpreter lock: long enough to amortise it, short
#: enough that a loader's other threads (a DataLoader's pin-memory thread) are not held up.
_STAT_BUDGET_S = 0.01
