"""The in-flight sample counter agrees with tarfile on every format and chunking, or says None.

Random tars, damaged ones and embedded tars are in tests/test_tarscan.py (hypothesis); these
are the counter's own contract: chunking, ``finish`` with random access, ``index_tar``'s paths.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest

from stager.errors import IntegrityError
from stager.shards.tarindex import count_samples
from stager.shards.tarparse import TarSampleCounter


def _tar(path: Path, fmt: int, long_names: bool) -> Path:
    rng = random.Random(7)
    with tarfile.open(path, "w", format=fmt) as tar:
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(9):
            for ext in ("cls", "jpg", "json"):
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 2000)))
                name = ("d" * 140 + "/" if long_names else "") + f"key{i:03d}.{ext}"
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1.5  # a float mtime forces PAX records
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths of an install without the compiled walk (no C compiler at install time)."""
    import stager.shards.tarnative as tarnative

    monkeypatch.setattr(tarnative, "_module", None)


@pytest.fixture(params=["native", "held", "scanned", "held_then_scanned"])
def hold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the counter takes the bytes: all seen by the compiled walk (the usual install), or
    without it: all held for the small-shard walk (the test tars are small), all fed to the
    scanner, or held until the tar outgrows the hold midway."""
    import stager.shards.tarnative as tarnative
    import stager.shards.tarparse as tarparse

    if request.param == "native":
        assert tarnative.available(), "the compiled walk is not built (pip install -e .)"
        return request.param
    monkeypatch.setattr(tarnative, "_module", None)
    limit = {"held": tarparse._HOLD_BYTES, "scanned": 0, "held_then_scanned": 5000}
    monkeypatch.setattr(tarparse, "_HOLD_BYTES", limit[request.param])
    return request.param


@pytest.fixture
def fast_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail where the counter falls back to tarfile: on tars tarfile writes, the walk or the
    scanner must vouch, however the bytes were held or chunked."""
    import stager.shards.tarparse as tarparse

    def refuse(*_args, **_kwargs):
        raise AssertionError("the counter fell back to tarfile")

    monkeypatch.setattr(tarparse, "index_with_tarfile", refuse)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("chunk", [1, 13, 512, 4096, 1 << 20])
def test_counts_like_tarfile_for_any_chunking(
    tmp_path: Path, fmt: int, chunk: int, hold: str, fast_only: None
) -> None:
    path = _tar(tmp_path / "s.tar", fmt, long_names=fmt != tarfile.USTAR_FORMAT)
    data = path.read_bytes()
    counter = _counted(data, chunk)
    assert counter.samples == count_samples(path) == 9


def _counted(data: bytes, chunk: int) -> TarSampleCounter:
    counter = TarSampleCounter()
    for start in range(0, len(data), chunk):
        counter.feed(data[start : start + chunk])
    counter.finish(lambda offset, nbytes: data[offset : offset + nbytes])
    return counter


@pytest.mark.parametrize("long_names", [True, False])
def test_truncated_or_corrupt_streams_give_none(
    tmp_path: Path, hold: str, long_names: bool
) -> None:
    path = _tar(tmp_path / "s.tar", tarfile.GNU_FORMAT, long_names=long_names)
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        header_at = tar.getmembers()[5].offset
    cut = _counted(data[: len(data) // 2], 4096)
    assert cut.samples is None and cut.index() is None
    garbled = bytearray(data)
    garbled[header_at + 130] ^= (
        0x01  # a size digit of a later header: its checksum no longer matches
    )
    bad = _counted(bytes(garbled), 4096)
    assert bad.samples is None


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_index_from_the_stream_equals_index_tar(
    tmp_path: Path, fmt: int, hold: str, fast_only: None
) -> None:
    from stager.shards.tarindex import (
        index_with_tarfile as index_tar,
    )  # the tarfile reference, not the fast path

    path = _tar(tmp_path / "s.tar", fmt, long_names=fmt != tarfile.USTAR_FORMAT)
    data = path.read_bytes()
    counter = _counted(data, 777)
    got, want = counter.index(), index_tar(path)
    assert got is not None
    assert got.keys == want.keys and got.exts == want.exts
    assert (
        got.offsets.tolist() == want.offsets.tolist() and got.sizes.tolist() == want.sizes.tolist()
    )
    assert got.member_start.tolist() == want.member_start.tolist()


def _same_index(got, want) -> None:
    assert got.keys == want.keys and got.exts == want.exts
    assert (
        got.offsets.tolist() == want.offsets.tolist() and got.sizes.tolist() == want.sizes.tolist()
    )
    assert got.member_start.tolist() == want.member_start.tolist()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("read", ["small", "whole", "walk", "map"])
def test_index_tar_fast_path_agrees_with_tarfile(
    tmp_path: Path, fmt: int, read: str, monkeypatch: pytest.MonkeyPatch, no_native: None
) -> None:
    import stager.shards.tarindex as tarindex
    import stager.shards.tarwalk as tarwalk

    if read != "small":  # past the small-shard walk's limit: the scanner's paths
        monkeypatch.setattr(tarwalk, "MAX_HEADERS", 0)
    if read in ("walk", "map"):  # past WHOLE_READ_BYTES: header by header, or mapped
        monkeypatch.setattr(tarindex, "WHOLE_READ_BYTES", 0)
        monkeypatch.setattr(tarindex, "_WALK_PROBE", 4)
        monkeypatch.setattr(tarindex, "_WALK_MIN_STRIDE", 0 if read == "walk" else 1 << 40)
    path = _tar(tmp_path / "s.tar", fmt, long_names=fmt != tarfile.USTAR_FORMAT)
    walks = []
    real_walk = tarindex._walk_headers
    monkeypatch.setattr(
        tarindex, "_walk_headers", lambda *a: walks.append(real_walk(*a)) or walks[-1]
    )
    fast = tarindex._index_fast(path)
    assert fast is not None  # the fast path vouched for it
    expected_walks = {"small": [], "whole": [], "walk": [True], "map": [False]}[read]
    assert [w is not None for w in walks] == expected_walks
    _same_index(fast, tarindex.index_with_tarfile(path))
    _same_index(tarindex.index_tar(path), fast)
    if read == "small":  # the walk vouches for plain names and hands the rest to the scanner
        data = path.read_bytes()
        walked = tarwalk.walk_tar(lambda offset, nbytes: data[offset : offset + nbytes])
        assert (walked is not None) == (fmt == tarfile.USTAR_FORMAT)


def test_fast_index_leaves_what_it_does_not_vouch_for_to_tarfile(tmp_path: Path) -> None:
    import stager.shards.tarindex as tarindex

    path = tmp_path / "g.tar"
    with tarfile.open(
        path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "made by git archive"}
    ) as tar:
        for ext in ("cls", "jpg"):
            info = tarfile.TarInfo(f"key000.{ext}")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    assert tarindex._index_fast(path) is None  # a global header: tarfile's job
    _same_index(tarindex.index_tar(path), tarindex.index_with_tarfile(path))
    assert tarindex.index_tar(path).num_samples == 1
    cut = tmp_path / "cut.tar"
    cut.write_bytes(path.read_bytes()[:1600])
    assert tarindex._index_fast(cut) is None
    with pytest.raises(IntegrityError, match="cut.tar"):
        tarindex.index_tar(cut)


def test_a_counter_made_while_numpy_imports_reads_the_copy_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_native: None
) -> None:
    """The first copies of a stage-in run before the scanner's import is done: they skip the
    bytes in flight and index the copy from the page cache at finish(), with the same result."""
    import threading

    import stager.shards.tarparse as tarparse

    path = _tar(tmp_path / "s.tar", tarfile.PAX_FORMAT, long_names=True)
    data = path.read_bytes()
    pending = threading.Event()
    monkeypatch.setattr(tarparse, "_imported", pending)
    monkeypatch.setattr(tarparse, "_start_import", lambda: None)  # the import is under way
    late = TarSampleCounter()
    for start in range(0, len(data), 1000):
        late.feed(data[start : start + 1000])
    reads: list[int] = []

    def read_at(offset: int, nbytes: int) -> bytes:
        reads.append(nbytes)
        return data[offset : offset + nbytes]

    threading.Timer(0.05, pending.set).start()  # the import finishes while finish() waits
    late.finish(read_at)
    assert sum(reads) >= len(data)  # the whole copy was read back
    _same_index(late.index(), _counted(data, 1000).index())


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_small_tar_the_walk_refuses_starts_the_import_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: int, no_native: None
) -> None:
    """A tar of at most 64 KiB never reaches the scanner while it is fed, so nothing starts
    numpy's import; one the walk does not vouch for (long names) must start it before waiting
    for it, or its copy thread waits forever (a background stage-in calls no load_scanner)."""
    import threading

    import stager.shards.tarparse as tarparse

    monkeypatch.setattr(tarparse, "_imported", threading.Event())
    monkeypatch.setattr(tarparse, "_import_started", threading.Lock())
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for i in range(3):
            for ext in ("cls", "jpg"):
                info = tarfile.TarInfo("d" * 140 + f"/key{i}.{ext}")  # a name the walk refuses
                info.size = 100
                tar.addfile(info, io.BytesIO(bytes(100)))
    data = buffer.getvalue()
    assert len(data) <= 64 << 10
    counter = TarSampleCounter()
    counter.feed(data)
    done = threading.Thread(
        target=counter.finish, args=(lambda at, n: data[at : at + n],), daemon=True
    )
    done.start()
    done.join(60)
    assert not done.is_alive(), "finish() waited for an import nothing had started"
    _same_index(counter.index(), _counted(data, 1000).index())


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("read", ["whole", "map"])
def test_index_tar_takes_the_compiled_walk_first(
    tmp_path: Path, fmt: int, read: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain WebDataset shards are indexed by the compiled walk, read whole or mapped, and the
    numpy scanner is never reached; the result is tarfile's."""
    import stager.shards.tarindex as tarindex
    import stager.shards.tarscan as tarscan

    def refuse(*_args, **_kwargs):
        raise AssertionError("the scanner ran where the compiled walk vouches")

    monkeypatch.setattr(tarscan, "scan_tar", refuse)
    monkeypatch.setattr(tarscan.TarScanner, "finish", refuse)
    if read == "map":
        monkeypatch.setattr(tarindex, "WHOLE_READ_BYTES", 0)
        monkeypatch.setattr(tarindex, "_WALK_PROBE", 4)
        monkeypatch.setattr(tarindex, "_WALK_MIN_STRIDE", 1 << 40)
        monkeypatch.setattr("stager.shards.tarwalk.MAX_HEADERS", 0)
    path = _tar(tmp_path / "s.tar", fmt, long_names=False)
    _same_index(tarindex._index_fast(path), tarindex.index_with_tarfile(path))


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_counter_the_compiled_walk_refuses_reads_the_copy_back(tmp_path: Path, fmt: int) -> None:
    """Names that are not printable ASCII are left to the scanner and tarfile: the counter
    reads the copy back at finish() and gives their answer."""
    from stager.shards.tarindex import index_with_tarfile

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tar:
        for i in range(3):
            for ext in ("cls", "jpg"):
                info = tarfile.TarInfo(f"\u00e9t\u00e9{i}.{ext}")
                info.size = 3
                tar.addfile(info, io.BytesIO(b"abc"))
    data = path.read_bytes()
    counter = TarSampleCounter()
    reads: list[int] = []
    for start in range(0, len(data), 4096):
        counter.feed(data[start : start + 4096])

    def read_at(offset: int, nbytes: int) -> bytes:
        reads.append(nbytes)
        return data[offset : offset + nbytes]

    counter.finish(read_at)
    assert sum(reads) >= len(data)
    _same_index(counter.index(), index_with_tarfile(path))


def test_a_plain_tar_under_a_gzip_name_says_to_rename_it(tmp_path: Path) -> None:
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    write_synthetic_dataset(tmp_path / "ds", SyntheticSpec(num_shards=1, samples_per_shard=2))
    plain = next((tmp_path / "ds").glob("*.tar"))
    misnamed = plain.rename(plain.with_suffix(".tgz"))
    with pytest.raises(IntegrityError, match=r"not gzip-compressed .* name it \*\.tar"):
        count_samples(misnamed)
