"""One tar header block read the way ``tarfile`` reads it, without numpy.

The vectorised scanner (:mod:`stager.shards.tarscan`) checks headers in bulk with numpy; the
walks that visit headers one at a time (:mod:`stager.shards.tarwalk`) need only these scalar
checks. Keeping them free of numpy lets a copy index its shard before numpy's import (~0.1 s)
has finished: the first copies of a run no longer wait for it.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Sequence

__all__ = [
    "BLOCK",
    "HDRCHARSET",
    "NAME_ENCODING",
    "UTF8",
    "checksums_ok",
    "name_bytes",
    "name_text",
    "numbers_general",
    "pax_records",
    "padded_pax_records",
]

BLOCK = 512

#: ``tarfile`` decodes names with the filesystem encoding; the byte-level split of a name into
#: key and extension equals the split of the decoded name only for UTF-8 (ASCII ``/`` and
#: ``.`` never occur inside a multi-byte sequence).
UTF8 = sys.getfilesystemencoding().lower().replace("-", "") == "utf8"
#: How tarfile decodes the names in headers and GNU long-name records (its ``ENCODING``), so
#: that a non-ASCII name reads the same here in any locale.
NAME_ENCODING = sys.getfilesystemencoding()


def name_bytes(text: str) -> bytes:
    """A key or extension of a member name as the bytes of its header: a name that is not in
    the encoding (Latin-1 bytes in a GNU tar made on such a filesystem) was decoded with
    surrogate escapes, as tarfile and webdataset decode it, and encodes back to its bytes."""
    return text.encode(NAME_ENCODING, "surrogateescape")


def name_text(raw: bytes) -> str:
    """:func:`name_bytes` undone: the key a loader yields, as webdataset's for the same bytes."""
    return raw.decode(NAME_ENCODING, "surrogateescape")


_HIGH_BYTES = bytes(range(0x80, 0x100))

#: A PAX header whose padded payload holds this anywhere is left to ``tarfile`` by every fast
#: indexer (see :func:`padded_pax_records`).
HDRCHARSET = b"hdrcharset="


def _byte_sum(data: bytes) -> int:
    """The sum of ``data``'s bytes (at most 256 of them), in C.

    Adler-32's first half is one plus the byte sum modulo 65,521; 256 bytes sum to at most
    65,280, so the modulo never applies. A Python ``sum`` over a header cost more than the rest
    of its walk.
    """
    return (zlib.adler32(data) & 0xFFFF) - 1 if data else 0


def _high_count(data: bytes) -> int:
    """How many of ``data``'s bytes are >= 0x80 (negative as signed chars)."""
    return len(data) - len(data.translate(None, _HIGH_BYTES))


def checksums_ok(headers: Sequence[bytes], stored: Sequence[int]) -> bool:
    """Whether every header's checksum equals its stored value, as ``tarfile`` checks it.

    The checksum counts its own field (bytes 148-155) as eight spaces; tarfile accepts the sum
    of the bytes read as unsigned chars or as signed chars.
    """
    for header, want in zip(headers, stored, strict=True):
        field = header[148:156]
        unsigned = _byte_sum(header[:256]) + _byte_sum(header[256:]) - _byte_sum(field) + 8 * 32
        if unsigned == want:
            continue
        if unsigned - 256 * (_high_count(header) - _high_count(field)) != want:
            return False
    return True


def _nti(field: bytes, *, base256: bool = True) -> int | None:
    """tarfile's ``nti`` for the forms every tar reader agrees on; None for the rest."""
    if field[:1] in (b"\x80", b"\xff"):
        return -1 if base256 else None  # valid, value not needed
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not all(ord("0") <= c <= ord("7") for c in text):
        return None
    return int(text, 8)


def numbers_general(header: bytes) -> tuple[bool, int, int]:
    """(ok, checksum, size) for a header whose numbers are not in a usual form."""
    chksum = _nti(header[148:156], base256=False)
    size = _nti(header[124:136], base256=False)
    others = (
        header[a:b]
        for a, b in ((100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))
    )
    if chksum is None or size is None or any(_nti(f) is None for f in others):
        return False, 0, 0
    return True, chksum, size


def padded_pax_records(padded: bytes, size: int) -> dict[bytes, bytes] | None:
    """:func:`pax_records` of a PAX header's ``size`` bytes, read with its block's padding.

    tarfile reads the padded blocks and goes on parsing records past ``size`` into the padding
    (3.11.7 while they match, later releases up to a NUL, raising on anything else), so a
    record hidden there could rename a member or change its size behind the header's back:
    None unless the padding starts with a NUL (or there is none).

    None too wherever :data:`HDRCHARSET` appears, even inside another record's value or in the
    padding: tarfile searches the whole padded payload for it with a regular expression and
    decodes what follows as strict UTF-8, raising on anything else.
    """
    if len(padded) > size and padded[size] != 0:
        return None
    if HDRCHARSET in padded:
        return None
    return pax_records(padded[:size])


def pax_records(payload: bytes) -> dict[bytes, bytes] | None:
    """The records of a PAX extended header, or None unless it is well formed.

    Strict on purpose: ``"%d %s=%s\\n"`` records that end exactly at the payload's end. Python
    versions differ in what they make of malformed records; for those the slower parsers
    decide, so the fast indexers agree with whichever tarfile is installed.
    """
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(payload):
        space = payload.find(b" ", pos, pos + 21)
        digits = payload[pos:space]
        if space <= pos or not digits.isdigit():
            return None
        end = pos + int(digits)
        if end <= space + 1 or end > len(payload) or payload[end - 1] != 0x0A:
            return None
        key, equals, value = payload[space + 1 : end - 1].partition(b"=")
        if not equals or not key:
            return None
        records[key] = value
        pos = end
    return records
