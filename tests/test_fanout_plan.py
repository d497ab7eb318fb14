"""The pure core of stage-in --fanout: ownership, broadcast order, digests, rendezvous endpoint.

Hundreds of simulated worlds in milliseconds; the real-process tests are in test_fanout_procs.py.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from stager.errors import UsageError
from stager.fanout.group import PORT_BASE, PORT_SPAN, FanoutOptions, fanout_port, resolve_endpoint
from stager.fanout.header import HEADER_BYTES
from stager.fanout.header import decode as _decode_header
from stager.fanout.header import encode as _encode_header
from stager.plan.fanout import SKIP, plan_fanout, shard_list_digest
from stager.slurm import SlurmEnv


def _world(rng: random.Random, *, have_p: float) -> tuple[list[int | None], list[list[bool]]]:
    world = rng.randint(1, 9)
    count = rng.randint(0, 60)
    sizes: list[int | None] = [
        rng.choice([None, 0, rng.randint(1, 10**9)])
        if rng.random() < 0.1
        else rng.randint(1, 10**7)
        for _ in range(count)
    ]
    have = [[rng.random() < have_p for _ in range(count)] for _ in range(world)]
    return sizes, have


@pytest.mark.parametrize("have_p", [0.0, 0.3, 0.9, 1.0])
def test_plan_invariants_over_random_worlds(have_p: float) -> None:
    rng = random.Random(int(have_p * 100))
    for _ in range(300):
        sizes, have = _world(rng, have_p=have_p)
        world, count = len(have), len(sizes)
        plan = plan_fanout(sizes, have)
        assert plan == plan_fanout(sizes, have)  # every node computes the same plan
        for i in range(count):
            holders = {r for r in range(world) if have[r][i]}
            if len(holders) == world:
                assert plan.owners[i] == SKIP and not plan.reads[i]
            elif holders:
                assert (
                    plan.owners[i] in holders and not plan.reads[i]
                )  # never re-read what a node has
            else:
                assert 0 <= plan.owners[i] < world and plan.reads[i]
        assert sorted(plan.order) == [i for i in range(count) if plan.owners[i] != SKIP]
        # Source bytes: exactly the shards nobody holds, each read once.
        nobody = sum(
            sizes[i] or 0 for i in range(count) if not any(have[r][i] for r in range(world))
        )
        assert (
            plan.source_bytes(sizes)
            == nobody
            == sum(plan.source_bytes(sizes, r) for r in range(world))
        )
        # A node's reads appear in the broadcast order in the order it reads them.
        for r in range(world):
            reads = plan.reads_of(r)
            assert reads == [i for i in plan.order if i in set(reads)]


def test_fresh_run_is_balanced_by_bytes_within_one_shard() -> None:
    rng = random.Random(7)
    for _ in range(300):
        world = rng.randint(1, 16)
        sizes = [rng.randint(1, 10**6) for _ in range(rng.randint(0, 100))]
        plan = plan_fanout(sizes, [[False] * len(sizes) for _ in range(world)])
        loads = [plan.source_bytes(sizes, r) for r in range(world)]
        assert max(loads) - min(loads) <= max(sizes, default=0)
        assert sum(loads) == sum(sizes)


def test_rerun_with_everything_staged_plans_nothing() -> None:
    plan = plan_fanout([5, 6, 7], [[True] * 3, [True] * 3])
    assert (
        plan.owners == (SKIP, SKIP, SKIP) and plan.order == () and plan.source_bytes([5, 6, 7]) == 0
    )


def test_a_node_that_already_has_a_shard_owns_it_and_goes_first() -> None:
    # Node 1 survived a crash with shards 0 and 1; node 0 has nothing.
    sizes = [100, 100, 100, 100]
    plan = plan_fanout(sizes, [[False] * 4, [True, True, False, False]])
    assert plan.owners[0] == plan.owners[1] == 1
    assert not plan.reads[0] and not plan.reads[1] and plan.reads[2] and plan.reads[3]
    assert set(plan.order[:2]) == {0, 1}  # ready at once: sent while the source reads run
    assert plan.source_bytes(sizes) == 200


def test_order_interleaves_owners_so_reads_overlap_sends() -> None:
    plan = plan_fanout([10] * 6, [[False] * 6 for _ in range(3)])
    owners_in_order = [plan.owners[i] for i in plan.order]
    assert owners_in_order == [0, 1, 2, 0, 1, 2]


def test_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_fanout([1, 2], [[True]])
    with pytest.raises(ValueError):
        plan_fanout([1], [])


def test_shard_list_digest_sees_order_names_and_sizes() -> None:
    base = [("a.tar", 10), ("b.tar", 20)]
    digest = shard_list_digest(base)
    assert -(2**63) <= digest < 2**63
    assert digest == shard_list_digest(list(base))
    assert digest != shard_list_digest([("a.tar", 10), ("b.tar", 21)])
    assert digest != shard_list_digest([("b.tar", 20), ("a.tar", 10)])
    assert digest != shard_list_digest([("a.tar", 10), ("b.tar", None)])
    assert shard_list_digest([("a", 1), ("b", 2)]) != shard_list_digest([("a\x001", 2)])


def test_port_is_derived_from_the_job_and_overridable() -> None:
    slurm = SlurmEnv.from_environ(
        {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1"}
    )
    port = fanout_port("4242")
    assert PORT_BASE <= port < PORT_BASE + PORT_SPAN and port == fanout_port("4242") != fanout_port(
        "4243"
    )
    assert resolve_endpoint(slurm, FanoutOptions(), env={}) == ("gpu07", port)
    assert resolve_endpoint(
        slurm, FanoutOptions(), env={"STAGER_FANOUT_PORT": "23456", "STAGER_FANOUT_HOST": "h"}
    ) == ("h", 23456)
    assert resolve_endpoint(
        slurm, FanoutOptions(host="x", port=1234), env={"STAGER_FANOUT_PORT": "1"}
    ) == ("x", 1234)
    with pytest.raises(UsageError):
        resolve_endpoint(slurm, FanoutOptions(), env={"STAGER_FANOUT_PORT": "http"})
    with pytest.raises(UsageError):
        resolve_endpoint(slurm, FanoutOptions(port=70000), env={})


def test_header_round_trips_and_truncates_long_reasons() -> None:
    raw = _encode_header(0, 123456789012, "xxh3_64:00ff")
    assert len(raw) == HEADER_BYTES and _decode_header(raw) == (0, 123456789012, "xxh3_64:00ff")
    status, size, text = _decode_header(_encode_header(1, 0, "é" * 1000))
    assert (status, size) == (1, 0) and text.startswith("é") and len(text.encode()) <= HEADER_BYTES


def test_importing_the_fanout_modules_does_not_import_torch() -> None:
    code = (
        "import sys, stager.fanout.run, stager.cli.commands.stage_in; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_nodes_compare_a_local_files_version_by_its_modification_time() -> None:
    """A per-node copy (``cp -a``) or a FUSE mount numbering inodes itself gives the same bytes
    another inode and change time on each node: only the modification time is compared, or
    such a fan-out stopped on every run; an object store's token is compared whole."""
    from stager.storage.identity import node_neutral

    here, there = "11:1700000000000000000:1800000000000000001", "97:1700000000000000000:1900"
    rewritten = "11:1700000000000000005:1800000000000000009"
    listed = [("a.tar", 10, node_neutral(here, True), None)]
    assert shard_list_digest(listed) == shard_list_digest(
        [("a.tar", 10, node_neutral(there, True), None)]
    )
    assert shard_list_digest(listed) != shard_list_digest(
        [("a.tar", 10, node_neutral(rewritten, True), None)]
    )
    assert node_neutral('"etag-1"', False) == '"etag-1"' and node_neutral(None, True) is None
    assert shard_list_digest(listed, "file:///a") != shard_list_digest(listed, "file:///b")
