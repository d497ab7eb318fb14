"""The in-flight sample counter agrees with tarfile on every format and chunking, or says None."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest

from stager.tarcount import TarSampleCounter
from stager.tarindex import count_samples


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


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("chunk", [1, 13, 512, 4096, 1 << 20])
def test_counts_like_tarfile_for_any_chunking(tmp_path: Path, fmt: int, chunk: int) -> None:
    path = _tar(tmp_path / "s.tar", fmt, long_names=fmt != tarfile.USTAR_FORMAT)
    data = path.read_bytes()
    counter = TarSampleCounter()
    for start in range(0, len(data), chunk):
        counter.feed(data[start : start + chunk])
    assert counter.samples == count_samples(path) == 9


def test_truncated_or_corrupt_streams_give_none(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", tarfile.GNU_FORMAT, long_names=True)
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        header_at = tar.getmembers()[5].offset
    cut = TarSampleCounter()
    cut.feed(data[: len(data) // 2])
    assert cut.samples is None
    garbled = bytearray(data)
    garbled[header_at + 130] ^= 0x01  # a size digit of a later header: its checksum no longer matches
    bad = TarSampleCounter()
    bad.feed(bytes(garbled))
    assert bad.samples is None


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_index_from_the_stream_equals_index_tar(tmp_path: Path, fmt: int) -> None:
    from stager.tarindex import index_tar

    path = _tar(tmp_path / "s.tar", fmt, long_names=fmt != tarfile.USTAR_FORMAT)
    data = path.read_bytes()
    counter = TarSampleCounter()
    for start in range(0, len(data), 777):
        counter.feed(data[start : start + 777])
    got, want = counter.index(), index_tar(path)
    assert got is not None
    assert got.keys == want.keys and got.exts == want.exts
    assert got.offsets.tolist() == want.offsets.tolist() and got.sizes.tolist() == want.sizes.tolist()
    assert got.member_start.tolist() == want.member_start.tolist()
