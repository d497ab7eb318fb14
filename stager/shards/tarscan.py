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

from collections.abc import Callable

import numpy as np

from stager.shards.members import TarColumns, TarIndex
from stager.shards.tarend import zeros_from
from stager.shards.tarfields import FILE_TYPES, META_TYPES, USTAR, vouch
from stager.shards.tarheader import BLOCK
from stager.shards.tarnames import (
    PAX_TYPES,
    PaxPayloads,
    Split,
    apply_meta,
    ext_codes,
    sample_starts,
    split_any,
    split_plain,
)

__all__ = ["scan_tar", "TarScanner"]


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
        self._batches: list[Batch] = []
        # The block after each PAX header seen in a chunk (its records, when they fit in one
        # block): read while the chunk is in cache rather than again at the end.
        self._pax_blocks: list[np.ndarray] = []
        self._pax_payloads: list[np.ndarray] = []

    @property
    def candidates(self) -> int:
        """Blocks fed so far that carry the ustar magic: at least the headers of the tar."""
        return self._pending + sum(len(batch.blocks) for batch in self._batches)

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Look at the next ``chunk`` of the tar; nothing of it is kept past the call but the
        candidate headers (copies), so the caller may reuse or unmap its buffer."""
        with memoryview(chunk) as raw, raw.cast("B") as view:
            self._feed(view)

    def _feed(self, view: memoryview) -> None:
        offset, pos = self._fed, 0
        self._fed += len(view)
        if self._carry:
            pos = min(BLOCK - len(self._carry), len(view))
            self._carry += view[:pos]
            if len(self._carry) < BLOCK:
                return
            block = np.frombuffer(bytes(self._carry), dtype=np.uint8).reshape(1, BLOCK)
            self._take(block, (offset + pos) // BLOCK - 1)
            self._carry.clear()
        whole = (len(view) - pos) // BLOCK * BLOCK
        if whole:
            blocks = np.frombuffer(view[pos : pos + whole], dtype=np.uint8).reshape(-1, BLOCK)
            self._take(blocks, (offset + pos) // BLOCK)
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
        cand = np.flatnonzero(((words >> np.uint64(8)) & np.uint64(0xFF_FFFF_FFFF)) == USTAR)
        if cand.size:
            numbered = cand + numbers if isinstance(numbers, int) else numbers[cand]
            self._rows.append(blocks[cand])
            self._row_blocks.append(numbered)
            if isinstance(numbers, int):  # consecutive blocks: keep PAX payloads seen here
                kinds = blocks[cand, 156]
                is_pax = (kinds == PAX_TYPES[0]) | (kinds == PAX_TYPES[1])  # isin costs 10x
                pax = cand[is_pax & (cand + 1 < len(blocks))]
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
        ok, size, kind, name_len, skips = vouch(hdr)
        if not ok.all():
            hdr, blocks, size, kind, name_len, skips = (
                a[ok] for a in (hdr, blocks, size, kind, name_len, skips)
            )
        if not len(blocks):
            return
        split = split_plain(hdr, name_len)
        odd = np.flatnonzero(~split.plain)
        self._batches.append(Batch(blocks, size, kind, skips, split, hdr[odd], odd, name_len[odd]))

    def finish(self, read_at: Callable[[int, int], bytes]) -> TarIndex | None:
        """The index, or None where this scanner does not vouch for the tar.

        ``read_at(offset, nbytes)`` reads the bytes fed at ``offset`` (fewer at the end).
        """
        self._check()
        if not self._batches or self._batches[0].blocks[0] != 0:
            first = read_at(0, BLOCK)
            if len(first) == BLOCK and not any(first) and zeros_from(read_at, BLOCK):
                return _empty()  # tarfile reads an archive that starts with its end as empty
            return None  # (or something after that end: tarend's check says if it is a header)
        rows = Batch.join(self._batches)
        self._batches = []
        nxt = rows.blocks + 1 + np.where(rows.skips, (rows.size + BLOCK - 1) // BLOCK, 0)
        chain = _chain(rows.blocks, nxt)
        end_block = int(nxt[chain[-1]])
        end = read_at(end_block * BLOCK, BLOCK)
        if len(end) < BLOCK or any(end):
            return None  # no end-of-archive block where tarfile looks for the next header
        if not zeros_from(read_at, (end_block + 1) * BLOCK):
            return None  # (headers the scan never saw, v7 ones too: tarend's check says)
        pax = PaxPayloads(self._pax_blocks, self._pax_payloads)
        return _index(rows.take(chain), read_at, pax)


class Batch:
    """Checked candidate headers: per row the block number, payload size, type, whether a
    payload follows, the split name; and the raw rows whose names need Python (``odd``)."""

    def __init__(self, blocks, size, kind, skips, split, odd_hdr, odd, odd_name_len):
        self.blocks, self.size, self.kind, self.skips, self.split = blocks, size, kind, skips, split
        self.odd_hdr, self.odd, self.odd_name_len = odd_hdr, odd, odd_name_len

    @staticmethod
    def join(batches: list[Batch]) -> Batch:
        if len(batches) == 1:
            return batches[0]
        starts = np.cumsum([0] + [len(b.blocks) for b in batches[:-1]])
        cat = np.concatenate
        return Batch(
            cat([b.blocks for b in batches]),
            cat([b.size for b in batches]),
            cat([b.kind for b in batches]),
            cat([b.skips for b in batches]),
            Split(
                cat([b.split.keys for b in batches]),
                cat([b.split.exts for b in batches]),
                cat([b.split.matched for b in batches]),
                cat([b.split.plain for b in batches]),
            ),
            cat([b.odd_hdr for b in batches]),
            cat([b.odd + start for b, start in zip(batches, starts, strict=True)]),
            cat([b.odd_name_len for b in batches]),
        )

    def take(self, rows: np.ndarray) -> Batch:
        """The batch restricted to ``rows`` (sorted positions)."""
        keep = np.searchsorted(rows, self.odd)
        keep = np.minimum(keep, len(rows) - 1)
        hit = rows[keep] == self.odd
        s = self.split
        return Batch(
            self.blocks[rows],
            self.size[rows],
            self.kind[rows],
            self.skips[rows],
            Split(s.keys[rows], s.exts[rows], s.matched[rows], s.plain[rows]),
            self.odd_hdr[hit],
            keep[hit],
            self.odd_name_len[hit],
        )


def _empty() -> TarIndex:
    empty = np.zeros(0, dtype=np.int64)
    return TarIndex([], np.zeros(1, dtype=np.int64), [], empty, empty)


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
    rows: Batch, read_at: Callable[[int, int], bytes], pax: PaxPayloads | None = None
) -> TarIndex | None:
    """The sample index from the headers of the chain (``rows``), in archive order."""
    is_meta = np.isin(rows.kind, META_TYPES)
    if is_meta[-1]:
        return None  # a metadata header right before the end block: tarfile raises
    meta_names = np.full(len(rows.kind), None, dtype=object)  # names set by metadata headers
    if is_meta.any() and not apply_meta(rows, is_meta, meta_names, read_at, pax):
        return None
    files = np.flatnonzero(np.isin(rows.kind, FILE_TYPES))
    split = rows.split
    plain = split.plain[files] & np.equal(meta_names[files], None)  # type: ignore[call-overload]
    if plain.all():  # the usual shard: keys stay fixed-width bytes until the end
        matched = split.matched[files]
        if not matched.any():
            return _empty()
        keys, exts = split.keys[files][matched], split.exts[files][matched]
        starts = sample_starts(keys)
        key_bytes = keys[starts]
        ext_names, codes = ext_codes(exts)
        key_list = key_bytes.astype(np.str_).tolist()
        ext_list = np.asarray(ext_names, dtype=object)[codes.ravel()].tolist()
        columns = TarColumns(key_bytes, codes.ravel().astype(np.int16), ext_names)
    else:
        keys, exts, matched = split_any(rows, files, plain, meta_names[files])
        if not matched.any():
            return _empty()
        keys, exts = keys[matched], exts[matched]
        starts = sample_starts(keys)
        key_list, ext_list, columns = keys[starts].tolist(), exts.tolist(), None
    members = files[matched]
    return TarIndex(
        keys=key_list,
        member_start=np.append(starts, len(keys)).astype(np.int64),
        exts=ext_list,
        offsets=((rows.blocks[members] + 1) * BLOCK).astype(np.int64),
        sizes=rows.size[members].astype(np.int64),
        columns=columns,
    )
