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

import xxhash

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


def plan_fanout(sizes: Sequence[int | None], have: Sequence[Sequence[bool]]) -> FanoutPlan:
    """Plan a fan-out over ``len(have)`` nodes; ``have[node][i]``: node ``node`` holds shard ``i``.

    ``sizes[i]`` may be ``None`` (unknown until read); such shards weigh as zero bytes but still
    spread by count, because ties break on the number of shards owned.
    """
    num_nodes = len(have)
    if num_nodes < 1:
        raise ValueError("a fan-out needs at least one node")
    count = len(sizes)
    if any(len(row) != count for row in have):
        raise ValueError("every node's have-list must cover every shard")
    owners = [SKIP] * count
    reads = [False] * count
    load = [0] * num_nodes
    owned = [0] * num_nodes

    def take(i: int, node: int) -> None:
        owners[i] = node
        load[node] += sizes[i] or 0
        owned[node] += 1

    by_size = sorted(range(count), key=lambda i: (-(sizes[i] or 0), i))
    # Held shards first: their owner is forced into a subset, so place them before the free ones.
    for i in by_size:
        holders = [r for r in range(num_nodes) if have[r][i]]
        if holders and len(holders) < num_nodes:
            take(i, min(holders, key=lambda r: (load[r], owned[r], r)))
    heap = [(load[r], owned[r], r) for r in range(num_nodes)]
    heapq.heapify(heap)
    for i in by_size:
        if any(have[r][i] for r in range(num_nodes)):
            continue
        _, _, node = heapq.heappop(heap)
        take(i, node)
        reads[i] = True
        heapq.heappush(heap, (load[node], owned[node], node))
    return FanoutPlan(
        tuple(owners), _broadcast_order(sizes, owners, reads, num_nodes), tuple(reads)
    )


def _broadcast_order(
    sizes: Sequence[int | None], owners: list[int], reads: list[bool], num_nodes: int
) -> tuple[int, ...]:
    """Broadcast shards in the order their owners will have them, so reads and sends overlap.

    Assuming the nodes read the source at the same rate, a shard is ready when its owner has read
    it and everything it reads before it; already-held shards are ready at once and go first, so
    they are sent while the owners' first source reads are still running.
    """
    ready: list[tuple[int, int, int]] = []
    read_so_far = [0] * num_nodes
    for i, owner in enumerate(owners):
        if owner == SKIP:
            continue
        if reads[i]:
            read_so_far[owner] += sizes[i] or 0
            ready.append((read_so_far[owner], owner, i))
        else:
            ready.append((0, owner, i))
    return tuple(i for _, _, i in sorted(ready))


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
