"""The compiled byte pump (stager/storage/_bytepump.c) against the Python pieces it replaces on
the copy path: xxhash's xxh3_64 for the digest, ``TarWalker.feed`` for the walk, and the
destination's bytes, over random files, tars and block sizes; and its errors."""

from __future__ import annotations

import io
import mmap
import os
import tarfile
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.shards._tarwalk import TarWalker
from stager.shards.tarparse import TarSampleCounter
from stager.storage import bytepath
from stager.storage.copy import copy_file

pytestmark = pytest.mark.skipif(
    not bytepath.available(), reason="the byte pump was not built (no C compiler)"
)


def _pump(walker: TarWalker | None = None):
    pump = bytepath.new_pump("xxh3_64", None)
    return type(pump)(walker)


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


_members = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c/d", "e" * 120]),
        st.sampled_from(["jpg", "cls", "json"]),
        st.binary(max_size=3000),
    ),
    max_size=12,
)
_contents = st.one_of(
    st.binary(max_size=200_000),
    _members.map(lambda ms: _tar([(f"{k}{i // 2}.{e}", d) for i, (k, e, d) in enumerate(ms)])),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=_contents,
    buffer_bytes=st.sampled_from([512, 4096, 65536]),
    first=st.integers(1, 70_000),
    limit=st.integers(1, 300_000),
    piece=st.sampled_from([1, 511, 1 << 20]),
)
def test_moves_hashes_and_walks_as_the_python_path(
    tmp_path: Path, data: bytes, buffer_bytes: int, first: int, limit: int, piece: int
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(data)
    walker, reference = TarWalker(), TarWalker()
    reference.feed(data)
    pump = _pump(walker)
    buffer = mmap.mmap(-1, buffer_bytes)
    moved_total, calls = 0, 0
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        want = first
        while True:
            moved, ended, lag_s = pump.move(src_fd, dst_fd, buffer, want, piece)
            calls += 1
            assert 0 <= moved <= want and lag_s >= 0.0
            moved_total += moved
            if ended:
                break
            assert moved == want  # a call stops short only at the end of the file
            want = limit
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert moved_total == len(data) == walker.fed
    assert dst.read_bytes() == data
    assert pump.hexdigest() == xxhash.xxh3_64_hexdigest(data)
    assert walker.finish() == reference.finish()


def test_a_reset_pump_hashes_from_the_start() -> None:
    pump = _pump()
    pump.__init__()
    assert pump.hexdigest() == xxhash.xxh3_64_hexdigest(b"")


def test_read_and_write_errors_raise_oserror_with_their_errno(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x" * 10_000)
    buffer = mmap.mmap(-1, 4096)
    readable = os.open(src, os.O_RDONLY)
    write_only = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as read_error:  # reading a write-only descriptor
            _pump().move(write_only, write_only, buffer, 100, 4096)
        with pytest.raises(OSError) as write_error:  # writing a read-only one
            _pump().move(readable, readable, buffer, 100, 4096)
    finally:
        os.close(readable)
        os.close(write_only)
    assert read_error.value.errno == write_error.value.errno == 9  # EBADF


def test_bad_arguments_are_refused() -> None:
    buffer = mmap.mmap(-1, 4096)
    with pytest.raises(TypeError, match="TarWalker"):
        _pump(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _pump().move(0, 1, buffer, 0, 4096)
    with pytest.raises(TypeError):  # a read-only buffer cannot be read into
        _pump().move(0, 1, b"abc", 10, 4096)


def test_copy_file_indexes_a_shard_through_the_pump_as_through_feed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage-in path end to end: a TarSampleCounter whose compiled walk the pump feeds gives
    the same index as one fed by the Python path."""
    shard = tmp_path / "shard.tar"
    shard.write_bytes(
        _tar([(f"s{i:05d}.{ext}", os.urandom(700)) for i in range(3000) for ext in ("jpg", "cls")])
    )
    pumped = TarSampleCounter(str(shard))
    copy_file(None, str(shard), tmp_path / "a.tar", inspect=pumped, block_bytes=1 << 16)
    monkeypatch.setattr(bytepath, "_pump", None)
    fed = TarSampleCounter(str(shard))
    copy_file(None, str(shard), tmp_path / "b.tar", inspect=fed, block_bytes=1 << 16)
    assert pumped.samples == fed.samples == 3000
    a, b = pumped.index(), fed.index()
    assert a.keys == b.keys and a.exts == b.exts
    assert [x.tolist() for x in (a.member_start, a.offsets, a.sizes)] == [
        x.tolist() for x in (b.member_start, b.offsets, b.sizes)
    ]
