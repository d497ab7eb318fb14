"""Which samples each rank reads, in which order: a pure function of counts, layout, epoch, seed.

Everything here is numpy only (no torch, no I/O), so stage-in can import it in a Slurm prologue
to decide which shards a node needs, and the tests can check hundreds of simulated worlds in
milliseconds. The I/O layers (:mod:`stager_loaders.dataset`, :mod:`stager_loaders.loader`) only execute the
plan computed here; exact resume is then "skip the first k batches of the plan".

Global sample index ``g`` numbers the samples of all shards in shard order: shard ``s`` owns
``offsets[s]:offsets[s + 1]`` where ``offsets = cumsum([0] + counts)``.

The split, per epoch:

1. an *order* over the samples: identity (``shuffle=False``), a seeded global permutation
   (``"global"``), or shard order permuted and samples shuffled only inside windows of
   ``block_samples`` (``"blocked"``: each rank touches few shards, which suits slow disks);
2. even-ing: the order is cut (``even="drop"``) or extended by repeating its head
   (``even="pad"``) to a multiple of ``world_size``, so every rank gets ``samples_per_rank``;
3. rank ``r`` takes the contiguous slice ``r * samples_per_rank : (r + 1) * samples_per_rank``
   (contiguous, so blocked orders keep their locality per rank);
4. batches of ``batch_size``: with ``"drop"`` only full batches, with ``"pad"`` the last batch may
   be short, but it is equally short on every rank;
5. batch ``i`` of a rank is fetched by DataLoader worker ``i % num_workers`` (torch's in-order
   map-style dispatch), so no sample is read by two workers except the padding repeats.

Node-subset staging (``subset="node"``) replaces the global order by a node-stable partition of
*shards* (:func:`node_partition`, the same for every epoch and seed, so the staged subset stays
valid) and shuffles only inside each node; the per-rank sample count is then agreed across
nodes (:func:`samples_per_rank`) so epochs still end together.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WorldLayout",
    "PlanOptions",
    "EVEN_MODES",
    "SHUFFLE_MODES",
    "shard_offsets",
    "epoch_order",
    "node_partition",
    "samples_per_rank",
    "rank_indices",
    "world_indices",
    "rank_batches",
    "num_batches",
    "remaining_after",
    "elastic_indices",
    "worker_of_batch",
    "locate",
    "fingerprint",
]

EVEN_MODES = ("pad", "drop")
SHUFFLE_MODES = ("none", "global", "blocked")


@dataclass(frozen=True)
class WorldLayout:
    """Where one rank sits: nodes x ranks per node, and its DataLoader workers.

    ``rank`` is the global rank; ranks are numbered node-major (rank ``r`` lives on node
    ``r // ranks_per_node``), as Slurm and torchrun number them.
    """

    num_nodes: int = 1
    ranks_per_node: int = 1
    rank: int = 0
    workers_per_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"num_nodes and ranks_per_node must be >= 1, got {self}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.workers_per_rank < 0:
            raise ValueError(f"workers_per_rank must be >= 0, got {self.workers_per_rank}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def node_rank(self) -> int:
        """Which node this rank is on."""
        return self.rank // self.ranks_per_node

    @property
    def rank_of_node(self) -> int:
        """This rank's index among the ranks of its node (SLURM_LOCALID)."""
        return self.rank % self.ranks_per_node

    def with_rank(self, rank: int) -> WorldLayout:
        return WorldLayout(self.num_nodes, self.ranks_per_node, rank, self.workers_per_rank)


@dataclass(frozen=True)
class PlanOptions:
    """How an epoch is cut: the knobs that, with the layout, fix every rank's batches."""

    batch_size: int
    seed: int = 0
    shuffle: str = "global"  # one of SHUFFLE_MODES
    even: str = "pad"  # one of EVEN_MODES
    block_samples: int = 4096  # window of the "blocked" shuffle
    subset: str = "all"  # "all" or "node"

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {self.shuffle!r}")
        if self.even not in EVEN_MODES:
            raise ValueError(f"even must be one of {EVEN_MODES}, got {self.even!r}")
        if self.subset not in ("all", "node"):
            raise ValueError(f"subset must be 'all' or 'node', got {self.subset!r}")
        if self.block_samples < 1:
            raise ValueError(f"block_samples must be >= 1, got {self.block_samples}")


def shard_offsets(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: the first global index of each shard, plus the total."""
    array = np.asarray(counts, dtype=np.int64)
    if array.ndim != 1 or (array < 0).any():
        raise ValueError("shard sample counts must be a 1-D list of non-negative integers")
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(array)])


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    # SeedSequence mixes the words, so (seed, epoch) pairs never alias as seed + epoch would.
    return np.random.default_rng(
        np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, salt])
    )


def epoch_order(
    counts: Sequence[int] | np.ndarray, *, epoch: int, options: PlanOptions, salt: int = 0
) -> np.ndarray:
    """The order in which the samples of ``counts`` are visited this epoch (global indices)."""
    offsets = shard_offsets(counts)
    total = int(offsets[-1])
    if options.shuffle == "none":
        return np.arange(total, dtype=np.int64)
    rng = _rng(options.seed, epoch, salt)
    if options.shuffle == "global":
        return rng.permutation(total).astype(np.int64, copy=False)
    shard_perm = rng.permutation(len(offsets) - 1)
    pieces = [np.arange(offsets[s], offsets[s + 1], dtype=np.int64) for s in shard_perm]
    order = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    for lo in range(0, total, options.block_samples):
        window = order[lo : lo + options.block_samples]
        window[:] = rng.permutation(window)
    return order


def node_partition(weights: Sequence[float] | np.ndarray, num_nodes: int) -> list[np.ndarray]:
    """Shard numbers per node, balanced by ``weights`` (sample counts, or bytes as a proxy).

    Greedy largest-first onto the lightest node; it depends on neither seed nor epoch, so a
    node's staged subset serves every epoch. Ties break by shard and node number, so every node
    computes the same partition independently.
    """
    w = np.asarray(weights, dtype=np.float64)
    load = np.zeros(num_nodes)
    owner = np.zeros(len(w), dtype=np.int64)
    for shard in np.argsort(-w, kind="stable"):
        node = int(np.argmin(load))
        owner[shard] = node
        load[node] += w[shard]
    return [np.flatnonzero(owner == node) for node in range(num_nodes)]


def samples_per_rank(total_samples: int | Sequence[int], layout: WorldLayout, even: str) -> int:
    """Samples every rank gets this epoch.

    ``total_samples`` is the dataset size, or for node subsets the sample count of each node;
    then every node's ranks must agree on one figure: the smallest share (``"drop"``) or the
    largest (``"pad"``, smaller nodes repeat samples).
    """
    if isinstance(total_samples, int | np.integer):
        world = layout.world_size
        return int(total_samples) // world if even == "drop" else -(-int(total_samples) // world)
    per_node = np.asarray(total_samples, dtype=np.int64)
    rpn = layout.ranks_per_node
    shares = per_node // rpn if even == "drop" else -(-per_node // rpn)
    return int(shares.min() if even == "drop" else shares.max())


def _even(order: np.ndarray, target: int) -> np.ndarray:
    if target <= len(order):
        return order[:target]
    if len(order) == 0:
        raise ValueError("cannot pad an empty dataset; stage or select at least one sample")
    reps = -(-target // len(order))
    return np.tile(order, reps)[:target]


def rank_indices(
    counts: Sequence[int] | np.ndarray,
    layout: WorldLayout,
    *,
    epoch: int,
    options: PlanOptions,
    per_rank: int | None = None,
) -> np.ndarray:
    """Global sample indices of ``layout.rank`` for ``epoch``, in delivery order.

    With ``options.subset == "node"``, ``counts`` are the shards staged on this rank's node
    (indices refer to them) and ``per_rank`` is the figure agreed across nodes (see
    :func:`samples_per_rank`); with ``"all"`` it is derived from ``counts``.
    """
    if options.subset == "node":
        order = epoch_order(counts, epoch=epoch, options=options, salt=1 + layout.node_rank)
        if per_rank is None:
            if layout.num_nodes != 1:
                raise ValueError(
                    "node subsets need per_rank agreed across nodes (samples_per_rank)"
                )
            per_rank = samples_per_rank(len(order), layout, options.even)
        group, position = layout.ranks_per_node, layout.rank_of_node
    else:
        order = epoch_order(counts, epoch=epoch, options=options)
        if per_rank is None:
            per_rank = samples_per_rank(len(order), layout, options.even)
        group, position = layout.world_size, layout.rank
    order = _even(order, per_rank * group)
    return order[position * per_rank : (position + 1) * per_rank]


def world_indices(
    counts: Sequence[int] | np.ndarray,
    num_nodes: int,
    ranks_per_node: int,
    *,
    epoch: int,
    options: PlanOptions,
) -> np.ndarray:
    """Row ``r`` is :func:`rank_indices` of rank ``r`` (``subset="all"``), computed in one pass.

    For simulations and checks over whole worlds: one permutation instead of one per rank.
    """
    if options.subset != "all":
        raise ValueError("world_indices covers subset='all'; simulate node subsets per node")
    world = num_nodes * ranks_per_node
    order = epoch_order(counts, epoch=epoch, options=options)
    per_rank = samples_per_rank(len(order), WorldLayout(num_nodes, ranks_per_node), options.even)
    return _even(order, per_rank * world).reshape(world, per_rank)


def remaining_after(
    counts: Sequence[int] | np.ndarray,
    num_nodes: int,
    ranks_per_node: int,
    *,
    epoch: int,
    options: PlanOptions,
    batches_consumed: int,
) -> np.ndarray:
    """The samples an epoch still owes after every rank consumed ``batches_consumed`` batches.

    In rank order, each sample once: padding repeats of samples already delivered are not owed.
    This is what an elastic resume redistributes over a new world.
    """
    rows = world_indices(counts, num_nodes, ranks_per_node, epoch=epoch, options=options)
    cut = min(batches_consumed * options.batch_size, rows.shape[1])
    delivered = np.unique(rows[:, :cut])
    owed = rows.shape[1]
    if options.even == "drop":  # the old plan never owed the samples it dropped; keep it that way
        owed = num_batches(owed, options.batch_size, "drop") * options.batch_size
    rest = rows[:, cut:owed]
    flat = rest.reshape(-1)
    flat = flat[~np.isin(flat, delivered)]
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)]


def elastic_indices(remaining: np.ndarray, layout: WorldLayout, even: str) -> np.ndarray:
    """This rank's share of ``remaining`` in a new world: contiguous, evened like a normal epoch."""
    per_rank = samples_per_rank(len(remaining), layout, even)
    evened = _even(remaining, per_rank * layout.world_size)
    return evened[layout.rank * per_rank : (layout.rank + 1) * per_rank]


def num_batches(per_rank: int, batch_size: int, even: str) -> int:
    """Batches per rank per epoch (``len(loader)``)."""
    return per_rank // batch_size if even == "drop" else -(-per_rank // batch_size)


def rank_batches(indices: np.ndarray, batch_size: int, even: str) -> list[np.ndarray]:
    """Cut a rank's indices into batches: full ones only for ``"drop"``, a short tail for ``"pad"``."""
    count = num_batches(len(indices), batch_size, even)
    return [indices[i * batch_size : (i + 1) * batch_size] for i in range(count)]


def worker_of_batch(batch: int, num_workers: int) -> int:
    """Which DataLoader worker fetches batch number ``batch`` (0 means the main process)."""
    return batch % num_workers if num_workers > 0 else 0


def locate(global_indices: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(shard, sample within shard)`` of each global index."""
    shard = np.searchsorted(offsets, global_indices, side="right") - 1
    return shard, global_indices - offsets[shard]


def fingerprint(relpaths: Sequence[str], counts: Sequence[int]) -> str:
    """A short digest of the shard list and its sample counts, stored with loader states."""
    payload = json.dumps([[str(p), int(c)] for p, c in zip(relpaths, counts, strict=True)]).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
