"""The staging order (stager.plan.staging) over hundreds of simulated worlds, in milliseconds.

What background staging relies on: the copy order and the loader's staging epoch agree, a
rank's first batches need only the head of the copy order, every rank gets the same number of
batches and the group still reads every sample, and a share evaluated in pieces (a resume)
equals the share evaluated whole.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from stager.plan.ranks import PlanOptions, WorldLayout, num_batches, samples_per_rank, shard_offsets
from stager.plan.staging import (
    StagingOrder,
    StagingSpec,
    copy_order,
    copy_salt,
    interleaved_positions,
    staging_share,
    window_starts,
)


def _counts(seed: int, shards: int, zeros: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0 if zeros else 1, 60, size=shards)


def test_copy_order_is_a_keyed_permutation() -> None:
    for n in (0, 1, 2, 7, 100):
        order = copy_order(n, seed=3)
        assert sorted(order.tolist()) == list(range(n))
        assert np.array_equal(order, copy_order(n, seed=3))
    assert not np.array_equal(copy_order(100, seed=3), copy_order(100, seed=4))
    assert not np.array_equal(copy_order(100, seed=3), copy_order(100, seed=3, salt=1))
    assert copy_salt("all", 5) == 0 and copy_salt("node", 0) == 1 and copy_salt("node", 5) == 6


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_windows_ramp_up_to_the_cap_and_down_again_covering_every_shard(window: int) -> None:
    for n in range(0, 60):
        starts = window_starts(n, window)
        sizes = np.diff(starts)
        assert starts[0] == 0 and starts[-1] == n
        if not n:
            continue
        assert sizes[0] == 1 and sizes[-1] == 1 and (sizes >= 1).all() and (sizes <= window).all()
        top = int(np.argmax(sizes))
        assert (np.diff(sizes[: top + 1]) >= 0).all() and (np.diff(sizes[top:]) <= 0).all()
        if n >= 2 * (1 + 2 + 4) + 8 and window == 8:
            assert sizes.max() > 4  # a long enough order mixes in windows near the cap


def test_order_is_a_bijection_and_position_of_inverts_it() -> None:
    for seed, shards, window in itertools.product(range(4), (1, 2, 9, 31), (1, 4, 8)):
        counts = _counts(seed, shards)
        order = StagingOrder(
            counts, spec=StagingSpec(seed, window), seed=seed + 10, epoch=seed % 2, salt=seed
        )
        whole = order.materialise()
        assert sorted(whole.tolist()) == list(range(int(counts.sum())))
        assert np.array_equal(order.position_of(whole), np.arange(len(whole)))


def test_each_window_reads_only_shards_already_copied() -> None:
    """Positions before the end of window w read only shards of windows 0..w of the copy
    order: the loader never waits for a shard the copier has not reached."""
    for seed, shards, window in itertools.product(range(5), (3, 10, 40), (1, 2, 8)):
        counts = _counts(seed, shards)
        spec = StagingSpec(copy_seed=seed, window_shards=window)
        order = StagingOrder(counts, spec=spec, seed=7, epoch=1)
        offsets = shard_offsets(counts)
        shard_of = np.searchsorted(offsets, order.materialise(), side="right") - 1
        copied = copy_order(shards, seed=seed)
        place = np.empty(shards, np.int64)
        place[copied] = np.arange(shards)
        starts = window_starts(shards, window)
        bounds = shard_offsets(counts[copied])[starts]
        for w in range(len(starts) - 1):
            lo, hi = bounds[w], bounds[w + 1]
            assert (place[shard_of[lo:hi]] < starts[w + 1]).all()
            assert (place[shard_of[lo:hi]] >= starts[w]).all()


def test_the_first_samples_come_from_the_first_shard_copied() -> None:
    counts = np.full(16, 50)
    order = StagingOrder(counts, spec=StagingSpec(copy_seed=2), seed=0, epoch=0)
    first = copy_order(16, seed=2)[0]
    assert set(order.at(np.arange(50)).tolist()) == set(range(first * 50, first * 50 + 50))


def test_the_window_shuffle_depends_on_seed_and_epoch_not_the_copy_order() -> None:
    counts = np.full(12, 30)
    spec = StagingSpec(copy_seed=5)

    def whole(seed: int, epoch: int) -> list[int]:
        return StagingOrder(counts, spec=spec, seed=seed, epoch=epoch).materialise().tolist()

    assert whole(0, 0) != whole(1, 0) and whole(0, 0) != whole(0, 1)
    assert whole(0, 0) == whole(0, 0)


def test_interleaving_is_a_bijection_onto_the_evened_positions() -> None:
    for group, per_rank, batch in itertools.product((1, 2, 3, 8), (0, 1, 7, 16, 33), (1, 4, 5)):
        items = np.arange(per_rank)
        rows = [interleaved_positions(items, s, group, per_rank, batch) for s in range(group)]
        got = np.sort(np.concatenate(rows)) if rows else np.zeros(0)
        assert np.array_equal(got, np.arange(group * per_rank))
        # step i of every rank comes before step i + 1 of any rank
        full = (per_rank // batch) * batch
        for s in range(group):
            steps = rows[s][:full].reshape(-1, batch) // (group * batch) if full else []
            assert all((row == i).all() for i, row in enumerate(steps))


@pytest.mark.parametrize("even", ["pad", "drop"])
def test_every_simulated_world_equal_batches_and_full_cover(even: str) -> None:
    """All ranks of the group: the same batch count, and together every sample (pad) or all
    but fewer than one step's worth per node (drop), none twice except pad's repeats."""
    cases = itertools.product((1, 2, 3), (1, 2, 4), (1, 3, 8), (2, 5, 17), range(3))
    for num_nodes, rpn, batch, shards, seed in cases:
        counts = _counts(seed, shards, zeros=seed != 1)
        total = int(counts.sum())
        if total == 0:
            continue
        options = PlanOptions(batch_size=batch, seed=seed, even=even)
        layout = WorldLayout(num_nodes, rpn)
        per_rank = samples_per_rank(total, layout, even)
        batches = num_batches(per_rank, batch, even)
        read = []
        for rank in range(layout.world_size):
            share = staging_share(
                counts,
                layout.with_rank(rank),
                epoch=0,
                options=options,
                spec=StagingSpec(seed),
                per_rank=per_rank,
            )
            used = share.indices(0, batches * batch if even == "drop" else None)
            assert len(used) == (batches * batch if even == "drop" else per_rank)
            read.append(used)
        flat = np.concatenate(read)
        if even == "pad":
            assert set(flat.tolist()) == set(range(total))
        else:
            assert len(set(flat.tolist())) == len(flat)
            assert total - len(flat) < layout.world_size * batch + layout.world_size


def test_first_batches_of_every_rank_read_the_head_of_the_copy_order() -> None:
    counts = np.full(20, 40)
    options = PlanOptions(batch_size=8, seed=1)
    layout = WorldLayout(2, 2)
    per_rank = samples_per_rank(int(counts.sum()), layout, "pad")
    head = set(copy_order(20, seed=9)[:3].tolist())  # windows of 1 and 2 shards: 120 samples
    for rank in range(4):
        share = staging_share(
            counts,
            layout.with_rank(rank),
            epoch=0,
            options=options,
            spec=StagingSpec(9),
            per_rank=per_rank,
        )
        first_step = share.indices(0, 8)
        assert set((first_step // 40).tolist()) <= head


def test_a_share_evaluated_in_pieces_equals_the_whole() -> None:
    counts = _counts(4, 13)
    options = PlanOptions(batch_size=5, seed=3)
    layout = WorldLayout(2, 3, rank=4)
    per_rank = samples_per_rank(int(counts.sum()), layout, "pad")
    share = staging_share(
        counts, layout, epoch=2, options=options, spec=StagingSpec(1, 3), per_rank=per_rank
    )
    whole = share.indices()
    for cut in (0, 1, 5, 17, per_rank):
        assert np.array_equal(np.concatenate([share.indices(0, cut), share.indices(cut)]), whole)


def test_node_subsets_order_each_node_by_its_own_salt() -> None:
    counts = np.full(10, 20)
    options = PlanOptions(batch_size=4, seed=0, subset="node")
    per_rank = 100
    rows = {}
    for node in (0, 1):
        layout = WorldLayout(2, 2, rank=node * 2)
        share = staging_share(
            counts, layout, epoch=0, options=options, spec=StagingSpec(3), per_rank=per_rank
        )
        rows[node] = share.indices(0, 20)
        first = copy_order(10, seed=3, salt=copy_salt("node", node))[0]
        assert set((rows[node][:4] // 20).tolist()) == {first}
    assert not np.array_equal(rows[0], rows[1])
