"""ShardedLoader in one process: locality, decoding, determinism, corrupt shards, resume refusal."""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import stager_loaders
from stager.errors import IntegrityError, UsageError
from stager.layout import StagedDataset
from stager.shards.loader_index import dataset_index_path
from stager.shards.synth import SyntheticSpec, sample_key, sample_label, write_synthetic_dataset
from stager.slurm import SlurmEnv
from stager.stagein.run import StageInOptions, stage_in
from stager.storage.sources import resolve_source
from stager_loaders import (
    LoaderOptions,
    ResumeMismatch,
    ShardedLoader,
    capture_rng_state,
    restore_rng_state,
)

from .conftest import REPO, clean_env, run_cli

SPEC = SyntheticSpec(
    num_shards=8, samples_per_shard=50, uneven=True, seed=1
)  # the small_dataset fixture


def all_keys(spec: SyntheticSpec = SPEC) -> set[str]:
    return {sample_key(s, i) for s, n in enumerate(spec.shard_sizes()) for i in range(n)}


def stage(source: Path, dest: Path) -> Path:
    options = StageInOptions(dest_root=dest, progress="none", jitter_max_s=0)
    report = stage_in(resolve_source(str(source)), options, slurm=SlurmEnv.from_environ({}))
    return Path(report.dataset_dir)


def keys_of(loader: ShardedLoader) -> list[str]:
    return [k for batch in loader for k in batch[0]]


def test_public_api_is_pinned_and_planner_is_torch_free() -> None:
    assert sorted(stager_loaders.__all__) == [
        "CsvMetrics",
        "LoaderMetrics",
        "LoaderOptions",
        "LoaderState",
        "PlanOptions",
        "ResumeMismatch",
        "ShardedLoader",
        "TensorBoardMetrics",
        "WorldLayout",
        "capture_rng_state",
        "restore_rng_state",
    ]
    for name in stager_loaders.__all__:
        assert getattr(stager_loaders, name) is not None
    code = "import sys, stager.plan.ranks, stager.plan.nodes; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_staged_copy_is_read_alone_source_deleted(
    dataset_copy: Path, tmp_path: Path, caplog
) -> None:
    dest = tmp_path / "scratch"
    staged = stage(dataset_copy, dest)
    shutil.rmtree(dataset_copy)  # any read of the source would now fail
    with caplog.at_level(logging.WARNING, logger="stager_loaders"):
        loader = ShardedLoader(
            dataset_copy,
            batch_size=16,
            to_tuple=("__key__", "npy"),
            options=LoaderOptions(dest=str(dest)),
        )
        got = keys_of(loader)
    assert isinstance(loader, DataLoader)
    assert loader.shards.staged_dir == staged and loader.shards.from_source == 0
    assert all(Path(s.location).is_relative_to(staged) for s in loader.shards.shards)
    assert set(got) == all_keys() and len(got) - len(all_keys()) < 1  # world of one: no padding
    assert len(loader) == -(-len(all_keys()) // 16)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the dataset index sits beside the staged copy (stage-in wrote it), so no loader walks headers
    assert dataset_index_path(staged / ".stager" / "index").is_file()


def test_missing_staged_shard_falls_back_with_one_warning(
    dataset_copy: Path, tmp_path: Path, caplog
) -> None:
    dest = tmp_path / "scratch"
    staged = stage(dataset_copy, dest)
    (staged / "train-000003.tar").unlink()
    with caplog.at_level(logging.WARNING, logger="stager_loaders"):
        loader = ShardedLoader(
            dataset_copy,
            batch_size=32,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(dest)),
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 8 shard(s) are read from the source")
    assert [s.relpath for s in loader.shards.shards if s.from_source] == ["train-000003.tar"]
    assert set(keys_of(loader)) == all_keys()


def test_decode_npy_and_cls_with_workers(small_dataset: Path, tmp_path: Path) -> None:
    loader = ShardedLoader(
        small_dataset,
        batch_size=10,
        num_workers=2,
        decode="rgb8",
        to_tuple=("__key__", "npy", "cls"),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    seen = 0
    for keys, images, labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (18, 18, 3)
        for key, label in zip(keys, labels.tolist(), strict=True):
            shard, index = int(key[1:6]), int(key[7:])
            assert label == sample_label(SPEC.seed, shard, index)
        seen += len(keys)
    assert seen == len(all_keys())


def test_raw_members_are_tensors_and_match_the_tar(small_dataset: Path, tmp_path: Path) -> None:
    loader = ShardedLoader(
        small_dataset, batch_size=7, num_workers=1, options=LoaderOptions(dest=str(tmp_path))
    )
    batch = next(iter(loader))
    assert set(batch) == {"__key__", "npy", "cls"}
    key, cls = batch["__key__"][0], batch["cls"][0]
    assert isinstance(cls, torch.Tensor) and cls.dtype == torch.uint8
    shard, index = int(key[1:6]), int(key[7:])
    assert bytes(cls.numpy()) == str(sample_label(SPEC.seed, shard, index)).encode()
    image = np.load(__import__("io").BytesIO(bytes(batch["npy"][0].numpy())))
    assert image.shape == (18, 18, 3)


@pytest.mark.parametrize("ragged", [False, True])
def test_packed_batch_columns_put_each_member_under_its_sample(ragged: bool) -> None:
    from stager_loaders.dataset import PackedBatch

    # three samples; in the ragged case the middle one lacks "cls" and has its members reversed
    members = [
        (0, "jpg", b"aa"),
        (0, "cls", b"1"),
        (1, "jpg", b"bbb"),
        (1, "cls", b"2"),
        (2, "jpg", b"c"),
        (2, "cls", b"3"),
    ]
    if ragged:
        members = [
            members[0],
            members[1],
            (1, "json", b"{}"),
            (1, "jpg", b"bbb"),
            members[4],
            members[5],
        ]
    names = ("jpg", "cls", "json")
    batch = PackedBatch(
        payload=np.frombuffer(b"".join(m[2] for m in members), dtype=np.uint8).copy(),
        keys=["a", "b", "c"],
        member_sample=np.asarray([m[0] for m in members], dtype=np.int32),
        member_ext=np.asarray([names.index(m[1]) for m in members], dtype=np.int16),
        member_size=np.asarray([len(m[2]) for m in members], dtype=np.int64),
        ext_names=names,
    )
    columns = batch.columns()
    as_bytes = {
        k: [None if t is None else bytes(t.numpy()) for t in v]
        for k, v in columns.items()
        if k != "__key__"
    }
    if ragged:
        assert as_bytes == {
            "jpg": [b"aa", b"bbb", b"c"],
            "cls": [b"1", None, b"3"],
            "json": [None, b"{}", None],
        }
    else:
        assert as_bytes == {"jpg": [b"aa", b"bbb", b"c"], "cls": [b"1", b"2", b"3"]}
    assert all(isinstance(t, torch.Tensor) for t in columns["jpg"])


@pytest.mark.parametrize("shm_min_bytes", [0, 1 << 40])
def test_raw_batches_from_workers_are_the_same_through_shared_memory_or_the_pipe(
    small_dataset: Path, tmp_path: Path, monkeypatch, shm_min_bytes: int
) -> None:
    import stager_loaders.dataset

    monkeypatch.setattr(stager_loaders.dataset, "SHARED_MEMORY_MIN_BYTES", shm_min_bytes)
    opts = LoaderOptions(dest=str(tmp_path))
    direct = [
        (b["__key__"], [bytes(t.numpy()) for t in b["npy"]])
        for b in ShardedLoader(small_dataset, batch_size=5, options=opts)
    ]
    workers = [
        (b["__key__"], [bytes(t.numpy()) for t in b["npy"]])
        for b in ShardedLoader(small_dataset, batch_size=5, num_workers=2, options=opts)
    ]
    assert workers == direct and len(direct) > 2


@pytest.mark.skipif(
    not hasattr(__import__("fcntl"), "F_GETPIPE_SZ"), reason="pipe sizes are Linux's"
)
@pytest.mark.parametrize("streaming", [False, True])
def test_workers_result_pipe_holds_a_pipe_sent_batch(
    small_dataset: Path, tmp_path: Path, monkeypatch, streaming: bool
) -> None:
    import fcntl

    import stager_loaders.loader

    sizes: list[int] = []
    widen = stager_loaders.loader._widen_result_pipe

    def spy(iterator) -> None:
        widen(iterator)
        sizes.append(
            fcntl.fcntl(iterator._worker_result_queue._reader.fileno(), fcntl.F_GETPIPE_SZ)
        )

    monkeypatch.setattr(stager_loaders.loader, "_widen_result_pipe", spy)
    opts = LoaderOptions(dest=str(tmp_path), force_streaming=streaming)
    batches = list(ShardedLoader(small_dataset, batch_size=5, num_workers=2, options=opts))
    assert batches and sizes == [stager_loaders.loader.RESULT_PIPE_BYTES]


def test_a_pipe_that_cannot_be_widened_changes_nothing(
    small_dataset: Path, tmp_path: Path, monkeypatch
) -> None:
    import stager_loaders.loader

    def refuse(*args) -> None:
        raise PermissionError(1, "Operation not permitted")

    opts = LoaderOptions(dest=str(tmp_path))
    widened = [
        b["__key__"]
        for b in ShardedLoader(small_dataset, batch_size=5, num_workers=2, options=opts)
    ]
    monkeypatch.setattr(stager_loaders.loader.fcntl, "fcntl", refuse)
    narrow = [
        b["__key__"]
        for b in ShardedLoader(small_dataset, batch_size=5, num_workers=2, options=opts)
    ]
    assert narrow == widened and len(narrow) > 2


def test_same_seed_and_epoch_same_order_other_epoch_differs(
    small_dataset: Path, tmp_path: Path
) -> None:
    def order(epoch: int, seed: int = 4) -> list[str]:
        loader = ShardedLoader(
            small_dataset,
            batch_size=16,
            seed=seed,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(tmp_path)),
        )
        loader.set_epoch(epoch)
        return keys_of(loader)

    first = order(1)
    assert first == order(1)
    assert first != order(2) and sorted(first) == sorted(order(2))
    assert first != order(1, seed=5)


def test_ranks_of_a_simulated_world_split_the_epoch(small_dataset: Path, tmp_path: Path) -> None:
    per_rank = []
    for rank in range(3):
        loader = ShardedLoader(
            small_dataset,
            batch_size=8,
            even="drop",
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(tmp_path), rank=rank, world_size=3),
        )
        per_rank.append([batch[0] for batch in loader])
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [k for batches in per_rank for b in batches for k in b]
    assert len(flat) == len(set(flat)) and len(all_keys()) - len(flat) < 3 * 8 + 3


def test_corrupt_header_names_shard_and_member_or_is_skipped(
    dataset_copy: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "scratch"
    staged = stage(dataset_copy, dest)
    victim = staged / "train-000002.tar"
    raw = bytearray(victim.read_bytes())
    raw[512 * 12 : 512 * 13] = b"\x7f" * 512  # same size, so the staged copy still looks whole
    victim.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as caught:
        ShardedLoader(dataset_copy, batch_size=8, options=LoaderOptions(dest=str(dest)))
    message = str(caught.value)
    assert "train-000002.tar" in message and "member" in message and "s00002-" in message
    loader = ShardedLoader(
        dataset_copy,
        batch_size=8,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(dest), on_error="skip"),
    )
    assert loader.skipped_shards == ["train-000002.tar"]
    got = set(keys_of(loader))
    assert got == {k for k in all_keys() if not k.startswith("s00002-")}


def test_truncated_unstaged_shard_is_refused(dataset_copy: Path, tmp_path: Path) -> None:
    victim = dataset_copy / "train-000005.tar"
    victim.write_bytes(victim.read_bytes()[:3000])
    with pytest.raises(IntegrityError, match="train-000005.tar"):
        ShardedLoader(
            dataset_copy, batch_size=8, options=LoaderOptions(dest=str(tmp_path / "none"))
        )


def test_compressed_shards_stream_with_exact_len(tmp_path: Path) -> None:
    spec = SyntheticSpec(num_shards=3, samples_per_shard=20, uneven=True, seed=2, compress=True)
    write_synthetic_dataset(tmp_path / "tgz", spec)
    loader = ShardedLoader(
        tmp_path / "tgz",
        batch_size=6,
        decode="rgb8",
        to_tuple=("__key__", "cls"),
        options=LoaderOptions(dest=str(tmp_path / "none")),
    )
    assert not loader.shards.random_access
    batches = list(loader)
    assert len(batches) == len(loader)
    assert {k for b in batches for k in b[0]} == all_keys(spec)


def test_resume_mismatch_is_refused_with_what_differs(
    small_dataset: Path, dataset_copy: Path, tmp_path: Path
) -> None:
    def make(source: Path = small_dataset, batch_size: int = 8, **world) -> ShardedLoader:
        options = LoaderOptions(dest=str(tmp_path), **world)
        return ShardedLoader(source, batch_size=batch_size, options=options)

    state = make().state_dict()
    with pytest.raises(ResumeMismatch, match="batch_size was 8, is now 16"):
        make(batch_size=16).load_state_dict(state)
    with pytest.raises(ResumeMismatch, match="world_size was 1, is now 2"):
        make(rank=1, world_size=2).load_state_dict(state)
    (dataset_copy / "train-000007.tar").unlink()
    with pytest.raises(ResumeMismatch, match="fingerprint"):
        make(dataset_copy).load_state_dict(state)
    make().load_state_dict(json.loads(json.dumps(state)))  # JSON round trip is accepted
    with pytest.raises(ResumeMismatch, match="different epoch order"):
        make().load_state_dict({**state, "version": 1})  # saved before the keyed epoch order


@pytest.mark.parametrize("knob", ["seed", "shuffle", "even"])
def test_resume_refuses_a_state_of_another_order(
    small_dataset: Path, tmp_path: Path, knob: str
) -> None:
    """The seed, the shuffle mode and the evening fix which samples batch k holds: a state saved
    under other values names a position in another order (resumed, some samples would come
    twice and some never), so it is refused naming the knob, before the loader moves."""
    changed: dict[str, object] = {"seed": 4, "shuffle": False, "even": "drop"}

    def make(**kwargs: object) -> ShardedLoader:
        options = LoaderOptions(dest=str(tmp_path))
        return ShardedLoader(small_dataset, batch_size=8, options=options, **kwargs)  # type: ignore[arg-type]

    saved = make()
    saved.set_epoch(2)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    other = make(**{knob: changed[knob]})
    with pytest.raises(ResumeMismatch, match=f"{knob} was"):
        other.load_state_dict(state)
    assert other.epoch == 0 and other.state_dict()["batches_consumed"] == 0


def test_resume_in_process_and_set_epoch_keeps_position(
    small_dataset: Path, tmp_path: Path
) -> None:
    def make() -> ShardedLoader:
        return ShardedLoader(
            small_dataset,
            batch_size=16,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(tmp_path)),
        )

    full = make()
    full.set_epoch(3)
    expected = [b[0] for b in full]
    first = make()
    first.set_epoch(3)
    it = iter(first)
    head = [next(it)[0] for _ in range(5)]
    state = first.state_dict()
    assert state["epoch"] == 3 and state["batches_consumed"] == 5
    second = make()
    second.load_state_dict(state)
    second.set_epoch(3)  # the training loop's usual call must not reset the resumed position
    assert head + [b[0] for b in second] == expected
    second.set_epoch(4)
    assert len(list(second)) == len(second)


def test_rng_state_round_trip() -> None:
    state = capture_rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rng_state_restores_from_a_checkpoint_mapped_to_the_gpu(tmp_path: Path) -> None:
    """``torch.load(map_location="cuda")`` puts the saved generator states on the GPU; the
    resume of the example training script failed there (found by scripts/nccl_smoke.py)."""
    torch.cuda.init()
    torch.save({"rng": capture_rng_state()}, tmp_path / "state.pt")
    drawn = (random.random(), torch.rand(1).item(), torch.rand(1, device="cuda").item())
    state = torch.load(tmp_path / "state.pt", map_location="cuda", weights_only=False)["rng"]
    assert state["torch"].is_cuda
    restore_rng_state(state)
    assert (random.random(), torch.rand(1).item(), torch.rand(1, device="cuda").item()) == drawn


def test_stage_in_subset_node_and_loader_agree(small_dataset: Path, tmp_path: Path) -> None:
    staged_sets = []
    for node in (0, 1):
        env = clean_env(
            SLURM_JOB_ID="77",
            SLURM_NODEID=str(node),
            SLURM_JOB_NUM_NODES="2",
            SLURM_JOB_NODELIST="n[0-1]",
            SLURM_PROCID=str(node),
            SLURM_NTASKS="2",
            SLURMD_NODENAME=f"n{node}",
        )
        dest = tmp_path / f"node{node}"
        done = run_cli(
            "stage-in",
            str(small_dataset),
            "--dest",
            str(dest),
            "--subset",
            "node",
            "--jitter-max",
            "0",
            "--quiet",
            env=env,
        )
        assert done.returncode == 0, done.stderr
        manifest = StagedDataset.of(dest / "ds").manifest_path.read_text()
        assert '"subset": "node"' in manifest
        staged_sets.append({p.name for p in (dest / "ds").glob("*.tar")})
    assert not staged_sets[0] & staged_sets[1]
    assert staged_sets[0] | staged_sets[1] == {p.name for p in small_dataset.glob("*.tar")}
    loader = ShardedLoader(
        small_dataset,
        batch_size=8,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path / "node0"), rank=0, world_size=1),
    )
    assert loader.plan_options.subset == "node"
    node_keys = {k for k in all_keys() if f"train-{int(k[1:6]):06d}.tar" in staged_sets[0]}
    assert set(keys_of(loader)) == node_keys


def test_elastic_resume_on_a_smaller_world_repeats_and_loses_nothing(
    small_dataset: Path, tmp_path: Path
) -> None:
    def make(rank: int, world: int) -> ShardedLoader:
        return ShardedLoader(
            small_dataset,
            batch_size=8,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(tmp_path), rank=rank, world_size=world),
        )

    consumed, state = [], None
    for rank in range(3):  # the old world: 3 ranks stop after 4 batches each
        loader = make(rank, 3)
        loader.set_epoch(2)
        it = iter(loader)
        consumed += [k for _ in range(4) for k in next(it)[0]]
        state = loader.state_dict()
    assert state is not None
    with pytest.raises(ResumeMismatch, match="world_size was 3, is now 2") as refused:
        make(0, 2).load_state_dict(state)
    assert "load_state_dict(state, elastic=True)" in str(refused.value)  # says what to do
    new_keys, lengths = [], set()
    for rank in range(2):
        loader = make(rank, 2)
        loader.load_state_dict(state, elastic=True)
        loader.set_epoch(2)
        lengths.add(len(loader))
        it = iter(loader)
        head = [next(it)[0] for _ in range(2)]
        mid = loader.state_dict()  # saved inside the elastic epoch: resumable again on this world
        assert mid["elastic_from"] == {"num_nodes": 1, "ranks_per_node": 3, "batches_consumed": 4}
        with pytest.raises(ResumeMismatch, match="already resumed elastically"):
            make(0, 3).load_state_dict(mid, elastic=True)
        again = make(rank, 2)
        again.load_state_dict(json.loads(json.dumps(mid)))
        again.set_epoch(2)
        tail = [b[0] for b in again]
        new_keys += [k for b in head + tail for k in b]
        assert len(head) + len(tail) == len(loader)
        loader.set_epoch(3)
        per_rank = -(-len(all_keys()) // 2)
        assert len(loader) == -(-per_rank // 8), (
            "the next epoch follows the new world's normal plan"
        )
    assert len(lengths) == 1
    assert set(consumed) | set(new_keys) == all_keys(), "nothing lost"
    assert not set(consumed) & set(new_keys), "nothing delivered twice"
    assert len(new_keys) - len(set(new_keys)) < 2, "only the pad of the new world repeats"


def test_memory_does_not_grow_across_epochs(small_dataset: Path, tmp_path: Path) -> None:
    import os

    def rss_bytes() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    loader = ShardedLoader(
        small_dataset,
        batch_size=16,
        decode="rgb8",
        to_tuple=("npy", "cls"),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    before = rss_bytes()
    for epoch in range(2, 8):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    assert rss_bytes() - before < 8 << 20, "RSS grew across epochs"


def test_dataset_index_is_cached_in_one_file_and_rebuilt_on_change(
    dataset_copy: Path, tmp_path: Path, monkeypatch
) -> None:
    dest = tmp_path / "scratch"
    staged = stage(dataset_copy, dest)
    first = ShardedLoader(
        dataset_copy, batch_size=16, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
    )
    assert dataset_index_path(staged / ".stager" / "index").is_file()

    import stager.shards.loader_index as index_module

    def no_header_walk(*args, **kwargs):
        raise AssertionError("the dataset index should have come from its one-file cache")

    monkeypatch.setattr(index_module, "cached_index", no_header_walk)
    again = ShardedLoader(
        dataset_copy, batch_size=16, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
    )
    assert keys_of(again) == keys_of(first)

    monkeypatch.undo()
    shard = sorted(staged.glob("*.tar"))[0]
    os.utime(
        shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9)
    )  # a changed shard
    monkeypatch.setattr(index_module, "cached_index", no_header_walk)
    with pytest.raises(AssertionError, match="one-file cache"):
        ShardedLoader(
            dataset_copy,
            batch_size=16,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=str(dest)),
        )


def test_first_loader_after_stage_in_reads_no_tar_header(
    dataset_copy: Path, tmp_path: Path, monkeypatch
) -> None:
    """stage-in hands over the member offsets it parsed in flight: no header walk, same batches."""
    dest = tmp_path / "scratch"
    staged = stage(dataset_copy, dest)
    assert dataset_index_path(staged / ".stager" / "index").is_file()
    import stager.shards.loader_index as index_module

    def no_header_walk(*args, **kwargs):
        raise AssertionError("the loader walked tar headers although stage-in indexed the shards")

    monkeypatch.setattr(index_module, "cached_index", no_header_walk)
    loader = ShardedLoader(
        dataset_copy,
        batch_size=16,
        to_tuple=("__key__", "npy"),
        options=LoaderOptions(dest=str(dest)),
    )
    got = keys_of(loader)
    monkeypatch.undo()
    dataset_index_path(staged / ".stager" / "index").unlink()
    walked = ShardedLoader(
        dataset_copy,
        batch_size=16,
        to_tuple=("__key__", "npy"),
        options=LoaderOptions(dest=str(dest)),
    )
    assert got == keys_of(walked) and set(got) == all_keys()
    first = next(iter(loader))
    again = next(iter(walked))
    assert [t.tolist() for t in first[1]] == [t.tolist() for t in again[1]]  # same payload bytes


def test_a_shard_index_is_cached_on_disk_only_when_it_was_slow_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stager.shards.loader_index as index_module

    [shard] = write_synthetic_dataset(
        tmp_path / "ds", SyntheticSpec(num_shards=1, samples_per_shard=5)
    )
    cache = tmp_path / "cache"
    quick = index_module.cached_index(shard, cache_dir=cache)
    assert quick.num_samples == 5 and not list(
        cache.rglob("*.idx.npz")
    )  # re-indexing beats a cache read

    monkeypatch.setattr(index_module, "CACHE_AFTER_S", 0.0)  # as if the shard were large
    index_module.cached_index(shard, cache_dir=cache)
    assert len(list(cache.rglob("*.idx.npz"))) == 1

    def no_header_walk(path):
        raise AssertionError("the cached index should have been used")

    monkeypatch.setattr(index_module, "index_tar", no_header_walk)
    cached = index_module.cached_index(shard, cache_dir=cache)
    assert cached.keys == quick.keys and cached.offsets.tolist() == quick.offsets.tolist()


def test_constructor_is_dataloader_like_with_one_options_object(
    small_dataset: Path, tmp_path: Path
) -> None:
    import inspect

    params = [
        p
        for p in inspect.signature(ShardedLoader.__init__).parameters.values()
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert len(params) <= 12 and params[-1].name == "options"
    assert [p.name for p in params[:3]] == ["source", "batch_size", "num_workers"]
    with pytest.raises(UsageError, match="even='drop'") as caught:
        ShardedLoader(small_dataset, batch_size=8, drop_last=True)
    assert "\n" not in str(caught.value)
    # (sampler=None, the default, is taken)
    with pytest.raises(UsageError, match="sampler"):
        ShardedLoader(small_dataset, batch_size=8, sampler=range(3))
    with pytest.raises(TypeError, match="samplr"):
        ShardedLoader(small_dataset, batch_size=8, samplr=None)
    with pytest.raises(UsageError, match="on_error"):
        LoaderOptions(on_error="ignore")
    # the keywords of earlier versions still work, and land in the options
    old_style = ShardedLoader(
        small_dataset,
        batch_size=8,
        rank=1,
        world_size=2,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path)),
    )
    new_style = ShardedLoader(
        small_dataset,
        batch_size=8,
        to_tuple=("__key__",),
        options=LoaderOptions(dest=str(tmp_path), rank=1, world_size=2),
    )
    assert old_style.options == new_style.options and old_style.layout.rank == 1
    assert keys_of(old_style) == keys_of(new_style)


@pytest.mark.parametrize("streaming", [False, True])
def test_both_readers_serve_the_same_loader_interface(
    small_dataset: Path, tmp_path: Path, streaming: bool
) -> None:
    from stager_loaders.readers import StagedReader, StreamingReader

    def make() -> ShardedLoader:
        return ShardedLoader(
            small_dataset,
            batch_size=8,
            num_workers=2,
            to_tuple=("__key__",),
            options=LoaderOptions(
                dest=str(tmp_path), force_streaming=streaming, persistent_workers=True
            ),
        )

    loader = make()
    assert isinstance(loader.reader, StreamingReader if streaming else StagedReader)
    assert loader.persistent_workers is not streaming, "streaming workers restart per epoch"
    loader.set_epoch(2)
    full = [b[0] for b in loader]
    assert len(full) == len(loader) and {k for b in full for k in b} == all_keys()
    first = make()
    first.set_epoch(2)
    it = iter(first)
    head = [next(it)[0] for _ in range(3)]
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + [b[0] for b in second] == full


@pytest.mark.parametrize("workers", [0, 2])
def test_more_shards_than_open_files_read_the_same_batches(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Past the open-file limit shards are read with pread and a few descriptors, not mapped."""
    import stager_loaders.shardio as shardio

    def make() -> ShardedLoader:
        return ShardedLoader(
            small_dataset,
            batch_size=7,
            num_workers=workers,
            options=LoaderOptions(dest=str(tmp_path)),
        )

    def batches(loader: ShardedLoader) -> list[tuple[list[str], list[bytes]]]:
        return [(b["__key__"], [bytes(t.numpy()) for t in b["npy"]]) for b in loader]

    mapped = make()
    assert isinstance(mapped.dataset.files, shardio.MappedShards)
    expected = batches(mapped)
    monkeypatch.setattr(shardio, "open_limit", lambda: 3)  # 8 shards, at most 3 open at once
    read = make()
    assert isinstance(read.dataset.files, shardio.PreadShards)
    assert batches(read) == expected and len(expected) > 10
    if workers == 0:
        assert 0 < len(read.dataset.files) <= 3


def test_a_dropped_loader_closes_its_shard_descriptors(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the open-file limit, a loader read in this process (num_workers=0) and dropped
    gives its descriptors back: a loader made each epoch kept them all, and failed (EMFILE)."""
    import gc

    import stager_loaders.shardio as shardio

    monkeypatch.setattr(shardio, "open_limit", lambda: 3)  # 8 shards, at most 3 open at once

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    loader = ShardedLoader(small_dataset, batch_size=7, options=LoaderOptions(dest=str(tmp_path)))
    assert isinstance(loader.dataset.files, shardio.PreadShards)
    before = open_fds()
    for _ in loader:
        pass
    assert len(loader.dataset.files) == 3 and open_fds() == before + 3
    del loader
    gc.collect()
    assert open_fds() == before


@pytest.mark.parametrize("many_shards", [False, True])
def test_a_shard_truncated_after_indexing_names_shard_and_sample(
    dataset_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, many_shards: bool
) -> None:
    import stager_loaders.shardio as shardio

    if many_shards:
        monkeypatch.setattr(shardio, "open_limit", lambda: 2)
    loader = ShardedLoader(
        dataset_copy,
        batch_size=400,
        shuffle=False,
        options=LoaderOptions(dest=str(tmp_path / "none")),
    )
    victim = dataset_copy / "train-000003.tar"
    with open(victim, "r+b") as handle:  # the same file, cut: the index still promises more
        handle.truncate(2048)
    with pytest.raises(IntegrityError, match=r"train-000003\.tar: member of sample 's00003-"):
        list(loader)


def test_a_corrupt_compressed_stream_says_to_re_create_the_shard(tmp_path: Path) -> None:
    """Every staged copy is checked against its source: a stream corrupt in scratch is corrupt
    at its source too (unless changed since), so "re-stage" alone would repeat the bad bytes."""
    from loaders.streaming import iter_tar_samples

    spec = SyntheticSpec(num_shards=1, samples_per_shard=20, seed=3, compress=True)
    write_synthetic_dataset(tmp_path / "tgz", spec)
    (shard,) = sorted((tmp_path / "tgz").glob("*.tar.gz"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(IntegrityError) as caught:
        list(iter_tar_samples(str(shard)))
    message = str(caught.value)
    assert shard.name in message and "re-create this shard" in message
    assert "helps only where the staged copy was changed" in message


def _gzip_members_tar(path: Path, samples: int, members: int) -> list[str]:
    """A .tar.gz written as ``members`` concatenated gzip members (bgzip, pigz -i, ``cat``):
    valid gzip, which tarfile's own stream mode reads only to the end of the first member."""
    import gzip
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(samples):
            for ext, data in (("jpg", os.urandom(2000)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{path.stem.split('.')[0]}-{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    cuts = [len(raw) * k // members for k in range(members + 1)]
    path.write_bytes(b"".join(gzip.compress(raw[a:b]) for a, b in itertools.pairwise(cuts)))
    return [f"{path.stem.split('.')[0]}-{i:03d}" for i in range(samples)]


def test_a_tar_gz_of_several_gzip_members_is_read_whole(tmp_path: Path) -> None:
    src = tmp_path / "ds"
    src.mkdir()
    keys = _gzip_members_tar(src / "a.tar.gz", 6, 3) + _gzip_members_tar(src / "b.tar.gz", 4, 1)
    dest = tmp_path / "s"
    for staged in (False, True):  # from the source, and from the staged copy
        if staged:
            assert run_cli("stage-in", str(src), "--dest", str(dest), "--quiet").returncode == 0
        loader = ShardedLoader(
            src, batch_size=1, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
        )
        assert sorted(k for (batch,) in loader for k in batch) == sorted(keys), staged


def test_a_truncated_tar_gz_is_skipped_on_request_when_read_from_the_source(
    tmp_path: Path,
) -> None:
    src = tmp_path / "ds"
    src.mkdir()
    good = _gzip_members_tar(src / "good.tar.gz", 5, 1)
    _gzip_members_tar(src / "bad.tar.gz", 5, 1)
    (src / "bad.tar.gz").write_bytes((src / "bad.tar.gz").read_bytes()[:3000])
    none = LoaderOptions(dest=str(tmp_path / "none"))
    with pytest.raises(IntegrityError, match="bad.tar.gz"):
        ShardedLoader(src, batch_size=2, to_tuple=("__key__",), options=none)
    skip = LoaderOptions(dest=str(tmp_path / "none"), on_error="skip")
    loader = ShardedLoader(src, batch_size=1, to_tuple=("__key__",), options=skip)
    assert loader.skipped_shards == ["bad.tar.gz"]
    assert sorted(k for (batch,) in loader for k in batch) == good
