"""Member names in bulk: WebDataset keys and extensions split with numpy, and the metadata
headers (GNU long names, PAX records) that change the name of the member after them.

Part of :mod:`stager.shards.tarscan`; Python runs per metadata header and per member whose
name is not plain ASCII only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from stager.shards.members import split_key
from stager.shards.tarheader import BLOCK, HDRCHARSET, NAME_ENCODING, UTF8, padded_pax_records

if TYPE_CHECKING:
    from stager.shards.tarscan import Batch


def sample_starts(keys: np.ndarray) -> np.ndarray:
    """Positions where the key changes: WebDataset groups consecutive members by key."""
    new = np.ones(len(keys), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    return np.flatnonzero(new)


def ext_codes(exts: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """The distinct extensions (ASCII bytes) as str, in order of first appearance, and each
    member's code into them.

    First appearance, as the compiled walk numbers them: the loader index a loader builds
    from this scanner is then the one stage-in writes from the walk, byte for byte (sorted,
    as ``unique`` gives them, the two differed in ``ext_names`` and ``member_ext``). Up to 8
    bytes (nearly always) they are found as integers, several times faster than as strings.
    """
    if exts.size and int(np.strings.str_len(exts).max()) <= 8:
        words = np.ascontiguousarray(exts.astype("S8")).view("<u8")
        uniq, first, codes = np.unique(words, return_index=True, return_inverse=True)
        names = uniq.view("S8")
    else:
        names, first, codes = np.unique(exts, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return tuple(u.decode("ascii") for u in names[order].tolist()), rank[codes.ravel()]


def _ext_list(exts: np.ndarray) -> list[str]:
    """Fixed-width ASCII extensions as a list of str, one object per distinct extension."""
    uniq, inverse = np.unique(exts, return_inverse=True)
    names = np.asarray([u.decode("ascii") for u in uniq.tolist()], dtype=object)
    return names[inverse.ravel()].tolist()


def apply_meta(
    rows: Batch,
    is_meta: np.ndarray,
    names: np.ndarray,
    read_at: Callable[[int, int], bytes],
    pax: PaxPayloads | None = None,
) -> bool:
    """Read GNU long names and PAX paths into ``names`` (by chain position); False: left to
    tarfile.

    A metadata header applies to the next header, and in a run of them the first one that sets
    a name wins: tarfile processes each by reading the next header recursively and patching it
    afterwards, so the outermost patch is the last applied. PAX headers whose records fit in
    one block and set no path (a float mtime on every member, as webdataset writes them) are
    checked as arrays (:func:`_pax_check`); the rest run :func:`pax_records` one by one.
    """
    positions = np.flatnonzero(is_meta)
    is_pax = np.isin(rows.kind[positions], PAX_TYPES)
    if is_pax.any() and not UTF8:
        return False
    one_by_one = ~is_pax
    if is_pax.any():
        pax_positions = positions[is_pax]
        sizes = rows.size[pax_positions]
        payloads, found = (pax or PaxPayloads([], [])).lookup(rows.blocks[pax_positions])
        small = found & (sizes <= BLOCK)
        checked = np.zeros(len(pax_positions), dtype=bool)
        if small.any():
            if HDRCHARSET in payloads[small].tobytes():
                return False  # tarfile decodes what follows strictly (padded_pax_records)
            ok, plain = _pax_check(payloads[small], sizes[small])
            if not ok.all():
                return False  # malformed, or a size / sparse record: tarfile decides
            checked[np.flatnonzero(small)[plain]] = True  # no path, nothing to apply
        one_by_one[np.flatnonzero(is_pax)[~checked]] = True
    for pos in positions[one_by_one][::-1].tolist():  # last first: the first of a run wins
        start = (int(rows.blocks[pos]) + 1) * BLOCK
        nbytes = int(rows.size[pos])
        target = pos + 1
        while is_meta[target]:
            target += 1
        code = int(rows.kind[pos])
        if code == ord("L"):  # tarfile reads the padded blocks and stops at the first NUL
            padded = read_at(start, -(-nbytes // BLOCK) * BLOCK)
            name = padded.split(b"\0", 1)[0].decode(NAME_ENCODING, "surrogateescape")
            names[target] = name.removesuffix("/") if rows.kind[target] == ord("5") else name
        elif code in PAX_TYPES:
            records = padded_pax_records(read_at(start, -(-nbytes // BLOCK) * BLOCK), nbytes)
            if records is None or b"size" in records:
                return False
            if any(key.startswith(b"GNU.sparse.") for key in records):
                return False
            if b"path" in records:
                names[target] = records[b"path"].decode("utf-8", "surrogateescape").rstrip("/")
        # "K" (GNU long link name) only sets the link target, which the index does not use.
    return True


class PaxPayloads:
    """The first payload block of PAX headers, by the header's block number."""

    def __init__(self, blocks: list[np.ndarray], payloads: list[np.ndarray]) -> None:
        self.blocks = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        self.payloads = np.concatenate(payloads) if payloads else np.zeros((0, BLOCK), np.uint8)

    def lookup(self, headers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(payload rows, found) for these header block numbers (rows of zeros where absent)."""
        if not self.blocks.size:
            return np.zeros((len(headers), BLOCK), np.uint8), np.zeros(len(headers), bool)
        at = np.minimum(np.searchsorted(self.blocks, headers), len(self.blocks) - 1)
        found = self.blocks[at] == headers
        return self.payloads[at], found


PAX_TYPES = (ord("x"), ord("X"))
_MAX_RECORDS = 16  # more records than this in one block: checked one by one


def _pax_check(payloads: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check PAX record sets as :func:`pax_records` would, a record at a time for all rows.

    Returns ``ok`` (well formed, without ``size`` or ``GNU.sparse.*`` records) and ``plain``
    (ok, and without a ``path`` record nor anything this check leaves to
    :func:`pax_records`: length fields of more than 6 digits, more than ``_MAX_RECORDS``
    records). Rows that are ok but not plain go through :func:`pax_records`.
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
    # tarfile parses on into the block's padding: only a NUL right after the records ends them
    # (sizes of whole blocks have no padding; see padded_pax_records)
    ok &= (sizes % BLOCK == 0) | (payloads[rows, sizes % BLOCK] == 0)
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


class Split:
    """Names split by whole-array operations: fixed-width ``keys``/``exts`` (bytes) per member,
    ``matched`` where the name has a key and an extension, ``plain`` where the split is valid
    (ASCII, no newline); the other rows are left to :func:`stager.shards.tarindex.split_key`."""

    def __init__(self, keys: np.ndarray, exts: np.ndarray, matched: np.ndarray, plain: np.ndarray):
        self.keys, self.exts, self.matched, self.plain = keys, exts, matched, plain


def split_plain(hdr: np.ndarray, name_len: np.ndarray) -> Split:
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
    exts = np.strings.lower(np.strings.slice(names, cut + 1, None))  # as split_key does
    return Split(keys, exts, matched, plain)


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


def split_any(
    rows: Batch, files: np.ndarray, plain: np.ndarray, meta_names: np.ndarray
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
            full = ((prefix + b"/" if prefix else b"") + raw).decode(
                NAME_ENCODING, "surrogateescape"
            )
        parts = split_key(full)
        if parts is not None:
            keys[i], exts[i] = parts
            matched[i] = True
    return keys, exts, matched
