"""The compiled byte pump (stager/storage/_bytepump.c) against the Python pieces it replaces on
the copy path: xxhash's xxh3_64 for the digest, ``TarWalker.feed`` for the walk, and the
destination's bytes, over random files, tars and block sizes; and its errors."""

from __future__ import annotations

import mmap
import os
import sys
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

from .trees import tar_bytes

pytestmark = pytest.mark.skipif(
    not bytepath.available(), reason="the byte pump was not built (no C compiler)"
)


def _pump(walker: TarWalker | None = None):
    pump = bytepath.new_pump("xxh3_64", None)
    return type(pump)(walker)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What the pump reports of a file: its inode, then mtime and ctime in seconds and
    nanoseconds apart."""
    return (st.st_ino, *divmod(st.st_mtime_ns, 10**9), *divmod(st.st_ctime_ns, 10**9))


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    return tar_bytes(members, tarfile.GNU_FORMAT)


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
            moved, ended, lag_s, end = pump.move(src_fd, dst_fd, buffer, want, piece)
            calls += 1
            assert 0 <= moved <= want and lag_s >= 0.0
            moved_total += moved
            if ended:
                assert end == (_identity(os.stat(src)), len(data))
                break
            assert moved == want and end is None  # a call stops short only at the end
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
    bare = type(pump).__new__(type(pump))  # (without __init__: still usable, not a crash)
    assert bare.hexdigest() == xxhash.xxh3_64_hexdigest(b"")


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


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_begin_opens_both_files_and_moves_the_first_block(tmp_path: Path) -> None:
    src, partial = tmp_path / "src", tmp_path / "out.partial"
    src.write_bytes(b"y" * 5000)
    before = _open_fds()
    pump = _pump()
    src_fd, dst_fd, opened, first_lag_s, (moved, ended, lag_s, end) = pump.begin(
        str(src), str(partial), mmap.mmap(-1, 4096), 1000, 3000, 4096
    )
    assert opened == _identity(os.stat(src))
    assert (moved, ended, end) == (3000, False, None) and first_lag_s >= lag_s >= 0
    assert pump.move(src_fd, dst_fd, mmap.mmap(-1, 4096), 10_000, 4096)[:2] == (2000, True)
    os.close(src_fd)
    os.close(dst_fd)
    # a file that ends within the call: its source is closed there (-1), the partial is not
    partial.unlink()
    src_fd, dst_fd, _, _, (moved, ended, _, end) = _pump().begin(
        str(src), str(partial), mmap.mmap(-1, 8192), 1000, 8192, 4096
    )
    assert (src_fd, moved, ended) == (-1, 5000, True) and end[-1] == 5000
    os.close(dst_fd)
    assert partial.read_bytes() == src.read_bytes() and _open_fds() == before
    assert pump.hexdigest() == xxhash.xxh3_64_hexdigest(src.read_bytes())


def test_begin_refuses_with_nothing_open_where_an_open_or_the_check_fails(tmp_path: Path) -> None:
    """The caller then opens the slow way, which names the problem (tests/test_trust.py and
    tests/test_hostile_stage_in.py hold those messages)."""
    good = tmp_path / "good"
    good.write_bytes(b"z" * 100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    cases = [
        (tmp_path / "missing", tmp_path / "a.partial"),
        (good, tmp_path / "no-such-dir" / "d.partial"),
        (good, tmp_path),  # the partial's name is a directory
    ]
    if os.geteuid() != 0:  # (root writes anywhere)
        cases.append((good, read_only / "e.partial"))
    before = _open_fds()
    walker = TarWalker()
    pump = _pump(walker)
    for src, partial in cases:
        assert pump.begin(str(src), str(partial), mmap.mmap(-1, 4096), 50, 100, 4096) is None
    # not regular: False, so that the caller refuses it without opening it again
    for src in (fifo, tmp_path, Path("/dev/null")):
        assert (
            pump.begin(str(src), str(tmp_path / "b.partial"), mmap.mmap(-1, 4096), 50, 100, 4096)
            is False
        )
    assert _open_fds() == before
    assert not list(tmp_path.glob("*.partial")) and walker.fed == 0
    begun = pump.begin(str(good), str(tmp_path / "f.partial"), mmap.mmap(-1, 4096), 50, 100, 4096)
    assert begun is not None and begun[4][:2] == (100, False)  # the pump is still usable
    os.close(begun[0])
    os.close(begun[1])


def test_begin_raises_the_open_audit_events_os_open_raises(tmp_path: Path) -> None:
    """Audit hooks (a site's, or a test's that watches which files a process reads) see the
    pump's opens as they saw the Python path's."""
    src, partial = tmp_path / "src", tmp_path / "out.partial"
    src.write_bytes(b"a" * 100)
    seen: list[bytes] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and isinstance(args[0], (str, bytes)):
            seen.append(os.fsencode(args[0]))

    sys.addaudithook(hook)  # (cannot be removed: it stops recording below)
    try:
        begun = _pump().begin(str(src), str(partial), mmap.mmap(-1, 4096), 50, 4096, 4096)
    finally:
        watching[0] = False
    os.close(begun[1])
    assert os.fsencode(src) in seen and os.fsencode(partial) in seen
