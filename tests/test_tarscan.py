"""The vectorised tar scanner against ``tarfile``, on random tars, whole and damaged.

The contract: where :func:`scan_tar` returns an index it is exactly the index ``tarfile`` gives
(``index_with_tarfile``: same keys, extensions, offsets, sizes and sample boundaries); where
``tarfile`` raises, the scanner returns None and :func:`index_tar` raises
:class:`IntegrityError` naming the shard. On tars that ``tarfile`` itself writes, the scanner
must vouch (otherwise the fast path would silently be the slow one).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stager.errors import IntegrityError
from stager.shards.tarindex import TarIndex, index_tar, index_with_tarfile
from stager.shards.tarscan import TarScanner, scan_tar

PROPERTY = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_NAME_CHARS = st.sampled_from(list("ab.z/_-09") + ["é", "\n", "..", "~"])
_BASE_NAMES = st.lists(_NAME_CHARS, min_size=1, max_size=12).map("".join)


@st.composite
def member_names(draw) -> str:
    """WebDataset-like names mostly (``dir/key.ext``), with odd ones mixed in: no extension,
    leading dots, newlines, non-ASCII, and names long enough for GNU/PAX/ustar-prefix forms."""
    kind = draw(st.sampled_from(["wds", "wds", "wds", "odd", "long"]))
    if kind == "wds":
        key = draw(st.sampled_from(["s0", "s1", "s2", "a/b/s3", "s0"]))
        ext = draw(st.sampled_from(["jpg", "cls", "json", "seg.png", ""]))
        return f"{key}.{ext}"
    if kind == "odd":
        return draw(_BASE_NAMES)
    depth = draw(st.integers(1, 4))
    parts = [draw(st.sampled_from(["d" * 60, "e" * 99, "f/g", "x" * 30])) for _ in range(depth)]
    return "/".join(parts) + "/" + draw(st.sampled_from(["k.jpg", "k.cls", "kk", ".k.x"]))


@st.composite
def members(draw) -> list[tuple[str, bytes, int, float]]:
    """(name, type, payload, mtime) per member. The payload is a size in bytes, or a negative
    number ``-n``: a tar of ``n`` members stored as the payload."""
    out = []
    for _ in range(draw(st.integers(0, 14))):
        name = draw(member_names())
        kind = draw(st.sampled_from([tarfile.REGTYPE] * 6 + [tarfile.DIRTYPE, tarfile.SYMTYPE]))
        payload = 0
        if kind == tarfile.REGTYPE:
            payload = draw(st.sampled_from([0, 1, 511, 512, 513, 1024, 3000, -1, -3]))
        mtime = draw(st.sampled_from([1_700_000_000, 1_700_000_000.5]))
        out.append((name, kind, payload, mtime))
    return out


def _payload(spec: int, salt: int) -> bytes:
    if spec < 0:
        return _embedded_tar(-spec)
    return bytes((i * 7 + salt) % 256 for i in range(spec))


def _embedded_tar(count: int) -> bytes:
    """A valid tar stored as a payload: its headers must not be taken for the outer tar's."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(count):
            info = tarfile.TarInfo(f"inner{i}.jpg")
            info.size = 600
            tar.addfile(info, io.BytesIO((b"\x00ustar\x00" * 90)[:600]))
    return buf.getvalue()


def _write(items: list[tuple[str, bytes, int, float]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, kind, spec, mtime in items:
            payload = _payload(spec, len(name))
            info = tarfile.TarInfo(name)
            info.type, info.mtime = kind, mtime
            if kind == tarfile.SYMTYPE:
                info.linkname = "target/" + "t" * (150 if len(name) > 50 else 3)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload) if payload else None)
    return buf.getvalue()


def _reference(path: Path) -> TarIndex | IntegrityError:
    try:
        return index_with_tarfile(path)
    except IntegrityError as exc:
        return exc


def _same(got: TarIndex, want: TarIndex) -> None:
    assert got.keys == want.keys
    assert got.exts == want.exts
    assert got.offsets.tolist() == want.offsets.tolist()
    assert got.sizes.tolist() == want.sizes.tolist()
    assert got.member_start.tolist() == want.member_start.tolist()


def _check(data: bytes, path: Path, *, must_vouch: bool = False) -> None:
    path.write_bytes(data)
    want = _reference(path)
    got = scan_tar(data)
    if got is not None:
        assert not isinstance(want, IntegrityError), f"scanner vouched, tarfile said: {want}"
        _same(got, want)
    elif must_vouch:
        pytest.fail(f"the scanner left a tar written by tarfile to the slow path: {want}")
    if isinstance(want, IntegrityError):
        with pytest.raises(IntegrityError, match=path.name):
            index_tar(path)
    else:
        _same(index_tar(path), want)


_FORMATS = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])


@PROPERTY
@given(items=members(), fmt=_FORMATS)
def test_scanner_equals_tarfile_on_tars_tarfile_writes(
    tmp_path: Path, items: list, fmt: int
) -> None:
    try:
        data = _write(items, fmt)
    except ValueError:  # e.g. a name too long for ustar
        assume(False)
    _check(data, tmp_path / "s.tar", must_vouch=True)


@PROPERTY
@given(
    items=members(),
    fmt=_FORMATS,
    damage=st.sampled_from(["truncate", "flip", "zero", "garbage_tail", "drop_end"]),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
)
def test_damaged_tars_are_vouched_for_only_where_tarfile_agrees(
    tmp_path: Path, items: list, fmt: int, damage: str, where: float, bit: int
) -> None:
    try:
        data = bytearray(_write(items, fmt))
    except ValueError:
        assume(False)
    at = min(int(where * len(data)), len(data) - 1)
    if damage == "truncate":
        data = data[:at]
    elif damage == "flip":
        data[at] ^= 1 << bit
    elif damage == "zero":  # a run of zeros: a header may become an end block
        data[at : at + 512] = bytes(len(data[at : at + 512]))
    elif damage == "garbage_tail":  # after the end block tarfile reads nothing more
        data += b"\x01garbage" * 100
    else:
        data = data.rstrip(b"\0")
    _check(bytes(data), tmp_path / "d.tar")


@PROPERTY
@given(items=members(), fmt=_FORMATS, chunks=st.lists(st.integers(1, 5000), min_size=1))
def test_chunked_feeding_gives_the_same_index(
    tmp_path: Path, items: list, fmt: int, chunks: list[int]
) -> None:
    try:
        data = _write(items, fmt)
    except ValueError:
        assume(False)
    whole = scan_tar(data)
    scanner = TarScanner()
    pos, i = 0, 0
    while pos < len(data):
        step = chunks[i % len(chunks)]
        scanner.feed(memoryview(data)[pos : pos + step])
        pos, i = pos + step, i + 1
    got = scanner.finish(lambda offset, nbytes: data[offset : offset + nbytes])
    assert (got is None) == (whole is None)
    if got is not None:
        _same(got, whole)


def _raw_header(name: bytes, size: int, kind: bytes, *, magic: bytes = b"ustar\x0000") -> bytes:
    """A header written field by field, for forms tarfile never writes."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\x00"
    block[108:116] = b"0000000\x00"
    block[116:124] = b"0000000\x00"
    block[124:136] = b"%011o\x00" % size
    block[136:148] = b"%011o\x00" % 1_700_000_000
    block[156:157] = kind
    block[257 : 257 + len(magic)] = magic
    block[148:156] = b"        "
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def _padded(payload: bytes) -> bytes:
    return payload + bytes(-len(payload) % 512)


@pytest.mark.parametrize(
    "case",
    [
        "meta_run_first_wins",
        "v7_dir_skips_no_payload",
        "no_magic",
        "pax_size",
        "global_pax",
        "meta_before_end",
        "pax_malformed",
        "base256_size",
        "spaced_numbers",
    ],
)
def test_hand_made_forms(tmp_path: Path, case: str) -> None:
    """Forms tarfile reads but never writes: the scanner agrees or steps aside."""
    end = bytes(1024)
    body = b"x" * 700
    if case == "meta_run_first_wins":  # L then x then the file: the L name wins
        pax = b"17 path=from.pax\n"
        data = (
            _raw_header(b"././@LongLink", 13, b"L")
            + _padded(b"from.long.nm\x00")
            + _raw_header(b"pax", len(pax), b"x")
            + _padded(pax)
            + _raw_header(b"header.jpg", len(body), b"0")
            + _padded(body)
            + end
        )
    elif case == "v7_dir_skips_no_payload":  # type NUL + trailing slash: a directory
        data = (
            _raw_header(b"dir/", 512, b"\x00")
            + _raw_header(b"k.jpg", len(body), b"\x00")
            + _padded(body)
            + end
        )
    elif case == "no_magic":
        data = _raw_header(b"k.jpg", len(body), b"0", magic=b"") + _padded(body) + end
    elif case == "pax_size":
        pax = b"13 size=700\n"
        data = _raw_header(b"p", len(pax), b"x") + _padded(pax)
        data += _raw_header(b"k.jpg", 0, b"0") + _padded(body) + end
    elif case == "global_pax":
        pax = b"16 comment=hello\n"
        data = _raw_header(b"g", len(pax), b"g") + _padded(pax)
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case == "meta_before_end":
        data = _raw_header(b"././@LongLink", 6, b"L") + _padded(b"a.jpg\x00") + end
    elif case == "pax_malformed":
        pax = b"99 path=x.jpg\n"
        data = _raw_header(b"p", len(pax), b"x") + _padded(pax)
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case == "base256_size":
        header = bytearray(_raw_header(b"k.jpg", 0, b"0"))
        header[124:136] = b"\x80" + (700).to_bytes(11, "big")
        header[148:156] = b"        "
        header[148:156] = b"%06o\x00 " % sum(header)
        data = bytes(header) + _padded(body) + end
    else:  # numbers padded with spaces instead of zeros, as some old tars write them
        header = bytearray(_raw_header(b"k.jpg", len(body), b"0"))
        header[100:108] = b"   644 \x00"
        header[124:136] = b"%11o " % len(body)
        header[148:156] = b"        "
        header[148:156] = b"%06o\x00 " % sum(header)
        data = bytes(header) + _padded(body) + end
    _check(data, tmp_path / f"{case}.tar")
    if case in ("meta_run_first_wins", "v7_dir_skips_no_payload", "spaced_numbers"):
        assert scan_tar(data) is not None, "a form the scanner claims to read"
    if case == "meta_run_first_wins":
        assert index_tar(tmp_path / f"{case}.tar").keys == ["from"]


def test_empty_archive_and_short_files(tmp_path: Path) -> None:
    _check(bytes(1024), tmp_path / "empty.tar", must_vouch=True)
    for data in (b"", b"\0" * 100, b"x" * 600):
        _check(data, tmp_path / "short.tar")


_RECORD_KEYS = st.sampled_from(
    [b"mtime", b"path", b"size", b"GNU.sparse.map", b"uname", b"", b"a=b"]
)


@st.composite
def pax_payloads(draw) -> bytes:
    """PAX record sets, mostly well formed, with every way of being malformed mixed in."""
    out = b""
    for _ in range(draw(st.integers(0, 5))):
        key = draw(_RECORD_KEYS)
        value = draw(st.binary(max_size=30))
        body = b" " + key + b"=" + value + b"\n"
        length = len(body) + len(str(len(body) + 3))
        length = len(body) + len(str(length))
        field = str(length).encode()
        fault = draw(st.sampled_from(["none"] * 6 + ["short", "long", "zeros", "no_nl"]))
        if fault == "short":
            field = str(length - 1).encode()
        elif fault == "long":
            field = str(length + 2).encode()
        elif fault == "zeros":  # leading zeros: still well formed, if the length says so
            field = b"000000" + field
            body = body  # the length now counts the zeros too, unless corrected below
            field = str(len(body) + len(field)).encode().rjust(len(field), b"0")
        elif fault == "no_nl":
            body = body[:-1] + b"x"
        out += field + body
    if draw(st.booleans()):
        out += draw(st.binary(max_size=4))  # trailing garbage
    return out[:512]


@PROPERTY
@given(payloads=st.lists(pax_payloads(), min_size=1, max_size=8))
def test_pax_records_checked_as_arrays_as_one_by_one(payloads: list[bytes]) -> None:
    """_pax_check (all rows at once) against _pax_records (one payload at a time)."""
    import numpy as np

    from stager.shards.tarnames import _pax_check, _pax_records

    rows = np.zeros((len(payloads), 512), dtype=np.uint8)
    for i, payload in enumerate(payloads):
        rows[i, : len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    sizes = np.asarray([len(p) for p in payloads], dtype=np.int64)
    ok, plain = _pax_check(rows, sizes)
    for i, payload in enumerate(payloads):
        records = _pax_records(payload)
        usable = records is not None and b"size" not in records
        usable = usable and not any(k.startswith(b"GNU.sparse.") for k in records or {})
        if plain[i]:  # vouched without Python: must be usable and set no name
            assert usable and b"path" not in records, payload
        elif ok[i]:  # left to _pax_records, which decides
            pass
        else:  # refused: _pax_records must refuse too
            assert not usable, payload
