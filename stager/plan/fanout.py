"""Who reads which shard from the source, and in which order the shards are broadcast.

Pure functions of (shard sizes, which node already has which shard, node count): every node
computes the same plan from the same all-gathered inputs, so no plan is ever sent over the wire
and the order of collective calls is identical on every node by construction.

Rules, in order:

* a shard every node already has is skipped (``SKIP``): no read, no broadcast;
* a shard some node already has is owned by one of those holders (the least loaded), so a
  rerun after a partial failure reads nothing from the source for it;
* a shard no node has goes to the least loaded node, largest shards first (greedy LPT): the
  bytes each node reads from the source differ by at most one shard's size.

"Load" is the bytes a node sends to its peers, i.e. the bytes of the shards it owns.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from stager.plan.havebits import HaveBits

__all__ = ["SKIP", "FanoutPlan", "plan_fanout", "shard_list_digest"]

#: Owner value of a shard that every node already holds.
SKIP = -1


@dataclass(frozen=True)
class FanoutPlan:
    """Owner per shard (``SKIP`` when nobody needs it) and the global broadcast order."""

    owners: tuple[int, ...]
    order: tuple[int, ...]  # shard indices, the same sequence of broadcasts on every node
    reads: tuple[bool, ...]  # per shard: its owner reads it from the source (nobody had it)

    def reads_of(self, node: int) -> list[int]:
        """Shards ``node`` reads from the source, in the order it should read them."""
        return [i for i in self.order if self.owners[i] == node and self.reads[i]]

    def source_bytes(self, sizes: Sequence[int | None], node: int | None = None) -> int:
        """Bytes read from the source by ``node`` (or by all nodes together)."""
        return sum(
            sizes[i] or 0
            for i, owner in enumerate(self.owners)
            if self.reads[i] and (node is None or owner == node)
        )


def plan_fanout(
    sizes: Sequence[int | None], have: HaveBits | Sequence[Sequence[bool]]
) -> FanoutPlan:
    """Plan a fan-out over ``have``'s nodes; ``have[node][i]``: node ``node`` holds shard ``i``
    (as lists, or packed as :class:`HaveBits`).

    ``sizes[i]`` may be ``None`` (unknown until read); such shards weigh as zero bytes but still
    spread by count, because ties break on the number of shards owned.

    Costs numpy passes over the packed bits, plus Python per shard (and, for a shard only some
    nodes hold, one numpy pass over the nodes): never Python per (node, shard).
    """
    if not isinstance(have, HaveBits):
        have = HaveBits.from_lists(have)
    num_nodes, count = have.num_nodes, len(sizes)
    if have.count != count:
        raise ValueError("every node's have-list must cover every shard")
    weight = np.array([size or 0 for size in sizes], dtype=np.int64)
    holding = have.holder_counts()
    owners = np.full(count, SKIP, dtype=np.int64)
    load = np.zeros(num_nodes, dtype=np.int64)
    owned = np.zeros(num_nodes, dtype=np.int64)

    # Largest first, ties by index (a stable sort of the negated sizes).
    by_size = np.argsort(-weight, kind="stable")
    sizes_of = weight.tolist()
    # Held shards first: their owner is forced into a subset, so place them before the free ones:
    # the least loaded holder, ties on the shards owned, then on the node's index.
    partial = by_size[(holding[by_size] > 0) & (holding[by_size] < num_nodes)]
    no_holder = np.iinfo(np.int64).max  # (no node has read 8 EiB)
    for block, rows in have.holder_rows(partial):
        for i, row in zip(block, rows, strict=True):
            loads = np.where(row, load, no_holder)
            node = int(loads.argmin())  # the first least loaded: the lowest index
            tied = loads == loads[node]
            if np.count_nonzero(tied) > 1:
                tied_nodes = np.flatnonzero(tied)
                node = int(tied_nodes[owned[tied_nodes].argmin()])
            owners[i] = node
            load[node] += sizes_of[i]
            owned[node] += 1
    # Shards nobody holds: greedy LPT over (load, shards owned, node).
    free = by_size[holding[by_size] == 0].tolist()
    heap = list(zip(load.tolist(), owned.tolist(), range(num_nodes), strict=True))
    heapq.heapify(heap)
    free_owners = []
    for i in free:
        node_load, node_owned, node = heap[0]
        free_owners.append(node)
        heapq.heapreplace(heap, (node_load + sizes_of[i], node_owned + 1, node))
    owners[free] = free_owners
    reads = holding == 0
    return FanoutPlan(
        tuple(owners.tolist()),
        _broadcast_order(weight, owners, reads),
        tuple(reads.tolist()),
    )


def _broadcast_order(
    weight: npt.NDArray[np.int64], owners: npt.NDArray[np.int64], reads: npt.NDArray[np.bool_]
) -> tuple[int, ...]:
    """Broadcast shards in the order their owners will have them, so reads and sends overlap.

    Assuming the nodes read the source at the same rate, a shard is ready when its owner has read
    it and everything it reads before it; already-held shards are ready at once and go first, so
    they are sent while the owners' first source reads are still running. Ties: by owner, then
    by index.
    """
    ready = np.zeros(len(owners), dtype=np.int64)
    # The reads grouped by owner, in index order within each: a running total of the bytes read,
    # restarted at each owner's first read, is when each is ready.
    read = np.flatnonzero(reads)
    if read.size:
        by_owner = read[np.argsort(owners[read], kind="stable")]
        running = np.cumsum(weight[by_owner])
        grouped = owners[by_owner]
        first = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        start = np.zeros(read.size, dtype=np.intp)
        start[first] = first
        start = np.maximum.accumulate(start)  # each read's owner's first read
        ready[by_owner] = running - (running - weight[by_owner])[start]
    sent = np.flatnonzero(owners != SKIP)
    return tuple(sent[np.lexsort((sent, owners[sent], ready[sent]))].tolist())


def shard_list_digest(
    entries: Sequence[tuple[str, int | None] | tuple[str, int | None, str | None, str | None]],
    context: str = "",
) -> int:
    """A signed 64-bit digest of (relpath, size[, version, expected hash]) entries and a
    ``context`` (the source asked for): nodes compare it before exchanging.

    Nodes list the source independently; if a shard appeared, or changed size or version in
    between, or the nodes were given different sources, their plans would disagree: the
    collectives would pair up wrong shards, and a node holding a copy of the old bytes would
    send them as the new version (a same-size rewrite), recorded so on every node. Signed so it
    fits an int64 tensor.
    """
    hasher = xxhash.xxh3_64()
    hasher.update(context.encode("utf-8", "surrogateescape") + b"\0\0")
    for relpath, size, *more in entries:
        hasher.update(relpath.encode("utf-8", "surrogateescape"))
        hasher.update(b"\0%d" % (-1 if size is None else size))
        for text in more:  # (versions and hashes hold no NUL)
            hasher.update(b"\0" + (b"-" if text is None else text.encode("utf-8", "replace")))
        hasher.update(b"\n")
    value = hasher.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value
