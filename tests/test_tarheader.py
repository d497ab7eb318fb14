"""The scalar header checks the walks use, held to tarfile's own, and the promise that a small
shard is indexed without importing numpy."""

from __future__ import annotations

import subprocess
import sys
import tarfile

from hypothesis import given, settings
from hypothesis import strategies as st

from stager.shards.tarheader import BLOCK, checksums_ok

_WITH_HIGH_BYTES = st.binary(min_size=BLOCK, max_size=BLOCK)
# the same with only one byte value >= 0x80 (0xFF): signed and unsigned sums differ a little
_LOW_OR_FF = bytes(b if b < 0x80 or b == 0xFF else b & 0x7F for b in range(256))
_MOSTLY_LOW = _WITH_HIGH_BYTES.map(lambda header: header.translate(_LOW_OR_FF))


@settings(max_examples=300)
@given(
    st.one_of(_WITH_HIGH_BYTES, _MOSTLY_LOW),
    st.sampled_from(["unsigned", "signed", "near", "any"]),
    st.integers(-300_000, 300_000),
)
def test_checksums_ok_agrees_with_tarfile(header: bytes, which: str, value: int) -> None:
    unsigned, signed = tarfile.calc_chksums(header)
    stored = {
        "unsigned": unsigned,
        "signed": signed,
        "near": unsigned + (1 if value % 2 else -65521),
        "any": value,
    }[which]
    assert checksums_ok([header], [stored]) == (stored in (unsigned, signed))


def test_checksums_ok_needs_every_header_right() -> None:
    good = tarfile.TarInfo("a.txt").tobuf(tarfile.USTAR_FORMAT)[:BLOCK]
    right = tarfile.calc_chksums(good)[0]
    assert checksums_ok([good, good], [right, right])
    assert not checksums_ok([good, good], [right, right + 1])
    assert checksums_ok([], [])


_SMALL_SHARD_WITHOUT_NUMPY = """
import io, sys, tarfile
from stager.shards.tarparse import TarSampleCounter
from stager.shards.tarwalk import walk_members
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for i in range(12):
        for ext, size in (("cls", 3), ("jpg", 900)):
            info = tarfile.TarInfo(f"s{i:04d}.{ext}")
            info.size = size
            info.mtime = 1700000000.5  # a float: a PAX record per member, as webdataset writes
            tar.addfile(info, io.BytesIO(bytes(size)))
data = buf.getvalue()
assert len(data) <= 64 << 10
counter = TarSampleCounter()
for start in range(0, len(data), 4096):
    counter.feed(data[start : start + 4096])
counter.finish(lambda offset, nbytes: data[offset : offset + nbytes])
walked = walk_members(lambda offset, nbytes: data[offset : offset + nbytes], 10**6)
print(counter.samples, walked.num_samples, "numpy" in sys.modules)
"""


def test_a_small_shard_is_indexed_without_importing_numpy() -> None:
    """numpy's import holds the interpreter lock ~60 ms: a copy must never wait on it for a
    shard the walk can index."""
    out = subprocess.run(
        [sys.executable, "-c", _SMALL_SHARD_WITHOUT_NUMPY],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert out == ["12", "12", "False"]
