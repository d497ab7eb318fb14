"""Index a tar shard from its bytes as a copy passes them, so stage-in hands the loader its
offsets without parsing the shard a second time.

The copy feeds every chunk (:meth:`TarSampleCounter.feed`) while the chunk is in the CPU cache;
the vectorised scanner (:mod:`stager.shards.tarscan`) keeps only candidate headers from it, so
no Python runs per member. :meth:`TarSampleCounter.finish` then needs random access to a few
blocks of the copy (the end of the archive, metadata payloads), which the copy gives it by
``pread`` on the file it wrote.

A tar the scanner does not vouch for (a v7 header, base-256 numbers, global PAX headers, or
damage) is read once more by ``tarfile`` from the copy; a damaged one gives ``samples`` None,
and stage-in then counts the final file the slow way, which reports the error with the
shard's name. It never guesses.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import IntegrityError
from stager.shards.tarindex import TarIndex, _index_tarfile

if TYPE_CHECKING:
    from stager.shards.tarscan import TarScanner

__all__ = ["TarSampleCounter"]


class TarSampleCounter:
    """Feed it the tar's bytes in order (any chunking), then :meth:`finish`; read
    :attr:`samples` and :meth:`index`."""

    def __init__(self, name: str = "<tar stream>") -> None:
        # Deferred: numpy costs ~0.2 s to import, which stage-in starts on a background thread
        # while it lists and plans, and which a stage-in with --no-count never pays.
        from stager.shards.tarscan import TarScanner

        self.name = name
        self._scanner: TarScanner | None = TarScanner()
        self._index: TarIndex | None = None
        self._fed = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Look at the next bytes of the tar (not kept: the caller may reuse its buffer)."""
        if self._scanner is not None:
            self._scanner.feed(chunk)
            self._fed += len(chunk)

    def finish(self, read_at: Callable[[int, int], bytes]) -> None:
        """Build the index; ``read_at(offset, nbytes)`` re-reads bytes that were fed.

        Errors of the tar itself leave :attr:`samples` None; I/O errors of ``read_at``
        propagate (the copy is then not trustworthy either).
        """
        scanner, self._scanner = self._scanner, None
        if scanner is None:
            return
        self._index = scanner.finish(read_at)
        if self._index is None:  # odd or damaged: tarfile decides, reading the copy
            try:
                self._index = _index_tarfile(Path(self.name), _ReadAt(read_at, self._fed))
            except IntegrityError:
                self._index = None

    @property
    def samples(self) -> int | None:
        """The count, or None if the bytes were not a complete, well-formed tar."""
        return None if self._index is None else self._index.num_samples

    def index(self) -> TarIndex | None:
        """Where each sample's members sit, as :func:`stager.shards.tarindex.index_tar` says."""
        return self._index


class _ReadAt(io.RawIOBase):
    """A seekable, read-only file over ``read_at`` (what was fed), for ``tarfile``."""

    def __init__(self, read_at: Callable[[int, int], bytes], size: int):
        self._read_at, self._size, self._pos = read_at, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        with memoryview(buffer) as view:
            want = min(len(view), max(0, self._size - self._pos))
            data = self._read_at(self._pos, want) if want else b""
            view[: len(data)] = data
        self._pos += len(data)
        return len(data)
