"""The dataset index: one memory-mapped file per dataset, shared by ranks and workers."""

from __future__ import annotations

import io
import mmap
import os
import pickle
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import IntegrityError
from stager.shards import tarnative
from stager.shards.arrayfile import map_arrays, write_arrays
from stager.shards.loader_index import (
    _ARRAYS,
    FlatIndex,
    build_flat_index,
    dataset_index_path,
    open_dataset_index,
)
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset


def _mapped(array: np.ndarray) -> bool:
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def _big_index(samples: int) -> FlatIndex:
    members = 2 * samples
    return FlatIndex(
        shard_samples=np.full(samples // 1000, 1000, dtype=np.int64),
        sample_offsets=np.arange(0, samples + 1, 1000, dtype=np.int64),
        keys=np.arange(samples).astype("S12"),
        member_start=np.arange(0, members + 1, 2, dtype=np.int64),
        member_ext=np.tile(np.asarray([0, 1], np.int16), samples),
        member_offset=np.arange(members, dtype=np.int64) * 512,
        member_size=np.full(members, 100, dtype=np.int64),
        ext_names=("jpg", "cls"),
    )


def test_array_file_round_trip_and_refuses_a_cut_file(tmp_path: Path) -> None:
    arrays = {
        "ints": np.arange(10, dtype=np.int64),
        "keys": np.asarray([b"a", b"bcd"]),
        "empty": np.zeros(0, np.int16),
        "grid": np.ones((3, 2), np.float32),
    }
    path = tmp_path / "x.arrays"
    write_arrays(path, arrays, {"note": [1, 2]})
    got, meta = map_arrays(path)
    assert meta == {"note": [1, 2]}
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array)
        assert not got[name].flags.writeable and _mapped(got[name])
    assert list(tmp_path.iterdir()) == [path], "no partial file left behind"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError):
        map_arrays(path)
    path.write_bytes(b"not ours at all, not ours at all")
    with pytest.raises(ValueError):
        map_arrays(path)


def test_opening_a_large_index_allocates_nothing_per_sample(tmp_path: Path) -> None:
    """2M samples (~80 MB of index): mapping it allocates kilobytes; np.load would copy it all."""
    from stager.shards.loader_index import _save_flat

    path = tmp_path / "dataset.index"
    assert _save_flat(path, b"\x01" * 32, _big_index(2_000_000), [])
    assert path.stat().st_size > 60 << 20
    tracemalloc.start()
    try:
        flat, skipped, stamp = open_dataset_index(path)
        reads = flat.member_offset[[5, 1_999_999]].tolist() + [flat.keys[123].decode()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"opening the index allocated {peak >> 10} KiB"
    assert reads == [5 * 512, 1_999_999 * 512, "123"] and skipped == [] and stamp == b"\x01" * 32
    assert all(_mapped(getattr(flat, name)) for name in ("keys", "member_offset", "member_start"))


def test_a_mapped_index_pickles_as_its_path_not_its_arrays(tmp_path: Path) -> None:
    from stager.shards.loader_index import _save_flat

    path = tmp_path / "dataset.index"
    _save_flat(path, b"\x02" * 32, _big_index(200_000), [])
    flat, _, _ = open_dataset_index(path)
    payload = pickle.dumps(flat)
    assert len(payload) < 1000, "a spawned worker must map the file, not receive a copy"
    again = pickle.loads(payload)
    assert _mapped(again.member_offset)
    assert np.array_equal(again.member_offset[:10], flat.member_offset[:10])
    in_memory = _big_index(2000)
    assert pickle.loads(pickle.dumps(in_memory)).keys.tolist() == in_memory.keys.tolist()


def test_build_flat_index_maps_what_it_wrote_and_rebuilds_a_damaged_file(tmp_path: Path) -> None:
    shards = write_synthetic_dataset(
        tmp_path / "ds", SyntheticSpec(num_shards=3, samples_per_shard=7, uneven=True)
    )
    cache = tmp_path / "ds" / ".stager" / "index"
    built, _ = build_flat_index(shards, cache_dir=cache)
    keys = built.keys.tolist()
    assert dataset_index_path(cache).is_file()
    assert _mapped(built.member_offset), "the process that built it reads the shared file too"
    raw = dataset_index_path(cache).read_bytes()
    damaged = cache / "damaged"
    damaged.write_bytes(raw[:100])
    damaged.replace(dataset_index_path(cache))  # a new file: `built` keeps its mapping
    rebuilt, _ = build_flat_index(shards, cache_dir=cache)
    assert rebuilt.keys.tolist() == keys == built.keys.tolist()
    assert dataset_index_path(cache).read_bytes() == raw
    in_memory, _ = build_flat_index(shards)  # no cache directory: arrays in memory
    assert in_memory.source is None and in_memory.keys.tolist() == built.keys.tolist()


@pytest.mark.parametrize("promised", [2**63, 2**64 + 5, 8])
def test_a_count_past_int64_is_a_mismatch_not_a_crash(tmp_path: Path, promised: int) -> None:
    # A manifest may promise any integer; the index's key must take it, and the count must be
    # refused as a mismatch (or the shard left out with on_error="skip"), as any wrong count is.
    shards = write_synthetic_dataset(
        tmp_path / "ds", SyntheticSpec(num_shards=3, samples_per_shard=7)
    )
    relpaths = [p.name for p in shards]
    cache = tmp_path / "ds" / ".stager" / "index"
    expected: list[int | None] = [7, promised, None]
    with pytest.raises(IntegrityError, match=f"manifest says {promised}"):
        build_flat_index(shards, relpaths=relpaths, expected_samples=expected, cache_dir=cache)
    flat, skipped = build_flat_index(
        shards, relpaths=relpaths, expected_samples=expected, cache_dir=cache, on_error="skip"
    )
    assert skipped == [relpaths[1]] and flat.shard_samples.tolist() == [7, 0, 7]


_KEYS = st.sampled_from(["a", "s0001", "x" * 40, "d/e/k9", "s0001"])
_EXTS = st.sampled_from(["jpg", "cls", "json", "seg.png", "txt"])
_SHARD = st.lists(st.tuples(_KEYS, _EXTS, st.integers(0, 700)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(shards=st.lists(_SHARD, max_size=6))
def test_joining_walks_column_by_column_equals_flattening_each_index(
    shards: list[list[tuple[str, str, int]]],
) -> None:
    """stage-in's finish joins the compiled walks' bytes (flatten_walks); the loader flattens a
    TarIndex per shard (flatten). Over shards that differ in key width, extension sets and
    their order, and empty shards, both must give the same index, array for array."""
    from stager.shards.flatindex import flatten, flatten_walks

    assert tarnative.available(), "the compiled walk is not built (pip install -e .)"
    walks = []
    for members in shards:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for key, ext, size in members:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes(size)))
        walker = tarnative.native_walk()
        assert walker is not None
        walker.feed(buffer.getvalue())
        parts = walker.finish()
        assert parts is not None, "plain ASCII names: the walk must vouch"
        walks.append(parts)
    joined = flatten_walks(walks)
    each = flatten([tarnative.to_index(parts) for parts in walks])
    assert joined.ext_names == each.ext_names
    for name in _ARRAYS:
        got, want = getattr(joined, name), getattr(each, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


@pytest.mark.parametrize("mixed", [False, True], ids=["all-walked", "one-not-ascii"])
def test_stage_in_writes_the_index_the_loader_would_build(tmp_path: Path, mixed: bool) -> None:
    """The index stage-in writes from the bytes in flight (joined walks, or TarIndexes where
    a shard's names sent it to the slower indexers) is the one the loader builds itself."""
    from stager.shards.indexkey import dataset_key
    from stager.shards.loader_index import _CACHE_VERSION
    from stager.slurm import SlurmEnv
    from stager.stagein.run import StageInOptions, stage_in
    from stager.storage.sources import resolve_source

    source = tmp_path / "ds"
    source.mkdir()
    layouts = [
        ("s", ["jpg", "cls"]),
        ("longer-key-", ["cls", "json"]),
        ("é" if mixed else "t", ["txt"]),
    ]
    for number, (prefix, exts) in enumerate(layouts):
        with tarfile.open(source / f"shard-{number}.tar", "w", format=tarfile.PAX_FORMAT) as tar:
            for sample in range(3):
                for ext in exts:
                    info = tarfile.TarInfo(f"{prefix}{sample}.{ext}")
                    info.size = 10 + sample
                    tar.addfile(info, io.BytesIO(bytes(info.size)))
    options = StageInOptions(dest_root=tmp_path / "scratch", progress="none", jitter_max_s=0)
    report = stage_in(resolve_source(str(source)), options, slurm=SlurmEnv.from_environ({}))
    staged = Path(report.dataset_dir)
    written, _, stamp = open_dataset_index(dataset_index_path(staged / ".stager" / "index"))
    shards = sorted(staged.glob("*.tar"))
    relpaths = [p.name for p in shards]
    built, _ = build_flat_index(shards, relpaths=relpaths, expected_samples=[3, 3, 3])
    assert stamp == dataset_key(shards, relpaths, [3, 3, 3], "raise", version=_CACHE_VERSION)
    assert written.ext_names == built.ext_names
    for name in _ARRAYS:
        assert np.array_equal(getattr(written, name), getattr(built, name)), name
    assert written.keys[-1].decode() == ("é2" if mixed else "t2")


def test_more_extensions_than_int16_holds_are_indexed_not_a_crash() -> None:
    """Two shards of 17,000 distinct extensions each: 34,000 codes need int32 (an int16 table
    raised OverflowError and stage-in ended with a traceback and no manifest)."""
    from stager.shards.flatindex import flatten, flatten_walks

    walks = []
    for prefix in ("a", "b"):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for number in range(17_000):
                tar.addfile(tarfile.TarInfo(f"k{number}.{prefix}{number}"), io.BytesIO())
        walker = tarnative.native_walk()
        assert walker is not None
        walker.feed(buffer.getvalue())
        parts = walker.finish()
        assert parts is not None
        walks.append(parts)
    joined = flatten_walks(walks)
    each = flatten([tarnative.to_index(parts) for parts in walks])
    assert joined.member_ext.dtype == each.member_ext.dtype == np.int32
    for name in _ARRAYS:
        assert np.array_equal(getattr(joined, name), getattr(each, name)), name
    assert joined.ext_names[int(joined.member_ext[-1])] == "b16999"


@pytest.mark.parametrize("compiled", [True, False], ids=["stat-runs", "os-stat"])
def test_the_dataset_key_stats_what_it_is_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Rows not given are stat'ed (in runs, past one run's 4,096 paths): the key equals the one
    made from ``os.stat`` rows, and a shard gone raises FileNotFoundError naming it."""
    from stager.shards import indexkey
    from stager.storage import statmany

    if not compiled:
        monkeypatch.setattr(statmany, "_module", None)
    shards = []
    for number in range(indexkey._RUN + 7):
        path = tmp_path / f"{number:05d}.tar"
        path.write_bytes(bytes(number % 13))
        shards.append(str(path))
    relpaths = [os.path.basename(p) for p in shards]
    counts = [1] * len(shards)
    rows = [(os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in shards]
    want = indexkey.dataset_key(shards, relpaths, counts, "raise", rows, version=1)
    assert indexkey.dataset_key(shards, relpaths, counts, "raise", version=1) == want
    some = [row if number % 3 else None for number, row in enumerate(rows)]
    assert indexkey.dataset_key(shards, relpaths, counts, "raise", some, version=1) == want
    # taken ahead on a thread (stage-in's finish), the same rows
    ahead = indexkey.StatsAhead(shards).rows()
    assert indexkey.dataset_key(shards, relpaths, counts, "raise", ahead, version=1) == want
    os.utime(shards[-2], ns=(1, 1))
    assert indexkey.dataset_key(shards, relpaths, counts, "raise", version=1) != want
    os.unlink(shards[-1])
    with monkeypatch.context() as patched:  # (a job at its process limit)
        patched.setattr(indexkey.threading.Thread, "start", _no_thread)
        unstarted = indexkey.StatsAhead(shards).rows()
    for stats in (None, indexkey.StatsAhead(shards).rows(), unstarted):  # (ahead: rows None)
        assert stats is None or stats == [None] * len(shards)
        with pytest.raises(FileNotFoundError) as raised:
            indexkey.dataset_key(shards, relpaths, counts, "raise", stats, version=1)
        assert raised.value.filename == shards[-1]


def _no_thread(self: object) -> None:
    raise RuntimeError("can't start new thread")
