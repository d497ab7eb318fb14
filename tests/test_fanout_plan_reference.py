"""plan_fanout on packed have-bits gives exactly the plan of the pure-Python planner it replaced.

Every node computes the plan on its own and the collectives pair up by it, so the numpy planner
must not merely be valid: it must choose the same owner for every shard and the same broadcast
order as the reference below (the planner before it was vectorised, kept verbatim), or nodes of
two versions would disagree, and a reviewed rule would have changed silently.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.plan import havebits
from stager.plan.fanout import SKIP, FanoutPlan, plan_fanout
from stager.plan.havebits import HaveBits


def reference_plan(sizes: Sequence[int | None], have: Sequence[Sequence[bool]]) -> FanoutPlan:
    """The planner as it was: Python per (node, shard) pair."""
    num_nodes = len(have)
    count = len(sizes)
    owners = [SKIP] * count
    reads = [False] * count
    load = [0] * num_nodes
    owned = [0] * num_nodes

    def take(i: int, node: int) -> None:
        owners[i] = node
        load[node] += sizes[i] or 0
        owned[node] += 1

    by_size = sorted(range(count), key=lambda i: (-(sizes[i] or 0), i))
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
    return FanoutPlan(tuple(owners), tuple(i for _, _, i in sorted(ready)), tuple(reads))


# Worlds of few distinct sizes (ties on load, then on shards owned) and of spread ones; None and
# 0 in both.
_sizes = st.one_of(
    st.lists(st.sampled_from([None, 0, 1, 7]), max_size=300),
    st.lists(st.one_of(st.none(), st.integers(0, 10**12)), max_size=300),
)


@st.composite
def _worlds(draw: st.DrawFn) -> tuple[list[int | None], list[list[bool]]]:
    num_nodes = draw(st.one_of(st.integers(1, 4), st.integers(1, 40)))  # small: more ties
    sizes = draw(_sizes)
    count = len(sizes)
    # Per node a density, so some nodes hold nothing or everything; per shard an override, so
    # some shards no node holds and some every node holds.
    density = draw(
        st.lists(
            st.sampled_from([0.0, 0.1, 0.5, 0.5, 0.9, 1.0]), min_size=num_nodes, max_size=num_nodes
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    have = rng.random((num_nodes, count)) < np.array(density)[:, None]
    column = rng.integers(0, 8, count)  # 7: nobody, 6: everybody, 5: one node, else as drawn
    have[:, column == 7] = False
    have[:, column == 6] = True
    one = np.flatnonzero(column == 5)
    have[:, one] = False
    have[rng.integers(0, num_nodes, one.size), one] = True
    return sizes, have.tolist()


@settings(max_examples=400, deadline=None)
@given(_worlds(), st.sampled_from([None, 1, 100, 1000]))
def test_packed_plan_is_the_reference_plan(
    world: tuple[list[int | None], list[list[bool]]], unpack_bytes: int | None
) -> None:
    """Also with blocks of a few shards, so a plan spans many blocks."""
    sizes, have = world
    expected = reference_plan(sizes, have)
    budget = havebits.UNPACK_BYTES if unpack_bytes is None else unpack_bytes
    with mock.patch.object(havebits, "UNPACK_BYTES", budget):
        assert plan_fanout(sizes, have) == expected
        assert plan_fanout(sizes, HaveBits.from_lists(have)) == expected


@settings(max_examples=100, deadline=None)
@given(_worlds(), st.integers(1, 400), st.randoms(use_true_random=False))
def test_holders_do_not_depend_on_the_block(
    world: tuple[list[int | None], list[list[bool]]], unpack_bytes: int, rng: random.Random
) -> None:
    _, have = world
    packed = HaveBits.from_lists(have)
    counts = [sum(have[r][i] for r in range(len(have))) for i in range(packed.count)]
    assert packed.holder_counts(unpack_bytes).tolist() == counts
    shards = list(range(packed.count))
    rng.shuffle(shards)
    rows = [
        (i, row.tolist())
        for block, block_rows in packed.holder_rows(np.array(shards, dtype=np.intp), unpack_bytes)
        for i, row in zip(block, block_rows, strict=True)
    ]
    assert rows == [(i, [have[r][i] for r in range(len(have))]) for i in shards]


def test_two_holders_equally_loaded_break_the_tie_on_shards_owned() -> None:
    # Shard 0 goes to node 1; zero-byte shards 1 and 2 then tie node 0 and node 2 on load:
    # shard 1 to node 0 (the lower index), shard 2 to node 2 (fewer shards owned).
    have = [[False, True, True], [True, False, False], [True, True, True]]
    plan = plan_fanout([5, 0, None], have)
    assert plan.owners == (1, 0, 2) == reference_plan([5, 0, None], have).owners


def test_handshake_padding_byte_is_not_a_shard() -> None:
    """The handshake pads one byte (gloo refuses empty tensors): its bits are no shard's."""
    bits = np.packbits(np.array([[True, False, True] + [True] * 5]), axis=1)
    packed = HaveBits(np.vstack([bits, bits]), 3)
    assert packed.holder_counts().tolist() == [2, 0, 2]
    assert plan_fanout([1, 2, 3], packed) == reference_plan([1, 2, 3], [[True, False, True]] * 2)


def test_bad_have_bits_are_refused() -> None:
    with pytest.raises(ValueError):
        HaveBits(np.zeros((0, 1), dtype=np.uint8), 0)
    with pytest.raises(ValueError):
        HaveBits(np.zeros((2, 1), dtype=np.uint8), 9)
    with pytest.raises(ValueError):
        HaveBits(np.zeros((2, 1), dtype=bool), 1)
    with pytest.raises(ValueError):
        plan_fanout([1, 2], HaveBits(np.zeros((2, 1), dtype=np.uint8), 3))
