"""The columns file of a staged manifest or a background plan: a rank's start (and every read
of a plan) maps it instead of parsing the JSON, and it never gives other columns than the
manifest it stands beside (stager.shards.manifestcolumns)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.layout import StagedDataset
from stager.shards import manifestcolumns
from stager.shards.manifest import Manifest, ManifestEntry, read_columns
from stager.shards.manifestcolumns import bytes_key, cached_columns, columns_path, save_columns
from stager.shards.packedstrings import PackedStrings
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager_loaders import LoaderOptions, ShardedLoader

from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--quiet"]

# canonical relative paths: parts of any characters but "/", "\\" and NUL, none "." or "..",
# lone surrogates (a name's undecodable bytes) and other scripts included
_PART = st.text(
    alphabet=st.characters(codec=None, exclude_characters="/\\\0"), min_size=1, max_size=6
).filter(lambda p: p not in (".", "..") and not p.startswith(".."))
_RELPATH = (
    st.lists(_PART, min_size=1, max_size=3)
    .map("/".join)
    .filter(lambda p: not p.endswith(".partial") and not (len(p) > 1 and p[1] == ":"))
)
_ROWS = st.lists(
    st.tuples(_RELPATH, st.integers(0, 2**62), st.none() | st.integers(0, 2**40)),
    max_size=20,
    unique_by=lambda row: row[0],
)
_META = st.dictionaries(st.text(max_size=5), st.text(max_size=8), max_size=3)


def _write(staged: StagedDataset, rows: list[tuple[str, int, int | None]], meta: dict) -> None:
    entries = tuple(ManifestEntry(rel, size, None, samples) for rel, size, samples in rows)
    staged.meta_dir.mkdir(parents=True, exist_ok=True)
    Manifest(entries, meta).write(staged.manifest_path)


def staged_columns(staged: StagedDataset):
    return cached_columns(staged.manifest_path, staged.index_dir)


def load_columns(manifest_path: Path, index_dir: Path):
    return manifestcolumns.load_columns(manifest_path, columns_path(index_dir))


def _as_lists(columns) -> tuple[list[str], list[int], list[int | None], dict[str, str]]:
    return list(columns.relpaths), list(columns.sizes), list(columns.samples), dict(columns.meta)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=_ROWS, meta=_META, later=_ROWS)
def test_the_columns_file_reads_back_its_manifest_and_no_other(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    rows: list[tuple[str, int, int | None]],
    meta: dict[str, str],
    later: list[tuple[str, int, int | None]],
) -> None:
    """Written by a loader that parsed the manifest (any dataset size here), it gives the very
    columns the JSON gives, paths of any script and undecodable names included; once the
    manifest is replaced by another, the new one is parsed, never the old columns read."""
    monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", 0)
    staged = StagedDataset(tmp_path_factory.mktemp("scratch"), "ds")
    _write(staged, rows, meta)
    want = _as_lists(read_columns(staged.manifest_path))
    assert _as_lists(staged_columns(staged)) == want  # parsed, and its columns file written
    assert columns_path(staged.index_dir).is_file()
    mapped = load_columns(staged.manifest_path, staged.index_dir)
    assert mapped is not None
    columns = staged_columns(staged)  # from the columns file
    assert isinstance(columns.relpaths, PackedStrings)
    assert _as_lists(columns) == want
    _write(staged, later, {**meta, "source": "elsewhere"})
    assert load_columns(staged.manifest_path, staged.index_dir) is None
    assert _as_lists(staged_columns(staged)) == _as_lists(read_columns(staged.manifest_path))


def test_columns_keyed_by_bytes_it_was_not_made_from_are_never_read(tmp_path: Path) -> None:
    """The key is of the bytes parsed, not of the file as it is when the columns are written:
    a loader that parsed a manifest a stage-in then replaced writes columns no start reads."""
    staged = StagedDataset(tmp_path, "ds")
    _write(staged, [("a.tar", 1, 1)], {})
    old_key = bytes_key(staged.manifest_path.read_bytes())
    _write(staged, [("b.tar", 2, 2)], {})  # replaced meanwhile
    save_columns(old_key, columns_path(staged.index_dir), ["a.tar"], [1], [1], {})
    assert load_columns(staged.manifest_path, staged.index_dir) is None
    assert list(staged_columns(staged).relpaths) == ["b.tar"]


@pytest.mark.parametrize(
    "damage",
    ["cut", "garbage", "climbs out", "absolute", "count", "unknown version", "meta of ints"],
)
def test_a_damaged_columns_file_is_passed_by(tmp_path: Path, damage: str) -> None:
    """A columns file cut short, not ours, or whose paths climb out of the copy is not read: the
    manifest is parsed instead (and no path outside the copy is ever named)."""
    staged = StagedDataset(tmp_path, "ds")
    rows = [("d/a.tar", 10, 1), ("d/b.tar", 20, 2)]
    _write(staged, rows, {"source": "/nfs/ds"})
    key = bytes_key(staged.manifest_path.read_bytes())
    relpaths, sizes, samples = ["d/a.tar", "d/b.tar"], [10, 20], [1, 2]
    meta: dict = {"source": "/nfs/ds"}
    if damage == "climbs out":
        relpaths = ["../a.tar", "d/b.tar"]
    elif damage == "absolute":
        relpaths = ["/etc/passw", "d/b.tar"]  # (as long as d/a.tar, but one byte)
    elif damage == "count":
        samples = [1]
    elif damage == "meta of ints":
        meta = {"source": 3}
    save_columns(key, columns_path(staged.index_dir), relpaths, sizes, samples, meta)
    path = columns_path(staged.index_dir)
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:-20])
    elif damage == "garbage":
        path.write_bytes(os.urandom(300))
    elif damage == "unknown version":
        monkeypatched = path.read_bytes().replace(b'"version": 1', b'"version": 9')
        path.write_bytes(monkeypatched)
    assert load_columns(staged.manifest_path, staged.index_dir) is None
    assert _as_lists(staged_columns(staged)) == _as_lists(read_columns(staged.manifest_path))


def test_stage_in_writes_the_columns_and_the_loader_reads_them_not_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage-in of at least COLUMNS_FROM shards (lowered here) leaves the columns file; a
    loader then starts without parsing the manifest and reads every sample it would have."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=5, samples_per_shard=3, seed=4))
    dest = tmp_path / "scratch"
    monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", 3)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    staged = StagedDataset(dest, "ds")
    assert load_columns(staged.manifest_path, staged.index_dir) is not None

    def no_parse(text: str) -> None:
        raise AssertionError("the manifest was parsed although its columns file is current")

    read = manifestcolumns.read_columns

    def no_read(path: Path):  # noqa: ANN202 - (read_columns of a missing plan says it is gone)
        if Path(path).exists():
            no_parse("")
        return read(path)

    with monkeypatch.context() as patched:
        patched.setattr(manifestcolumns, "parse_columns", no_parse)
        patched.setattr(manifestcolumns, "read_columns", no_read)
        loader = ShardedLoader(
            str(src), batch_size=2, options=LoaderOptions(dest=str(dest), world_size=1)
        )
        keys = sorted(k for batch in loader for k in batch["__key__"])
    assert loader.shards.from_source == 0
    assert len(keys) == 15 == len(set(keys))
    reference = ShardedLoader(
        str(src), batch_size=2, options=LoaderOptions(dest=str(tmp_path / "none"), world_size=1)
    )
    assert keys == sorted(k for batch in reference for k in batch["__key__"])
    # a manifest rewritten by hand (one shard's count changed): the columns are not used
    manifest = json.loads(staged.manifest_path.read_text())
    manifest["shards"][0]["samples"] = 99
    staged.manifest_path.write_text(json.dumps(manifest))
    assert load_columns(staged.manifest_path, staged.index_dir) is None
    assert staged_columns(staged).samples[0] == 99


def test_small_datasets_get_no_columns_file(tmp_path: Path) -> None:
    """Below COLUMNS_FROM shards the JSON parses in milliseconds: no file is written."""
    staged = StagedDataset(tmp_path, "ds")
    _write(staged, [(f"s{i}.tar", i, i) for i in range(5)], {})
    staged_columns(staged)
    assert manifestcolumns.COLUMNS_FROM > 5
    assert not columns_path(staged.index_dir).exists()


def test_a_large_plans_columns_carry_its_hashes_and_every_read_maps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage-in --background plan of at least COLUMNS_FROM shards (lowered here) gets its
    columns file, digests included: read_plan (the loader's, and --wait-first's polls) maps it
    without parsing the plan, and a worker's fetch still checks the plan's hash. A plan
    replaced by hand is parsed, never read from the older columns."""
    import stager.stagein.status as status
    from stager.errors import HashMismatch

    from .test_loader_background_fetch import _plan_without_copier, _worker_gate

    monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", 2)
    src, staged = _plan_without_copier(tmp_path)
    plan = Manifest.read(staged.staging_path)
    assert columns_path(staged.index_dir, manifestcolumns.PLAN_COLUMNS_NAME).is_file()

    def no_parse(text: str) -> None:
        raise AssertionError("the plan was parsed although its columns file is current")

    with monkeypatch.context() as patched:
        patched.setattr(manifestcolumns, "parse_columns", no_parse)
        loaded = status.read_plan(staged)
        assert loaded is not None
        columns, facts = loaded
        assert list(columns.relpaths) == [e.relpath for e in plan.entries]
        assert list(columns.sizes) == [e.size for e in plan.entries]
        assert list(columns.samples) == [e.samples for e in plan.entries]
        assert columns.hashes is not None
        assert list(columns.hashes) == [e.hash for e in plan.entries]
        assert facts.run_id == "r1"
        gate = _worker_gate(staged)
    relpath = gate.relpaths[1].decode()
    with open(src / relpath, "r+b") as handle:  # changed since the plan, at the same size
        handle.seek(2048)
        handle.write(b"\xff" * 64)
    with pytest.raises(HashMismatch):
        gate.fetch(1)
    # the plan rewritten by hand (another run id): parsed, its new facts read
    text = staged.staging_path.read_text().replace('"run_id": "r1"', '"run_id": "r2"')
    staged.staging_path.write_text(text)
    loaded = status.read_plan(staged)
    assert loaded is not None and loaded[1].run_id == "r2"


@pytest.mark.parametrize("craft", ["float starts", "unsigned starts", "header a list"])
def test_a_columns_file_with_the_right_key_but_other_types_is_passed_by(
    tmp_path: Path, craft: str
) -> None:
    """Arrays of another type than written (unsigned starts wrap np.diff's check and gave items
    holding a NUL; float starts cannot index) or a footer of another shape: passed by, never a
    traceback, and the manifest's own paths read."""
    import numpy as np

    from stager.shards.arrayfile import RawArray, write_arrays

    staged = StagedDataset(tmp_path, "ds")
    _write(staged, [("a.tar", 1, 1), ("b.tar", 1, 1), ("c.tar", 1, 1)], {"source": "/x"})
    header: dict = {"format": "stager-manifest-columns", "version": 1, "meta": {"source": "/x"}}
    header["key"] = bytes_key(staged.manifest_path.read_bytes())
    starts: object = RawArray("<i8", np.asarray([0, 6, 12, 18], "<i8").tobytes())
    if craft == "float starts":
        starts = RawArray("<f8", np.asarray([0, 6, 12, 18], "<f8").tobytes())
    elif craft == "unsigned starts":
        starts = RawArray("<u8", np.asarray([0, 12, 6, 18], "<u8").tobytes())
    ones = RawArray("<i8", np.ones(3, "<i8").tobytes())
    arrays = {"paths": RawArray("|u1", b"a.tar\0b.tar\0c.tar\0"), "starts": starts}
    path = columns_path(staged.index_dir)
    write_arrays(path, {**arrays, "sizes": ones, "samples": ones}, header)
    if craft == "header a list":  # (the footer's whole meta: write_arrays takes only a dict)
        data = path.read_bytes()
        length = int.from_bytes(data[-8:], "little")
        footer = json.loads(data[-8 - length : -8])
        footer["meta"] = ["x"]
        text = json.dumps(footer).encode()
        path.write_bytes(data[: -8 - length] + text + len(text).to_bytes(8, "little"))
    assert load_columns(staged.manifest_path, staged.index_dir) is None
    assert list(staged_columns(staged).relpaths) == ["a.tar", "b.tar", "c.tar"]


def test_a_manifest_size_past_int64_is_a_shard_not_whole_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A staged manifest edited by hand to a size no file has (2**64): the shard is read from
    the source, as before the columns file and the compiled stats (an OverflowError)."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=2, seed=6))
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    manifest = StagedDataset(dest, "ds").manifest_path
    edited = json.loads(manifest.read_text())
    edited["shards"][1]["size"] = 2**64
    manifest.write_text(json.dumps(edited))
    for threshold in (0, 10**9):  # (the loader writes a columns file, or not)
        monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", threshold)
        options = LoaderOptions(dest=str(dest), world_size=1)
        loader = ShardedLoader(str(src), batch_size=2, options=options)
        assert loader.shards.from_source == 1
        assert sum(len(batch["__key__"]) for batch in loader) == 8


def test_stage_in_leaves_no_columns_file_no_reader_would_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun that shrank the copy below COLUMNS_FROM removes the earlier run's file, and names
    a reader refuses (a backslash) get none: each would only make every reader hash the
    manifest for nothing."""
    clean_process_env(monkeypatch)
    monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", 3)
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=2, seed=7))
    dest = tmp_path / "scratch"
    staged = StagedDataset(dest, "ds")
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    assert columns_path(staged.index_dir).is_file()
    for tar in sorted(src.glob("*.tar"))[2:]:
        tar.unlink()
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    assert not columns_path(staged.index_dir).exists()
    odd = tmp_path / "src" / "odd"
    write_synthetic_dataset(odd, SyntheticSpec(num_shards=4, samples_per_shard=2, seed=8))
    first = sorted(odd.glob("*.tar"))[0]
    first.rename(first.with_name("a\\b.tar"))
    assert run_main(capsys, "stage-in", str(odd), "--dest", str(dest), *FAST).returncode == 0
    odd_staged = StagedDataset(dest, "odd")
    assert (odd_staged.dir / "a\\b.tar").is_file()
    assert not columns_path(odd_staged.index_dir).exists()


def test_a_discarded_plan_takes_its_columns_file_along(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain --cache run after a background one discards the plan: its columns file went
    unremoved, stayed in the copy's index for good, and the cache kept it (keep_index) and
    gave it back to every later copy of the dataset."""

    from .inproc import clean_process_env, run_main
    from .test_loader_background_fetch import _plan_without_copier

    clean_process_env(monkeypatch)
    monkeypatch.setattr(manifestcolumns, "COLUMNS_FROM", 2)
    src, staged = _plan_without_copier(tmp_path)
    plan_columns = columns_path(staged.index_dir, manifestcolumns.PLAN_COLUMNS_NAME)
    assert plan_columns.is_file()
    cache = tmp_path / "scratch" / "cache"
    argv = ["--dest", str(staged.dir.parent), "--cache", str(cache), "--jitter-max", "0"]
    result = run_main(capsys, "stage-in", str(src), *argv, "--quiet")
    assert result.returncode == 0, result.stderr
    assert not staged.staging_path.exists() and not plan_columns.exists()
    assert not list(cache.rglob(manifestcolumns.PLAN_COLUMNS_NAME))


def test_a_staged_shard_touched_past_2262_is_read_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A staged shard whose mtime is past int64's nanoseconds (`touch -d 2300-01-01`) made
    every loader start raise OverflowError (the index key's int64 times): it is read from the
    copy, its time held at int64's end."""
    import subprocess

    clean_process_env(monkeypatch)
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=2, seed=9))
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    shard = sorted(StagedDataset(dest, "ds").dir.glob("*.tar"))[1]
    subprocess.run(["touch", "-d", "2300-01-01", str(shard)], check=True)
    for _ in range(2):  # (the index rebuilt, then found by its key)
        loader = ShardedLoader(
            str(src), batch_size=2, options=LoaderOptions(dest=str(dest), world_size=1)
        )
        assert loader.shards.from_source == 0
        assert sum(len(batch["__key__"]) for batch in loader) == 6
