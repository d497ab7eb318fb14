"""Index a tar shard from its bytes as a copy passes them, so stage-in hands the loader its
offsets without parsing the shard a second time.

Where the compiled walk is built (:mod:`stager.shards.tarnative`, the usual case) it reads
every chunk, without the interpreter lock, and vouches for plain WebDataset shards of any size
(~8 ms per 77 MB shard of 25,000 samples in flight, against the scanner's ~36 ms); everything
below is then the path for a tar it does not vouch for, read back from the copy in
:meth:`TarSampleCounter.finish`, and the path of an install without a C compiler.

The copy feeds every chunk (:meth:`TarSampleCounter.feed`) while the chunk is in the CPU cache;
the vectorised scanner (:mod:`stager.shards.tarscan`) keeps only candidate headers from it, so
no Python runs per member. :meth:`TarSampleCounter.finish` then needs random access to a few
blocks of the copy (the end of the archive, metadata payloads), which the copy gives it by
``pread`` on the file it wrote. A shard of few members is indexed there by the small-shard
walk (:mod:`stager.shards.tarwalk`) instead: its cost follows the headers, where the scanner's
end costs ~0.7 ms per shard whatever the size.

The scanner needs numpy, whose import takes ~60 ms and holds the interpreter lock nearly
throughout. Without the compiled walk, stage-in imports it before the copies start
(:func:`load_scanner`; with it, after them, for the loader index): beside them it
made every copy thread wait for the lock after each system call. A counter used without that
(fan-out, the API) starts the import on a thread and, if it is not done when its copy starts,
skips looking at the bytes in flight and reads the copy back from the page cache in
:meth:`TarSampleCounter.finish` once the import is done. Shards of up to 64 KiB never need it:
the walk's checks are numpy-free (:mod:`stager.shards.tarheader`), and their index is made an
array only when the loader index is written, after the copies.

A tar the scanner does not vouch for (a v7 header, base-256 numbers, global PAX headers, or
damage) is read once more by ``tarfile`` from the copy; a damaged one gives ``samples`` None,
and stage-in then counts the final file the slow way, which reports the error with the
shard's name. It never guesses.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.errors import IntegrityError
from stager.shards.members import SampleGrouper
from stager.shards.tarheader import BLOCK
from stager.shards.tarindex import TarIndex, index_with_tarfile
from stager.shards.tarnative import NativeWalk, WalkResult, native_walk, to_index
from stager.shards.tarnative import available as native_walk_available
from stager.shards.tarwalk import MAX_HEADERS, walk_members
from stager.storage.bytepath import PRIVATE_MAPPING

if TYPE_CHECKING:
    from stager.shards.tarscan import TarScanner

__all__ = ["TarSampleCounter", "load_scanner"]

_REREAD_BYTES = 4 << 20
_imported = threading.Event()  # set once stager.shards.tarscan (and numpy) can be used
_import_started = threading.Lock()


def _start_import() -> None:
    """Import the scanner on a daemon thread, once; :data:`_imported` says when it is done."""
    if _imported.is_set() or not _import_started.acquire(blocking=False):
        return

    def load() -> None:
        try:
            import stager.shards.tarscan  # noqa: F401 - numpy, ~0.15 s
        finally:
            _imported.set()  # an import error surfaces in _new_scanner

    threading.Thread(target=load, name="tarscan-import", daemon=True).start()


def load_scanner() -> None:
    """Import the scanner (numpy) on this thread, before the copies start; nothing where the
    compiled walk indexes the copies (numpy is then imported after them, by the loader index).

    Why not on a thread beside the copies: an import holds the interpreter lock for most of
    its ~60 ms, and each copy thread, between two system calls, waits for it. Imported beside
    them, numpy cost 16 x 64 MB from a tmpfs ~0.12 s, twice what importing it first costs.
    Why not first with the compiled walk: the copies do not need it, and after them it was
    2-6% faster (10 alternating runs from a tmpfs to a tmpfs: 16 x 64 MB 0.428 against
    0.437 s; 16 x 77 MB of ~1 KB samples 0.535 against 0.570 s, medians).
    """
    if native_walk_available():
        return
    try:
        import stager.shards.tarscan  # noqa: F401 - numpy
    except ImportError:
        pass  # _new_scanner says None: shards are counted the slow way
    finally:
        _imported.set()


_buffers = threading.local()


def _read_back(read_at: Callable[[int, int], bytes], nbytes: int, scanner: TarScanner) -> None:
    """Feed ``scanner`` the first ``nbytes`` of the copy again, from the page cache.

    Through this thread's reused buffer where ``read_at`` can fill one (the copy's
    ``readinto``): a fresh bytes object per read would fault its pages in on every call.
    """
    readinto = getattr(read_at, "readinto", None)
    if readinto is None:
        for offset in range(0, nbytes, _REREAD_BYTES):
            scanner.feed(read_at(offset, min(_REREAD_BYTES, nbytes - offset)))
        return
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = mmap.mmap(-1, _REREAD_BYTES, flags=PRIVATE_MAPPING)
    with memoryview(buffer) as view:
        offset = 0
        while offset < nbytes:
            got = readinto(offset, view[: min(_REREAD_BYTES, nbytes - offset)])
            if not got:
                break
            scanner.feed(view[:got])
            offset += got


def _new_scanner() -> TarScanner | None:
    """A scanner; None where numpy cannot be imported (the shard is counted the slow way)."""
    try:
        from stager.shards.tarscan import TarScanner
    except ImportError:
        return None
    return TarScanner()


#: The first bytes of every tar are held (copied) rather than scanned: up to this size the tar
#: is indexed by the small-shard walk alone, and the scanner never sees it.
_HOLD_BYTES = 64 << 10


def _walk(
    source: Callable[[int, int], bytes], max_headers: int | None = None
) -> SampleGrouper | None:
    """The members by the small-shard walk (:mod:`stager.shards.tarwalk`, no numpy); None
    where it does not vouch or the tar has more than ``max_headers`` headers (then the scanner
    decides).

    Why: the scanner's work at the end costs ~0.7 ms per shard whatever its size, which was
    most of the cost of staging a shard of a few small samples.
    """
    walked = walk_members(source, max_headers)
    return walked if isinstance(walked, SampleGrouper) else None


class TarSampleCounter:
    """Feed it the tar's bytes in order (any chunking), then :meth:`finish`; read
    :attr:`samples` and :meth:`index`.

    Where the compiled walk is built (:mod:`stager.shards.tarnative`) it sees every byte and
    the paths below only run for a tar it does not vouch for, from the copy, in :meth:`finish`.
    """

    def __init__(self, name: str = "<tar stream>") -> None:
        self.name = name
        self._native = native_walk()
        self._walk_parts: dict[str, Any] | None = None  # what the compiled walk found
        self._scanner: TarScanner | None = None
        self._late = False  # the scanner was not importable when the bytes passed
        self._index: TarIndex | None = None
        self._walked: SampleGrouper | None = None  # members found by a walk, not indexed yet
        self._fed = 0
        # the bytes fed, while under _HOLD_BYTES (not with the compiled walk, which sees all)
        self._held: bytearray | None = None if self._native is not None else bytearray()

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Look at the next bytes of the tar (not kept: the caller may reuse its buffer)."""
        if self._native is not None:
            self._native.feed(chunk)  # without the interpreter lock
            return
        if self._held is not None:
            if self._fed + len(chunk) <= _HOLD_BYTES:
                self._held += chunk
                self._fed += len(chunk)
                return
            held, self._held = self._held, None  # not a small tar: the scanner takes over
            _start_import()
            self._scan(held)
        self._scan(chunk)
        self._fed += len(chunk)

    def compiled_walk(self) -> NativeWalk | None:
        """The compiled walk, which a copy may feed from C (``stager/storage/_bytepump.c``)
        instead of calling :meth:`feed`; None where it is not built, or after :meth:`finish`."""
        return self._native

    def _scan(self, chunk: bytes | bytearray | memoryview) -> None:
        if self._scanner is None and not self._late:
            self._scanner = _new_scanner() if _imported.is_set() else None
            self._late = self._scanner is None  # then finish() reads the copy back
        if self._scanner is not None:
            self._scanner.feed(chunk)

    def finish(self, read_at: Callable[[int, int], bytes]) -> None:
        """Build the index; ``read_at(offset, nbytes)`` re-reads bytes that were fed.

        Errors of the tar itself leave :attr:`samples` None; I/O errors of ``read_at``
        propagate (the copy is then not trustworthy either).
        """
        native, self._native = self._native, None
        if native is not None:
            self._fed = native.fed  # fed here, or by the byte pump (compiled_walk)
            self._walk_parts = native.finish()
            if self._walk_parts is not None:
                return
            # not vouched for: the scanner, then tarfile, decide from the copy (below)
        held, self._held = self._held, None
        scanner, self._scanner = self._scanner, None
        if held is not None:  # a small tar: walked whole, however many headers it has
            data = bytes(held)
            self._walked = _walk(lambda at, n: data[at : at + n], len(data) // BLOCK)
        elif scanner is not None and scanner.candidates <= MAX_HEADERS:
            self._walked = _walk(read_at)  # few headers (large members): walked by pread
        if self._walked is not None:
            return
        _start_import()  # (a small tar the walk refused: nothing may have started it yet)
        _imported.wait()  # at once, unless numpy was still importing when the copy began
        if scanner is None:
            scanner = _new_scanner()
            if scanner is None:
                return
            _read_back(read_at, self._fed, scanner)
        self._index = scanner.finish(read_at)
        if self._index is None:  # odd or damaged: tarfile decides, reading the copy
            try:
                reader = _ReadAt(read_at, self._fed)
                self._index = index_with_tarfile(Path(self.name), reader)  # type: ignore[arg-type]
            except IntegrityError:
                self._index = None

    @property
    def samples(self) -> int | None:
        """The count, or None if the bytes were not a complete, well-formed tar."""
        if self._walk_parts is not None:
            return int(self._walk_parts["samples"])
        if self._walked is not None:
            return self._walked.num_samples
        return None if self._index is None else self._index.num_samples

    @property
    def repeated_member(self) -> str | None:
        """A member named twice in one sample (``"key.ext"``), or a sample whose members lie
        apart (its key), as the compiled walk found it; None where there is none, or where
        only indexing the copy would tell."""
        if self._walk_parts is None:
            return None
        return self._walk_parts["duplicate"] or self._walk_parts.get("split")

    def result(self) -> TarIndex | WalkResult | None:
        """:meth:`index`, or where the compiled walk vouched, its columns as they came (no
        numpy per shard: :func:`stager.shards.loader_index.save_dataset_index` joins them)."""
        if self._index is None and self._walk_parts is not None:
            return WalkResult(self._walk_parts)
        return self.index()

    def index(self) -> TarIndex | None:
        """Where each sample's members sit, as :func:`stager.shards.tarindex.index_tar` says."""
        if self._index is None and self._walk_parts is not None:
            self._index = to_index(self._walk_parts)
        if self._index is None and self._walked is not None:
            self._index = self._walked.index()  # numpy: by now imported, off the copy threads
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

    def readinto(self, buffer) -> int:
        with memoryview(buffer) as view:
            want = min(len(view), max(0, self._size - self._pos))
            data = self._read_at(self._pos, want) if want else b""
            view[: len(data)] = data
        self._pos += len(data)
        return len(data)
