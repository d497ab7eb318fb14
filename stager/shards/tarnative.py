"""The compiled tar walk (``stager/shards/_tarwalk.c``), where it was built: a shard's index
from its bytes in flight, with no Python per member and without the interpreter lock.

Why compiled: the numpy scanner (:mod:`stager.shards.tarscan`) costs ~36 ms per 77 MB shard of
25,000 ~1 KB samples, as much as copying it; the walk costs ~1 ms, and while it runs the
other copy threads keep the interpreter. It vouches for the tars the small-shard walk
(:mod:`stager.shards.tarwalk`) vouches for, and for GNU long names and PAX paths, when the
names are printable ASCII; for anything else it says None and the callers go on to the
scanner, then ``tarfile``, exactly as before.

The extension is built by ``pip install`` (``setup.py``, optional: without a C compiler the
package installs without it). ``STAGER_NATIVE_TAR=0`` turns it off, to compare or to rule it
out; ``STAGER_NATIVE_TAR=1`` makes its absence an error (the test suite sets it, so a build
that silently failed cannot pass as the fallback).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from stager.native import load_optional
from stager.shards.members import TarColumns, TarIndex, repeated_member, split_message
from stager.shards.tarheader import UTF8

__all__ = [
    "NativeWalk",
    "WalkResult",
    "available",
    "join_columns",
    "native_walk",
    "to_index",
    "walk_bytes",
]


class NativeWalk(Protocol):
    """What ``_tarwalk.TarWalker`` offers (typed here: the extension has no stubs)."""

    fed: int  # bytes fed so far, by feed() or by the byte pump

    def feed(self, chunk: bytes | bytearray | memoryview) -> None: ...
    def finish(self) -> dict[str, Any] | None: ...


#: (Off where the filesystem encoding is not UTF-8: tarfile's names and PAX records differ.)
_module: Any = load_optional("stager.shards._tarwalk", "STAGER_NATIVE_TAR") if UTF8 else None


class WalkResult:
    """One shard's walk as the extension returned it: its columns as bytes.

    Kept as bytes (not a :class:`TarIndex`) until something needs one: the loader index of a
    whole dataset is joined from these column by column (``loader_index``), where a
    ``TarIndex`` per shard cost ~12 us of numpy each, a tenth of a 20 KB shard's copy. A
    slotted class, not a frozen dataclass, whose ``__init__`` cost ~0.8 us of a finish's
    serial Python per shard; treat it as immutable.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts

    def __repr__(self) -> str:
        return f"WalkResult(samples={self.parts.get('samples')})"

    @property
    def num_samples(self) -> int:
        return int(self.parts["samples"])

    @property
    def duplicate(self) -> str | None:
        """The first member named twice in one sample (``"key.ext"``), found by the walk."""
        return self.parts["duplicate"]

    @property
    def problem(self) -> str | None:
        """What is wrong with how the members group into samples, said in one sentence
        (:func:`stager.shards.members.grouping_problem`), or None."""
        if self.parts["duplicate"] is not None:
            return repeated_member(self.parts["duplicate"])
        split = self.parts.get("split")
        return None if split is None else split_message(split)

    def index(self) -> TarIndex:
        return to_index(self.parts)


def available() -> bool:
    """Whether the compiled walk is built and enabled."""
    return _module is not None


def join_columns(
    walks: Sequence[dict[str, Any]], lookup: bytes, table_at: bytes, n_names: int
) -> dict[str, Any]:
    """The compiled join of many walks' columns into a dataset index's
    (:func:`stager.shards.indexfile.join_walks` says what it takes and gives)."""
    if _module is None:
        raise RuntimeError("the compiled tar walk is not built")
    return _module.join_walks(walks, lookup, table_at, n_names)


def native_walk() -> NativeWalk | None:
    """A new walker to feed a tar's bytes to, or None where the extension is not available."""
    return None if _module is None else _module.TarWalker()


def walk_bytes(data: bytes | bytearray | memoryview) -> TarIndex | None:
    """The index of a whole tar in memory (or mapped), or None where the walk does not vouch
    or is not available."""
    walker = native_walk()
    if walker is None:
        return None
    walker.feed(data)
    parts = walker.finish()
    return None if parts is None else to_index(parts)


def to_index(parts: dict[str, Any]) -> TarIndex:
    """The :class:`TarIndex` of a walk's result: its arrays are views of the walk's bytes."""
    import numpy as np  # deferred: a copy thread reaches here only after the copies

    key_bytes = np.frombuffer(parts["key_bytes"], dtype=f"S{parts['key_width']}")
    codes = np.frombuffer(parts["ext_codes"], dtype=np.int16)
    names = parts["ext_names"]
    return TarIndex(
        # the walk vouches only for ASCII names, which hold no NUL: numpy's trimming of the
        # padding gives each key back whole
        keys=[key.decode("ascii") for key in key_bytes.tolist()],
        member_start=np.frombuffer(parts["member_start"], dtype=np.int64),
        exts=[names[code] for code in codes.tolist()],
        offsets=np.frombuffer(parts["offsets"], dtype=np.int64),
        sizes=np.frombuffer(parts["sizes"], dtype=np.int64),
        columns=TarColumns(key_bytes, codes, parts["ext_names"]),
        duplicates_checked=True,
        duplicate=parts["duplicate"],
        split=parts.get("split"),
    )
