"""The exchange's failure paths, in one process: nodes are threads, the group an in-memory fake.

The fake broadcast has gloo's semantics (every rank calls it in the same order, the owner's
tensor lands in everyone's), so the exchange code runs unchanged; what the real gloo group adds
is covered by test_fanout_procs.py.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from stager.errors import FanoutError, ShardFailure
from stager.fanout.exchange import Exchange, ExchangeOutcome, ExchangeShard
from stager.fanout.group import FanoutOptions
from stager.plan.fanout import plan_fanout
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport
from stager.stagein.run import StageInOptions
from stager.storage.paths import safe_join
from stager.storage.retry import RetryPolicy
from stager.storage.sources import SourceSet, resolve_source

torch = pytest.importorskip("torch")


class ThreadWorld:
    """Shared state of the fake group: one slot and a barrier, like a broadcast on a wire."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slot = None


class FakeGroup:
    def __init__(
        self,
        shared: ThreadWorld,
        node: int,
        *,
        corrupt_call: int | None = None,
        fail_call: int | None = None,
    ):
        self.torch, self.node, self.num_nodes, self._shared = torch, node, shared.world, shared
        self._calls, self._corrupt_call, self._fail_call = 0, corrupt_call, fail_call

    def broadcast(self, tensor, src: int) -> None:
        self._calls += 1
        if self._calls == self._fail_call:
            self._shared.barrier.abort()  # the peers' next wait fails too, as gloo's would
            raise RuntimeError("Connection closed by peer [10.0.0.2]:40000")
        if self.node == src:
            self._shared.slot = tensor.clone()
        self._shared.barrier.wait()
        if self.node != src:
            tensor.copy_(self._shared.slot)
            if self._calls == self._corrupt_call:
                tensor[0] ^= 0xFF
        self._shared.barrier.wait()

    def barrier(self) -> None:
        self._shared.barrier.wait()


def _exchange(
    source: SourceSet, tmp: Path, groups: list[FakeGroup]
) -> list[ExchangeOutcome | BaseException]:
    results: list[ExchangeOutcome | BaseException] = [None] * len(groups)  # type: ignore[list-item]

    def node(rank: int) -> None:
        dest = tmp / f"node{rank}" / "ds"
        dest.mkdir(parents=True)
        items = [
            ExchangeShard(s, safe_join(dest, s.relpath), s.size, None, have=False)
            for s in source.shards
        ]
        plan = plan_fanout([it.size for it in items], [[False] * len(items)] * len(groups))
        options = StageInOptions(dest_root=tmp, retry=RetryPolicy(attempts=1))
        report = StageInReport(
            node=f"node{rank}", job_id="t", dataset_dir=str(dest), source=source.root_url
        )
        try:
            results[rank] = Exchange(
                groups[rank],
                plan,
                items,
                source=source,
                options=options,
                fanout=FanoutOptions(chunk_bytes=16 << 10),
                report=report,
                progress=Progress(0, 0, label="t", mode="none"),
                node_label=lambda r: f"node{r}",
                log=io.StringIO(),
            ).run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=node, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.fixture()
def source_dir(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=4, samples_per_shard=8, image_bytes=4000, seed=2)
    )
    return src


def _failed_urls(outcome: ExchangeOutcome) -> list[str]:
    return [f.url.rsplit("/", 1)[-1] for f in outcome.failures]


def test_a_shard_its_owner_cannot_read_fails_on_every_node_and_the_rest_arrive(
    source_dir: Path, tmp_path: Path
) -> None:
    shared = ThreadWorld(2)
    source = resolve_source(str(source_dir))
    # Listed, then gone before its owner reads it (the source changed under the job).
    (source_dir / "train-000001.tar").rename(tmp_path / "moved.tar")
    outcomes = _exchange(source, tmp_path, [FakeGroup(shared, 0), FakeGroup(shared, 1)])
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, ExchangeOutcome), outcome
        assert _failed_urls(outcome) == ["train-000001.tar"]
        staged = sorted(p.name for p in (tmp_path / f"node{rank}" / "ds").glob("*.tar"))
        assert staged == ["train-000000.tar", "train-000002.tar", "train-000003.tar"]
    receiver_reason = next(
        f for o in outcomes for f in o.failures if "could not read it" in f.reason
    )
    assert isinstance(receiver_reason, ShardFailure) and "owner node" in receiver_reason.reason


def test_bytes_corrupted_in_transit_fail_the_hash_check_and_leave_nothing(
    source_dir: Path, tmp_path: Path
) -> None:
    shared = ThreadWorld(2)
    # Node 1's 2nd broadcast is node 0's first shard's first chunk: flip a byte on receipt.
    outcomes = _exchange(
        resolve_source(str(source_dir)),
        tmp_path,
        [FakeGroup(shared, 0), FakeGroup(shared, 1, corrupt_call=2)],
    )
    assert isinstance(outcomes[1], ExchangeOutcome) and len(outcomes[1].failures) == 1, outcomes
    assert "differs from its" in outcomes[1].failures[0].reason
    assert len(list((tmp_path / "node1" / "ds").glob("*.tar"))) == 3
    assert not list((tmp_path / "node1" / "ds").glob("*.partial"))
    assert isinstance(outcomes[0], ExchangeOutcome) and not outcomes[0].failures


def test_a_collective_error_becomes_one_fanout_error_naming_shard_and_owner(
    source_dir: Path, tmp_path: Path
) -> None:
    shared = ThreadWorld(2)
    outcomes = _exchange(
        resolve_source(str(source_dir)),
        tmp_path,
        [FakeGroup(shared, 0), FakeGroup(shared, 1, fail_call=3)],
    )
    for outcome in outcomes:
        assert isinstance(outcome, FanoutError), outcome
        text = str(outcome)
        assert ".tar (owner node" in text and "rerun" in text and "\n" not in text
    for rank in range(2):
        assert not list((tmp_path / f"node{rank}" / "ds").glob("*.partial"))
