"""Which cached datasets to evict to stay under the limit: a pure function of the records.

The cache's size is the bytes of every object some dataset record names, each counted once
(two specs listing one shard share its object). Eviction removes whole datasets, least
recently used first, never one in use (a stage-in holds its lock, or a job that used it is
still running) and never the one being staged; an object goes only when no remaining dataset
names it. When that is not enough, the run being staged caches fewer of its shards (those it
has not cached yet) and copies the rest straight to scratch: the limit is a cap, not a wish.

Where the cache shares its filesystem with scratch (the layout that links shards into scratch),
the free space bounds it too (:func:`space_shortfall`, :mod:`stager.cache.room`): idle cached
datasets make way for the shards a run must write, where they used to fill the disk and fail
the job (exit 6) under the cap.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DatasetUsage",
    "EvictionPlan",
    "cache_bytes",
    "plan_eviction",
    "shards_over_limit",
    "space_shortfall",
]


@dataclass(frozen=True)
class DatasetUsage:
    """What eviction needs to know of one cached dataset."""

    key: str
    last_used: float
    objects: Mapping[str, int]  # object key -> size
    in_use: bool = False


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[str, ...]  # dataset keys, in the order they go
    freed_objects: tuple[str, ...]  # object keys no remaining dataset names
    total_bytes: int  # the cache's size once they are gone


def cache_bytes(datasets: Iterable[DatasetUsage]) -> int:
    """Bytes of the objects the datasets name, each object counted once."""
    sizes: dict[str, int] = {}
    for dataset in datasets:
        sizes.update(dataset.objects)
    return sum(sizes.values())


def plan_eviction(
    datasets: Sequence[DatasetUsage], limit_bytes: int, *, keep: str = ""
) -> EvictionPlan:
    """Evict least recently used datasets (not in use, not ``keep``) until the rest fit.

    Records naming no object are dropped on the way, whatever the size.
    """
    refs: Counter[str] = Counter()
    sizes: dict[str, int] = {}
    for dataset in datasets:
        refs.update(dataset.objects.keys())
        sizes.update(dataset.objects)
    total = sum(sizes.values())
    evicted: list[str] = []
    freed: list[str] = []
    candidates = sorted(
        (d for d in datasets if not d.in_use and d.key != keep), key=lambda d: (d.last_used, d.key)
    )
    for dataset in candidates:
        if total <= limit_bytes and dataset.objects:
            continue  # an empty record (all of it evicted or left out) goes regardless
        evicted.append(dataset.key)
        for key in dataset.objects:
            refs[key] -= 1
            if refs[key] == 0:
                total -= sizes[key]
                freed.append(key)
    return EvictionPlan(tuple(evicted), tuple(freed), total)


def shards_over_limit(
    total_bytes: int,
    limit_bytes: int,
    missing: Sequence[tuple[str, int]],
    *,
    shared: Iterable[str] = (),
) -> set[str]:
    """Object keys of the run's not yet cached shards to leave out of the cache so it fits.

    ``missing``: (key, size) of the shards the run would add, counted in ``total_bytes``;
    ``shared``: keys another dataset names too (counted whatever this run does). Shards are
    left out from the end of the run's order, so a partly cached dataset is cached from its
    start.
    """
    shared = set(shared)
    out: set[str] = set()
    for key, size in reversed(missing):
        if total_bytes <= limit_bytes:
            break
        if key in shared or key in out:
            continue
        out.add(key)
        total_bytes -= size
    return out


#: Room kept free beside a run's shards on a filesystem the cache shares with scratch, for its
#: manifest, loader index and directories: this, plus a 64th of the shards' bytes (those files
#: take ~300 bytes a shard, 1.5% of a 20 KB shard).
SPACE_HEADROOM = 1 << 20
_BLOCK = 4096


def space_shortfall(missing: Sequence[tuple[str, int]], free_bytes: int) -> int:
    """The bytes to free on a filesystem with ``free_bytes`` free (less any reserve the caller
    keeps) before the run's ``missing`` shards are written there: what they take in whole
    blocks and a headroom (:data:`SPACE_HEADROOM`, only where something is to be written),
    less the free space. Zero or less: nothing to free."""
    if not missing:
        return -free_bytes
    in_blocks = sum(-(-size // _BLOCK) * _BLOCK for _key, size in missing)
    return in_blocks + SPACE_HEADROOM + in_blocks // 64 - free_bytes
