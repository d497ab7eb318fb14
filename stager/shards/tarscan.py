"""Index an uncompressed tar from its bytes with numpy: no Python per member.

Why: a shard of 25,000 ~1 KB samples has 50,000 members, and walking their headers one at a
time in Python (~10 us each) made indexing, not copying, the cost of staging it. Here the shard
is one array of 512-byte blocks, and every step is an array operation:

1. candidates: blocks with the ``ustar`` magic at byte 257 (a strided read of one word per
   block);
2. vouching: each candidate's checksum and numeric fields are checked the way ``tarfile``
   checks them; a candidate that fails, or that uses a feature left to the slower parsers
   (base-256 sizes, global PAX headers, sparse files, unknown types), is dropped;
3. the chain: each vouched header names the block where the next header starts (after its
   payload); pointer doubling from block 0 marks the headers ``tarfile`` would visit, so a tar
   stored inside a payload, whose headers are perfectly valid, is ignored;
4. the end: the chain must stop on an all-zero block inside the data.

Python runs per *metadata* header only (a GNU long name, a PAX record set) and per member
whose name is not plain ASCII; plain shards run no Python per member at all.

Anything else -- the chain reaching a block that is not a vouched header (a v7 header without
magic, a corrupt or truncated tar) -- returns None, and the caller falls back to the slower
parsers, which accept exactly what ``tarfile`` accepts and name the member where a shard
breaks. This module never decides that a shard is bad; it only vouches for the good ones.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from stager.shards.tarindex import TarColumns, TarIndex, split_key

__all__ = ["scan_tar", "TarScanner"]

_BLOCK = 512
_U64 = np.uint64
_USTAR = int.from_bytes(b"ustar", "little")
_FILE_TYPES = (ord("0"), 0, ord("7"))  # tarfile's isfile(): REGTYPE, AREGTYPE, CONTTYPE
_NO_PAYLOAD_TYPES = tuple(map(ord, "123456"))  # links, devices, directories, FIFOs
_META_TYPES = tuple(map(ord, "xXLK"))  # apply to the next header; their payload is metadata
#: ``tarfile`` decodes names with the filesystem encoding; the byte-level split below equals
#: the split of the decoded name only for UTF-8 (ASCII ``/`` and ``.`` never occur inside a
#: multi-byte sequence).
_UTF8 = sys.getfilesystemencoding().lower().replace("-", "") == "utf8"


def scan_tar(data: bytes | bytearray | memoryview) -> TarIndex | None:
    """The index :func:`stager.shards.tarindex.index_tar` would return for these tar bytes, or
    None when this scanner does not vouch for them (then ask the slower parsers)."""
    with memoryview(data) as view, view.cast("B") as octets:
        scanner = TarScanner()
        scanner.feed(octets)
        return scanner.finish(lambda offset, nbytes: octets[offset : offset + nbytes].tobytes())


class TarScanner:
    """Feed it a tar's bytes in order (chunks of any size), then :meth:`finish` for the index.

    Each chunk is looked at once, while a copy has it in the CPU cache: candidate headers are
    found and copied out (512 bytes each), and every ``_BATCH`` of them are checked and their
    names split as arrays. Only :meth:`finish` needs random access, for a few blocks: the end
    of the archive and the payloads of metadata headers.
    """

    _BATCH = 8192  # candidate headers checked together: large enough to amortise numpy calls

    def __init__(self) -> None:
        self._fed = 0  # bytes fed so far
        self._carry = bytearray()  # the start of a block split between two chunks
        self._rows: list[np.ndarray] = []  # candidate headers (copies) not checked yet
        self._row_blocks: list[np.ndarray] = []  # their block numbers
        self._pending = 0
        self._batches: list[_Batch] = []
        # The block after each PAX header seen in a chunk (its records, when they fit in one
        # block): read while the chunk is in cache rather than again at the end.
        self._pax_blocks: list[np.ndarray] = []
        self._pax_payloads: list[np.ndarray] = []

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Look at the next ``chunk`` of the tar; nothing of it is kept past the call but the
        candidate headers (copies), so the caller may reuse or unmap its buffer."""
        with memoryview(chunk) as raw, raw.cast("B") as view:
            self._feed(view)

    def _feed(self, view: memoryview) -> None:
        offset, pos = self._fed, 0
        self._fed += len(view)
        if self._carry:
            pos = min(_BLOCK - len(self._carry), len(view))
            self._carry += view[:pos]
            if len(self._carry) < _BLOCK:
                return
            block = np.frombuffer(bytes(self._carry), dtype=np.uint8).reshape(1, _BLOCK)
            self._take(block, (offset + pos) // _BLOCK - 1)
            self._carry.clear()
        whole = (len(view) - pos) // _BLOCK * _BLOCK
        if whole:
            blocks = np.frombuffer(view[pos : pos + whole], dtype=np.uint8).reshape(-1, _BLOCK)
            self._take(blocks, (offset + pos) // _BLOCK)
        self._carry += view[pos + whole :]

    def feed_headers(self, headers: np.ndarray, block_numbers: np.ndarray) -> None:
        """Feed header blocks found by walking the tar (``headers``: rows of 512 bytes), not
        every byte: where members are large, reading only their headers saves reading the
        payloads from disk. The blocks the walk skipped are never candidates, so the walk
        decides which headers are seen; :meth:`finish` still checks that they chain."""
        self._take(headers, np.asarray(block_numbers, dtype=np.int64))

    def _take(self, blocks: np.ndarray, numbers: np.ndarray | int) -> None:
        """Keep the blocks with the ustar magic; ``numbers``: their block numbers, or the
        number of the first of consecutive blocks."""
        words = blocks.view("<u8")[:, 32]  # bytes 256-263 of every block
        cand = np.flatnonzero(((words >> _U64(8)) & _U64(0xFF_FFFF_FFFF)) == _USTAR)
        if cand.size:
            numbered = cand + numbers if isinstance(numbers, int) else numbers[cand]
            self._rows.append(blocks[cand])
            self._row_blocks.append(numbered)
            if isinstance(numbers, int):  # consecutive blocks: keep PAX payloads seen here
                pax = cand[np.isin(blocks[cand, 156], _PAX_TYPES) & (cand + 1 < len(blocks))]
                if pax.size:
                    self._pax_blocks.append(pax + numbers)
                    self._pax_payloads.append(blocks[pax + 1])
            self._pending += cand.size
            if self._pending >= self._BATCH:
                self._check()

    def _check(self) -> None:
        if not self._pending:
            return
        hdr = np.concatenate(self._rows) if len(self._rows) > 1 else self._rows[0]
        blocks = np.concatenate(self._row_blocks)
        self._rows, self._row_blocks, self._pending = [], [], 0
        ok, size, kind, name_len, skips = _vouch(hdr)
        if not ok.all():
            hdr, blocks, size, kind, name_len, skips = (
                a[ok] for a in (hdr, blocks, size, kind, name_len, skips)
            )
        if not len(blocks):
            return
        split = _split_plain(hdr, name_len)
        odd = np.flatnonzero(~split.plain)
        self._batches.append(_Batch(blocks, size, kind, skips, split, hdr[odd], odd, name_len[odd]))

    def finish(self, read_at: Callable[[int, int], bytes]) -> TarIndex | None:
        """The index, or None where this scanner does not vouch for the tar.

        ``read_at(offset, nbytes)`` reads the bytes fed at ``offset`` (fewer at the end).
        """
        self._check()
        if not self._batches or self._batches[0].blocks[0] != 0:
            first = read_at(0, _BLOCK)
            if len(first) == _BLOCK and not any(first):
                return _empty()  # tarfile reads an archive that starts with its end as empty
            return None
        rows = _Batch.join(self._batches)
        self._batches = []
        nxt = rows.blocks + 1 + np.where(rows.skips, (rows.size + _BLOCK - 1) // _BLOCK, 0)
        chain = _chain(rows.blocks, nxt)
        end = read_at(int(nxt[chain[-1]]) * _BLOCK, _BLOCK)
        if len(end) < _BLOCK or any(end):
            return None  # no end-of-archive block where tarfile looks for the next header
        pax = _PaxPayloads(self._pax_blocks, self._pax_payloads)
        return _index(rows.take(chain), read_at, pax)


class _Batch:
    """Checked candidate headers: per row the block number, payload size, type, whether a
    payload follows, the split name; and the raw rows whose names need Python (``odd``)."""

    def __init__(self, blocks, size, kind, skips, split, odd_hdr, odd, odd_name_len):
        self.blocks, self.size, self.kind, self.skips, self.split = blocks, size, kind, skips, split
        self.odd_hdr, self.odd, self.odd_name_len = odd_hdr, odd, odd_name_len

    @staticmethod
    def join(batches: list[_Batch]) -> _Batch:
        if len(batches) == 1:
            return batches[0]
        starts = np.cumsum([0] + [len(b.blocks) for b in batches[:-1]])
        cat = np.concatenate
        return _Batch(
            cat([b.blocks for b in batches]),
            cat([b.size for b in batches]),
            cat([b.kind for b in batches]),
            cat([b.skips for b in batches]),
            _Split(
                cat([b.split.keys for b in batches]),
                cat([b.split.exts for b in batches]),
                cat([b.split.matched for b in batches]),
                cat([b.split.plain for b in batches]),
            ),
            cat([b.odd_hdr for b in batches]),
            cat([b.odd + start for b, start in zip(batches, starts, strict=True)]),
            cat([b.odd_name_len for b in batches]),
        )

    def take(self, rows: np.ndarray) -> _Batch:
        """The batch restricted to ``rows`` (sorted positions)."""
        keep = np.searchsorted(rows, self.odd)
        keep = np.minimum(keep, len(rows) - 1)
        hit = rows[keep] == self.odd
        s = self.split
        return _Batch(
            self.blocks[rows],
            self.size[rows],
            self.kind[rows],
            self.skips[rows],
            _Split(s.keys[rows], s.exts[rows], s.matched[rows], s.plain[rows]),
            self.odd_hdr[hit],
            keep[hit],
            self.odd_name_len[hit],
        )


def _empty() -> TarIndex:
    empty = np.zeros(0, dtype=np.int64)
    return TarIndex([], np.zeros(1, dtype=np.int64), [], empty, empty)


def _vouch(hdr: np.ndarray):
    """Per candidate header: whether tarfile would accept it and this scanner handles it, its
    payload size, type byte, name length and whether tarfile skips a payload after it."""
    count = len(hdr)
    # Bytes 100-163 as eight little-endian words: mode, uid, gid, size (8 + 4 bytes), mtime
    # (4 + 8), checksum, type...; and the device numbers (bytes 329-344) as two more.
    words = np.ascontiguousarray(hdr[:, 100:164]).view("<u8")
    devices = np.ascontiguousarray(hdr[:, 329:345]).view("<u8")
    chksum, ok = _octal8(words[:, 6], checksum=True)
    ok &= _octal8(words[:, 0:3], value=False)[1].all(axis=1)  # mode, uid, gid
    ok &= _octal8(devices, value=False)[1].all(axis=1)
    thirty_two = _U64(32)
    size, size_ok = _octal12(words[:, 3], words[:, 4] & _U64(0xFFFFFFFF))
    mtime = (words[:, 4] >> thirty_two) | (words[:, 5] << thirty_two)
    ok &= size_ok & _octal12(mtime, words[:, 5] >> thirty_two, value=False)[1]
    for row in np.flatnonzero(~ok).tolist():  # rare: numbers spaced unusually, or base-256
        ok[row], chksum[row], size[row] = _numbers_general(hdr[row].tobytes())
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
_ROLE[list(_FILE_TYPES)] = 2
_ROLE[list(_META_TYPES)] = 3
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
        values = np.where(seven, _digits_value(x, 7), 0) if value else None
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


def _numbers_general(header: bytes) -> tuple[bool, int, int]:
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


def _chain(cand: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Positions (into ``cand``) of the headers reached from block 0, in order.

    ``nxt[i]`` is the block where the header after ``cand[i]`` must start. Following it one
    step at a time would be Python per member; pointer doubling gets the same set in
    ``log2(len(cand))`` array steps: after step ``k`` the marked set holds the first ``2**k``
    headers of the chain, and the jump table moves ``2**k`` headers ahead. Headers inside
    payloads (an embedded tar) are candidates too, but never reached. Returns None when the
    chain leaves the candidates somewhere other than its end (a header the scanner did not
    vouch for): the caller cannot tell a corrupt tar from an unusual one and falls back.
    """
    count = len(cand)
    pos = np.minimum(np.searchsorted(cand, nxt), count - 1)
    jump = np.append(np.where(cand[pos] == nxt, pos, count), count)  # ``count``: left the set
    reached = np.zeros(count + 1, dtype=bool)
    reached[0] = True
    while not reached[count]:
        reached[jump[reached]] = True
        jump = jump[jump]
    return np.flatnonzero(reached[:count])


def _index(
    rows: _Batch, read_at: Callable[[int, int], bytes], pax: _PaxPayloads | None = None
) -> TarIndex | None:
    """The sample index from the headers of the chain (``rows``), in archive order."""
    is_meta = np.isin(rows.kind, _META_TYPES)
    if is_meta[-1]:
        return None  # a metadata header right before the end block: tarfile raises
    meta_names = np.full(len(rows.kind), None, dtype=object)  # names set by metadata headers
    if is_meta.any() and not _apply_meta(rows, is_meta, meta_names, read_at, pax):
        return None
    files = np.flatnonzero(np.isin(rows.kind, _FILE_TYPES))
    split = rows.split
    plain = split.plain[files] & np.equal(meta_names[files], None)
    if plain.all():  # the usual shard: keys stay fixed-width bytes until the end
        matched = split.matched[files]
        if not matched.any():
            return _empty()
        keys, exts = split.keys[files][matched], split.exts[files][matched]
        starts = _starts(keys)
        key_bytes = keys[starts]
        ext_names, codes = _ext_codes(exts)
        key_list = key_bytes.astype(np.str_).tolist()
        ext_list = np.asarray(ext_names, dtype=object)[codes.ravel()].tolist()
        columns = TarColumns(key_bytes, codes.ravel().astype(np.int16), ext_names)
    else:
        keys, exts, matched = _split_any(rows, files, plain, meta_names[files])
        if not matched.any():
            return _empty()
        keys, exts = keys[matched], exts[matched]
        starts = _starts(keys)
        key_list, ext_list, columns = keys[starts].tolist(), exts.tolist(), None
    members = files[matched]
    return TarIndex(
        keys=key_list,
        member_start=np.append(starts, len(keys)).astype(np.int64),
        exts=ext_list,
        offsets=((rows.blocks[members] + 1) * _BLOCK).astype(np.int64),
        sizes=rows.size[members].astype(np.int64),
        columns=columns,
    )


def _starts(keys: np.ndarray) -> np.ndarray:
    """Positions where the key changes: WebDataset groups consecutive members by key."""
    new = np.ones(len(keys), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    return np.flatnonzero(new)


def _ext_codes(exts: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """The distinct extensions (ASCII bytes) as str, and each member's code into them.

    Up to 8 bytes (nearly always) they are sorted as integers, several times faster than
    as strings; numpy's ``unique`` sorts either way, and the codes only need to be consistent.
    """
    if exts.size and int(np.strings.str_len(exts).max()) <= 8:
        words = np.ascontiguousarray(exts.astype("S8")).view("<u8")
        uniq, codes = np.unique(words, return_inverse=True)
        names = uniq.view("S8")
    else:
        names, codes = np.unique(exts, return_inverse=True)
    return tuple(u.decode("ascii") for u in names.tolist()), codes.ravel()


def _ext_list(exts: np.ndarray) -> list[str]:
    """Fixed-width ASCII extensions as a list of str, one object per distinct extension."""
    uniq, inverse = np.unique(exts, return_inverse=True)
    names = np.asarray([u.decode("ascii") for u in uniq.tolist()], dtype=object)
    return names[inverse.ravel()].tolist()


def _apply_meta(
    rows: _Batch,
    is_meta: np.ndarray,
    names: np.ndarray,
    read_at: Callable[[int, int], bytes],
    pax: _PaxPayloads | None = None,
) -> bool:
    """Read GNU long names and PAX paths into ``names`` (by chain position); False: left to
    tarfile.

    A metadata header applies to the next header, and in a run of them the first one that sets
    a name wins: tarfile processes each by reading the next header recursively and patching it
    afterwards, so the outermost patch is the last applied. PAX headers whose records fit in
    one block and set no path (a float mtime on every member, as webdataset writes them) are
    checked as arrays (:func:`_pax_check`); the rest run :func:`_pax_records` one by one.
    """
    positions = np.flatnonzero(is_meta)
    is_pax = np.isin(rows.kind[positions], _PAX_TYPES)
    if is_pax.any() and not _UTF8:
        return False
    one_by_one = ~is_pax
    if is_pax.any():
        pax_positions = positions[is_pax]
        sizes = rows.size[pax_positions]
        payloads, found = (pax or _PaxPayloads([], [])).lookup(rows.blocks[pax_positions])
        small = found & (sizes <= _BLOCK)
        checked = np.zeros(len(pax_positions), dtype=bool)
        if small.any():
            ok, plain = _pax_check(payloads[small], sizes[small])
            if not ok.all():
                return False  # malformed, or a size / sparse record: tarfile decides
            checked[np.flatnonzero(small)[plain]] = True  # no path, nothing to apply
        one_by_one[np.flatnonzero(is_pax)[~checked]] = True
    for pos in positions[one_by_one][::-1].tolist():  # last first: the first of a run wins
        start = (int(rows.blocks[pos]) + 1) * _BLOCK
        nbytes = int(rows.size[pos])
        target = pos + 1
        while is_meta[target]:
            target += 1
        code = int(rows.kind[pos])
        if code == ord("L"):  # tarfile reads the padded blocks and stops at the first NUL
            padded = read_at(start, -(-nbytes // _BLOCK) * _BLOCK)
            name = padded.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            names[target] = name.removesuffix("/") if rows.kind[target] == ord("5") else name
        elif code in _PAX_TYPES:
            records = _pax_records(read_at(start, nbytes))
            if records is None or b"size" in records:
                return False
            if any(key.startswith(b"GNU.sparse.") for key in records):
                return False
            if b"path" in records:
                names[target] = records[b"path"].decode("utf-8", "surrogateescape").rstrip("/")
        # "K" (GNU long link name) only sets the link target, which the index does not use.
    return True


class _PaxPayloads:
    """The first payload block of PAX headers, by the header's block number."""

    def __init__(self, blocks: list[np.ndarray], payloads: list[np.ndarray]) -> None:
        self.blocks = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        self.payloads = np.concatenate(payloads) if payloads else np.zeros((0, _BLOCK), np.uint8)

    def lookup(self, headers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(payload rows, found) for these header block numbers (rows of zeros where absent)."""
        if not self.blocks.size:
            return np.zeros((len(headers), _BLOCK), np.uint8), np.zeros(len(headers), bool)
        at = np.minimum(np.searchsorted(self.blocks, headers), len(self.blocks) - 1)
        found = self.blocks[at] == headers
        return self.payloads[at], found


_PAX_TYPES = (ord("x"), ord("X"))
_MAX_RECORDS = 16  # more records than this in one block: checked one by one


def _pax_check(payloads: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check PAX record sets as :func:`_pax_records` would, a record at a time for all rows.

    Returns ``ok`` (well formed, without ``size`` or ``GNU.sparse.*`` records) and ``plain``
    (ok, and without a ``path`` record nor anything this check leaves to
    :func:`_pax_records`: length fields of more than 6 digits, more than ``_MAX_RECORDS``
    records). Rows that are ok but not plain go through :func:`_pax_records`.
    """
    count = len(sizes)
    rows = np.arange(count)
    pos = np.zeros(count, dtype=np.int64)
    ok = np.ones(count, dtype=bool)
    plain = np.ones(count, dtype=bool)
    cols = np.arange(21)
    for _ in range(_MAX_RECORDS):
        active = ok & plain & (pos < sizes)
        if not active.any():
            break
        at = pos[:, None] + cols
        window = np.where(at < sizes[:, None], _gather(payloads, pos, 21), 0)
        is_space = window == ord(" ")
        has_space = is_space.any(axis=1)
        space = np.where(has_space, is_space.argmax(axis=1), 0)  # digits before the space
        is_digit = (window >= ord("0")) & (window <= ord("9"))
        digits_ok = has_space & (space >= 1) & (is_digit | (cols >= space[:, None])).all(axis=1)
        long_field = digits_ok & (space > 6)
        plain &= ~(active & long_field)
        weights = np.where(cols < space[:, None], 10 ** np.clip(space[:, None] - 1 - cols, 0, 6), 0)
        length = ((window.astype(np.int64) - ord("0")) * weights).sum(axis=1)
        end = pos + length
        key_at = pos + space + 1
        good = digits_ok & ~long_field & (end > key_at) & (end <= sizes)
        last = payloads[rows, np.clip(end - 1, 0, 511)]
        good &= last == ord("\n")
        width = int(np.where(active & good, end - 1 - key_at, 0).max())
        key_cols = np.arange(max(width, 11))
        at = key_at[:, None] + key_cols
        inside = at < (end - 1)[:, None]
        key_bytes = np.where(inside, _gather(payloads, key_at, len(key_cols)), 0)
        is_equals = (key_bytes == ord("=")) & inside
        has_equals = is_equals.any(axis=1)
        key_len = np.where(has_equals, is_equals.argmax(axis=1), 0)
        good &= has_equals & (key_len >= 1)
        head = key_bytes[:, :11]
        is_size = (key_len == 4) & (head[:, :4] == _SIZE).all(axis=1)
        is_path = (key_len == 4) & (head[:, :4] == _PATH).all(axis=1)
        is_sparse = (key_len >= 11) & (head == _SPARSE).all(axis=1)
        ok &= ~active | long_field | (good & ~is_size & ~is_sparse)
        plain &= ~(active & is_path)
        pos = np.where(active, end, pos)
    leftover = ok & plain & (pos < sizes)  # more records than checked here
    plain &= ~leftover
    ok &= ~(plain & (pos != sizes))
    return ok, plain & ok


def _gather(rows: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """``rows[i, start[i] : start[i] + width]`` for every row (clipped to the row's end): a
    slice when every row starts at the same place (the first record of most PAX headers)."""
    first = int(start[0]) if len(start) else 0
    if (start == first).all() and 0 <= first and first + width <= rows.shape[1]:
        return rows[:, first : first + width]
    at = np.clip(start[:, None] + np.arange(width), 0, rows.shape[1] - 1)
    return np.take_along_axis(rows, at, axis=1)


_SIZE = np.frombuffer(b"size", dtype=np.uint8)
_PATH = np.frombuffer(b"path", dtype=np.uint8)
_SPARSE = np.frombuffer(b"GNU.sparse.", dtype=np.uint8)


def _pax_records(payload: bytes) -> dict[bytes, bytes] | None:
    """The records of a PAX extended header, or None unless it is well formed.

    Strict on purpose: ``"%d %s=%s\\n"`` records that end exactly at the payload's end. Python
    versions differ in what they make of malformed records; for those the slower parsers
    decide, so this scanner agrees with whichever tarfile is installed.
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


class _Split:
    """Names split by whole-array operations: fixed-width ``keys``/``exts`` (bytes) per member,
    ``matched`` where the name has a key and an extension, ``plain`` where the split is valid
    (ASCII, no newline); the other rows are left to :func:`stager.shards.tarindex.split_key`."""

    def __init__(self, keys: np.ndarray, exts: np.ndarray, matched: np.ndarray, plain: np.ndarray):
        self.keys, self.exts, self.matched, self.plain = keys, exts, matched, plain


def _split_plain(hdr: np.ndarray, name_len: np.ndarray) -> _Split:
    """Split ``prefix/dirs/key.ext`` exactly as ``split_key``'s pattern does, for every row
    whose name (and ustar prefix) is ASCII without a newline.

    The pattern takes the key up to the first dot of the base name, which must not start with
    a dot, and the extension to the end; ``.`` in ``(?:.*/|)`` does not match a newline, hence
    names with one are left to the pattern itself. The searches are numpy's string functions
    (one C loop over all names each), on the names cut at their first NUL.
    """
    count = len(hdr)
    width = max(1, int(name_len.max())) if count else 1
    name = np.ascontiguousarray(hdr[:, :width])
    names = name.view(f"S{width}").ravel()
    if count and (np.strings.str_len(names) != name_len).any():  # bytes after a NUL: cut
        name = np.ascontiguousarray(np.where(np.arange(width) < name_len[:, None], name, 0))
        names = name.view(f"S{width}").ravel()
    plain = np.ones(count, dtype=bool)
    if (name >= 0x80).any() or (name == ord("\n")).any():  # per row only where needed
        plain = ~((name >= 0x80) | (name == ord("\n"))).any(axis=1)
    prefix_len = _field_len(hdr, 345, 500) if hdr[:, 345].any() else np.zeros(count, np.int64)
    pwidth = int(prefix_len.max()) if count else 0
    if pwidth:
        prefix = np.ascontiguousarray(hdr[:, 345 : 345 + pwidth])
        in_prefix = np.arange(pwidth) < prefix_len[:, None]
        plain &= ~(((prefix >= 0x80) | (prefix == ord("\n"))) & in_prefix).any(axis=1)
    base = np.strings.rfind(names, b"/") + 1  # where the base name starts (0: no slash)
    dot = np.strings.find(names, b".", base)  # -1: none; == base: the base name starts with "."
    matched = plain & (dot > base)
    cut = np.where(matched, dot, 0)
    keys = np.strings.slice(names, 0, cut)
    if pwidth:
        pre = np.ascontiguousarray(np.where(np.arange(pwidth) < prefix_len[:, None], prefix, 0))
        joined = np.strings.add(np.strings.add(pre.view(f"S{pwidth}").ravel(), b"/"), keys)
        keys = np.where(prefix_len > 0, joined, keys.astype(joined.dtype))
    exts = np.strings.slice(names, cut + 1, None)
    return _Split(keys, exts, matched, plain)


def _field_len(hdr: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Length of each header's ``[lo, hi)`` text field up to its first NUL (``tarfile.nts``)."""
    field = np.ascontiguousarray(hdr[:, lo:hi])
    length = np.strings.str_len(field.view(f"S{hi - lo}").ravel())  # to the last non-NUL
    width = int(length.max()) if len(length) else 0
    if width:
        inner = (field[:, :width] == 0) & (np.arange(width) < length[:, None])
        rows = np.flatnonzero(inner.any(axis=1))
        if rows.size:  # a NUL before the last byte: the text ends there
            length[rows] = inner[rows].argmax(axis=1)
    return length


def _split_any(
    rows: _Batch, files: np.ndarray, plain: np.ndarray, meta_names: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys and extensions (str objects) of ``files`` when some names need the pattern
    (non-ASCII, a newline, a name from a metadata header): those rows, and only those, run
    Python."""
    count = len(files)
    keys = np.full(count, None, dtype=object)
    exts = np.full(count, None, dtype=object)
    matched = rows.split.matched[files] & plain
    done = np.flatnonzero(matched)
    keys[done] = rows.split.keys[files[done]].astype(np.str_)
    exts[done] = np.asarray(_ext_list(rows.split.exts[files[done]]), dtype=object)
    for i in np.flatnonzero(~plain).tolist():
        full = meta_names[i]
        if full is None:  # an odd name in the header itself: its row was kept
            j = int(np.searchsorted(rows.odd, files[i]))
            header = rows.odd_hdr[j]
            raw = header[: rows.odd_name_len[j]].tobytes()
            prefix = header[345:500].tobytes().split(b"\0", 1)[0]
            full = ((prefix + b"/" if prefix else b"") + raw).decode("utf-8", "surrogateescape")
        parts = split_key(full)
        if parts is not None:
            keys[i], exts[i] = parts
            matched[i] = True
    return keys, exts, matched
