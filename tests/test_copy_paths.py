"""Every byte path of copy_file for local sources (buffered in Python; the compiled byte pump;
kernel copy + hashing through a mapping) keeps every guarantee: whole and verified under the
final name, the hash of the bytes, every byte handed to the inspector once and in order,
ScratchFull on a full disk with no ``.partial`` left, and the first/last-byte times the stream
controller reads."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from stager.errors import ScratchFull
from stager.shards._tarwalk import TarWalker
from stager.storage import bytepath
from stager.storage.bytepath import FIRST_READ_BYTES
from stager.storage.copy import HashMismatch, SizeMismatch, copy_file
from stager.storage.identity import local_version
from stager.storage.throttle import Throttle


@pytest.fixture(params=["buffered", "kernel", "pumped"])
def byte_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(bytepath, "KERNEL_COPY", request.param == "kernel")
    if request.param == "pumped":
        assert bytepath.available(), "stager/storage/_bytepump.c was not built: pip install -e ."
    else:
        monkeypatch.setattr(bytepath, "_pump", None)
    return request.param


class _Recorder:
    """An inspector that keeps what it was fed, and what ``read_at`` returns afterwards; on the
    pumped path it offers a compiled walk, which the pump feeds in ``feed``'s place."""

    def __init__(self, byte_path: str = "buffered") -> None:
        self.fed = bytearray()
        self.reread: bytes | None = None
        self.walker = TarWalker() if byte_path == "pumped" else None

    def feed(self, chunk: memoryview) -> None:
        self.fed += chunk

    def finish(self, read_at: Callable[[int, int], bytes]) -> None:
        seen = self.walker.fed if self.walker is not None else len(self.fed)
        self.reread = read_at(0, seen + 10)

    def compiled_walk(self) -> object | None:
        return self.walker


def _data(nbytes: int) -> bytes:
    return bytes((i * 131 + i // 4093) % 256 for i in range(nbytes))


@pytest.mark.parametrize("nbytes", [0, 1, 4095, FIRST_READ_BYTES + 3, 3 * (1 << 20) + 17])
def test_copies_hashes_and_inspects_every_byte_once(
    tmp_path: Path, byte_path: str, nbytes: int
) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(_data(nbytes))
    seen = _Recorder(byte_path)
    final = tmp_path / "out" / "dst.bin"
    result = copy_file(None, str(src), final, inspect=seen, block_bytes=1 << 20)
    assert final.read_bytes() == src.read_bytes()
    assert (
        result.size == nbytes
        and result.hash == f"xxh3_64:{xxhash.xxh3_64_hexdigest(src.read_bytes())}"
    )
    if seen.walker is not None:  # the pump fed the walk every byte, and feed() none
        assert seen.walker.fed == nbytes and not seen.fed
    else:
        assert bytes(seen.fed) == src.read_bytes()
    assert seen.reread == src.read_bytes()
    assert not list(tmp_path.rglob("*.partial"))


def test_sha256_manifest_and_mismatch(tmp_path: Path, byte_path: str) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(_data(200_000))
    want = "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    assert copy_file(None, str(src), tmp_path / "a.bin", expected_hash=want).hash == want
    with pytest.raises(HashMismatch):
        copy_file(None, str(src), tmp_path / "b.bin", expected_hash="sha256:" + "0" * 64)
    assert not (tmp_path / "b.bin").exists() and not list(tmp_path.glob("*.partial"))


def test_throttle_and_progress_see_every_byte(tmp_path: Path, byte_path: str) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(_data(2_500_000))
    consumed: list[int] = []
    throttle = Throttle(1e12)
    throttle.consume = consumed.append  # type: ignore[method-assign]
    progress: list[int] = []
    result = copy_file(
        None, str(src), tmp_path / "d.bin", throttle=throttle, on_bytes=progress.append
    )
    assert sum(consumed) == sum(progress) == result.size == 2_500_000
    assert 0 < result.first_byte_s <= result.last_byte_s <= result.seconds


def test_kernel_copy_falls_back_where_the_kernel_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_file_range refused (EXDEV: across filesystems) -> sendfile; sendfile refused too
    (EINVAL: a filesystem without splice) -> the buffered path for the rest of the file."""
    monkeypatch.setattr(bytepath, "KERNEL_COPY", True)
    calls: list[str] = []

    def no_range(*args: object) -> int:
        calls.append("copy_file_range")
        raise OSError(18, "Invalid cross-device link")

    real_sendfile = os.sendfile

    def sendfile_once(out_fd: int, in_fd: int, offset: object, count: int) -> int:
        calls.append("sendfile")
        if calls.count("sendfile") > 1:
            raise OSError(22, "Invalid argument")
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "copy_file_range", no_range)
    monkeypatch.setattr(os, "sendfile", sendfile_once)
    src = tmp_path / "src.bin"
    src.write_bytes(_data(3 * FIRST_READ_BYTES))
    seen = _Recorder()
    copy_file(None, str(src), tmp_path / "d.bin", inspect=seen)
    assert calls[:3] == ["copy_file_range", "sendfile", "sendfile"]
    assert (tmp_path / "d.bin").read_bytes() == src.read_bytes() == bytes(seen.fed)


@pytest.fixture()
def small_tmpfs(tmp_path: Path):
    """A real 1 MiB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1024k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_full_scratch_is_scratch_full_and_leaves_no_partial(
    tmp_path: Path, small_tmpfs: Path, byte_path: str
) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(_data(3 << 20))
    with pytest.raises(ScratchFull, match="no space left") as full:
        copy_file(None, str(src), small_tmpfs / "big.bin", inspect=_Recorder(byte_path))
    assert not list(small_tmpfs.iterdir())
    written = int(str(full.value).split("(")[1].split(" bytes written")[0])
    assert 0 < written <= 1 << 20  # what reached the 1 MiB disk, not 0 and not the source's size


@pytest.mark.parametrize("change", ["append", "same size"])
def test_a_source_changed_during_the_copy_is_never_published(
    tmp_path: Path, byte_path: str, change: str
) -> None:
    """Rewritten after its first block: the copy fails (a retryable SizeMismatch) and leaves
    neither the final name nor a partial, whichever path copied it."""
    src = tmp_path / "src.bin"
    src.write_bytes(_data(3 * FIRST_READ_BYTES))
    final = tmp_path / "out.bin"

    rewritten: list[int] = []

    def rewrite(nbytes: int) -> None:
        if rewritten:
            return
        rewritten.append(nbytes)
        if change == "append":
            with open(src, "ab") as handle:
                handle.write(b"more")
        else:
            with open(src, "r+b") as handle:
                handle.write(b"X" * 10)

    with pytest.raises(SizeMismatch, match="changed while it was copied"):
        copy_file(
            None,
            str(src),
            final,
            on_bytes=rewrite,
            inspect=_Recorder(byte_path),
            block_bytes=1 << 16,
        )
    assert not final.exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("change", ["rewrite", "remove", "replace"])
def test_a_source_changed_while_the_bandwidth_cap_holds_the_copy_is_never_published(
    tmp_path: Path, byte_path: str, change: str
) -> None:
    """The cap (``--bw-limit``; in ``--background`` a shard waits there for the earlier ones)
    paces a copy after its last read: a source changed, replaced or removed meanwhile was
    published with exit 0 as bytes it no longer holds."""
    src = tmp_path / "src.bin"
    src.write_bytes(_data(FIRST_READ_BYTES // 2))  # one read: the pump's end stat comes first
    final = tmp_path / "out.bin"

    def change_while_paced(nbytes: int) -> None:
        if change == "remove":
            src.unlink()
        elif change == "replace":
            (tmp_path / "new.bin").write_bytes(_data(FIRST_READ_BYTES // 2)[::-1])
            os.replace(tmp_path / "new.bin", src)
        else:
            with open(src, "r+b") as handle:
                handle.write(b"X" * 10)

    throttle = Throttle(1e12)
    throttle.consume = change_while_paced  # type: ignore[method-assign]
    with pytest.raises(SizeMismatch, match="changed while it was copied"):
        copy_file(None, str(src), final, throttle=throttle, inspect=_Recorder(byte_path))
    assert not final.exists() and not list(tmp_path.glob("*.partial"))


def test_a_file_read_in_one_read_has_no_transfer_time(tmp_path: Path, byte_path: str) -> None:
    """The stream controller takes ``last_byte_s - first_byte_s`` for the transfer: for a shard
    that one read returns whole it must be nothing, not the Python between two clock readings
    (which made the controller take 20 KB shards for latency-bound and run too many streams)."""
    src = tmp_path / "src.bin"
    src.write_bytes(_data(20_000))
    result = copy_file(None, str(src), tmp_path / "d.bin", inspect=_Recorder(byte_path))
    assert 0 < result.first_byte_s == result.last_byte_s


def test_the_version_recorded_is_the_sources_even_past_the_year_2262(
    tmp_path: Path, byte_path: str
) -> None:
    """mtime and ctime in nanoseconds overflow 64 bits after 2262-04-11 (ext4 keeps times to
    2446): a wrong version would make every later run copy the shard again, or trust a stale
    one."""
    src = tmp_path / "src.bin"
    src.write_bytes(_data(100_000))
    late = 10_413_792_000 * 1_000_000_000 + 123_456_789  # 2300-01-01, past 2**63 ns
    os.utime(src, ns=(late, late))
    if os.stat(src).st_mtime_ns != late:
        pytest.skip("this filesystem does not keep times past 2262")
    result = copy_file(None, str(src), tmp_path / "d.bin", inspect=_Recorder(byte_path))
    assert result.version == local_version(os.stat(src))


@pytest.mark.parametrize("delta", [-1000, 1000])
def test_a_remote_source_whose_bytes_differ_from_its_listed_size_is_never_published(
    tmp_path: Path, delta: int
) -> None:
    """A source read through fsspec (an object store; ``faulty://`` here) has no local stat to
    compare at the end of the copy: a response cut short that the client took for the end, or
    an object rewritten after the listing, is caught only by the listed size. Without a
    manifest hash, that check alone keeps the wrong bytes from the final name."""
    from .faulty_fs import FaultyFileSystem

    src = tmp_path / "src.bin"
    src.write_bytes(_data(100_000))
    final = tmp_path / "out" / "dst.bin"
    with pytest.raises(SizeMismatch, match="source listed"):
        copy_file(
            FaultyFileSystem(),
            str(src),
            final,
            url=f"faulty://{src}",
            expected_size=100_000 + delta,
        )
    assert not final.exists() and not list(tmp_path.rglob("*.partial"))
    copy_file(FaultyFileSystem(), str(src), final, url=f"faulty://{src}", expected_size=100_000)
    assert final.read_bytes() == src.read_bytes()
