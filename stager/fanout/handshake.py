"""The fan-out's handshake: the nodes' first exchange, which decides whether they exchange at all.

Every node all-gathers one row: a digest of its shard list, its state, its shard count and its
chunk size. The state says whether it can take part:

* ``READY``: planned, with room in scratch for what it lacks;
* ``NO_SPACE``: its scratch cannot hold the dataset;
* ``FAILED``: it failed before the exchange (its source listing, its scratch, its planning;
  not a lock another task of the node holds: that task joins instead).

A node that failed before the exchange still joins the group to say so
(:func:`failure_told_to_peers`). Without it, its peers waited ``--fanout-timeout`` for it, fell
back to reading the whole dataset each from the source (the load the fan-out is there to keep
off NFS), and the step failed anyway on the node that had failed. Now every node stops at once,
the peers with one line naming the node (exit 10), the node with its own error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy

from stager.errors import FanoutError, GroupUnavailable, ScratchFull, StagerError, one_line
from stager.fanout.group import FanoutOptions, NodeGroup, form_group
from stager.plan.fanout import shard_list_digest
from stager.plan.havebits import HaveBits
from stager.storage.identity import node_neutral

__all__ = ["READY", "NO_SPACE", "FAILED", "state_of", "handshake", "failure_told_to_peers"]

READY, NO_SPACE, FAILED = 1, 0, 2


def state_of(refusal: StagerError | None) -> int:
    """The handshake state of a node that refused with ``refusal`` (``None``: it did not)."""
    if refusal is None:
        return READY
    return NO_SPACE if isinstance(refusal, ScratchFull) else FAILED


def _gather_rows(group: NodeGroup, row: Sequence[int]) -> list[list[int]]:
    torch = group.torch
    try:
        mine = torch.tensor(list(row), dtype=torch.int64)
        return [m.tolist() for m in group.all_gather(mine, forming=True)]
    except Exception as exc:  # noqa: BLE001 - torch errors while forming: no group
        raise GroupUnavailable(f"handshake failed ({one_line(exc)[:300]})") from exc


def _refuse_unready(rows: list[list[int]], node: int, label: Callable[[int], str]) -> None:
    """Raise :class:`FanoutError` on a ready node when any other node is not ready."""
    full = [label(r) for r, row in enumerate(rows) if row[1] == NO_SPACE and r != node]
    failed = [label(r) for r, row in enumerate(rows) if row[1] == FAILED and r != node]
    reasons, fixes = [], []
    if failed:
        reasons.append(f"node(s) {', '.join(failed)} failed before the exchange")
        fixes.append("fix what it says")
    if full:
        reasons.append(f"node(s) {', '.join(full)} lack scratch space for the dataset")
        fixes.append("free space there or pass --dest")
    if reasons:
        raise FanoutError(
            f"{' and '.join(reasons)}, so nobody copied anything; see their error line, "
            f"{' or '.join(fixes)}, and rerun"
        )


def handshake(
    group: NodeGroup,
    items: Sequence[Any],
    label: Callable[[int], str],
    asked: tuple[str, int, bool],
) -> HaveBits:
    """All-gather (shard-list digest, state, count, chunk), then the have-bitmaps; refuse any
    disagreement, and stop where another node is not ready. ``items`` are
    :class:`stager.fanout.exchange.ExchangeShard`; ``asked``: the source spec and chunk size,
    which every node must share too, and whether the source is local (its versions are then
    compared by their modification times only).

    Runs under the short form timeout: a failure here still means "no group", so every node
    falls back rather than some exchanging and some not.
    """
    spec, chunk_bytes, local = asked
    listed = [
        (it.shard.relpath, it.size, node_neutral(it.shard.version, local), it.want_hash)
        for it in items
    ]
    rows = _gather_rows(group, (shard_list_digest(listed, spec), READY, len(items), chunk_bytes))
    _refuse_unready(rows, group.node, label)
    if any(row[3] != rows[0][3] for row in rows):
        chunks = ", ".join(f"{label(r)}: {row[3] // 1024}" for r, row in enumerate(rows))
        raise FanoutError(f"nodes were given different --fanout-chunk-kib ({chunks})")
    if any(row[0] != rows[0][0] or row[2] != rows[0][2] for row in rows):
        counts = ", ".join(f"{label(r)}: {row[2]}" for r, row in enumerate(rows))
        raise FanoutError(
            f"nodes listed different shards ({counts} shards, or other sizes or versions), "
            "or were given different sources: the source changed while the job started? "
            "rerun once it is stable, with one SOURCE for every node"
        )
    # packbits of zero shards is empty; gloo wants at least one element, so pad one byte.
    bits = numpy.packbits(numpy.array([it.have for it in items] + [False], dtype=bool))
    try:
        gathered = group.all_gather(group.torch.from_numpy(bits), forming=True)
    except Exception as exc:  # noqa: BLE001 - torch errors while forming: no group
        raise GroupUnavailable(f"handshake failed ({one_line(exc)[:300]})") from exc
    # Kept packed (nodes x shards bits): lists of bools were nodes x shards Python objects.
    return HaveBits(numpy.stack([t.numpy() for t in gathered]), len(items))


@contextlib.contextmanager
def failure_told_to_peers(
    where: Callable[[], tuple[tuple[str, int], str]],
    node: int,
    num_nodes: int,
    options: FanoutOptions,
) -> Iterator[None]:
    """Run the block; if it fails with a :class:`StagerError`, join the group to say so in the
    handshake, then raise that error as it was. Where no group forms (peers absent, torch
    missing) the error is raised all the same, after the form timeout at most.

    ``where()`` gives the rendezvous ``(host, port)`` and the group's tag; it is called only on
    failure, and where it fails in turn the peers are not told.
    """
    try:
        yield
    except StagerError as exc:
        if num_nodes > 1:
            try:
                endpoint, tag = where()
            except StagerError:
                raise exc from None
            with contextlib.suppress(GroupUnavailable):
                with form_group(*endpoint, node, num_nodes, options, tag) as group:
                    _gather_rows(group, (0, state_of(exc), 0, options.chunk_bytes))
        raise
