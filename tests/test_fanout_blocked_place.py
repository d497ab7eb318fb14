"""A directory in the way of a shard a fan-out node receives: the line plain stage-in gives.

The receiving side said ``cannot place it in scratch: [Errno 21] Is a directory: '...partial'
-> '...'`` where plain stage-in (and the same node for a shard it read itself) says which path
is blocked and what to do. Found by a hostile review.
"""

from __future__ import annotations

from pathlib import Path

from stager.plan.fanout import plan_fanout

from .test_fanout_procs import Nodes, _finish, _shards, fanout_dataset  # noqa: F401 - a fixture


def test_a_directory_in_the_way_of_a_received_shard_is_named_as_plain_stage_in_names_it(
    fanout_dataset: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    shards = _shards(fanout_dataset)
    sizes = [(fanout_dataset / rel).stat().st_size for rel in shards]
    plan = plan_fanout(sizes, [[False] * len(shards)] * 2)
    received = next(shards[i] for i in plan.order if plan.owners[i] == 0)  # node 1 receives it
    nodes = Nodes(tmp_path, 2)
    blocked = nodes.dest(1) / "ds" / received
    (blocked / "x").mkdir(parents=True)
    results = _finish(nodes.start(fanout_dataset, "--fanout-op-timeout", "60"))
    assert results[0][0] == 0, results[0]
    code, err = results[1]
    assert code == 5, err
    assert "Traceback" not in err and "Errno" not in err, err
    assert f"cannot place {blocked} in scratch: a directory has that name" in err, err
