"""A DataLoader worker that fetches a shard itself beside ``stage-in --background`` (the copier
is gone, or failed the shard) verifies it against the plan the rank resolved, held by the gate
it was handed: it never reads the plan (each worker read all of it, ~5 s and ~670 MB kept at
1e6 shards), and the checks are those of stage-in (size, hash, sample count).

No copier runs here: the plan is as a copier published it, its lock free and no result, as
after a ``kill -9``. The gate is pickled as a spawned worker receives it.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from pathlib import Path

import pytest

from stager.errors import HashMismatch, IntegrityError
from stager.layout import StagedDataset, canonical_spec
from stager.shards.manifest import Manifest
from stager.stagein.status import PlanFacts, write_plan
from stager_loaders import LoaderOptions
from stager_loaders.staging import StagingReader, resolve_staging
from stager_loaders.waiting import ShardGate

from .background_util import dataset, source_reads


def _plan_without_copier(tmp_path: Path, samples_off: int = 0) -> tuple[Path, StagedDataset]:
    """The source and its staging plan, nothing staged yet; ``samples_off``: shard 2's count
    in the plan is that far from its real one."""
    src = dataset(tmp_path)
    entries = list(Manifest.read(src / "stager-manifest.json").entries)
    entries[2] = dataclasses.replace(entries[2], samples=(entries[2].samples or 0) + samples_off)
    staged = StagedDataset(tmp_path / "scratch", "ds")
    staged.dir.mkdir(parents=True)
    facts = PlanFacts(
        run_id="r1",
        started_at=time.time(),
        job_id="",
        restart_count=0,
        node="n0",
        copy_seed=0,
        salt=0,
        subset="all",
        source=str(src),
        spec=canonical_spec(str(src)),
    )
    write_plan(staged, entries, facts)
    return src, staged


def _worker_gate(staged: StagedDataset) -> ShardGate:
    """The gate as the rank builds it from the plan it resolved, then as a worker unpickles it."""
    shards = resolve_staging(staged, None, "raise")
    assert shards is not None and shards.growing
    reader = StagingReader(shards, LoaderOptions(on_copier_death="source"), None, None)
    gate = pickle.loads(pickle.dumps(reader.gate))
    assert isinstance(gate, ShardGate)
    return gate


def test_a_worker_fetches_a_shard_without_reading_the_plan(tmp_path: Path) -> None:
    src, staged = _plan_without_copier(tmp_path)
    gate = _worker_gate(staged)
    relpath = gate.relpaths[2].decode()
    with source_reads(staged.staging_path, tmp_path / "opened.log") as opened:
        gate.fetch(2)
        assert gate.is_published(2)
    assert opened.read_text() == ""  # the whole plan, in every worker that fetched
    assert (staged.dir / relpath).read_bytes() == (src / relpath).read_bytes()


def test_a_fetched_shard_is_still_verified_against_the_plans_hash(tmp_path: Path) -> None:
    src, staged = _plan_without_copier(tmp_path)
    gate = _worker_gate(staged)
    relpath = gate.relpaths[1].decode()
    with open(src / relpath, "r+b") as handle:  # changed since the plan: its size is the same
        handle.seek(2048)
        handle.write(b"\xff" * 64)
    with pytest.raises(HashMismatch):
        gate.fetch(1)
    assert not (staged.dir / relpath).exists()
    assert not list(staged.dir.rglob("*.partial"))


def test_a_fetched_shard_is_still_verified_against_the_plans_sample_count(
    tmp_path: Path,
) -> None:
    _, staged = _plan_without_copier(tmp_path, samples_off=1)
    gate = _worker_gate(staged)
    with pytest.raises(IntegrityError, match="samples but the plan says"):
        gate.fetch(2)
    assert not gate.is_published(2)


def test_a_fetch_shows_progress_to_readers_waiting_on_the_lock(tmp_path: Path) -> None:
    """A reader fetching for a copier long gone holds the node lock: it touches the lock file
    as a copier's heartbeat does, so another reader waiting meanwhile does not take it for a
    copier stalled since its death (LoaderOptions.copier_stall_s)."""
    import os

    _, staged = _plan_without_copier(tmp_path)
    gate = _worker_gate(staged)
    staged.lock_path.touch()
    long_ago = time.time() - 7200
    os.utime(staged.lock_path, (long_ago, long_ago))
    gate.fetch(1)
    assert gate.is_published(1)
    assert staged.lock_path.stat().st_mtime > long_ago + 3600
