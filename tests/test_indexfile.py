"""stage-in's loader index, joined and written without numpy (stager.shards.indexfile).

The compiled join must give what the loader's numpy flatten gives for the same shards, array
for array and type for type, including where values pass 32 bits (the columns stay int64)
and extension codes pass a byte; and a whole stage-in must never import numpy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.shards import indexfile, tarnative
from stager.shards.flatindex import flatten
from stager.shards.loader_index import _ARRAYS, build_flat_index, open_dataset_index
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

pytestmark = pytest.mark.skipif(not tarnative.available(), reason="compiled walk not built")


def _walk(samples: list[tuple[str, list[tuple[str, int, int]]]]) -> dict:
    """A walk's ``finish()`` dict for samples of ``(key, [(ext, offset, size), ...])``, built
    by hand so that offsets and sizes can be as large as a shard of many GiB gives."""
    names: dict[str, int] = {}
    width = max([len(key) for key, _ in samples] + [1])
    starts, codes, offsets, sizes = [], [], [], []
    for _key, members in samples:
        starts.append(len(codes))
        for ext, offset, size in members:
            codes.append(names.setdefault(ext, len(names)))
            offsets.append(offset)
            sizes.append(size)
    starts.append(len(codes))
    return {
        "samples": len(samples),
        "key_bytes": b"".join(key.encode().ljust(width, b"\0") for key, _ in samples),
        "key_width": width,
        "member_start": np.asarray(starts, np.int64).tobytes(),
        "ext_names": tuple(names),
        "ext_codes": np.asarray(codes, np.int16).tobytes(),
        "offsets": np.asarray(offsets, np.int64).tobytes(),
        "sizes": np.asarray(sizes, np.int64).tobytes(),
        "duplicate": None,
    }


_VALUES = st.one_of(st.integers(0, 4096), st.integers(2**32 - 2, 2**40))
_MEMBER = st.tuples(st.sampled_from(["jpg", "cls", "json", "seg.png", "e" * 30]), _VALUES, _VALUES)
_SAMPLE = st.tuples(
    st.text("abc/-_0123456789", min_size=1, max_size=12), st.lists(_MEMBER, min_size=1, max_size=3)
)


@settings(max_examples=200, deadline=None)
@given(shards=st.lists(st.lists(_SAMPLE, max_size=5), max_size=5))
def test_the_compiled_join_equals_the_numpy_flatten(shards: list) -> None:
    walks = [_walk(samples) for samples in shards]
    columns, ext_names = indexfile.join_walks(walks)
    want = flatten([tarnative.to_index(walk) for walk in walks])
    assert ext_names == want.ext_names
    for name in _ARRAYS:
        got = np.frombuffer(columns[name].data, np.dtype(columns[name].dtype))
        expected = getattr(want, name)
        assert got.dtype == expected.dtype, name
        assert np.array_equal(got, expected), name


def test_more_than_256_extensions_take_wider_codes() -> None:
    walks = [_walk([(f"k{n}", [(f"x{n}", n, 1)]) for n in range(300)])]
    columns, names = indexfile.join_walks(walks)
    assert columns["member_ext"].dtype == "<i2" and len(names) == 300
    codes = np.frombuffer(columns["member_ext"].data, np.int16)
    assert codes.tolist() == list(range(300))


def test_a_walk_with_a_code_outside_its_table_is_refused_not_read_past() -> None:
    walk = _walk([("k", [("jpg", 0, 1)])])
    walk["ext_codes"] = np.asarray([5], np.int16).tobytes()
    with pytest.raises(ValueError, match="outside its table"):
        indexfile.join_walks([walk])
    walk = _walk([("k", [("jpg", 0, 1)])])
    walk["sizes"] = b""
    with pytest.raises(ValueError, match="differ in length"):
        indexfile.join_walks([walk])


@pytest.mark.parametrize(
    "damage",
    ["offsets not whole int64s", "key width past memory", "member starts out of order", "list"],
)
def test_malformed_walks_raise_rather_than_read_or_write_out_of_bounds(damage: str) -> None:
    """The join takes bytes from a dict: any inconsistency is a ValueError, never a write past
    a buffer (15 bytes of offsets and sizes) or a read at a wild pointer (a key width of 2**62
    whose product with the sample count wrapped to the length given)."""
    from stager.shards import _tarwalk  # type: ignore[attr-defined]

    walk = _walk([("a", [("jpg", 0, 1)]), ("b", [("jpg", 1, 1)])])
    if damage == "offsets not whole int64s":
        walk["offsets"] = walk["sizes"] = bytes(15)
        walk["ext_codes"] = bytes(2)
    elif damage == "key width past memory":
        walk["key_width"] = 2**62
        walk["member_start"] = np.asarray([0, 0, 0, 0, 0], np.int64).tobytes()
        walk["key_bytes"] = b""
        walk["offsets"] = walk["sizes"] = walk["ext_codes"] = b""
    elif damage == "member starts out of order":
        walk["member_start"] = np.asarray([0, 2, 1], np.int64).tobytes()
    table, bases = np.asarray([0], np.int32).tobytes(), np.zeros(1, np.int64).tobytes()
    if damage == "list":
        # a tuple of walks is taken as given (the join copies any sequence before reading it)
        got = _tarwalk.join_walks((walk,), table, bases, 1)
        assert got["key_width"] == 1
        return
    with pytest.raises(ValueError):
        _tarwalk.join_walks([walk], table, bases, 1)


@pytest.mark.parametrize("count", [4, 300])
def test_stage_in_never_imports_numpy_and_writes_the_loaders_index(
    tmp_path: Path, count: int
) -> None:
    """A whole stage-in (copies, counts, manifest, loader index) with the compiled walk runs
    without numpy, and the index it writes is the one the loader builds and accepts. 300
    shards: the finish takes the key's stats on a thread (``StatsAhead``, from 256)."""
    shards = write_synthetic_dataset(
        tmp_path / "ds", SyntheticSpec(num_shards=count, samples_per_shard=9)
    )
    code = (
        "import sys\n"
        "from stager.cli.main import stage_in_main\n"
        f"sys.argv = ['stage-in', {str(tmp_path / 'ds')!r}, '--dest', "
        f"{str(tmp_path / 'scratch')!r}, '--quiet']\n"
        "try:\n"
        "    stage_in_main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy')[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    staged = tmp_path / "scratch" / "ds"
    cache = staged / ".stager" / "index"
    written, _, stamp = open_dataset_index(cache / indexfile.DATASET_INDEX_NAME)
    relpaths = [p.name for p in shards]
    built, skipped = build_flat_index(
        [staged / r for r in relpaths], relpaths=relpaths, expected_samples=[9] * count
    )
    assert not skipped and written.ext_names == built.ext_names
    for name in _ARRAYS:
        assert np.array_equal(getattr(written, name), getattr(built, name)), name
    # and the loader takes it as current: built again with the cache, the file is unchanged
    before = (cache / indexfile.DATASET_INDEX_NAME).stat().st_mtime_ns
    build_flat_index(
        [staged / r for r in relpaths],
        relpaths=relpaths,
        expected_samples=[9] * count,
        cache_dir=cache,
    )
    assert (cache / indexfile.DATASET_INDEX_NAME).stat().st_mtime_ns == before


def test_a_shard_the_loader_scans_with_numpy_gets_the_same_index_as_stage_in_writes(
    tmp_path: Path,
) -> None:
    """Over 1 MiB of large members the loader indexes with the numpy scanner, which numbered
    extensions sorted (bin before txt) where the walk numbers them as they first appear."""
    import io
    import tarfile

    from stager.shards.loader_index import dataset_index_path
    from stager.slurm import SlurmEnv
    from stager.stagein.run import StageInOptions, stage_in
    from stager.storage.sources import resolve_source

    source = tmp_path / "ds"
    source.mkdir()
    with tarfile.open(source / "big.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for sample in range(40):
            for ext, size in (("txt", 10), ("bin", 70_000)):
                info = tarfile.TarInfo(f"s{sample:04d}.{ext}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes(size)))
    options = StageInOptions(dest_root=tmp_path / "scratch", progress="none", jitter_max_s=0)
    report = stage_in(resolve_source(str(source)), options, slurm=SlurmEnv.from_environ({}))
    staged = Path(report.dataset_dir)
    written, _, _ = open_dataset_index(dataset_index_path(staged / ".stager" / "index"))
    built, _ = build_flat_index([staged / "big.tar"], relpaths=["big.tar"], expected_samples=[40])
    assert written.ext_names == built.ext_names == ("txt", "bin")
    for name in _ARRAYS:
        got, want = getattr(written, name), getattr(built, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
