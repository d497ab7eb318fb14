"""Index a tar of few members by visiting its headers one by one: the small-shard path.

Why: the vectorised scanner (:mod:`stager.shards.tarscan`) runs ~470 numpy calls per shard,
~0.7 ms whatever the shard's size. Over 10,000 shards of four samples that made indexing
3x slower than ``tarfile`` had been. Visiting a header in Python costs a few microseconds,
so below a few dozen headers visiting them one by one is the cheaper way, and past
``max_headers`` this walk stops and the scanner takes over.

It vouches for a subset of what the scanner vouches for, checked the same way: the ``ustar``
magic; the checksum as unsigned or signed bytes; every numeric field in a form ``tarfile``
reads (:func:`stager.shards.tarheader.numbers_general`); files, directories, links and devices;
PAX records that rename nothing (webdataset writes one before every member, for its float
mtime), read by :func:`stager.shards.tarheader.pax_records`. The walk follows the sizes from
block 0 as ``tarfile`` does, so a tar inside a payload is never seen, and it must end on a
zero block. Members are grouped into samples by :class:`stager.shards.members.SampleGrouper`,
as on the ``tarfile`` path. Anything else -- a ustar prefix, a GNU long name, a PAX path, a
non-ASCII name, an unknown type, damage -- returns None, and the caller asks the scanner, then
``tarfile``.

No numpy here (the checks are :mod:`stager.shards.tarheader`'s): a copy that ends before
numpy's import has finished indexes its shard by this walk instead of waiting for the import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final, Literal

from stager.shards.members import SampleGrouper, TarIndex
from stager.shards.tarend import zeros_from
from stager.shards.tarheader import BLOCK, UTF8, checksums_ok, numbers_general, padded_pax_records

__all__ = ["MANY", "walk_index", "walk_members", "walk_tar"]

#: Returned by :func:`walk_tar` when the tar has more than ``max_headers`` headers.
MANY: Final = "many"

#: Past this many headers the scanner's fixed cost is the smaller one.
MAX_HEADERS = 48

_ZERO_BLOCK = bytes(BLOCK)
_FILE_TYPES = frozenset(b"0\x007")  # tarfile's isfile(): REGTYPE, AREGTYPE, CONTTYPE
_NO_PAYLOAD_TYPES = frozenset(b"123456")  # links, devices, directories, FIFOs
_PAX_TYPES = frozenset(b"xX")

# The forms tarfile and GNU tar write, matched from byte 100: mode, uid and gid (seven digits
# then NUL or space, or an empty field), size and mtime (eleven digits then NUL or space, or
# empty), checksum (six digits then NUL). Other forms go to numbers_general.
_USUAL_NUMBERS = re.compile(
    rb"(?:[0-7]{7}[\0 ]|\0.{7}){3}(?:([0-7]{11})[\0 ]|\0.{11})(?:[0-7]{11}[\0 ]|\0.{11})"
    rb"([0-7]{6})\0",
    re.DOTALL,
)
_USUAL_DEVICES = re.compile(rb"(?:[0-7]{7}[\0 ]|\0.{7}){2}", re.DOTALL)  # from byte 329


def walk_tar(
    read_at: Callable[[int, int], bytes], max_headers: int | None = None
) -> TarIndex | Literal["many"] | None:
    """The index :func:`stager.shards.tarindex.index_tar` would return, :data:`MANY` after
    ``max_headers`` headers (default :data:`MAX_HEADERS`), or None where this walk does not
    vouch for the tar.

    ``read_at(offset, nbytes)`` reads the tar's bytes (fewer at its end).
    """
    walked = walk_members(read_at, max_headers)
    return walked.index() if isinstance(walked, SampleGrouper) else walked


def walk_members(
    read_at: Callable[[int, int], bytes], max_headers: int | None = None
) -> SampleGrouper | Literal["many"] | None:
    """:func:`walk_tar`'s members, grouped into samples but not yet made an index (which
    needs numpy): ``.num_samples`` counts them, ``.index()`` builds the index."""
    limit = MAX_HEADERS if max_headers is None else max_headers
    samples = SampleGrouper()
    headers: list[bytes] = []  # checked together at the end: the path never depends on them
    checksums: list[int] = []
    offset = 0
    after_meta = False  # a PAX header applies to the next header, which must exist
    for _ in range(limit + 1):
        header = read_at(offset, BLOCK)
        if header == _ZERO_BLOCK:
            if after_meta or not checksums_ok(headers, checksums):
                return None  # tarfile raises on a metadata header right before the end
            # (bytes after the end that are not zero: tarindex's check says what they are)
            return samples if zeros_from(read_at, offset + BLOCK) else None
        if len(header) < BLOCK or header[257:262] != b"ustar":
            return None
        numbers = _numbers(header)
        if numbers is None:
            return None
        size = numbers[0]
        headers.append(header)
        checksums.append(numbers[1])
        kind = header[156]
        payload = 0
        after_meta = False
        if kind in _FILE_TYPES:
            name = header[:100].split(b"\0", 1)[0]
            if kind == 0 and name.endswith(b"/"):
                pass  # tarfile reads it as a directory: no payload follows
            elif header[345] or not name.isascii():
                return None  # a ustar prefix or a non-ASCII name: left to the scanner
            else:
                payload = size
                samples.add(name.decode("ascii"), offset + BLOCK, size)
        elif kind in _PAX_TYPES:
            padded = read_at(offset + BLOCK, -(-size // BLOCK) * BLOCK)
            if not UTF8 or not _renames_nothing(padded, size):
                return None
            payload, after_meta = size, True
        elif kind not in _NO_PAYLOAD_TYPES:
            return None  # GNU long names, global PAX headers, sparse files, unknown types
        offset += BLOCK + -(-payload // BLOCK) * BLOCK
    return MANY


def walk_index(source: bytes | Callable[[int, int], bytes]) -> TarIndex | None:
    """:func:`walk_tar` over bytes in memory or a ``read_at``, with its default limit; None
    where the walk does not vouch or stopped at the limit (the scanner decides then)."""
    if isinstance(source, bytes):
        data = source
        walked = walk_tar(lambda offset, nbytes: data[offset : offset + nbytes])
    else:
        walked = walk_tar(source)
    return walked if isinstance(walked, TarIndex) else None


def _numbers(header: bytes) -> tuple[int, int] | None:
    """The payload size and the stored checksum, if every numeric field is readable."""
    usual = _USUAL_NUMBERS.match(header, 100)
    if usual is not None and _USUAL_DEVICES.match(header, 329) is not None:
        return int(usual[1], 8) if usual[1] is not None else 0, int(usual[2], 8)
    ok, chksum, size = numbers_general(header)
    return (size, chksum) if ok else None


def _renames_nothing(padded: bytes, size: int) -> bool:
    """Whether a PAX header's records (``size`` bytes of ``padded``) are well formed and change
    neither the next member's name nor its size (those tars are left to the scanner). A payload
    cut short by the end of the file may parse; the walk then finds no header after it."""
    records = padded_pax_records(padded, size)
    if records is None or b"path" in records or b"size" in records:
        return False
    return not any(key.startswith(b"GNU.sparse.") for key in records)
