"""What a run with the node cache asks of the two filesystems: room for fills, whose error, and
what an eviction for either is said as.

Apart from :mod:`stager.stagein.cache` (one run's use of the cache) because these are plain
functions of paths and sizes, tested on their own.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path

from stager.cache.records import DatasetRecord
from stager.stagein.guards import free_bytes
from stager.stagein.plan import CopyItem
from stager.units import human_bytes

__all__ = [
    "cache_refusal",
    "evicted_message",
    "free_bytes_or_0",
    "same_fs",
    "uncached_bytes",
    "unfit",
]


def same_fs(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.stat(a).st_dev == os.stat(b).st_dev
    return False


def free_bytes_or_0(path: Path) -> int:
    with contextlib.suppress(OSError):
        return free_bytes(path)
    return 0


def unfit(missing: list[tuple[str, int]], free_bytes: int) -> set[str]:
    """Keys to leave out, from the end, so that the rest fits in ``free_bytes``."""
    need = sum(size for _key, size in missing)
    out: set[str] = set()
    for key, size in reversed(missing):
        if need <= free_bytes:
            break
        out.add(key)
        need -= size
    return out


def uncached_bytes(items: Iterable[CopyItem], shards: Mapping[str, tuple[str, int]]) -> int:
    """Bytes of the planned ``items`` copied past the cache (not in ``shards``, relpath ->
    (key, size): no key): on a filesystem the cache shares with scratch they take room too."""
    return sum(i.size or 0 for i in items if i.shard.relpath not in shards)


def cache_refusal(exc: BaseException, root: Path) -> str | None:
    """Why ``exc`` is the cache's doing, or None: an error (or its cause) naming a path inside
    the cache ``root`` that no retry fixes (permissions, a read-only mount, a file where a
    directory should be). Scratch's errors and the source's are not (they are the job's)."""
    inside = str(root).rstrip(os.sep) + os.sep
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _REFUSALS:
            for name in (seen.filename, seen.filename2):
                if isinstance(name, str) and (name + os.sep).startswith(inside):
                    return f"{seen.strerror or seen}: {name}"
        seen = seen.__cause__ or seen.__context__
    return None


#: Errors of a path that a retry would not fix.
_REFUSALS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})


def evicted_message(record: DatasetRecord, for_space: AbstractSet[str]) -> str:
    """The warning that registering evicted ``record``: for the cap, or (its key in
    ``for_space``) for the free space of the filesystem the cache shares with scratch."""
    short = record.key in for_space
    why = "scratch's filesystem short of space" if short else "cache over its limit"
    return (
        f"{why}: evicted {record.name or record.spec!r} ({human_bytes(record.total_bytes)}, "
        "unused by any running job)"
    )
