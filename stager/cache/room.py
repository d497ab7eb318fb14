"""Room on a filesystem the node cache shares with scratch: what a run's registration must free
there, and which idle datasets free it (:meth:`stager.cache.store.ShardCache.register`).

Counted on disk, not from the records: an object another link holds (an ended job's scratch
that was not cleaned) or that is not there frees nothing when it goes, the objects a
registration stops naming free their blocks, and the fills other stage-ins running now have
registered but not written yet take their room whatever the free space says. Where evicting
every idle dataset would not make the room, none is evicted for it: the run fails (exit 6) and
the cache keeps what it had.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from stager.cache.evict import (
    DatasetUsage,
    EvictionPlan,
    cache_bytes,
    plan_eviction,
    space_shortfall,
)
from stager.cache.locks import lock_is_held
from stager.cache.paths import CacheLayout
from stager.cache.records import DatasetRecord

__all__ = ["alone_bytes", "shortfall", "space_plan"]


def alone_bytes(layout: CacheLayout, objects: Mapping[str, int]) -> dict[str, int]:
    """Key -> the bytes dropping each of ``objects`` frees: its blocks where the cache's name
    is its only link, else 0 (a job's scratch links it, or it is not there)."""
    out = {}
    for key in objects:
        try:
            st = os.stat(layout.object_path(key))
        except OSError:
            out[key] = 0
            continue
        out[key] = st.st_blocks * 512 if st.st_nlink == 1 else 0
    return out


def shortfall(
    layout: CacheLayout,
    free_bytes: int | Callable[[], int],
    before: Mapping[str, int],
    records: Mapping[str, DatasetRecord],
    own: str,
    missing: Sequence[tuple[str, int]],
    reserve_bytes: int,
) -> int:
    """Bytes to free before the run's ``missing`` shards fit (:func:`space_shortfall`), with
    ``reserve_bytes`` kept free, and the fills other stage-ins have yet to write; ``before``: the
    objects the run's dataset ``own`` named until now (those no record names any more are
    dropped by the registration: their room counts as free)."""
    free_now = free_bytes() if callable(free_bytes) else free_bytes
    named = {k for r in records.values() for k in r.objects}
    dropped = {k: size for k, size in before.items() if k not in named}
    free_now += sum(alone_bytes(layout, dropped).values())
    free_now -= _pending_bytes(layout, records, own, missing)
    return space_shortfall(missing, free_now - reserve_bytes)


def space_plan(
    layout: CacheLayout,
    records: Mapping[str, DatasetRecord],
    own: str,
    short: int,
    in_use: Callable[[DatasetRecord], bool],
) -> EvictionPlan | None:
    """The idle datasets whose going frees ``short`` bytes, least recently used first; None
    where all of them would not."""
    usages = [
        DatasetUsage(key, r.last_used, r.objects, False)
        if key == own
        else DatasetUsage(key, r.last_used, alone_bytes(layout, r.objects), in_use(r))
        for key, r in records.items()
    ]
    room = cache_bytes(usages) - short
    plan = plan_eviction(usages, room, keep=own)
    return plan if plan.total_bytes <= room else None


def _pending_bytes(
    layout: CacheLayout,
    records: Mapping[str, DatasetRecord],
    own: str,
    missing: Sequence[tuple[str, int]],
) -> int:
    """Bytes other stage-ins running now (their dataset's lock held) have registered and not
    written yet (this run's own missing shards aside)."""
    mine = {k for k, _s in missing}
    running = [
        record
        for key, record in records.items()
        if key != own and lock_is_held(layout.dataset_lock(key))
    ]
    named = {obj: size for r in running for obj, size in r.objects.items() if obj not in mine}
    there = layout.present(named.keys())
    return sum(size for obj, size in named.items() if obj not in there)
