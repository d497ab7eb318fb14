"""The plan at scale: the keyed index bijection, O(share) planning, and worlds of 1,024 x 8 ranks.

Huge worlds are checked without materialising them: a sample of ranks is planned (equal
lengths, in range, pairwise disjoint), and coverage is checked by sampling *samples* and asking
the inverse plan which rank reads each one (:func:`rank_of_sample`), then checking that rank's
share really holds it. Elastic resume is compared with the reference definition (the old,
world-materialising algorithm) over hundreds of small worlds.
"""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

from stager.plan.elastic import elastic_indices, remaining_after
from stager.plan.order import EpochOrder, shard_order
from stager.plan.permute import ROUNDS, permute, round_keys, unpermute, window_keys
from stager.plan.ranks import (
    PlanOptions,
    WorldLayout,
    epoch_order,
    node_owner,
    node_partition,
    num_batches,
    rank_indices,
    rank_of_sample,
    samples_per_rank,
    world_indices,
)

SHUFFLES = ("none", "global", "blocked")


@pytest.mark.parametrize("n", [*range(1, 70), 127, 128, 129, 1000, 4097, 65_536, 100_003])
def test_permute_is_a_bijection_and_unpermute_inverts_it(n: int) -> None:
    keys = round_keys(7, n, 1)
    image = permute(np.arange(n), n, keys)
    assert np.array_equal(np.sort(image), np.arange(n))
    assert np.array_equal(unpermute(image, n, keys), np.arange(n))


def test_permute_depends_on_every_key_word_and_refuses_out_of_range() -> None:
    base = permute(np.arange(1000), 1000, round_keys(1, 2, 3))
    for words in [(2, 2, 3), (1, 3, 3), (1, 2, 4)]:
        assert not np.array_equal(base, permute(np.arange(1000), 1000, round_keys(*words)))
    assert round_keys(1, 2, 3).shape == (ROUNDS,)
    with pytest.raises(ValueError):
        permute(np.asarray([1000]), 1000, round_keys(1))
    with pytest.raises(ValueError):
        permute(np.asarray([-1]), 1000, round_keys(1))


def test_per_window_keys_give_independent_permutations_of_each_window() -> None:
    sizes = np.asarray([7, 7, 7, 3])
    window = np.repeat(np.arange(4), sizes)
    within = np.concatenate([np.arange(s) for s in sizes])
    keys = window_keys(round_keys(5), window)
    image = permute(within, np.repeat(sizes, sizes), keys)
    rows = np.split(image, np.cumsum(sizes)[:-1])
    assert all(np.array_equal(np.sort(r), np.arange(len(r))) for r in rows)
    assert len({tuple(r.tolist()) for r in rows[:3]}) == 3, "each window has its own order"
    assert np.array_equal(unpermute(image, np.repeat(sizes, sizes), keys), within)


@pytest.mark.parametrize("mode", SHUFFLES)
def test_epoch_order_is_a_bijection_with_an_exact_inverse(mode: str) -> None:
    rng = np.random.default_rng(2)
    for trial in range(30):
        counts = rng.integers(0, 60, size=int(rng.integers(1, 40)))
        order = EpochOrder(counts, mode=mode, seed=trial, epoch=3, block_samples=17)
        full = order.materialise()
        assert np.array_equal(np.sort(full), np.arange(int(counts.sum())))
        assert np.array_equal(order.position_of(full), np.arange(len(full)))


def test_shard_order_is_a_permutation_per_epoch() -> None:
    a = shard_order(1000, seed=1, epoch=0)
    assert np.array_equal(np.sort(a), np.arange(1000))
    assert not np.array_equal(a, shard_order(1000, seed=1, epoch=1))


@pytest.mark.parametrize("mode", SHUFFLES)
@pytest.mark.parametrize("even", ["pad", "drop"])
def test_a_rank_slice_is_the_slice_of_the_whole_plan(mode: str, even: str) -> None:
    counts = np.random.default_rng(3).integers(0, 50, size=23)
    options = PlanOptions(batch_size=4, seed=1, shuffle=mode, even=even, block_samples=9)
    rows = world_indices(counts, 2, 3, epoch=1, options=options)
    for rank, (start, stop) in itertools.product(range(6), [(0, 5), (3, 11), (7, 7), (9, 10**9)]):
        part = rank_indices(
            counts, WorldLayout(2, 3, rank), epoch=1, options=options, start=start, stop=stop
        )
        assert np.array_equal(part, rows[rank][start:stop])


def _reference_remaining(
    counts: np.ndarray, nodes: int, rpn: int, epoch: int, options: PlanOptions, k: int
) -> np.ndarray:
    """The definition, materialising the old world (what remaining_after computed before)."""
    rows = world_indices(counts, nodes, rpn, epoch=epoch, options=options)
    cut = min(k * options.batch_size, rows.shape[1])
    delivered = np.unique(rows[:, :cut])
    owed = rows.shape[1]
    if options.even == "drop":
        owed = num_batches(owed, options.batch_size, "drop") * options.batch_size
    flat = rows[:, cut:owed].reshape(-1)
    flat = flat[~np.isin(flat, delivered)]
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)]


def test_remaining_after_matches_the_materialising_definition_over_small_worlds() -> None:
    rng = np.random.default_rng(0)
    for trial in range(120):  # includes datasets smaller than the world (padding repeats twice)
        counts = rng.integers(0, 6, size=int(rng.integers(1, 6)))
        nodes, rpn = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        for even, mode in itertools.product(("pad", "drop"), SHUFFLES):
            options = PlanOptions(
                batch_size=int(rng.integers(1, 4)), seed=trial, even=even, shuffle=mode
            )
            for k in range(4):
                want = _reference_remaining(counts, nodes, rpn, 1, options, k)
                got = remaining_after(
                    counts, nodes, rpn, epoch=1, options=options, batches_consumed=k
                )
                assert len(got) == len(want)
                assert np.array_equal(np.asarray(got), want), (trial, even, mode, k)


# ---- worlds of 1,024 nodes x 8 ranks --------------------------------------------------------

NODES, RPN = 1024, 8


def _huge_counts() -> np.ndarray:
    return np.random.default_rng(11).integers(1500, 2500, size=20_000)  # ~4e7 samples


@pytest.mark.parametrize("mode", SHUFFLES)
@pytest.mark.parametrize("even", ["pad", "drop"])
def test_huge_world_sampled_ranks_are_equal_disjoint_and_cover_by_inversion(
    mode: str, even: str
) -> None:
    counts = _huge_counts()
    total = int(counts.sum())
    options = PlanOptions(batch_size=32, seed=4, shuffle=mode, even=even, block_samples=512)
    world = NODES * RPN
    per_rank = samples_per_rank(total, WorldLayout(NODES, RPN), even)
    ranks = np.random.default_rng(5).choice(world, size=24, replace=False).tolist()
    ranks += [0, world - 1]  # the padded tail lives on the last rank
    shares = {
        r: rank_indices(counts, WorldLayout(NODES, RPN, r), epoch=2, options=options) for r in ranks
    }
    assert {len(s) for s in shares.values()} == {per_rank}
    seen = np.concatenate([s for r, s in shares.items() if r != world - 1])
    assert seen.min() >= 0 and seen.max() < total
    assert len(np.unique(seen)) == len(seen), "two ranks read the same sample"
    # counting: the positions dealt cover the dataset (pad) or lose less than one per rank
    if even == "pad":
        assert 0 <= per_rank * world - total < world
    else:
        assert 0 <= total - per_rank * world < world
    # coverage by inversion: a sampled sample is read by the rank the inverse names
    probe = np.random.default_rng(6).integers(0, total, size=2000)
    slot, within = rank_of_sample(counts, WorldLayout(NODES, RPN), probe, epoch=2, options=options)
    if even == "pad":
        assert (slot >= 0).all()
    else:
        assert (slot >= 0).mean() > 0.99
    for sample, rank, place in zip(probe[:200], slot[:200], within[:200], strict=True):
        if rank < 0:
            continue
        got = rank_indices(
            counts,
            WorldLayout(NODES, RPN, int(rank)),
            epoch=2,
            options=options,
            start=int(place),
            stop=int(place) + 1,
        )
        assert got.tolist() == [sample]


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_huge_world_node_subsets_agree_on_length_and_stay_within_node(even: str) -> None:
    counts = _huge_counts()[:12_000]
    parts = node_partition(counts, NODES)
    per_node = [int(counts[p].sum()) for p in parts]
    per_rank = samples_per_rank(per_node, WorldLayout(NODES, RPN), even)
    options = PlanOptions(batch_size=16, seed=2, even=even, subset="node")
    for node in np.random.default_rng(1).choice(NODES, size=6, replace=False).tolist():
        local = counts[parts[node]]
        shares = [
            rank_indices(
                local,
                WorldLayout(NODES, RPN, node * RPN + r),
                epoch=1,
                options=options,
                per_rank=per_rank,
            )
            for r in range(RPN)
        ]
        assert {len(s) for s in shares} == {per_rank}
        flat = np.concatenate(shares)
        assert flat.min() >= 0 and flat.max() < int(local.sum()), "indices refer to the node"
        if even == "drop" or per_rank * RPN <= int(local.sum()):
            assert len(np.unique(flat)) == len(flat)
        else:
            assert set(flat.tolist()) == set(range(int(local.sum()))), "pad covers the node"


def test_huge_world_elastic_resume_owes_each_undelivered_sample_once() -> None:
    counts = np.full(4096, 2048)  # 8,388,608 samples: 1,024 per rank, no padding
    options = PlanOptions(batch_size=32, seed=9)
    old = WorldLayout(NODES, RPN)
    k = 13
    remaining = remaining_after(counts, NODES, RPN, epoch=0, options=options, batches_consumed=k)
    assert len(remaining) == NODES * RPN * (1024 - k * 32), "counting: every rank's rest, once"
    new = WorldLayout(512, 8)
    per_rank = samples_per_rank(len(remaining), new, "pad")
    picked = [0, 1, 2047, 4095]
    shares = [elastic_indices(remaining, new.with_rank(r), "pad") for r in picked]
    assert {len(s) for s in shares} == {per_rank}
    flat = np.concatenate(shares[:-1])
    assert len(np.unique(flat)) == len(flat)
    _, within = rank_of_sample(counts, old, flat, epoch=0, options=options)
    assert (within >= k * 32).all(), "an owed sample was delivered before the interruption"


def test_node_owner_scales_to_a_million_shards_and_balances() -> None:
    weights = np.random.default_rng(0).integers(100_000_000, 200_000_000, size=1_000_000)
    owner = node_owner(weights, 4096)
    loads = np.bincount(owner, weights=weights.astype(np.float64), minlength=4096)
    counts = np.bincount(owner, minlength=4096)
    assert counts.max() - counts.min() <= 1
    assert loads.max() - loads.min() <= weights.max()
    assert np.array_equal(owner, node_owner(weights, 4096)), "deterministic"


def test_planning_one_rank_allocates_for_its_share_not_the_dataset() -> None:
    """2e9 samples over 4,096 x 8 ranks: a rank's plan allocates a few MB (a permutation: 16 GB)."""
    counts = np.full(200_000, 10_000, dtype=np.int64)  # 2e9 samples
    layout = WorldLayout(4096, 8, 12_345)
    for mode in SHUFFLES:
        options = PlanOptions(batch_size=256, seed=1, shuffle=mode)
        tracemalloc.start()
        try:
            share = rank_indices(counts, layout, epoch=3, options=options)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(share) == 2_000_000_000 // (4096 * 8) + 1
        assert peak < 48 << 20, f"{mode}: planning one rank allocated {peak >> 20} MiB"


def test_epoch_order_materialises_the_same_order_as_rank_indices() -> None:
    counts = [10, 0, 30, 5, 55]
    options = PlanOptions(batch_size=4, seed=1, shuffle="blocked", block_samples=8)
    whole = epoch_order(counts, epoch=2, options=options)
    assert np.array_equal(
        whole, rank_indices(counts, WorldLayout(1, 1, 0), epoch=2, options=options)
    )


def test_streaming_plan_allocates_for_shards_and_batches_not_samples() -> None:
    """2e9 samples in 200k shards, 4,096 x 8 ranks, 8 workers: one worker's ranges and the
    delivery order cost O(shards + batches) (a few MB), never O(samples)."""
    from stager.plan.streaming import StreamingPlan

    counts = np.full(200_000, 10_000, dtype=np.int64)
    layout = WorldLayout(4096, 8, 777, 8)
    options = PlanOptions(batch_size=256, seed=3)
    per_rank = samples_per_rank(int(counts.sum()), layout, "pad")
    tracemalloc.start()
    try:
        plan = StreamingPlan(counts, layout, options, per_rank, 8)
        segments = plan.segments(epoch=2, worker=5)
        order = plan.delivery_order()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(stop - first for _, first, stop in segments) == plan.worker_samples[5]
    assert len(order) == plan.num_batches
    assert peak < 24 << 20, f"planning one streaming worker allocated {peak >> 20} MiB"
