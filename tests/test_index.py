"""`stager index`: one parallel scan per dataset gives sizes, hashes and sample counts that
stage-in verifies against; corrupt shards are named (shard and member), never indexed."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

import stager.shards.manifest
from stager.cli.main import main
from stager.errors import EXIT_INTEGRITY, EXIT_SOURCE, EXIT_USAGE, IntegrityError
from stager.layout import StagedDataset
from stager.shards.build import IndexOptions, build_manifest, index_source
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.shards.tarindex import count_samples, count_samples_stream, index_tar
from stager.storage.hashing import hash_file
from stager.storage.sources import resolve_source
from stager.storage.statmany import stat_many_python

from .conftest import run_cli
from .faulty_fs import FaultyFileSystem
from .inproc import clean_process_env, run_main

SPEC = SyntheticSpec(num_shards=6, samples_per_shard=10, image_bytes=3000, uneven=True, seed=5)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index") / "ds"
    write_synthetic_dataset(root, SPEC)
    return root


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


@pytest.fixture()
def fresh(dataset: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    return copy


def test_index_writes_sizes_hashes_and_sample_counts_beside_the_dataset(fresh: Path) -> None:
    result = run_cli("stager", "index", str(fresh))
    assert result.returncode == 0, result.stderr
    assert "6 shards" in result.stderr and str(fresh / "stager-manifest.json") in result.stderr
    manifest = Manifest.read(fresh / "stager-manifest.json")
    shards = sorted(fresh.glob("*.tar"))
    assert [e.relpath for e in manifest.entries] == [p.name for p in shards]
    for entry, path, samples in zip(manifest.entries, shards, SPEC.shard_sizes(), strict=True):
        assert entry.size == path.stat().st_size
        assert entry.hash == hash_file(path, "xxh3_64")
        assert entry.samples == samples
    assert manifest.total_samples == sum(SPEC.shard_sizes())


def test_sha256_and_parquet_out(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "elsewhere" / "m.parquet"
    result = run_main(
        capsys, "stager", "index", str(fresh), "--hash", "sha256", "--out", str(out), "--jobs", "3"
    )
    assert result.returncode == 0, result.stderr
    manifest = Manifest.read(out)
    assert all(e.hash == hash_file(fresh / e.relpath, "sha256") for e in manifest.entries)
    assert all(e.hash.startswith("sha256:") for e in manifest.entries)
    assert not (fresh / "stager-manifest.json").exists()


def test_large_datasets_default_to_parquet(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stager.shards.manifest, "JSON_MAX_ENTRIES", 3)
    manifest, where, _ = index_source(resolve_source(str(fresh)))
    assert where == str(fresh / "stager-manifest.parquet")
    assert Manifest.read(where).entries == manifest.entries


def test_compressed_shards_are_counted_and_hashed_as_stored(tmp_path: Path) -> None:
    spec = SyntheticSpec(num_shards=3, samples_per_shard=7, image_bytes=500, compress=True)
    paths = write_synthetic_dataset(tmp_path / "gz", spec)
    manifest = build_manifest(resolve_source(str(tmp_path / "gz")))
    assert [e.samples for e in manifest.entries] == [7, 7, 7]
    assert [e.hash for e in manifest.entries] == [hash_file(p) for p in paths]


def test_each_shard_is_read_once(dataset: Path) -> None:
    FaultyFileSystem.reset()
    build_manifest(resolve_source(f"faulty://{dataset}"), IndexOptions(jobs=4))
    opens = {k: v for k, v in FaultyFileSystem.counts().items() if k.startswith("open:")}
    assert len(opens) == SPEC.num_shards and set(opens.values()) == {1}


def test_stage_in_verifies_against_the_index_and_carries_its_sample_counts(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(capsys, "stager", "index", str(fresh)).returncode == 0
    dest = tmp_path / "scratch"
    result = run_main(
        capsys,
        "stage-in",
        str(fresh),
        "--dest",
        str(dest),
        "--no-count",
        "--jitter-max",
        "0",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    staged = Manifest.read(StagedDataset.of(dest / "ds").manifest_path)
    indexed = Manifest.read(fresh / "stager-manifest.json")
    # --no-count: the sample counts can only have come from the manifest
    # The staged manifest adds the source version each shard was copied from.
    assert all(e.version for e in staged.entries)
    assert [dataclasses.replace(e, version=None) for e in staged.entries] == list(indexed.entries)


def test_explicit_manifest_elsewhere_is_used(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    assert run_main(capsys, "stager", "index", str(fresh), "--out", str(out)).returncode == 0
    data = json.loads(out.read_text())
    data["shards"][0]["hash"] = "xxh3_64:0000000000000000"  # a manifest that disagrees
    out.write_text(json.dumps(data))
    result = run_main(
        capsys,
        "stage-in",
        str(fresh),
        "--dest",
        str(tmp_path / "s"),
        "--manifest",
        str(out),
        "--jitter-max",
        "0",
    )
    assert result.returncode == EXIT_INTEGRITY
    assert f"FAILED {fresh / 'train-000000.tar'}:" in result.stderr


def test_usage_and_source_errors(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["index", str(fresh), "--out", str(tmp_path / "m.txt")]) == EXIT_USAGE
    assert main(["index", str(fresh), "--jobs", "0"]) == EXIT_USAGE
    capsys.readouterr()
    assert main(["index", str(tmp_path / "nope")]) == EXIT_SOURCE
    assert "not found" in capsys.readouterr().err
    assert not list(tmp_path.rglob("stager-manifest.*"))


# -- corrupt and truncated tars ------------------------------------------------------------------
def _member_header_offset(path: Path, member: int) -> tuple[int, str, str]:
    """Byte offset of the header of member number ``member`` and the names around it."""
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    return members[member].offset, members[member - 1].name, members[member].name


def _count_streaming(path: Path) -> int:
    with open(path, "rb") as handle:
        return count_samples_stream(handle, str(path))


def test_corrupt_header_names_shard_and_member(
    fresh: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = fresh / "train-000001.tar"
    offset, before, _ = _member_header_offset(shard, 5)
    data = bytearray(shard.read_bytes())
    data[offset : offset + 100] = b"Z" * 100
    shard.write_bytes(bytes(data))
    for read in (index_tar, count_samples, _count_streaming):
        with pytest.raises(IntegrityError) as info:
            read(shard)
        assert str(shard) in str(info.value) and repr(before) in str(info.value)

    result = run_main(capsys, "stager", "index", str(fresh))
    assert result.returncode == EXIT_INTEGRITY
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and str(shard) in failed[0] and before in failed[0]
    assert not (fresh / "stager-manifest.json").exists()


@pytest.mark.parametrize("where", ["at a member boundary", "inside a member"])
def test_truncated_tar_names_shard_and_member(fresh: Path, where: str) -> None:
    shard = fresh / "train-000002.tar"
    offset, before, inside = _member_header_offset(shard, 4)
    cut = offset if where == "at a member boundary" else offset + 700
    shard.write_bytes(shard.read_bytes()[:cut])
    expected = before if where == "at a member boundary" else inside
    for read in (index_tar, _count_streaming):
        with pytest.raises(IntegrityError) as info:
            read(shard)
        assert str(shard) in str(info.value) and repr(expected) in str(info.value)
        if where == "at a member boundary":  # what can help: not a re-stage
            assert "without the end-of-archive blocks" in str(info.value)
            assert "re-stage" not in str(info.value) and "/dev/zero" in str(info.value)
            assert "re-run stager index where a manifest lists it" in str(info.value)


def test_a_corrupt_block_after_the_last_member_is_not_sent_to_a_re_stage(fresh: Path) -> None:
    """Staging checks every copy against its source: a shard found corrupt at staging is
    corrupt at its source, and the line says to re-create it (re-staging only helps where the
    staged copy was changed since)."""
    shard = fresh / "train-000002.tar"
    offset, before, _ = _member_header_offset(shard, 4)
    shard.write_bytes(shard.read_bytes()[:offset] + b"x" * 512 + bytes(1024))
    for read in (index_tar, _count_streaming):
        with pytest.raises(IntegrityError) as info:
            read(shard)
        message = str(info.value)
        assert repr(before) in message and "re-create this shard" in message
        assert "re-stage" not in message  # (re-staging is named only with when it helps)


def test_a_compressed_tar_without_end_blocks_is_not_told_to_append_zeros(fresh: Path) -> None:
    """Zeros appended to a gzip file would corrupt it: for a .tar.gz the line says to
    decompress first."""
    plain = fresh / "train-000002.tar"
    offset, before, _ = _member_header_offset(plain, 4)
    packed = fresh.parent / "cut.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()[:offset]))
    with pytest.raises(IntegrityError) as info:
        count_samples(packed)
    assert repr(before) in str(info.value)
    assert "decompress the source shard, append them" in str(info.value)
    assert ">> SHARD.tar) and compress it again" in str(info.value)


def test_a_tar_whose_end_blocks_are_appended_reads_whole(fresh: Path) -> None:
    """The advice for a tar that ends at a member boundary works: with two zero blocks
    appended, every member before the cut is read."""
    shard = fresh / "train-000002.tar"
    offset, before, _ = _member_header_offset(shard, 4)
    shard.write_bytes(shard.read_bytes()[:offset])
    with pytest.raises(IntegrityError):
        index_tar(shard)
    with open(shard, "ab") as handle:
        handle.write(bytes(1024))  # head -c 1024 /dev/zero >> SHARD
    with tarfile.open(shard) as tar:
        names = [m.name for m in tar.getmembers()]
    assert names[-1] == before and len(names) == 4
    assert index_tar(shard).num_samples == _count_streaming(shard) > 0


def test_truncated_gzip_shard_names_shard(tmp_path: Path) -> None:
    [path] = write_synthetic_dataset(
        tmp_path / "gz", SyntheticSpec(num_shards=1, samples_per_shard=5, compress=True)
    )
    raw = gzip.decompress(path.read_bytes())
    assert count_samples(path) == 5
    path.write_bytes(path.read_bytes()[:-12])  # the gzip trailer (CRC, length) and a little more
    with pytest.raises(IntegrityError, match=str(path)):
        count_samples(path)
    path.write_bytes(gzip.compress(raw[: len(raw) // 2]))  # a valid gzip of half a tar
    with pytest.raises(IntegrityError, match="after member 's00000-"):
        count_samples(path)


def test_stage_in_stats_only_the_shards_the_manifest_does_not_describe(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import stager.stagein.sizing
    import stager.storage.listing

    assert run_main(capsys, "stager", "index", str(fresh)).returncode == 0
    shutil.copyfile(fresh / "train-000000.tar", fresh / "train-extra.tar")  # added after indexing
    stat_calls: list[str] = []
    real_info = stager.storage.listing.stat_one
    monkeypatch.setattr(
        stager.storage.listing,
        "stat_one",
        lambda fs, path: stat_calls.append(path) or real_info(fs, path),
    )
    # shards not in the manifest are sized while they copy
    monkeypatch.setattr(
        stager.stagein.sizing,
        "_stat_run",
        lambda paths, budget_s: stat_many_python(
            paths, budget_s, stat=lambda path: stat_calls.append(path) or os.stat(path)
        ),
    )
    dest = tmp_path / "scratch"
    result = run_main(
        capsys, "stage-in", str(fresh), "--dest", str(dest), "--jitter-max", "0", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    assert [p for p in stat_calls if p.endswith(".tar")] == [str(fresh / "train-extra.tar")]
    assert "1 shard(s) are not in the manifest" in result.stderr
    staged = Manifest.read(StagedDataset.of(dest / "ds").manifest_path)
    assert {e.relpath: e.size for e in staged.entries} == {
        p.name: p.stat().st_size for p in fresh.glob("*.tar")
    }


def test_shard_whose_size_differs_from_the_manifest_fails_as_integrity_without_retries(
    fresh: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(capsys, "stager", "index", str(fresh)).returncode == 0
    shard = fresh / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-512])  # truncated after indexing
    report = tmp_path / "report.json"
    result = run_main(
        capsys,
        "stage-in",
        str(fresh),
        "--dest",
        str(tmp_path / "s"),
        "--jitter-max",
        "0",
        "--report",
        str(report),
    )
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    assert f"FAILED {shard}:" in result.stderr and "the manifest lists" in result.stderr
    assert json.loads(report.read_text())["retries"] == 0
    assert not (tmp_path / "s" / "ds" / shard.name).exists()


def test_a_sparse_member_is_refused_by_index_as_by_stage_in_and_the_loader(tmp_path: Path) -> None:
    """GNU tar's --sparse stores a member's bytes in pieces; the loader reads members by
    offset, so stage-in and the loader refuse such a shard. stager index wrote a manifest for
    it, exit 0, and every stage-in then failed the shard against that manifest."""
    import subprocess

    src, ds = tmp_path / "src", tmp_path / "ds"
    src.mkdir()
    ds.mkdir()
    with open(src / "0001.bin", "wb") as handle:
        handle.seek(1 << 20)
        handle.write(b"x")
    (src / "0001.cls").write_text("1")
    tar = ["tar", "--sparse", "--format=gnu", "-cf", str(ds / "a.tar"), "-C", str(src), "."]
    subprocess.run(tar, check=True)
    with tarfile.open(ds / "a.tar") as made:
        assert any(m.issparse() for m in made)  # (the tar is sparse)
    result = run_cli("stager", "index", str(ds))
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    assert "is a sparse file (tar --sparse)" in result.stderr
    assert not list(ds.glob("stager-manifest*"))
    staged = run_cli("stage-in", str(ds), "--dest", str(tmp_path / "s"), "--quiet")
    assert staged.returncode == EXIT_INTEGRITY and "sparse" in staged.stderr, staged.stderr


def test_bytes_appended_after_a_gzip_stream_are_named_as_such(tmp_path: Path) -> None:
    """A .tgz whose tar is whole, with bytes appended after its gzip stream, was refused as a
    "corrupt or truncated tar"; the refusal now says what is wrong with it."""
    import io

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name in ("0.jpg", "0.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    data = gzip.compress(raw.getvalue())
    assert count_samples_stream(io.BytesIO(data), "a.tgz", compressed=True) == 1
    with pytest.raises(IntegrityError, match="bytes after the end of its gzip stream"):
        count_samples_stream(io.BytesIO(data + b"junkjunk"), "a.tgz", compressed=True)
