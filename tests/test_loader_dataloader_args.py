"""ShardedLoader as a drop-in DataLoader: the arguments a training script passes to a DataLoader
are taken, or refused in one line that says what to pass instead (they raised a bare TypeError,
or failed deep inside), and an epoch of nothing is an error, not a training run of no steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import webdataset as wds

from stager.errors import SourceError, UsageError
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

SPEC = SyntheticSpec(num_shards=3, samples_per_shard=5, seed=2, image_bytes=64)


@pytest.fixture()
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "STAGER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STAGER_SCRATCH_ROOT", str(tmp_path / "scratch"))
    write_synthetic_dataset(tmp_path / "ds", SPEC)
    return tmp_path / "ds"


def mark_worker(worker_id: int) -> None:
    """A worker_init_fn (module level: a spawned worker imports it)."""
    Path(os.environ["MARK_DIR"], f"worker{worker_id}").write_text(str(os.getpid()))


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"batch_size": None}, "batch_size must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"generator": object()}, "pass seed= instead of generator="),
        ({"in_order": False}, "in_order=False"),
        ({"sampler": object()}, "pass no sampler= or batch_sampler="),
        ({"batch_sampler": object()}, "pass no sampler= or batch_sampler="),
    ],
)
def test_dataloader_arguments_that_would_undo_the_plan_are_refused_in_one_line(
    source: Path, arguments: dict, says: str
) -> None:
    from stager_loaders import ShardedLoader

    with pytest.raises(UsageError, match=says):
        ShardedLoader(source, **arguments)


def test_timeout_worker_init_fn_and_a_start_method_are_passed_to_the_workers(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stager_loaders import ShardedLoader

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARK_DIR", str(marks))
    loader = ShardedLoader(
        source,
        batch_size=4,
        num_workers=2,
        to_tuple=("__key__",),
        timeout=60,
        worker_init_fn=mark_worker,
        multiprocessing_context="spawn",
    )
    assert loader.batch_size == 4 and loader.timeout == 60
    keys = [key for (batch,) in loader for key in batch]
    assert len(set(keys)) == sum(SPEC.shard_sizes())
    assert sorted(p.name for p in marks.iterdir()) == ["worker0", "worker1"]


def test_shards_that_hold_no_sample_are_an_error_not_an_empty_training_run(
    tmp_path: Path, source: Path
) -> None:
    from stager_loaders import ShardedLoader

    empty = tmp_path / "empty"
    empty.mkdir()
    for n in range(2):
        with wds.TarWriter(str(empty / f"shard-{n:06d}.tar")):
            pass
    with pytest.raises(SourceError, match="hold no sample"):
        ShardedLoader(empty, batch_size=4)


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_second_iter_ends_the_first_which_says_so_when_used(
    source: Path, num_workers: int, persistent: bool
) -> None:
    """zip(loader, loader) counted both in one position (a state_dict no loader could load),
    and a second iter() after load_state_dict rewound the first. The ended one takes no batch
    of the newer pass (persistent workers serve both from one queue)."""
    from stager_loaders import LoaderOptions, ShardedLoader

    options = LoaderOptions(persistent_workers=persistent)
    loader = ShardedLoader(
        source, batch_size=2, num_workers=num_workers, to_tuple=("__key__",), options=options
    )
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(UsageError, match="ended by a newer iter"):
        next(first)
    keys = [key for (batch,) in second for key in batch]
    assert len(set(keys)) == sum(SPEC.shard_sizes())  # the newer one reads the whole pass
    assert loader.state_dict()["batches_consumed"] == len(loader)
