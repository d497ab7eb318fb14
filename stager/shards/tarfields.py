"""Vouching for tar header blocks in bulk: checksums and numeric fields read as arrays.

:mod:`stager.shards.tarscan` hands over the candidate header blocks of a shard; each is checked
the way ``tarfile`` checks a header (checksum, octal or space-padded numbers, base-256 sizes
left to the slow path), with numpy over all of them at once.
"""

from __future__ import annotations

import numpy as np

from stager.shards.tarheader import numbers_general

#: The tar format's constants, shared by the scanner (tarscan) and the name splitter (tarnames).
USTAR = int.from_bytes(b"ustar", "little")
FILE_TYPES = (ord("0"), 0, ord("7"))  # tarfile's isfile(): REGTYPE, AREGTYPE, CONTTYPE
META_TYPES = tuple(map(ord, "xXLK"))  # apply to the next header; their payload is metadata
_NO_PAYLOAD_TYPES = tuple(map(ord, "123456"))  # links, devices, directories, FIFOs
_U64 = np.uint64


def vouch(hdr: np.ndarray):
    """Per candidate header: whether tarfile would accept it and this scanner handles it, its
    payload size, type byte, name length and whether tarfile skips a payload after it."""
    count = len(hdr)
    # Bytes 100-163 as eight little-endian words: mode, uid, gid, size (8 + 4 bytes), mtime
    # (4 + 8), checksum, type...; and the device numbers (bytes 329-344) as two more.
    words = np.ascontiguousarray(hdr[:, 100:164]).view("<u8")
    devices = np.ascontiguousarray(hdr[:, 329:345]).view("<u8")
    chksum, ok = _octal8(words[:, 6], checksum=True)
    assert chksum is not None  # asked for the value
    ok &= _octal8(words[:, 0:3], value=False)[1].all(axis=1)  # mode, uid, gid
    ok &= _octal8(devices, value=False)[1].all(axis=1)
    thirty_two = _U64(32)
    size, size_ok = _octal12(words[:, 3], words[:, 4] & _U64(0xFFFFFFFF))
    assert size is not None  # asked for the value
    mtime = (words[:, 4] >> thirty_two) | (words[:, 5] << thirty_two)
    ok &= size_ok & _octal12(mtime, words[:, 5] >> thirty_two, value=False)[1]
    for row in np.flatnonzero(~ok).tolist():  # rare: numbers spaced unusually, or base-256
        ok[row], chksum[row], size[row] = numbers_general(hdr[row].tobytes())
    # The checksum counts its own field as eight spaces; tarfile accepts the sum of the bytes
    # as unsigned or as signed chars. Halves of 256 bytes sum in uint16 without overflow.
    halves = hdr.reshape(count, 2, 256).sum(axis=2, dtype=np.uint16)
    unsigned = halves.sum(axis=1, dtype=np.int64) - _word_byte_sum(words[:, 6]) + 8 * 32
    good_sum = unsigned == chksum
    if not good_sum.all():
        high = (hdr >= 0x80).sum(axis=1, dtype=np.int64) - (hdr[:, 148:156] >= 0x80).sum(
            axis=1, dtype=np.int64
        )
        good_sum |= (unsigned - 256 * high) == chksum
    ok &= good_sum
    kind = hdr[:, 156].copy()
    name_len = _name_len(hdr)
    regular = np.flatnonzero(kind == 0)  # AREGTYPE: a directory if its name ends with "/"
    if regular.size:
        ends = hdr[regular, np.maximum(name_len[regular] - 1, 0)]
        kind[regular[(name_len[regular] > 0) & (ends == ord("/"))]] = ord("5")
    role = _ROLE[kind]
    ok &= role != 0
    return ok, size, kind, name_len, role >= _SKIPS


#: What a type byte means here: 0 left to the slower parsers, 1 no payload follows, 2 a file,
#: 3 a metadata header for the next one (2 and 3 are followed by their payload).
_ROLE = np.zeros(256, dtype=np.uint8)
_ROLE[list(_NO_PAYLOAD_TYPES)] = 1
_ROLE[list(FILE_TYPES)] = 2
_ROLE[list(META_TYPES)] = 3
_SKIPS = 2


def _name_len(hdr: np.ndarray) -> np.ndarray:
    """Length of each name field up to its first NUL (``tarfile.nts``), eight bytes at a time.

    ``(w - 0x01..) & ~w & 0x80..`` flags the zero bytes of a word; its lowest flag is exact.
    Words are looked at in order until every name has ended (names are mostly short). The
    last word holds bytes 96-103, of which 100-103 (the mode) count as the end.
    """
    words = hdr.view("<u8")
    length = np.full(len(hdr), -1, dtype=np.int64)
    ones, highs = _U64(0x0101010101010101), _U64(0x8080808080808080)
    open_rows = np.arange(len(hdr))
    for k in range(13):
        w = words[open_rows, k]
        if k == 12:
            w &= _U64(0xFFFFFFFF)
        flags = (w - ones) & ~w & highs
        ended = flags != 0
        if ended.any():
            lowest = flags[ended]
            lowest &= ~lowest + _U64(1)  # the lowest set bit: 0x80 << 8 * (byte in the word)
            byte = (np.log2(lowest.astype(np.float64)).astype(np.int64) - 7) // 8
            length[open_rows[ended]] = 8 * k + byte
            open_rows = open_rows[~ended]
            if not open_rows.size:
                break
    return length


def _word_byte_sum(x: np.ndarray) -> np.ndarray:
    """Sum of the eight bytes of each uint64."""
    lanes = _U64(0x00FF00FF00FF00FF)
    pairs = (x & lanes) + ((x >> _U64(8)) & lanes)
    return ((pairs * _U64(0x0001000100010001)) >> _U64(48)).astype(np.int64)


def _digits_value(x: np.ndarray, ndigits: int) -> np.ndarray:
    """Value of the ``ndigits`` octal digits at the start of each word (most significant
    first), eight bytes combined at once (SWAR): pairs, then quads, then the whole word."""
    keep = (1 << (8 * ndigits)) - 1
    d = x & _U64(0x0707070707070707 & keep)
    t = ((d & _U64(0x00FF00FF00FF00FF)) << _U64(3)) + ((d >> _U64(8)) & _U64(0x00FF00FF00FF00FF))
    u = ((t & _U64(0x0000FFFF0000FFFF)) << _U64(6)) + ((t >> _U64(16)) & _U64(0x0000FFFF0000FFFF))
    v = ((u & _U64(0xFFFFFFFF)) << _U64(12)) + (u >> _U64(32))
    return (v >> _U64(3 * (8 - ndigits))).astype(np.int64)


def _are_digits(x: np.ndarray, ndigits: int) -> np.ndarray:
    keep = (1 << (8 * ndigits)) - 1
    return (x & _U64(0xF8F8F8F8F8F8F8F8 & keep)) == _U64(0x3030303030303030 & keep)


def _byte(x: np.ndarray, i: int) -> np.ndarray:
    return (x >> _U64(8 * i)) & _U64(0xFF)


def _octal8(
    x: np.ndarray, checksum: bool = False, value: bool = True
) -> tuple[np.ndarray | None, np.ndarray]:
    """Value and usual-form flag of 8-byte number fields (``x``: the field as a word).

    Usual forms, read as tarfile's ``nti`` reads them: seven digits then NUL or space; six
    digits then NUL (the checksum's form), or then a space and NUL or space (libarchive's);
    an empty field (0). Base-256 counts as valid for the fields other than the checksum,
    whose value this scanner does not need. The form tarfile and GNU tar write is checked
    first, with few operations; only the other rows are tried against every form.
    """
    if checksum:  # six digits, NUL
        fast = _are_digits(x, 6) & (_byte(x, 6) == 0)
        values = np.where(fast, _digits_value(x, 6), 0)
    else:  # seven digits, NUL or space; or empty (devmajor and devminor of most members)
        seven = _are_digits(x, 7) & (((x >> _U64(56)) | _U64(32)) == _U64(32))
        values = np.where(seven, _digits_value(x, 7), 0) if value else None  # type: ignore[assignment]
        fast = seven | ((x & _U64(0xFF)) == _U64(0))
    if fast.all():
        return values, fast
    rest = np.nonzero(~fast)
    rest_values, fast[rest] = _octal8_forms(x[rest], checksum)
    if values is not None:
        values[rest] = rest_values
    return values, fast


def _octal8_forms(x: np.ndarray, checksum: bool) -> tuple[np.ndarray, np.ndarray]:
    b6, b7 = _byte(x, 6), _byte(x, 7)
    seven = _are_digits(x, 7) & ((b7 == 0) | (b7 == 32))
    six = _are_digits(x, 6) & ((b6 == 0) | ((b6 == 32) & ((b7 == 0) | (b7 == 32))))
    first = _byte(x, 0)
    values = np.where(seven, _digits_value(x, 7), np.where(six, _digits_value(x, 6), 0))
    ok = seven | six | (first == 0)
    if not checksum:
        ok |= (first == 0x80) | (first == 0xFF)
    return values, ok


def _octal12(
    x: np.ndarray, tail: np.ndarray, value: bool = True
) -> tuple[np.ndarray | None, np.ndarray]:
    """Value and usual-form flag of 12-byte number fields (size, mtime): eleven digits then
    NUL or space, or empty. ``x`` holds the first eight bytes, ``tail`` (uint32) the last four."""
    y = tail.astype(_U64)
    eleven = _are_digits(x, 8) & _are_digits(y, 3) & (((y >> _U64(24)) | _U64(32)) == _U64(32))
    ok = eleven | ((x & _U64(0xFF)) == _U64(0))
    if not value:
        return None, ok
    low = (
        ((y & _U64(7)) << _U64(6))
        + (((y >> _U64(8)) & _U64(7)) << _U64(3))
        + ((y >> _U64(16)) & _U64(7))
    )
    values = np.where(eleven, _digits_value(x, 8) * 512 + low.astype(np.int64), 0)
    return values, ok
