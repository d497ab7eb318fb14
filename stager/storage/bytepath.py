"""How the bytes of one copy move: through a reused buffer, hashed and inspected on the way
(by the compiled byte pump where it was built, else in Python), or in the kernel
(``copy_file_range``/``sendfile``) and then hashed from the page cache.

:func:`stager.storage.copy.copy_file` opens, verifies and publishes; this module only moves
bytes between the descriptors it opened, keeping the first- and last-byte times the stream
controller needs.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from typing import Any, Literal

from stager.native import load_optional
from stager.storage.throttle import Throttle

__all__ = [
    "FIRST_READ_BYTES",
    "ReadBack",
    "Progress",
    "copy_buffered",
    "copy_kernel",
    "available",
    "copy_pumped",
    "new_pump",
    "open_pumped",
    "KERNEL_COPY",
]

#: The first read is small so that "time to first byte" measures the source's per-file latency,
#: not the transfer of a whole block (the stream controller depends on the difference).
FIRST_READ_BYTES = 64 << 10

_buffers = threading.local()


def _buffer(block_bytes: int) -> memoryview:
    """This thread's reusable copy buffer.

    An anonymous mapping rather than a ``bytearray``: ``bytearray(n)`` zero-fills all ``n``
    bytes at once, and dozens of threads each touching 4 MiB cost more than copying 300 small shards
    (page faults and ``mmap_lock`` contention); a mapping is faulted in only as far as reads go.
    Private (:data:`PRIVATE_MAPPING`): Python's default mapping is shared, so a process forked
    after a copy (a DataLoader worker, a ``multiprocessing`` child) shared this buffer with its
    parent and siblings, and two of them copying at once wrote into each other's bytes.
    """
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) != block_bytes:
        buf = _buffers.buf = mmap.mmap(-1, block_bytes, flags=PRIVATE_MAPPING)
    return memoryview(buf)


#: A mapping that fork copies on write, never shares (``mmap``'s default is ``MAP_SHARED``).
PRIVATE_MAPPING = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class ReadBack:
    """``read_at(offset, nbytes)`` over the copy being written, for :meth:`Inspector.finish`;
    ``readinto(offset, view)`` fills a caller's buffer instead of allocating one per call
    (fresh allocations of a few MiB fault their pages in again on every call)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def readinto(self, offset: int, view: memoryview) -> int:
        return os.preadv(self.fd, [view], offset)


class Progress:
    """Bytes copied so far, the first- and last-byte times the stream controller needs, and
    the per-block duties shared by both byte paths (throttle, progress callback)."""

    __slots__ = ("started", "throttle", "on_bytes", "copied", "first_byte_s", "last_byte_s")

    def __init__(self, started: float, throttle: Throttle | None, on_bytes) -> None:
        self.started, self.throttle, self.on_bytes = started, throttle, on_bytes
        self.copied = 0
        self.first_byte_s = self.last_byte_s = 0.0

    def read(self, nbytes: int, lag_s: float = 0.0, first_lag_s: float | None = None) -> None:
        """A read (or kernel copy) returned ``nbytes`` (0: the end of the file), ``lag_s``
        seconds ago (the byte pump reports the time it spent after its last read); the first
        byte came ``first_lag_s`` ago, where one call made several reads (the pump's ``begin``).

        Both times come from one reading of the clock: a transfer timed across two readings
        would include the Python between them, and on a 20 KB shard read in one ``read`` that
        made up the whole "transfer", so the stream controller took the copies for
        latency-bound and ran more streams than cores (10,000 x 20 KB: 2.3 s against 1.5 s).
        """
        now = time.perf_counter() - self.started
        if not self.first_byte_s:
            self.first_byte_s = now - (lag_s if first_lag_s is None else first_lag_s)
        if nbytes:
            self.last_byte_s = now - lag_s

    def done(self, nbytes: int) -> None:
        """``nbytes`` are written, hashed and inspected."""
        self.copied += nbytes
        if self.throttle is not None:
            self.throttle.consume(nbytes)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)


def copy_buffered(src, dst: Any, hasher, inspect, block_bytes: int, progress: Progress) -> None:
    """Read into this thread's buffer; hash and inspect it while it is in cache; write it."""
    view = _buffer(block_bytes)
    want = min(FIRST_READ_BYTES, block_bytes)
    while True:
        target = view[:want]
        n = src.readinto(target) if hasattr(src, "readinto") else _read_into(src, target)
        want = block_bytes
        progress.read(n)
        if not n:
            return
        chunk = view[:n]
        hasher.update(chunk)
        if inspect is not None:
            inspect.feed(chunk)
        written = 0
        while written < n:
            written += dst.write(chunk[written : written + _WRITE_BYTES])
        progress.done(n)


def copy_pumped(src: Any, dst: Any, pump: Any, block_bytes: int, progress: Progress) -> None:
    """:func:`copy_buffered` in one compiled call per block (``stager/storage/_bytepump.c``):
    read, hash, walk and write with the interpreter lock released once per block, not at every
    step. ``pump`` (from :func:`new_pump`) is the hasher: its ``hexdigest`` is the copy's."""
    view = _buffer(block_bytes)
    first = pump.move(src.fd, dst.fd, view, min(FIRST_READ_BYTES, block_bytes), _WRITE_BYTES)
    _pump_rest(pump, src.fd, dst.fd, view, block_bytes, progress, first)


#: What the pump reports of a source at its end: ``(inode, mtime_ns, ctime_ns, size)``.
EndStat = tuple[int, int, int, int]


def open_pumped(
    pump: Any, src_path: str, partial: str, block_bytes: int, progress: Progress
) -> tuple[int, int, tuple[int, int, int], EndStat] | Literal[False] | None:
    """Open ``src_path`` and create ``partial`` and copy all of it with ``pump``: a small file's
    opens, checks and whole copy (up to a block) cost one release of the interpreter lock
    (``begin``).

    Returns ``(src_fd, dst_fd, identity at open, identity at the end)``, the descriptors still
    open for the caller's checks (it closes them; ``src_fd`` is -1 where ``begin`` read the
    source to its end and closed it), or None where an open failed, with nothing opened or
    moved: the caller then opens the slow way, which raises the error that says why, or makes
    the partial's missing directory. False where the source is not a regular file (a FIFO, a
    device): opened once and never read, as opening it again could block or act.
    """
    view = _buffer(block_bytes)
    first_read = min(FIRST_READ_BYTES, block_bytes)  # alone: the first-byte time
    begun = pump.begin(src_path, partial, view, first_read, block_bytes, _WRITE_BYTES)
    if not begun:  # None, or False: not a regular file (opened once, never read)
        return begun
    src_fd, dst_fd, opened, first_lag_s, moved = begun
    try:
        end = _pump_rest(pump, src_fd, dst_fd, view, block_bytes, progress, moved, first_lag_s)
    except BaseException:
        if src_fd >= 0:
            os.close(src_fd)
        os.close(dst_fd)
        raise
    return src_fd, dst_fd, _identity(opened), end


def _pump_rest(
    pump: Any,
    src_fd: int,
    dst_fd: int,
    view: memoryview,
    block_bytes: int,
    progress: Progress,
    moved: tuple[int, bool, float, tuple[tuple[int, ...], int] | None],
    first_lag_s: float | None = None,
) -> EndStat:
    """Account for a move (``moved``: its result; ``first_lag_s``: see :meth:`Progress.read`)
    and make the rest, a block per call; the source's identity where it ended."""
    while True:
        nbytes, ended, lag_s, end = moved
        progress.read(nbytes, lag_s, first_lag_s)
        first_lag_s = None
        if nbytes:
            progress.done(nbytes)  # (the throttle, and a stop requested meanwhile, act here)
        if ended:
            assert end is not None  # (the pump stats the source where it ends)
            identity, size = end
            return (*_identity(identity), size)
        moved = pump.move(src_fd, dst_fd, view, block_bytes, _WRITE_BYTES)


def _identity(reported: tuple[int, ...]) -> tuple[int, int, int]:
    """:func:`stager.storage.identity.local_identity` from the pump's ``(inode, mtime_s,
    mtime_ns, ctime_s, ctime_ns)``: seconds and nanoseconds come apart because their product
    overflows 64 bits past the year 2262."""
    inode, mtime_s, mtime_ns, ctime_s, ctime_ns = reported
    return inode, mtime_s * 1_000_000_000 + mtime_ns, ctime_s * 1_000_000_000 + ctime_ns


#: The hash the compiled pump makes (xxHash's XXH3, 64 bits): a manifest with another takes
#: the Python path.
PUMP_ALGORITHM = "xxh3_64"


def new_pump(algorithm: str, inspect: Any) -> Any:
    """A compiled byte pump for one copy, or None where :func:`copy_buffered` must run: the
    extension not built (or ``STAGER_NATIVE_COPY=0``), a hash other than xxh3_64, or an
    inspector without a compiled walk to feed (``inspect.compiled_walk()``)."""
    if _pump is None or algorithm != PUMP_ALGORITHM:
        return None
    walker = None
    if inspect is not None:
        compiled_walk = getattr(inspect, "compiled_walk", None)
        walker = compiled_walk() if compiled_walk is not None else None
        if walker is None or not _pump.WALKS:
            return None
    return _pump.BytePump(walker)


#: The compiled byte pump (``stager/storage/_bytepump.c``), where it was built.
_pump: Any = load_optional("stager.storage._bytepump", "STAGER_NATIVE_COPY")


def available() -> bool:
    """Whether the compiled byte pump is built and enabled."""
    return _pump is not None


#: The most one ``write`` hands the kernel. A 4 MiB write into ext4's page cache (kernel 6.18,
#: large folios) now and then cost 1-3 CPU-s per GB in the kernel instead of ~0.35, in 5 of 6
#: runs of 1 GB; in 1 MiB or 256 KiB pieces it cost 0.29-0.47 (``cp`` writes 128 KiB), while
#: one ``writev`` of 256 KiB pieces did not help (the size of the call is what matters). 1 MiB:
#: each piece is a release and re-acquisition of the interpreter lock (docs/tuning.md). On tmpfs
#: the piece size made no difference.
_WRITE_BYTES = 1 << 20

#: Copy local sources in the kernel (:func:`copy_kernel`) rather than through the buffer.
#: Off: on the 2-core VMs measured (docs/tuning.md), mapping page-cache pages to hash and index
#: them cost ~1.5 us per 4 KiB page, more than the user-space copy the kernel copy saves, and
#: 1 GB staged ~10-25% slower. Where mappings are cheap (bare metal) it may win: measure with
#: benchmarks/bench_stage_in.py before turning it on.
KERNEL_COPY = False
_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def copy_kernel(src: Any, dst: Any, hasher, inspect, block_bytes: int, progress) -> None:
    """Copy in the kernel, a block at a time, and hash and inspect each block from the page
    cache right after: one pass over the bytes in user space, none of them a copy.

    ``copy_file_range`` within one filesystem (which may clone or copy server-side); across
    filesystems (NFS to local scratch) ``sendfile``; where neither applies (a FUSE mount without
    splice, an old kernel), the rest of the file goes through the buffered path. Both calls
    move the descriptors' offsets, so switching path mid-file loses nothing.
    """
    use_range = True
    want = min(FIRST_READ_BYTES, block_bytes)
    while True:
        try:
            if use_range:
                n = os.copy_file_range(src.fd, dst.fd, want)
            else:
                n = os.sendfile(dst.fd, src.fd, None, want)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            if use_range:
                use_range = False
                continue
            copy_buffered(src, dst, hasher, inspect, block_bytes, progress)
            return
        progress.read(n)
        if not n:
            return
        want = block_bytes
        _look(dst.fd, progress.copied, n, hasher, inspect)
        progress.done(n)


def _look(fd: int, offset: int, nbytes: int, hasher, inspect) -> None:
    """Hash (and inspect) ``nbytes`` of ``fd`` at ``offset`` through a mapping of the page
    cache: no copy into user space. The mapping starts at the page boundary below ``offset``."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with (
        mmap.mmap(
            fd, offset + nbytes - start, prot=mmap.PROT_READ, offset=start, flags=_MAP_FLAGS
        ) as mapped,
        memoryview(mapped) as view,
        view[offset - start :] as chunk,
    ):
        hasher.update(chunk)
        if inspect is not None:
            inspect.feed(chunk)


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _read_into(src, view: memoryview) -> int:
    data = src.read(len(view))
    view[: len(data)] = data
    return len(data)
