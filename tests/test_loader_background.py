"""The loader beside a running ``stage-in --background``: it starts before the shards exist,
reads each one as it lands (never the source, never a partial file), follows the staging plan
exactly in epoch 0 and the full shuffle once staging is done, resumes exactly mid-staging, and
says in one line when the copier died (then fails or fetches from the source, as asked).

The copier is a real process (``stage-in --background --bw-limit``); the loader runs here.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from stager.errors import IntegrityError, StagingStopped
from stager.layout import StagedDataset
from stager_loaders import LoaderOptions, ShardedLoader
from stager_loaders.staging import StagingReader

from .background_util import (
    SPEC,
    dataset,
    finished,
    job_env,
    planned_keys,
    source_reads,
    start_copier,
    stop,
    wait_plan,
)

BATCH, SEED = 8, 4
COUNTS = SPEC.shard_sizes()


def _loader(src: Path, dest: Path, workers: int = 0, **options: object) -> ShardedLoader:
    return ShardedLoader(
        str(src),
        batch_size=BATCH,
        num_workers=workers,
        seed=SEED,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(dest), rank=0, world_size=1, **options),  # type: ignore[arg-type]
    )


def _keys(loader: ShardedLoader, limit: int | None = None) -> list[str]:
    out: list[str] = []
    for i, (keys,) in enumerate(loader):
        out += list(keys)
        if limit is not None and i + 1 == limit:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_reads_as_shards_land_in_the_plans_order_and_never_the_source(
    tmp_path: Path, workers: int
) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    copier = start_copier(src, dest, "--bw-limit", "0.4")  # ~1.1 MB: about 3 s
    try:
        wait_plan(dest)
        with source_reads(src, tmp_path / "opened.log") as opened:
            loader = _loader(src, dest, workers)
            assert isinstance(loader.reader, StagingReader)
            epoch0 = _keys(loader)
            assert finished(copier) == 0  # staging done before epoch 1 starts
            loader.set_epoch(1)
            epoch1 = _keys(loader)
        assert opened.read_text() == ""  # the loader opened nothing under the source
    finally:
        stop(copier)
    assert epoch0 == planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=0, staging=True)
    assert epoch1 == planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=1, staging=False)
    assert epoch0 != planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=0, staging=False)
    metrics = loader.metrics.as_dict()
    assert metrics["shards_waited"] >= 1 and metrics["staging_wait_s"] > 0
    assert loader.state_dict().get("staging_order") is None  # epoch 1: the full shuffle


def test_resume_mid_staging_replays_the_staging_order_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job stopped inside epoch 0 while the copier still runs (a requeue stops both), then a
    new copier and a new loader from the saved state: the same samples, in the same order."""
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    for name, value in job_env(0).items():
        monkeypatch.setenv(name, value)
    copier = start_copier(src, dest, "--bw-limit", "0.2")
    try:
        wait_plan(dest)
        first = _loader(src, dest)
        head = _keys(first, limit=3)
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        code, err = stop(copier)
    assert code == 11, err  # stopped by SIGTERM before it finished
    assert state["version"] == 3 and state["staging_order"] == {"copy_seed": 0, "window_shards": 8}
    assert not list((dest / "ds").rglob("*.partial"))

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued run of the job
    again = start_copier(src, dest, restart_count=1)  # keeps what was published
    try:
        wait_plan(dest, restart_count=1)
        second = _loader(src, dest)
        second.load_state_dict(state)
        tail = _keys(second)
        assert finished(again) == 0
        second.set_epoch(1)
        epoch1 = _keys(second)
    finally:
        stop(again)
    assert head + tail == planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=0, staging=True)
    assert epoch1 == planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=1, staging=False)


def test_a_state_saved_after_staging_resumes_in_the_full_shuffle(tmp_path: Path) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    copier = start_copier(src, dest)
    assert finished(copier) == 0
    loader = _loader(src, dest)
    assert not isinstance(loader.reader, StagingReader)  # done: the plain staged reader
    loader.set_epoch(0)
    head = _keys(loader, limit=2)
    state = loader.state_dict()
    assert state["version"] == 2 and "staging_order" not in state
    resumed = _loader(src, dest)
    resumed.load_state_dict(state)
    want = planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=0, staging=False)
    assert head + _keys(resumed) == want


@pytest.mark.parametrize("mode", ["fail", "source"])
def test_a_dead_copier_is_said_in_one_line_then_fails_or_reads_the_source(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import stager.stagein.status as status_module

    monkeypatch.setattr(status_module, "GONE_AFTER_S", 0.2)  # the one rule (CopierWatch)
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    copier = start_copier(src, dest, "--bw-limit", "0.1")  # ~2 s per shard
    try:
        wait_plan(dest, first_shards=1)
        loader = _loader(src, dest, on_copier_death=mode)
        batches = iter(loader)
        head = list(next(batches)[0])
        copier.send_signal(signal.SIGKILL)  # no handler runs: the lock is freed by the kernel
        copier.wait(timeout=60)
        with source_reads(src, tmp_path / "opened.log") as opened:
            if mode == "fail":
                with pytest.raises(StagingStopped) as raised:
                    for _ in batches:
                        pass
                message = str(raised.value)
                assert "\n" not in message and "on_copier_death='source'" in message
                assert opened.read_text() == ""
                return
            rest = [k for (keys,) in batches for k in keys]
            assert opened.read_text() != ""  # the shards the copier did not stage
    finally:
        stop(copier)
    said = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert len(said) == 1 and "reading the others from the source" in said[0]
    assert head + rest == planned_keys(COUNTS, batch=BATCH, seed=SEED, epoch=0, staging=True)
    staged = StagedDataset(dest, "ds")
    for shard in sorted(src.glob("*.tar")):
        assert (staged.dir / shard.name).read_bytes() == shard.read_bytes()
    assert not list(staged.dir.rglob("*.partial"))


@pytest.mark.parametrize(("mode", "workers"), [("fail", 0), ("source", 2)])
def test_a_stopped_copier_that_holds_its_lock_is_given_up_in_one_line(
    tmp_path: Path, mode: str, workers: int
) -> None:
    """A copier stopped (SIGSTOP: a suspended step, or a read hung on a dead server) keeps its
    lock and heartbeats no more: the loader waited for it forever, saying nothing. Past
    ``copier_stall_s`` without progress it raises StagingStopped in one line; the source is
    not read (a fetch would need the lock the stopped copier holds). From a worker too, whose
    error torch wraps in a traceback."""
    import os
    import time

    src, dest = dataset(tmp_path), tmp_path / "scratch"
    copier = start_copier(src, dest, "--bw-limit", "0.1")  # ~2 s per shard
    try:
        wait_plan(dest, first_shards=1)
        loader = _loader(src, dest, workers, on_copier_death=mode, copier_stall_s=600.0)
        batches = iter(loader)
        head = list(next(batches)[0])
        copier.send_signal(signal.SIGSTOP)
        lock = StagedDataset(dest, "ds").lock_path
        last_beat = time.time() - 3600  # (the stopped copier cannot touch it again)
        os.utime(lock, (last_beat, last_beat))
        with source_reads(src, tmp_path / "opened.log") as opened:
            with pytest.raises(StagingStopped) as raised:
                for _ in batches:
                    pass
            assert opened.read_text() == ""
    finally:
        copier.send_signal(signal.SIGCONT)
        stop(copier)
    message = str(raised.value)
    assert "\n" not in message and re.search(r"no progress for 36\d\d s", message), message
    assert "copier_stall_s" in message and head
    staged = StagedDataset(dest, "ds")
    for shard in sorted(src.glob("*.tar")):  # (what is there is whole and the source's)
        copy = staged.dir / shard.name
        assert not copy.exists() or copy.read_bytes() == shard.read_bytes()


def test_a_background_run_that_ended_with_a_corrupt_shard_is_resolved_as_it_ended(
    tmp_path: Path,
) -> None:
    """The copier ended (exit 4) before the loader started: with on_error="skip" the corrupt
    shard is out of the plan from the start, where it stayed in it and raised mid-epoch."""
    from stager.errors import EXIT_INTEGRITY, IntegrityError

    src, dest = dataset(tmp_path), tmp_path / "scratch"
    victim = sorted(src.glob("*.tar"))[1]
    with open(victim, "r+b") as handle:  # damaged after `stager index`: its size is unchanged
        handle.seek(1024)
        handle.write(b"\xff" * 100)
    copier = start_copier(src, dest)
    _, err = copier.communicate(timeout=120)
    assert copier.returncode == EXIT_INTEGRITY, err
    with pytest.raises(IntegrityError, match=victim.name):
        _loader(src, dest)
    loader = _loader(src, dest, on_error="skip")
    assert loader.skipped_shards == [victim.name]
    keys = _keys(loader)
    assert len(keys) == sum(COUNTS) - COUNTS[1]
    assert not [k for k in keys if k.startswith("s00001-")]


def test_a_sample_whose_members_lie_apart_is_refused_while_the_copier_runs(
    tmp_path: Path,
) -> None:
    """A dataset indexed before stager refused such shards (its manifest counts the parts as
    samples): the staged, source and streamed paths raise, but the loader reading while stage-in
    --background copied gave the half-samples to training."""
    from stager.shards.build import build_manifest, write_manifest
    from stager.shards.manifest import Manifest, ManifestEntry
    from stager.storage.hashing import hash_file
    from stager.storage.sources import resolve_source

    from .trees import tar_bytes

    src = dataset(tmp_path)
    split = src / "zz-split.tar"
    split.write_bytes(tar_bytes([(n, b"x") for n in ("x1.npy", "x2.npy", "x1.cls", "x2.cls")]))
    manifest_path = src / "stager-manifest.json"
    manifest_path.unlink()
    whole = build_manifest(resolve_source(str(src / "train-*.tar")))
    entry = ManifestEntry("zz-split.tar", split.stat().st_size, hash_file(split), 4)
    write_manifest(Manifest((*whole.entries, entry), whole.meta), str(manifest_path))
    dest = tmp_path / "scratch"
    copier = start_copier(src, dest, "--bw-limit", "0.4")
    try:
        wait_plan(dest)
        with pytest.raises(IntegrityError, match="members of sample 'x1' are not next to"):
            _keys(_loader(src, dest))
    finally:
        stop(copier)
