"""The fast tar indexers against ``tarfile``, on random tars, whole and damaged: the
vectorised scanner (:func:`scan_tar`) and the small-shard walk (:func:`walk_tar`).

The contract: where an indexer returns an index it is exactly the index ``tarfile`` gives
(``index_with_tarfile``: same keys, extensions, offsets, sizes and sample boundaries); where
``tarfile`` raises, the indexer returns None and :func:`index_tar` raises
:class:`IntegrityError` naming the shard. On tars that ``tarfile`` itself writes, the scanner
must vouch, and the walk too where the names are plain (otherwise the fast path would silently
be the slow one).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stager.errors import IntegrityError
from stager.shards import tarnative
from stager.shards.tarindex import TarIndex, duplicate_member, index_tar, index_with_tarfile
from stager.shards.tarscan import TarScanner, scan_tar
from stager.shards.tarwalk import MANY, walk_tar

from .trees import v7_bytes

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


def _walk(data: bytes) -> TarIndex | None:
    """The small-shard walk with no header limit, over bytes in memory."""
    got = walk_tar(lambda offset, nbytes: data[offset : offset + nbytes], max_headers=10**6)
    assert got != MANY
    return got  # type: ignore[return-value]


def _native(data: bytes) -> TarIndex | None:
    """The compiled walk (stager/shards/_tarwalk.c), fed the whole tar at once; fed again in
    uneven chunks (headers and PAX records split between them), it must say the same."""
    assert tarnative.available(), "the compiled walk is not built (pip install -e .)"
    whole = tarnative.walk_bytes(data)
    walker = tarnative.native_walk()
    assert walker is not None
    pos, step = 0, 1
    while pos < len(data):
        walker.feed(data[pos : pos + step])
        pos, step = pos + step, (step * 7 + 300) % 1500 + 1
    parts = walker.finish()
    assert (parts is None) == (whole is None)
    if parts is not None and whole is not None:
        _same(tarnative.to_index(parts), whole)
    return whole


#: The fast indexers, each held to tarfile's answer by the properties below.
INDEXERS = pytest.mark.parametrize(
    "indexer", [scan_tar, _walk, _native], ids=["scanner", "walk", "native"]
)


def _check(data: bytes, path: Path, *, must_vouch: bool = False, indexer=scan_tar) -> None:
    path.write_bytes(data)
    want = _reference(path)
    got = indexer(data)
    if got is not None:
        assert not isinstance(want, IntegrityError), f"indexer vouched, tarfile said: {want}"
        _same(got, want)
        if got.duplicates_checked:  # a member named twice in a sample: the same one reported
            assert got.duplicate == duplicate_member(want)
    elif must_vouch:
        pytest.fail(f"the indexer left a tar written by tarfile to the slow path: {want}")
    if isinstance(want, IntegrityError):
        with pytest.raises(IntegrityError, match=path.name):
            index_tar(path)
    else:
        _same(index_tar(path), want)


_FORMATS = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])


def _plain_names(items: list) -> bool:
    """Whether the walk must vouch for these members: ASCII names that fit the name field,
    and link targets short enough to need no GNU or PAX long link."""
    return all(
        name.isascii() and len(name) < 100 and not (kind == tarfile.SYMTYPE and len(name) > 50)
        for name, kind, _, _ in items
    )


@PROPERTY
@INDEXERS
@given(items=members(), fmt=_FORMATS)
def test_indexers_equal_tarfile_on_tars_tarfile_writes(
    tmp_path: Path, indexer, items: list, fmt: int
) -> None:
    try:
        data = _write(items, fmt)
    except ValueError:  # e.g. a name too long for ustar
        assume(False)
    must_vouch = indexer is scan_tar or _plain_names(items)
    if indexer is _native:  # printable ASCII names of any length (GNU or PAX long names)
        must_vouch = all(
            name.isascii()
            and name.isprintable()
            and (fmt != tarfile.USTAR_FORMAT or kind != tarfile.REGTYPE or len(name) <= 100)
            for name, kind, _, _ in items
        )
    _check(data, tmp_path / "s.tar", must_vouch=must_vouch, indexer=indexer)


@PROPERTY
@INDEXERS
@given(
    items=members(),
    fmt=_FORMATS,
    damage=st.sampled_from(
        [
            "truncate",
            "flip",
            "zero",
            "garbage_tail",
            "drop_end",
            "concatenated",
            "concatenated_v7",
            "zeros_inserted",
        ]
    ),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
)
def test_damaged_tars_are_vouched_for_only_where_tarfile_agrees(
    tmp_path: Path, indexer, items: list, fmt: int, damage: str, where: float, bit: int
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
    elif damage == "concatenated":  # cat a.tar b.tar: every reader stops at a's end
        data += _write(items, fmt)
    elif damage == "concatenated_v7":  # the same, the second tar with no ustar magic
        data += v7_bytes([("v0.jpg", b"v" * (1 + bit * 100))])
    elif damage == "zeros_inserted":  # one or two zero blocks between two blocks
        block = at - at % 512
        data[block:block] = bytes(512 * (1 + bit % 2))
    else:
        data = data.rstrip(b"\0")
    _check(bytes(data), tmp_path / "d.tar", indexer=indexer)


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
    walker = tarnative.native_walk()
    assert walker is not None, "the compiled walk is not built (pip install -e .)"
    pos, i = 0, 0
    while pos < len(data):
        step = chunks[(i + 1) % len(chunks)]
        walker.feed(memoryview(data)[pos : pos + step])
        pos, i = pos + step, i + 1
    parts = walker.finish()
    at_once = _native(data)
    assert (parts is None) == (at_once is None)
    if parts is not None and at_once is not None:
        _same(tarnative.to_index(parts), at_once)


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


def _record(key: bytes, value: bytes) -> bytes:
    """One well-formed PAX record: its length counts its own digits."""
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))
    return str(length).encode() + body


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
        "signed_checksum",
        "pax_mtime_only",
        "pax_before_end",
        "pax_size_zero",
        "pax_sparse_name",
        "unknown_type_with_payload",
        "pax_path_in_padding",
        "pax_size_in_padding",
        "long_pax_path_in_padding",
        "pax_hdrcharset_not_utf8",
        "pax_hdrcharset_inside_a_value",
        "pax_hdrcharset_in_padding",
        "empty_extension_first",
        "pax_path_then_long_name",
        "pax_path_trailing_slashes",
        "long_name_fills_its_blocks",
        "long_link_then_long_name",
        "long_name_before_a_directory",
        "long_name_not_printable",
    ],
)
@INDEXERS
def test_hand_made_forms(tmp_path: Path, case: str, indexer) -> None:
    """Forms tarfile reads but never writes: each indexer agrees or steps aside."""
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
        pax = _record(b"size", b"700")
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
    elif case == "signed_checksum":  # old tars summed the bytes as signed chars
        header = bytearray(_raw_header(b"k.jpg", len(body), b"0"))
        header[265:270] = b"\xe9user"  # a non-ASCII owner name
        header[148:156] = b"        "
        signed = sum(b - 256 if b >= 128 else b for b in header)
        header[148:156] = b"%06o\x00 " % signed
        data = bytes(header) + _padded(body) + end
    elif case == "pax_mtime_only":  # as webdataset writes every member: a float mtime
        pax = b"30 mtime=1700000000.123456789\n"
        data = _raw_header(b"p", len(pax), b"x") + _padded(pax)
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case == "pax_before_end":  # records for a member that never comes
        pax = _record(b"mtime", b"1.5")
        data = _raw_header(b"p", len(pax), b"x") + _padded(pax) + end
    elif case.startswith("pax_hdrcharset"):
        # tarfile searches the padded records for "\d+ hdrcharset=...\n" and decodes the value
        # as strict UTF-8: it raises where a fast indexer would have read an ordinary record
        record = {
            "pax_hdrcharset_not_utf8": _record(b"hdrcharset", b"\xff"),
            "pax_hdrcharset_inside_a_value": _record(b"comment", b"1 hdrcharset=\xff"),
            "pax_hdrcharset_in_padding": _record(b"mtime", b"1.5"),
        }[case]
        padded = _padded(record)
        if case == "pax_hdrcharset_in_padding":  # after the NUL that ends the records
            tail = b"\x0016 hdrcharset=\xff\n"
            padded = record + tail + bytes(512 - len(record) - len(tail))
        data = _raw_header(b"p", len(record), b"x") + padded
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case == "pax_path_then_long_name":  # x then L then the file: the PAX path wins
        pax = _record(b"path", b"from.pax")
        data = _raw_header(b"pax", len(pax), b"x") + _padded(pax)
        data += _raw_header(b"././@LongLink", 13, b"L") + _padded(b"from.long.nm\x00")
        data += _raw_header(b"header.jpg", len(body), b"0") + _padded(body) + end
    elif case == "pax_path_trailing_slashes":  # tarfile strips every trailing '/' of a path
        pax = _record(b"path", b"dir/k.jpg//")
        data = _raw_header(b"pax", len(pax), b"x") + _padded(pax)
        data += _raw_header(b"other.cls", len(body), b"0") + _padded(body) + end
    elif case == "long_name_fills_its_blocks":  # no NUL: the name runs to the blocks' end
        name = b"d/" + b"k" * 507 + b".jpg"
        data = _raw_header(b"././@LongLink", len(name), b"L") + _padded(name)
        data += _raw_header(b"short.jpg", len(body), b"0") + _padded(body) + end
    elif case == "long_link_then_long_name":  # K sets a link target only
        data = _raw_header(b"././@LongLink", 9, b"K") + _padded(b"t/a.jpg\x00\x00")
        data += _raw_header(b"././@LongLink", 8, b"L") + _padded(b"l/b.cls\x00")
        data += _raw_header(b"h.jpg", len(body), b"0") + _padded(body) + end
    elif case == "long_name_before_a_directory":  # the name is the directory's, not the next
        data = _raw_header(b"././@LongLink", 9, b"L") + _padded(b"x/y.jpg/\x00")
        data += _raw_header(b"dir", 0, b"5") + _raw_header(b"k.jpg", len(body), b"0")
        data += _padded(body) + end
    elif case == "long_name_not_printable":  # a tab: left to the slower indexers
        data = _raw_header(b"././@LongLink", 8, b"L") + _padded(b"a\tb.jpg\x00")
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case == "empty_extension_first":  # "k." has the key "k" and an empty extension
        data = _raw_header(b"k.", 3, b"0") + _padded(b"abc")
        data += _raw_header(b"k.jpg", len(body), b"0") + _padded(body) + end
    elif case.endswith("_in_padding"):
        # tarfile parses records on into the block's padding, past the header's size: a record
        # hidden there renames the member or changes its size behind the header's back
        pax = _record(b"mtime", b"1700000000.5")
        if case.startswith("long"):  # over one block: the records are read one by one
            pax += _record(b"comment", b"c" * 600)
        hidden = _record(b"size", b"0") if "size" in case else _record(b"path", b"evil.png")
        data = _raw_header(b"p", len(pax), b"x") + _padded(pax + hidden)
        data += _raw_header(b"good.jpg", len(body), b"0") + _padded(body) + end
    elif case in ("pax_size_zero", "pax_sparse_name", "unknown_type_with_payload"):
        # the header's size (512) says the next block is payload, a header of its own; the
        # PAX size record (0) or the unknown type decides whether tarfile reads it
        inner = _raw_header(b"inner.cls", 0, b"0")
        kind, pax = (
            b"0",
            {
                "pax_size_zero": _record(b"size", b"0"),
                "pax_sparse_name": _record(b"GNU.sparse.name", b"other.jpg"),
                "unknown_type_with_payload": b"",
            }[case],
        )
        if case == "unknown_type_with_payload":
            kind = b"V"  # a GNU volume label: tarfile skips its payload
        data = (_raw_header(b"p", len(pax), b"x") + _padded(pax)) if pax else b""
        data += _raw_header(b"k.jpg", 512, kind) + inner + _raw_header(b"k.cls", 3, b"0")
        data += _padded(b"abc") + end
    else:  # numbers padded with spaces instead of zeros, as some old tars write them
        header = bytearray(_raw_header(b"k.jpg", len(body), b"0"))
        header[100:108] = b"   644 \x00"
        header[124:136] = b"%11o " % len(body)
        header[148:156] = b"        "
        header[148:156] = b"%06o\x00 " % sum(header)
        data = bytes(header) + _padded(body) + end
    _check(data, tmp_path / f"{case}.tar", indexer=indexer)
    read_by_all = (
        "v7_dir_skips_no_payload",
        "spaced_numbers",
        "signed_checksum",
        "pax_mtime_only",
        "empty_extension_first",
    )
    if indexer is _native:  # the long names and paths the compiled walk reads itself
        read_by_all += (
            "meta_run_first_wins",
            "pax_path_then_long_name",
            "pax_path_trailing_slashes",
            "long_name_fills_its_blocks",
            "long_link_then_long_name",
            "long_name_before_a_directory",
        )
    if case in read_by_all or (case == "meta_run_first_wins" and indexer is scan_tar):
        assert indexer(data) is not None, "a form the indexer claims to read"
    if case == "meta_run_first_wins":
        assert index_tar(tmp_path / f"{case}.tar").keys == ["from"]


@INDEXERS
def test_empty_archive_and_short_files(tmp_path: Path, indexer) -> None:
    _check(bytes(1024), tmp_path / "empty.tar", must_vouch=True, indexer=indexer)
    for data in (b"", b"\0" * 100, b"x" * 600):
        _check(data, tmp_path / "short.tar", indexer=indexer)


def test_the_walk_hands_over_past_its_header_limit(tmp_path: Path) -> None:
    """Past ``max_headers`` the walk says MANY and the scanner takes over: index_tar gives
    tarfile's answer either side of the limit."""
    from stager.shards.tarwalk import MAX_HEADERS

    for count in (6, MAX_HEADERS + 5):
        items = [(f"s{i}.jpg", tarfile.REGTYPE, 10, 1_700_000_000) for i in range(count)]
        data = _write(items, tarfile.USTAR_FORMAT)
        read = lambda offset, nbytes, data=data: data[offset : offset + nbytes]  # noqa: E731
        assert walk_tar(read, max_headers=count - 1) == MANY
        assert walk_tar(read, max_headers=count) not in (None, MANY)
        path = tmp_path / f"{count}.tar"
        path.write_bytes(data)
        _same(index_tar(path), index_with_tarfile(path))


_OTHER_LOCALE_CHECK = """
import io, sys, tarfile
from pathlib import Path
from stager.shards.tarindex import index_tar, index_with_tarfile
from stager.shards.tarscan import scan_tar
assert sys.getfilesystemencoding() == "ascii", sys.getfilesystemencoding()
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8") as tar:
    for name in ["\\u00e9t\\u00e9.jpg", "\\u00e9t\\u00e9.cls", "x" * 120 + "/\\u00fc.jpg", "k.jpg"]:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
data = buf.getvalue()
path = Path(sys.argv[1])
path.write_bytes(data)
want = index_with_tarfile(path)
for got in (scan_tar(data), index_tar(path)):
    if got is not None:
        assert (got.keys, got.exts) == (want.keys, want.exts), (got.keys, want.keys)
print("same", [ascii(k) for k in want.keys])
"""


def test_non_ascii_names_read_as_tarfile_reads_them_in_a_non_utf8_locale(tmp_path: Path) -> None:
    """tarfile decodes header names with the filesystem encoding (ASCII under ``LC_ALL=C``
    without UTF-8 mode): the scanner must give the same keys, or step aside."""
    env = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_LOCALE_CHECK, str(tmp_path / "names.tar")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "\\udcc3" in done.stdout  # the undecodable bytes kept, as tarfile keeps them


def test_a_stream_tarfile_cannot_decode_is_an_integrity_error() -> None:
    """A PAX hdrcharset that is not UTF-8 makes tarfile raise UnicodeDecodeError; counting a
    stream (a remote or compressed shard) reports it as a corrupt shard, by name. (Pythons
    before 3.11.4's tarfile changes read past the record: there the count is tarfile's.)"""
    import tarfile

    from stager.shards.tarindex import count_samples_stream

    record = _record(b"hdrcharset", b"\xff")
    data = _raw_header(b"p", len(record), b"x") + _padded(record)
    data += _raw_header(b"k.jpg", 3, b"0") + _padded(b"abc") + bytes(1024)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
            members = [m.name for m in tar]
    except UnicodeDecodeError:
        with pytest.raises(IntegrityError, match="s.tar"):
            count_samples_stream(io.BytesIO(data), "s.tar")
    else:  # (this Python's tarfile reads it: the count agrees with what it reads)
        assert count_samples_stream(io.BytesIO(data), "s.tar") == len(members) == 1


@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_a_sparse_member_is_said_to_be_sparse_not_truncated(tmp_path: Path, fmt: str) -> None:
    """GNU tar's --sparse stores a member in pieces: the index (read by offset) cannot serve
    it. It was refused as 'truncated' with advice to re-stage, which can never help."""

    from stager.errors import IntegrityError
    from stager.shards.tarindex import index_tar

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.cls").write_bytes(b"1")
    with open(tree / "a.bin", "wb") as handle:
        handle.write(b"H")
        handle.seek(1 << 20)
        handle.write(b"T")
    shard = tmp_path / "s.tar"
    subprocess.run(
        ["tar", "cf", str(shard), "--sparse", f"--format={fmt}", "-C", str(tree), "."], check=True
    )
    with pytest.raises(IntegrityError, match="is a sparse file .*without --sparse"):
        index_tar(shard)


def test_a_gzip_file_named_tar_is_said_to_be_gzip(tmp_path: Path) -> None:
    import gzip

    from stager.errors import IntegrityError
    from stager.shards.tarindex import index_tar

    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("a.cls"), io.BytesIO())
    shard = tmp_path / "s.tar"
    shard.write_bytes(gzip.compress(plain.getvalue()))
    with pytest.raises(IntegrityError, match="gzip-compressed: name it \\*.tar.gz"):
        index_tar(shard)


def test_a_file_that_is_no_tar_is_sent_to_re_create_it(tmp_path: Path) -> None:
    """Not a tar and not compressed: as for the other corrupt-tar lines, re-staging is named
    only with when it helps (every copy is checked against its source as it is made)."""
    from stager.errors import IntegrityError
    from stager.shards.tarindex import index_tar

    shard = tmp_path / "s.tar"
    shard.write_bytes(b"not a tar at all\n" * 64)
    with pytest.raises(IntegrityError) as info:
        index_tar(shard)
    assert "not a readable tar" in str(info.value)
    assert "re-create this shard" in str(info.value) and "re-stage" not in str(info.value)
