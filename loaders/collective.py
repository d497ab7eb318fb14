"""What the ranks of a ``torch.distributed`` group settle together when a loader is built.

Every rank builds its own loader from its own listing. Where those differ (a remote source
changed between two ranks' listings, nodes that staged different copies, a shard corrupt on one
node only), each rank plans a different epoch: ranks read the same samples, miss others, and one
waits in the training step's all-reduce for batches the others never send. So the ranks compare
one digest of what they see (:func:`agree_on_dataset`), and every rank raises where they differ.

Counting a remote shard's samples reads the whole shard. Every rank counted every shard, so a
job of N ranks read the dataset N times before its first step: :func:`count_in_shares` has each
rank count its share and the ranks add up the results, one all-reduce of a count per shard.

Outside an initialised group (one process, or a launcher without ``init_process_group``) both
are local, and so for a loader of a world other than the group's (``LoaderOptions(rank=0,
world_size=1)`` on rank 0 alone, for a validation pass there: a collective on one rank would
wait forever). Under ``--subset node`` nodes hold different shards on purpose: only the ranks of
one node compare what they see, and counting is each node's own.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from stager.errors import IntegrityError, SourceError, UsageError, one_line
from stager.plan.ranks import WorldLayout

__all__ = ["agree_on_dataset", "count_in_shares", "failing_together", "layout_group"]


def layout_group(layout: WorldLayout) -> tuple[Any, str] | None:
    """``(dist, device)`` where an initialised group is the world the loader's ``layout``
    shares its samples over (its size and this rank's place are the layout's); None for a
    loader of another world (rank 0's alone, for a validation pass), which must enter no
    collective the other ranks never join. ``device``: where the group reduces tensors."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if (dist.get_world_size(), dist.get_rank()) != (layout.world_size, layout.rank):
        return None
    return dist, "cuda" if dist.get_backend() == "nccl" else "cpu"  # (NCCL: GPU tensors only)


def _group(layout: WorldLayout) -> tuple[Any, int, int, str] | None:
    """``(dist, rank, world, device)`` of the :func:`layout_group` where it has more than one
    rank (one has nothing to compare)."""
    found = layout_group(layout)
    if found is None or found[0].get_world_size() < 2:
        return None
    dist, device = found
    return dist, dist.get_rank(), dist.get_world_size(), device


def agree_on_dataset(
    fingerprint: str, settings: str, source: object, subset: str, layout: WorldLayout
) -> str:
    """Raise :class:`SourceError` on every rank unless every rank's shard list and sample
    counts have this ``fingerprint`` (:func:`stager.plan.ranks.fingerprint`), and
    :class:`UsageError` unless every rank was given the same ``settings`` (a digest of the
    knobs that cut the epoch); one all-reduce.

    Returns the fingerprint a loader state records. Under ``--subset node`` each node holds
    other shards, so only the ranks of one node must agree on them, and the state's
    fingerprint is the job's: every node's in turn (one all-gather), so the state rank 0 saves
    resumes the ranks of every node, as a state saved under ``--subset all`` does.
    """
    group = _group(layout)
    if group is None:
        return fingerprint
    # One all-reduce of the same shape on every rank whatever its subset (the settings hold
    # it): ranks that disagree on it raise together instead of waiting in two collectives.
    shards = fingerprint if subset != "node" else _NODES_DIFFER
    same_settings, same_shards = _same_everywhere(group, settings, shards)
    if not same_settings:
        raise _settings_differ(group[2])
    if subset != "node":
        if not same_shards:
            raise _differ(group[2], source)
        return fingerprint
    per_rank = _gathered(group, fingerprint)
    ranks = layout.ranks_per_node
    nodes = [per_rank[first : first + ranks] for first in range(0, len(per_rank), ranks)]
    if any(len(set(node)) != 1 for node in nodes):
        raise _differ(group[2], source)
    job = hashlib.sha256(b"node subsets\0" + "\0".join(n[0] for n in nodes).encode())
    return job.hexdigest()[:16]


@contextlib.contextmanager
def failing_together(layout: WorldLayout, source: object) -> Iterator[None]:
    """Run the block on every rank; where it raises on some rank, every rank raises.

    A rank that fails opening the dataset on its own (a shard corrupt or missing on its node
    only) raised before the collectives that compare what the ranks see, and the others waited
    in them for it: a hang instead of the error. One all-reduce of a flag after the block
    (none outside a group of several ranks): the failing rank raises its own error, the others
    a :class:`SourceError` pointing at it. The block must hold no collective that a failing
    rank could skip (a streaming reader's counts share their errors, so all ranks fail alike).
    """
    group = _group(layout)
    try:
        yield
    except Exception:
        if group is not None:
            _any_failed(group, True)
        raise
    if group is not None and _any_failed(group, False):
        raise SourceError(
            f"another of the {group[2]} ranks could not open {source} (its own error says why: "
            "a shard corrupt or missing on its node?); every rank stops rather than wait for it"
        )


def _any_failed(group: tuple[Any, int, int, str], failed: bool) -> bool:
    import torch

    dist, _, _, device = group
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


#: What node-subset ranks put in the shards' slot of the first all-reduce: their shards differ.
_NODES_DIFFER = "0" * 16


def _same_everywhere(group: tuple[Any, int, int, str], *digests: str) -> tuple[bool, ...]:
    """Whether every rank holds each of these hex ``digests``; one all-reduce of two integers
    each."""
    import torch

    dist, _, _, device = group
    values = []
    for digest in digests:
        mine = int(digest[:15], 16)  # (60 bits: an int64 holds it and its negation)
        values += [mine, -mine]
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    reduced = tensor.cpu().tolist()
    return tuple(reduced[i] == -reduced[i + 1] for i in range(0, len(reduced), 2))


def _gathered(group: tuple[Any, int, int, str], digest: str) -> list[str]:
    """Each rank's hex ``digest`` (its first 15 digits), in rank order; one all-gather."""
    import torch

    dist, _, world, device = group
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [f"{int(value):015x}" for value in torch.cat(every).cpu().tolist()]


def _settings_differ(world: int) -> UsageError:
    return UsageError(
        f"the {world} ranks were given different loader settings (batch_size, seed, shuffle, "
        "even or block_samples): their epochs would not line up (samples read twice or never, "
        "or one rank waiting for batches another never sends). Pass the same values on every "
        "rank; the loader already shuffles each rank's share apart, so a seed per rank is "
        "not needed"
    )


def _differ(world: int, source: object) -> SourceError:
    return SourceError(
        f"the {world} ranks do not see the same shards and sample counts of {source}: the "
        "source changed while they listed it, nodes staged different copies (or found other "
        "shards corrupt), or some read a staged copy and others the source; let stage-in "
        "finish on every node (every rank then reads one staged copy of one version) and "
        "restart"
    )


def count_in_shares(
    known: Sequence[int | None],
    count: Callable[[int], int],
    name: Callable[[int], str],
    subset: str,
    layout: WorldLayout,
    source: object = "the source",
) -> tuple[dict[int, int], dict[int, Exception]]:
    """``count(i)`` for each shard ``i`` whose count is None in ``known`` on any rank, each
    rank counting every world-th one: the counts by index, and the errors by index (each rank
    gets every rank's: an error on one rank alone would leave the others waiting in the
    reduce). ``name(i)`` names shard ``i``; ranks whose shard lists differ raise
    :class:`SourceError`, all of them, before any count. Which shards to count is decided
    together: a manifest one rank could not read (a store's 503) costs counting, not the run."""
    group = _group(layout) if subset != "node" else None
    todo = [i for i, n in enumerate(known) if n is None]
    if group is not None:
        import torch

        dist, _, _, device = group
        names = "\0".join(name(i) for i in range(len(known)))
        if not _same_everywhere(group, hashlib.sha256(names.encode()).hexdigest())[0]:
            raise _differ(group[2], source)
        # Whether any rank lacks a count first (one integer): where none does (a manifest on
        # every rank), no flag per shard crosses the network.
        lacking = torch.tensor([len(todo)], dtype=torch.int64, device=device)
        dist.all_reduce(lacking, op=dist.ReduceOp.MAX)
        if int(lacking.item()):
            unknown = torch.tensor([n is None for n in known], dtype=torch.int64, device=device)
            dist.all_reduce(unknown, op=dist.ReduceOp.MAX)
            todo = [i for i, flag in enumerate(unknown.cpu().tolist()) if flag]
        else:
            todo = []
    rank, world = (group[1], group[2]) if group is not None else (0, 1)
    counts: dict[int, int] = {}
    errors: dict[int, Exception] = {}
    for slot in range(rank, len(todo), world):
        try:
            counts[todo[slot]] = count(todo[slot])
        except Exception as exc:  # noqa: BLE001 - every rank must reach the reduce below
            errors[todo[slot]] = exc
    if group is None or not todo:
        return counts, errors
    # one entry per shard, set by the rank that counted it: count + 1, -1 corrupt, -2 unreadable
    found = torch.zeros(len(todo), dtype=torch.int64)
    for slot, i in enumerate(todo):
        if i in counts:
            found[slot] = counts[i] + 1
        elif i in errors:
            found[slot] = -1 if isinstance(errors[i], IntegrityError) else -2
    found = found.to(device)
    dist.all_reduce(found, op=dist.ReduceOp.SUM)
    for slot, value in enumerate(found.cpu().tolist()):
        i = todo[slot]
        if value > 0:
            counts[i] = value - 1
        elif i not in errors:
            kind = IntegrityError if value == -1 else SourceError
            what = "is corrupt or not a tar" if value == -1 else "could not be read"
            errors[i] = kind(f"shard {one_line(name(i))} {what} (counted by rank {slot % world})")
    return counts, errors
