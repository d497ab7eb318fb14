"""A manifest's content hashes as one compact column (:class:`DigestColumn`).

A reader beside ``stage-in --background`` may have to copy any shard of the plan itself (around
a dead copier, or a shard the copier failed), and must then verify it against the plan's hash.
Each DataLoader worker read the whole plan into a dict of entries for that: at 1e6 shards,
~5 s and ~670 MB kept per worker, 43 GB on a node of 8 ranks x 8 workers. Here the rank keeps
the hashes it already parsed while resolving the plan as their raw bytes in one numpy array
(8 bytes per shard for xxh3_64, 32 for sha256) and one byte naming the algorithm: pages that
are never written, so forked workers share them, and a few MB to pickle for spawned ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DigestColumn"]


class DigestColumn:
    """Each shard's ``"<algorithm>:<hex>"`` (or None), stored as raw bytes; immutable.

    Digests must be canonical (lower-case hex), as every manifest reader returns them, so that
    an item reads back exactly as it was given.
    """

    __slots__ = ("_names", "_widths", "_codes", "_raw")

    def __init__(self, digests: Sequence[str | None]):
        present = [d for d in digests if d is not None]
        uniform = _uniform(present)
        if uniform is not None:
            name, rows = uniform
            self._names: tuple[str, ...] = ("", name)
            self._widths: tuple[int, ...] = (0, rows.shape[1])
            if len(present) == len(digests):
                self._codes, self._raw = np.ones(len(digests), dtype=np.uint8), rows
                return
            hashed = np.fromiter((d is not None for d in digests), bool, len(digests))
            self._codes = hashed.astype(np.uint8)  # (0: no hash)
            self._raw = np.zeros((len(digests), rows.shape[1]), dtype=np.uint8)
            self._raw[hashed] = rows
            return
        # (several algorithms in one manifest: rare, and done item by item; a code per
        # algorithm fits a byte, as the manifest readers know three)
        codes_of: dict[str, int] = {"": 0}
        widths = [0]
        codes = np.zeros(len(digests), dtype=np.uint8)
        rows_of: list[bytes] = []
        for i, digest in enumerate(digests):
            name, _, hexpart = (digest or "").partition(":")
            row = bytes.fromhex(hexpart)
            code = codes_of.setdefault(name, len(codes_of))
            if code == len(widths):
                widths.append(len(row))
            if widths[code] != len(row):
                raise ValueError(f"digest {digest!r} is not as long as the other {name} digests")
            codes[i] = code
            rows_of.append(row)
        width = max(widths)
        self._names, self._widths, self._codes = tuple(codes_of), tuple(widths), codes
        raw = np.frombuffer(b"".join(r.ljust(width, b"\0") for r in rows_of), dtype=np.uint8)
        self._raw = raw.reshape(len(rows_of), width)

    def __len__(self) -> int:
        return len(self._codes)

    def __getitem__(self, shard: int) -> str | None:
        code = int(self._codes[shard])
        if code == 0:
            return None
        return f"{self._names[code]}:{self._raw[shard, : self._widths[code]].tobytes().hex()}"

    def parts(self) -> tuple[tuple[str, ...], tuple[int, ...], np.ndarray, np.ndarray]:
        """``(names, widths, codes, raw)``: what :meth:`from_parts` takes back (a columns file
        stores them: :mod:`stager.shards.manifestcolumns`)."""
        return self._names, self._widths, self._codes, self._raw

    @classmethod
    def from_parts(
        cls,
        names: Sequence[str],
        widths: Sequence[int],
        codes: np.ndarray,
        raw: np.ndarray,
    ) -> DigestColumn:
        """The column :meth:`parts` gave; raises ``ValueError`` where they do not fit
        together (a code past the names, a width past the rows, rows not one per code)."""
        names, widths = tuple(names), tuple(int(w) for w in widths)
        codes = np.asarray(codes, dtype=np.uint8).reshape(-1)
        raw = np.asarray(raw, dtype=np.uint8)
        count = len(codes)
        if raw.ndim != 2 or len(raw) != count or len(names) != len(widths) or not names:
            raise ValueError("digest parts of other shapes")
        if names[0] != "" or widths[0] != 0 or max(widths) > raw.shape[1]:
            raise ValueError("digest widths past their rows")
        if count and int(codes.max()) >= len(names):
            raise ValueError("a digest code past the names")
        column = cls.__new__(cls)
        column._names, column._widths, column._codes, column._raw = names, widths, codes, raw
        return column

    @property
    def nbytes(self) -> int:
        """Bytes held by the column's arrays (what a worker pickles, besides a few names)."""
        return int(self._codes.nbytes + self._raw.nbytes)


def _uniform(digests: Sequence[str]) -> tuple[str, np.ndarray] | None:
    """The raw rows of ``digests`` when they are of one algorithm and canonical: the common
    case, in C (~0.35 s at 1e6 shards on a busy two-core machine, where the loop over the items
    took 1.85 s). None when that does not hold."""
    if not digests:
        return "", np.zeros((0, 0), dtype=np.uint8)
    if ":" not in digests[0]:
        return None
    first = digests[0]
    name = first[: first.index(":")]
    length, head = len(first), len(name) + 1
    joined = "".join(digests)
    if (length - head) % 2 or len(joined) != length * len(digests) or not joined.isascii():
        return None
    table = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).reshape(len(digests), length)
    if not (table[:, :head] == np.frombuffer(first[:head].encode(), np.uint8)).all():
        return None
    hexes = table[:, head:].tobytes().decode("ascii")
    try:
        raw = bytes.fromhex(hexes)
    except ValueError:
        return None
    if raw.hex() != hexes:  # upper-case hex would not read back as given
        return None
    return name, np.frombuffer(raw, dtype=np.uint8).reshape(len(digests), (length - head) // 2)
