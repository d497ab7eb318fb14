"""Many strings held as one buffer: a dataset's shard paths in the training process.

A list of 100k paths is 100k ``str`` objects spread over the Python heap, among whatever else
was allocated while they were built (the staged manifest's 100k dicts, freed right after). The
heap's arenas then stay mapped, held by the few strings that survive in each, and every
DataLoader worker forked later shares those pages: a third of them counted in each worker's
PSS at two workers, ~18 MiB per worker at 100k shards (docs/benchmarks.md). Held as one bytes
buffer and one array of offsets, the same strings are two allocations that the arenas never
see, so the transient objects' arenas are given back whole.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["PackedStrings"]

_SEPARATOR = "\0"  # no path holds a NUL; an item that does takes the slower, general build
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")  # a lone surrogate, as surrogatepass writes it


class PackedStrings(Sequence[str]):
    """An immutable sequence of ``str`` stored back to back in one UTF-8 buffer.

    Items are decoded on access. The buffer is UTF-8 with lone surrogates passed through
    (``surrogatepass``), so every str comes back exactly, the surrogates that stand for a
    name's undecodable bytes included. Compares equal to any sequence of the same strings.
    """

    __slots__ = ("_buffer", "_starts", "_joined", "_prefix")
    _buffer: bytes
    _starts: np.ndarray
    _joined: bool
    _prefix: str

    def __init__(self, strings: Iterable[str] = (), prefix: str = ""):
        if isinstance(strings, PackedStrings):  # the same (immutable) buffer, not rebuilt
            self._buffer, self._starts = strings._buffer, strings._starts
            self._joined, self._prefix = strings._joined, prefix + strings._prefix
            return
        items = strings if isinstance(strings, list) else list(strings)
        self._prefix = prefix  # held once: a dataset's locations share their directory
        self._pack(_SEPARATOR.join(items), len(items), lambda: items)

    @classmethod
    def prefixed(cls, prefix: str, strings: Iterable[str]) -> PackedStrings:
        """``prefix + s`` for each ``s``; the prefix is stored once, not once per item."""
        return cls(strings, prefix)

    @classmethod
    def from_terminated(cls, buffer: bytes, starts: np.ndarray) -> PackedStrings:
        """The strings of ``buffer``: UTF-8 (``surrogatepass``), each followed by one NUL,
        item ``i`` at ``starts[i]`` (``len(starts) - 1`` items, the last start the buffer's
        length), as :mod:`stager.shards.manifestcolumns` holds a manifest's paths. The caller
        has checked that they are so; no str is made."""
        if len(starts) < 2:
            return cls()
        packed = cls.__new__(cls)
        packed._prefix = ""
        packed._buffer = buffer[:-1]  # this class keeps no separator after the last item
        packed._starts = np.asarray(starts, dtype=np.int64)
        packed._joined = True
        return packed

    def nul_joined(self) -> str:
        """``"\\0".join(self)``, decoded once (:func:`stager.storage.paths.nul_joined`)."""
        if not self._joined:
            return "\0".join(self)
        text = self._buffer.decode("utf-8", "surrogatepass")
        if not self._prefix or not len(self):
            return text if len(self) else ""
        return self._prefix + text.replace("\0", "\0" + self._prefix)

    def any_endswith(self, suffixes: tuple[str, ...]) -> bool:
        """Whether any item ends with one of ``suffixes``, found in the buffer: no str made."""
        if not len(self):
            return False
        empty_item = bool((np.diff(self._starts) == 1).any())
        if not self._joined or (self._prefix and empty_item):
            return any(s.endswith(suffixes) for s in self)  # (an empty item: the prefix's end)
        buffer = self._buffer + b"\0"
        return any(suffix.encode("utf-8", "surrogatepass") + b"\0" in buffer for suffix in suffixes)

    def native_paths(self, parts: int = 1) -> list[tuple[bytes, bytes, int]] | None:
        """The items as the filesystem encodes them, in up to ``parts`` runs of consecutive
        items, each ``(prefix, names joined by NUL, count)`` for
        :func:`stager.storage.statmany.key_stats_joined`; None where that is not this buffer
        (a name with an undecodable byte: ``surrogatepass`` and the filesystem's
        ``surrogateescape`` write it otherwise), or the items were not joined."""
        if not self._joined or sys.getfilesystemencoding() != "utf-8":
            return None
        if _SURROGATE.search(self._buffer):
            return None
        try:
            prefix = os.fsencode(self._prefix)
        except UnicodeEncodeError:
            return None
        count = len(self)
        bounds = sorted({count * k // max(parts, 1) for k in range(max(parts, 1) + 1)})
        runs = []
        for first, last in zip(bounds, bounds[1:], strict=False):
            start, stop = int(self._starts[first]), int(self._starts[last]) - 1
            runs.append((prefix, self._buffer[start:stop], last - first))
        return runs or [(prefix, b"", 0)]

    def _pack(self, joined: str, count: int, items: Callable[[], Sequence[str]]) -> None:
        """Hold ``joined`` (``count`` items joined by the separator); ``items()`` gives them
        one by one, needed only when an item holds the separator itself."""
        buffer = joined.encode("utf-8", "surrogatepass")
        separators = np.flatnonzero(np.frombuffer(buffer, dtype=np.uint8) == 0)
        if len(separators) == max(count - 1, 0):
            # starts[i]: where item i begins; an item ends one byte (its separator) before the
            # next one starts, the last one at the end of the buffer (starts[count] = len + 1)
            starts = np.empty(count + 1, dtype=np.int64)
            starts[1:count] = separators + 1
            starts[0], starts[count] = 0, len(buffer) + 1
            self._buffer, self._starts, self._joined = buffer, starts, True
            return
        encoded = [s.encode("utf-8", "surrogatepass") for s in items()]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        starts = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=starts[1:])
        self._buffer = _SEPARATOR.encode().join(encoded)
        self._starts, self._joined = starts, False

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("PackedStrings index out of range")
        return self._prefix + self._item(index)

    def _item(self, index: int) -> str:
        start, stop = int(self._starts[index]), int(self._starts[index + 1]) - 1
        return self._buffer[start:stop].decode("utf-8", "surrogatepass")

    def _items(self) -> list[str]:
        """Every item without the prefix."""
        if not len(self):
            return []
        if self._joined:  # one decode and one split, in C
            return self._buffer.decode("utf-8", "surrogatepass").split(_SEPARATOR)
        return [self._item(i) for i in range(len(self))]

    def __iter__(self) -> Iterator[str]:
        prefix = self._prefix
        return iter([prefix + s for s in self._items()] if prefix else self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedStrings) and self._prefix == other._prefix:
            return self._buffer == other._buffer and np.array_equal(self._starts, other._starts)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which do not hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedStrings, (self._items(), self._prefix))

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        more = f", ... ({len(self)} in all)" if len(self) > 3 else ""
        return f"PackedStrings([{head}{more}])"
