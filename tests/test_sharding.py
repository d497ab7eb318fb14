"""The pure split (stager.plan.ranks) over hundreds of simulated worlds, in milliseconds."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stager.plan.elastic import elastic_indices, remaining_after
from stager.plan.ranks import (
    PlanOptions,
    WorldLayout,
    epoch_order,
    fingerprint,
    locate,
    node_partition,
    num_batches,
    rank_batches,
    rank_indices,
    samples_per_rank,
    shard_offsets,
    worker_of_batch,
    world_indices,
)

NODES = (1, 2, 3, 8, 64)
RANKS_PER_NODE = (1, 2, 3, 8)
WORKERS = (0, 1, 3, 16)


def _counts(seed: int, shards: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 400, size=shards)


def _world(
    num_nodes: int, rpn: int, counts: np.ndarray, options: PlanOptions, epoch: int = 0
) -> list[list[np.ndarray]]:
    """Every rank's batches."""
    rows = world_indices(counts, num_nodes, rpn, epoch=epoch, options=options)
    return [rank_batches(row, options.batch_size, options.even) for row in rows]


def test_world_indices_agrees_with_rank_indices() -> None:
    counts = _counts(1, 9)
    for options in (
        PlanOptions(batch_size=3),
        PlanOptions(batch_size=3, even="drop", shuffle="blocked", block_samples=7),
    ):
        rows = world_indices(counts, 3, 2, epoch=2, options=options)
        for rank in range(6):
            assert np.array_equal(
                rows[rank], rank_indices(counts, WorldLayout(3, 2, rank), epoch=2, options=options)
            )


@pytest.mark.parametrize("even", ["pad", "drop"])
@pytest.mark.parametrize("shuffle", ["none", "global", "blocked"])
def test_every_layout_equal_batches_full_cover_bounded_loss(even: str, shuffle: str) -> None:
    counts = _counts(3, 37)
    total = int(counts.sum())
    for num_nodes, rpn, batch in itertools.product(NODES, RANKS_PER_NODE, (1, 7, 64)):
        world = num_nodes * rpn
        options = PlanOptions(
            batch_size=batch, seed=5, shuffle=shuffle, even=even, block_samples=100
        )
        ranks = _world(num_nodes, rpn, counts, options)
        lengths = {len(b) for b in ranks}
        assert len(lengths) == 1, (num_nodes, rpn, batch)
        sizes = {tuple(len(x) for x in b) for b in ranks}
        assert len(sizes) == 1, "batch i must have the same size on every rank"
        seen = np.concatenate([np.concatenate(b) if b else np.zeros(0, np.int64) for b in ranks])
        assert ((seen >= 0) & (seen < total)).all()
        if even == "drop":
            assert len(np.unique(seen)) == len(seen), "drop must never repeat a sample"
            # at most one partial batch per rank plus the world remainder is lost
            assert total - len(seen) < world * batch + world
        else:
            assert set(seen.tolist()) == set(range(total)), "pad must deliver every sample"
            assert len(seen) - total < world, "padding is bounded by the world size"
        # per worker: every batch fetched by exactly one worker of the rank
        for workers in WORKERS:
            for batches in ranks[:2]:
                owners = [worker_of_batch(i, workers) for i in range(len(batches))]
                assert all(0 <= w < max(1, workers) for w in owners)
                if workers and len(batches) >= workers:
                    assert set(owners) == set(range(workers)), "round-robin uses every worker"


def test_determinism_per_seed_and_epoch() -> None:
    counts = [10, 30, 5, 55]
    options = PlanOptions(batch_size=4, seed=1)
    a = epoch_order(counts, epoch=3, options=options)
    assert np.array_equal(a, epoch_order(counts, epoch=3, options=options))
    assert not np.array_equal(a, epoch_order(counts, epoch=4, options=options))
    assert not np.array_equal(
        a, epoch_order(counts, epoch=3, options=PlanOptions(batch_size=4, seed=2))
    )
    assert sorted(a.tolist()) == list(range(100))


def test_blocked_order_keeps_shards_together() -> None:
    counts = [1000] * 6
    options = PlanOptions(batch_size=8, shuffle="blocked", block_samples=100)
    order = epoch_order(counts, epoch=0, options=options)
    shard, _ = locate(order, shard_offsets(counts))
    # each window of 100 comes from one shard (1000 is a multiple of 100)
    for lo in range(0, 6000, 100):
        assert len(set(shard[lo : lo + 100].tolist())) == 1
    assert sorted(order.tolist()) == list(range(6000))


def test_node_partition_is_stable_and_balanced() -> None:
    counts = _counts(11, 101)
    for nodes in (1, 2, 5, 64):
        parts = node_partition(counts, nodes)
        assert all(
            np.array_equal(a, b) for a, b in zip(parts, node_partition(counts, nodes), strict=True)
        )
        flat = np.concatenate(parts)
        assert sorted(flat.tolist()) == list(range(101))
        loads = [int(counts[p].sum()) for p in parts]
        assert max(loads) - min(loads) <= int(counts.max())


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_node_subset_equal_batches_and_stays_within_node(even: str) -> None:
    counts = _counts(4, 40)
    for num_nodes, rpn, batch in itertools.product((1, 2, 3, 8), (1, 2, 4), (1, 16)):
        parts = node_partition(counts, num_nodes)
        per_node = [int(counts[p].sum()) for p in parts]
        layout0 = WorldLayout(num_nodes, rpn, 0)
        per_rank = samples_per_rank(per_node, layout0, even)
        options = PlanOptions(batch_size=batch, seed=9, even=even, subset="node")
        lengths = set()
        for epoch in (1,):
            for node in range(num_nodes):
                local = counts[parts[node]]
                seen = []
                for r in range(rpn):
                    layout = WorldLayout(num_nodes, rpn, node * rpn + r)
                    idx = rank_indices(
                        local, layout, epoch=epoch, options=options, per_rank=per_rank
                    )
                    lengths.add(num_batches(len(idx), batch, even))
                    seen.extend(idx.tolist())
                assert all(0 <= i < int(local.sum()) for i in seen), (
                    "indices refer to the node's shards"
                )
                if even == "drop":
                    assert len(set(seen)) == len(seen)
        assert len(lengths) == 1


def test_pad_of_tiny_dataset_and_empty_refusal() -> None:
    options = PlanOptions(batch_size=4)
    layout = WorldLayout(2, 4, 7)
    assert len(rank_indices([3], layout, epoch=0, options=options)) == 1
    assert len(rank_indices([0], layout, epoch=0, options=options)) == 0, (
        "empty dataset: empty epoch"
    )
    node_options = PlanOptions(batch_size=4, subset="node")
    with pytest.raises(ValueError, match="empty"):
        rank_indices([0], layout, epoch=0, options=node_options, per_rank=2)
    assert (
        len(rank_indices([0], layout, epoch=0, options=PlanOptions(batch_size=4, even="drop"))) == 0
    )


def test_bad_arguments_refused() -> None:
    with pytest.raises(ValueError):
        WorldLayout(2, 2, 4)
    with pytest.raises(ValueError):
        PlanOptions(batch_size=0)
    with pytest.raises(ValueError):
        PlanOptions(batch_size=1, even="wrap")
    with pytest.raises(ValueError):
        shard_offsets([1, -1])


def test_fingerprint_changes_with_counts_and_names() -> None:
    base = fingerprint(["a.tar", "b.tar"], [1, 2])
    assert base == fingerprint(["a.tar", "b.tar"], [1, 2])
    assert base != fingerprint(["a.tar", "b.tar"], [1, 3])
    assert base != fingerprint(["a.tar", "c.tar"], [1, 2])


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_elastic_remaining_is_exactly_what_the_old_world_still_owed(even: str) -> None:
    counts = _counts(8, 13)
    options = PlanOptions(batch_size=5, seed=2, even=even)
    for (old_nodes, old_rpn), new_world, k in itertools.product(
        [(1, 3), (2, 2), (4, 1)], (1, 2, 5), (0, 1, 4)
    ):
        rows = world_indices(counts, old_nodes, old_rpn, epoch=3, options=options)
        owed = rows.shape[1] if even == "pad" else num_batches(rows.shape[1], 5, "drop") * 5
        consumed = set(rows[:, : k * 5].reshape(-1).tolist())
        remaining = np.asarray(
            remaining_after(
                counts, old_nodes, old_rpn, epoch=3, options=options, batches_consumed=k
            )
        )
        assert len(set(remaining.tolist())) == len(remaining), "nothing owed twice"
        assert not consumed & set(remaining.tolist()), "nothing delivered is owed again"
        assert consumed | set(remaining.tolist()) == set(rows[:, :owed].reshape(-1).tolist())
        shares = [
            elastic_indices(remaining, WorldLayout(1, new_world, r), even) for r in range(new_world)
        ]
        assert len({len(s) for s in shares}) == 1
        delivered = np.concatenate(shares).tolist()
        if even == "pad":
            assert (
                set(delivered) == set(remaining.tolist())
                and len(delivered) - len(remaining) < new_world
            )
        else:
            assert (
                len(set(delivered)) == len(delivered)
                and len(remaining) - len(delivered) < new_world
            )
