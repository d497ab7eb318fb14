"""What a WebDataset tar holds, as data: members grouped into samples by key, and where each
member's payload lies (:class:`TarIndex`). The parsers (:mod:`.tarindex`, :mod:`.tarparse`,
:mod:`.tarscan`) produce it; the loader index (:mod:`.loader_index`) flattens it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING

from stager.shards.tarheader import name_text

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "COMPRESSED_SUFFIXES",
    "SampleGrouper",
    "SampleRuns",
    "TarColumns",
    "TarIndex",
    "any_compressed",
    "duplicate_member",
    "grouping_problem",
    "is_compressed",
    "repeated_member",
    "split_message",
    "split_sample",
    "split_key",
]

_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


def split_key(member_name: str) -> tuple[str, str] | None:
    """``"a/b/000012.JPG"`` -> ``("a/b/000012", "jpg")``; None for names without an extension.

    The extension is lower-cased, as webdataset groups members (``group_by_keys(lcase=True)``):
    ``to_tuple=("jpg", "cls")`` reads ``000.JPG`` and ``000.CLS``, and ``k.jpg`` beside
    ``k.JPG`` is one member twice."""
    match = _KEY_EXT.match(member_name)
    if not match:
        return None
    return match.group(1), match.group(2).lower()


#: Names of gzip-compressed shards, which are streamed rather than indexed.
COMPRESSED_SUFFIXES = (".tgz", ".tar.gz")


def is_compressed(path: str | Path) -> bool:
    """True for gzip-compressed shards, which are streamed rather than indexed."""
    return str(path).endswith(COMPRESSED_SUFFIXES)


def any_compressed(paths: Iterable[str]) -> bool:
    """True when any of ``paths`` is compressed; a C-level pass with no Python frame per
    name (100k names in ~4 ms, against ~10 ms through a generator)."""
    packed = getattr(paths, "any_endswith", None)
    if callable(packed):  # the loader's packed paths: looked for in their buffer, no str each
        return bool(packed(COMPRESSED_SUFFIXES))
    return any(map(str.endswith, paths, repeat(COMPRESSED_SUFFIXES)))


@dataclass(frozen=True)
class TarColumns:
    key_bytes: np.ndarray  # "S", one per sample
    ext_codes: np.ndarray  # int16, one per member
    ext_names: tuple[str, ...]


@dataclass(frozen=True)
class TarIndex:
    """Offsets of every sample member of one shard.

    Sample ``i`` owns members ``member_start[i]:member_start[i + 1]``; member ``j`` has the
    extension ``exts[j]`` and its payload is ``sizes[j]`` bytes at byte ``offsets[j]``.
    """

    keys: list[str]
    member_start: np.ndarray  # int64, len(keys) + 1
    exts: list[str]
    offsets: np.ndarray  # int64, one per member
    sizes: np.ndarray  # int64, one per member
    #: The same keys and extensions as arrays, where the indexer had them (the vectorised
    #: scanner): ``keys`` UTF-8 encoded (numpy ``S``), ``exts`` as codes into ``ext_names``.
    #: Lets the loader index be flattened without a Python loop over members.
    columns: TarColumns | None = field(default=None, compare=False, repr=False)
    #: Set by an indexer that looked for a member named twice in one sample while it grouped
    #: them (:class:`SampleGrouper`): then :func:`duplicate_member` needs no second pass.
    duplicates_checked: bool = field(default=False, compare=False, repr=False)
    duplicate: str | None = field(default=None, compare=False, repr=False)
    #: ...and for a key met again after other samples (:func:`split_sample`), checked alike
    split: str | None = field(default=None, compare=False, repr=False)

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    def members(self, sample: int) -> list[tuple[str, int, int]]:
        """``(ext, offset, size)`` of each member of sample number ``sample``."""
        lo, hi = int(self.member_start[sample]), int(self.member_start[sample + 1])
        return [(self.exts[j], int(self.offsets[j]), int(self.sizes[j])) for j in range(lo, hi)]


class SampleRuns:
    """Each key's latest sample's extensions, to tell a sample whose members lie apart
    (:func:`split_message`): its key met again in a sample sharing none of its extensions. The
    grouper, the array check, the stream counter and the loader's stream all ask it alike."""

    __slots__ = ("_latest",)

    def __init__(self) -> None:
        self._latest: dict[str, set[str]] = {}

    def apart(self, key: str, exts: set[str]) -> bool:
        """Record ``key``'s sample of ``exts``; whether it is one whose members lie apart."""
        before = self._latest.get(key)
        self._latest[key] = exts
        return before is not None and before.isdisjoint(exts)


class SampleGrouper:
    """Builds a :class:`TarIndex` from file members met in archive order, grouped into samples
    the way WebDataset groups them (consecutive members with the same key). The ``tarfile``
    parser and the small-shard walk both feed it, so they group alike."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._starts: list[int] = []
        self._exts: list[str] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._sample_exts: list[str] = []  # the current sample's extensions so far
        self._duplicate: str | None = None  # the first "key.ext" met twice in one sample
        self._runs = SampleRuns()
        self._split: str | None = None  # the first sample whose members lie apart

    def add(self, name: str, offset: int, size: int) -> None:
        """A file member ``name`` whose payload is ``size`` bytes at ``offset``; names without
        an extension are not sample members and are skipped."""
        parts = split_key(name)
        if parts is None:
            return
        key, ext = parts
        if not self._keys or self._keys[-1] != key:
            self._end_sample()
            self._keys.append(key)
            self._starts.append(len(self._exts))
            self._sample_exts = [ext]
        elif ext in self._sample_exts:
            self._duplicate = self._duplicate or f"{key}.{ext}"
        else:
            self._sample_exts.append(ext)
        self._exts.append(ext)
        self._offsets.append(offset)
        self._sizes.append(size)

    def _end_sample(self) -> None:
        """The sample just grouped: split where its key's latest sample shared none of its
        extensions (:func:`split_message`)."""
        if not self._keys:
            return
        key = self._keys[-1]
        if self._runs.apart(key, set(self._sample_exts)):
            self._split = self._split or key

    @property
    def num_samples(self) -> int:
        return len(self._keys)

    def index(self) -> TarIndex:
        import numpy as np  # deferred: stage-in's start-up should not pay for numpy

        self._end_sample()
        self._runs = SampleRuns()  # (ended: a second call finds nothing new)

        return TarIndex(
            keys=self._keys,
            member_start=np.asarray([*self._starts, len(self._exts)], dtype=np.int64),
            exts=self._exts,
            offsets=np.asarray(self._offsets, dtype=np.int64),
            sizes=np.asarray(self._sizes, dtype=np.int64),
            duplicates_checked=True,
            duplicate=self._duplicate,
            split=self._split,
        )


def repeated_member(member: str) -> str:
    """What stage-in and `stager index` say of a shard with ``member`` (``"key.ext"``) twice in
    one sample, which the loader, like webdataset, refuses."""
    return f"member {member!r} appears twice in one sample; re-create this shard"


def split_message(key: str) -> str:
    """What is said of a shard whose sample ``key`` has members apart, other samples between
    them and no extension in common (GNU tar of a directory stores files in the order the
    directory lists them: ``k.jpg``, ``m.jpg``, ``k.cls``): read as webdataset reads it, it is
    two samples, each missing what the other holds. A sample stored twice whole (the same
    extensions) is two samples, as webdataset reads it, and is not refused."""
    return (
        f"the members of sample {key!r} are not next to each other (more of them come after "
        "other samples), so it would be read as two samples, each missing members; re-create "
        "this shard with each sample's files together (GNU tar: --sort=name)"
    )


def split_sample(index: TarIndex) -> str | None:
    """The key of the first sample whose members lie apart (:func:`split_message`), or None."""
    if index.duplicates_checked:
        return index.split
    runs = SampleRuns()
    for i, key in enumerate(index.keys):
        text = name_text(key) if isinstance(key, bytes) else str(key)
        if runs.apart(text, {ext for ext, _, _ in index.members(i)}):
            return text
    return None


def grouping_problem(index: TarIndex) -> str | None:
    """What is wrong with how ``index``'s members group into samples, said in one sentence:
    a member twice in one sample, or a sample's members apart; None where nothing is."""
    twice = duplicate_member(index)
    if twice is not None:
        return repeated_member(twice)
    key = split_sample(index)
    return None if key is None else split_message(key)


def duplicate_member(index: TarIndex) -> str | None:
    """The first member named twice inside one sample (``"key.ext"``), or None.

    WebDataset groups a sample's members by key; two ``key.jpg`` in a row would leave one of
    them unread, silently. webdataset itself refuses such a shard, and so does the loader.
    """
    if index.duplicates_checked:
        return index.duplicate
    import numpy as np

    starts = np.asarray(index.member_start, dtype=np.int64)
    counts = np.diff(starts)
    if not len(counts) or int(counts.max(initial=0)) < 2:
        return None
    if index.columns is not None:
        codes = np.asarray(index.columns.ext_codes, dtype=np.int64)
        names: tuple[str, ...] | list[str] = index.columns.ext_names
    else:
        lookup: dict[str, int] = {}
        codes = np.asarray([lookup.setdefault(e, len(lookup)) for e in index.exts], np.int64)
        names = list(lookup)
    sample = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    pairs = sample * (int(codes.max(initial=0)) + 1) + codes
    order = np.argsort(pairs, kind="stable")
    repeated = np.flatnonzero(pairs[order][1:] == pairs[order][:-1])
    if not len(repeated):
        return None
    member = int(order[repeated + 1].min())  # the first met twice, in archive order
    keys = index.keys
    key = keys[int(sample[member])]
    key = name_text(key) if isinstance(key, bytes) else str(key)
    return f"{key}.{names[int(codes[member])]}"
