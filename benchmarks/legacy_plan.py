"""The planner before issue 20, kept only so the benchmarks can measure it beside the new one.

Copied from ``stager/plan/ranks.py`` at a7dae1f (epoch order, evening, one rank's indices, the
greedy node partition): each rank builds the whole epoch permutation with numpy's
``Generator.permutation`` and keeps its slice. Not imported by the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stager.plan.ranks import PlanOptions, WorldLayout, samples_per_rank, shard_offsets

__all__ = ["epoch_order", "rank_indices", "node_partition"]


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.default_rng(
        np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, salt])
    )


def epoch_order(
    counts: Sequence[int] | np.ndarray, *, epoch: int, options: PlanOptions, salt: int = 0
) -> np.ndarray:
    """The whole epoch's order: a seeded numpy permutation (global) or shard-then-window order."""
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


def _even(order: np.ndarray, target: int) -> np.ndarray:
    if target <= len(order):
        return order[:target]
    reps = -(-target // len(order))
    return np.tile(order, reps)[:target]


def rank_indices(
    counts: Sequence[int] | np.ndarray, layout: WorldLayout, *, epoch: int, options: PlanOptions
) -> np.ndarray:
    """One rank's indices (``subset="all"``), the old way: the whole permutation, then a slice."""
    order = epoch_order(counts, epoch=epoch, options=options)
    per_rank = samples_per_rank(len(order), layout, options.even)
    order = _even(order, per_rank * layout.world_size)
    return order[layout.rank * per_rank : (layout.rank + 1) * per_rank]


def node_partition(weights: Sequence[float] | np.ndarray, num_nodes: int) -> list[np.ndarray]:
    """Greedy largest-first onto the lightest node: a Python loop over shards x argmin(nodes)."""
    w = np.asarray(weights, dtype=np.float64)
    load = np.zeros(num_nodes)
    owner = np.zeros(len(w), dtype=np.int64)
    for shard in np.argsort(-w, kind="stable"):
        node = int(np.argmin(load))
        owner[shard] = node
        load[node] += w[shard]
    return [np.flatnonzero(owner == node) for node in range(num_nodes)]
