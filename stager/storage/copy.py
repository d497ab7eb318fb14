"""Copy one file from any fsspec filesystem to a local path, atomically and verified.

The bytes go to ``<final>.partial``; only after the size (and, when one is known, the hash)
check out is the file renamed to its final name. A file with its final name is therefore always
whole: a kill at any moment leaves at most a ``.partial``, which the next run deletes. This is
the single boundary where fsspec/OS errors on the byte path become stager errors.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stager.errors import (
    DestinationError,
    HashMismatch,
    PathBlocked,
    ScratchFull,
    SizeMismatch,
    SourceError,
)
from stager.storage import bytepath
from stager.storage.bytepath import (
    Progress,
    ReadBack,
    copy_buffered,
    copy_kernel,
    copy_pumped,
    new_pump,
    open_pumped,
)
from stager.storage.hashing import DEFAULT_ALGORITHM, new_hasher, split_digest
from stager.storage.identity import is_regular, local_identity, local_version, version_of
from stager.storage.paths import discard, partial_of
from stager.storage.sources import protocol_of
from stager.storage.throttle import Throttle

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "CopyResult",
    "copy_file",
    "placing_error",
    "partial_path",
    "SizeMismatch",
    "HashMismatch",
    "DEFAULT_BLOCK_BYTES",
    "Inspector",
]

DEFAULT_BLOCK_BYTES = 4 << 20


@dataclass(slots=True)
class CopyResult:
    """What a copy made and how long it took. Treated as immutable but not declared frozen: a
    frozen dataclass's ``__init__`` costs ~2 us, once per shard of a run of small shards."""

    size: int
    hash: str  # "<algorithm>:<hex>"
    bytes_read: int
    first_byte_s: float = 0.0  # open + first read: the per-file latency of the source
    seconds: float = 0.0
    #: Until the last read that returned bytes: ``last_byte_s - first_byte_s`` is the transfer,
    #: without the local work after it (writes, the end-of-file read, the rename).
    last_byte_s: float = 0.0
    #: A local source's version (:mod:`stager.storage.identity`) when it was opened, which it
    #: still had at the end of the copy; None for a remote source.
    version: str | None = None
    #: CPU time of the whole process (every thread, user and system) while this copy ran
    process_cpu_s: float = 0.0

    @property
    def cores_used(self) -> float:
        """How many CPUs the process kept busy while this copy ran: near the node's cores when
        copies from a memory-speed source saturate them, near 0 when they wait on a server."""
        return self.process_cpu_s / self.seconds if self.seconds > 0 else 0.0


def partial_path(final: Path) -> Path:
    return Path(partial_of(os.fspath(final)))


class _Fd:
    """A bare file descriptor with ``readinto``/``write``, closed by ``with``.

    Why not ``open(..., buffering=0)``: each ``FileIO`` adds an ``fstat`` (and an object) per
    file, and every system call is a point where dozens of copy threads hand the GIL around;
    at thousands of small shards on NFS that overhead is a large part of stage-in's CPU.
    """

    __slots__ = ("fd", "url")

    def __init__(self, path: str | os.PathLike[str], flags: int, url: str = ""):
        self.fd = os.open(path, flags | os.O_CLOEXEC, 0o666)  # as open(): the umask decides
        self.url = url

    @classmethod
    def adopt(cls, fd: int) -> _Fd:
        """An already open descriptor (the byte pump's), closed by ``with`` like the others."""
        adopted = cls.__new__(cls)
        adopted.fd, adopted.url = fd, ""
        return adopted

    def readinto(self, view: memoryview) -> int:
        try:
            return os.readv(self.fd, (view,))
        except IsADirectoryError as exc:  # os.open accepts a directory; only reading it fails
            raise SourceError(f"source shard is a directory, not a file: {self.url}") from exc

    def write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def fileno(self) -> int:
        return self.fd

    def __enter__(self) -> _Fd:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fd >= 0:  # (-1: adopted from the byte pump, which closed it already)
            os.close(self.fd)


def _open_source(fs: fsspec.AbstractFileSystem | None, path: str, url: str, block_bytes: int):
    """An unbuffered reader: a bare descriptor for local paths (NFS mounts included), fsspec else.

    fsspec's local opener adds a stat and three seeks per file; on a mount where every
    metadata call is a round trip, and with dozens of streams sharing one GIL, those add up.
    """
    try:
        if fs is None or protocol_of(fs) == "file":
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever
            # (while holding the node lock); the fstat below refuses anything not a regular
            # file, and on a regular file the flag changes nothing.
            return _Fd(path, os.O_RDONLY | os.O_NONBLOCK, url)
        return fs.open(path, "rb", block_size=block_bytes)
    except FileNotFoundError as exc:
        raise SourceError(f"source shard not found: {url}") from exc
    except PermissionError as exc:
        raise SourceError(f"source shard not readable (permission denied): {url}") from exc
    except IsADirectoryError as exc:
        raise SourceError(f"source shard is a directory, not a file: {url}") from exc


_WRITE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_TRUNC  # read too: the copy is hashed and indexed


def _open_partial(partial: str) -> _Fd:
    """Open the ``.partial`` for writing, creating its directory only when it is missing.

    Trying first saves a ``mkdir -p`` (several stats) per file: all but the first shard of a
    directory find it there.
    """
    try:
        try:
            return _Fd(partial, _WRITE_FLAGS)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(partial), exist_ok=True)
            return _Fd(partial, _WRITE_FLAGS)
    except IsADirectoryError as exc:
        raise PathBlocked(
            f"cannot write {partial}: a directory has that name (the source has one beside the "
            "shard, or it was made in scratch); rename or remove it"
        ) from exc
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # never fixed by a retry
            raise DestinationError(
                f"cannot write {partial}: {exc.strerror}; the destination is read-only or not "
                "ours: pass --dest to a writable directory"
            ) from exc
        raise


class Inspector(Protocol):
    """Something that looks at a file's bytes as they are copied (the in-flight tar indexer).

    ``feed`` gets every chunk once, in order, while it is in the CPU cache; it must not keep
    the view. ``finish`` runs after the last byte, before publication, with ``read_at(offset,
    nbytes)`` to re-read a few bytes of the copy. An inspector may also offer
    ``compiled_walk()``: a compiled walk (``stager.shards._tarwalk.TarWalker``) that the byte
    pump then feeds from C instead of calling ``feed`` (:func:`~stager.storage.bytepath.new_pump`).
    """

    def feed(self, chunk: memoryview, /) -> None: ...

    def finish(self, read_at: Callable[[int, int], bytes], /) -> None: ...


def copy_file(
    fs: fsspec.AbstractFileSystem | None,
    src_path: str,
    final: str | os.PathLike[str],
    *,
    url: str | None = None,
    expected_size: int | None = None,
    expected_hash: str | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    throttle: Throttle | None = None,
    on_bytes: Callable[[int], None] | None = None,
    inspect: Inspector | None = None,
    fsync: bool = False,
    size_from_manifest: bool = False,
    publish: Callable[[str, str], object] | None = None,
) -> CopyResult:
    """Copy ``src_path`` on ``fs`` (None: a local path) to ``final``; return its size and hash.

    Raises :class:`SizeMismatch`/:class:`HashMismatch` on verification failure,
    :class:`ScratchFull` when the local filesystem runs out of space, and lets other transient
    ``OSError``s through for the caller's retry loop. The partial file is removed on any error.
    ``size_from_manifest``: ``expected_size`` is the manifest's, so a different size means the
    source changed (an integrity error), not a file still being written (worth a retry).
    ``publish(partial, final)`` replaces the final rename (e.g. to hold it until a check passes).

    Every byte is read once, into this thread's buffer (a few MiB, in the CPU cache), where the
    hash and ``inspect`` (the tar indexer) read it before it is written: no second pass over
    the file. :func:`~stager.storage.bytepath.copy_kernel` (``copy_file_range``/``sendfile``,
    then hash and index through a mapping of the page cache) is the other byte path for local
    sources; it is off
    (``bytepath.KERNEL_COPY``) because on the machines measured it was slower (docs/tuning.md).
    """
    url = url or src_path
    algorithm = split_digest(expected_hash)[0] if expected_hash else DEFAULT_ALGORITHM
    hasher = new_hasher(algorithm)
    partial = partial_of(os.fspath(final))  # a str: pathlib costs microseconds per call
    started, cpu_started = time.perf_counter(), time.process_time()
    progress = Progress(started, throttle, on_bytes)
    local = fs is None or protocol_of(fs) == "file"
    pump = new_pump(algorithm, inspect) if local and not bytepath.KERNEL_COPY else None
    version: str | None = None
    try:
        pumped = open_pumped(pump, src_path, partial, block_bytes, progress) if pump else None
        if pumped is False:
            raise _not_regular(url)
        if pumped is not None:  # the compiled path: opened, checked and copied in C
            src_fd, dst_fd, opened_identity, end = pumped
            with _Fd.adopt(src_fd), _Fd.adopt(dst_fd):
                if throttle is not None:  # (the cap paced the copy after the pump's last stat)
                    end = _end_after_pacing(src_path, end)
                _check_unchanged(opened_identity, end, progress.copied, url)
                _finish_copy(dst_fd, inspect, fsync)
            version = version_of(*opened_identity)
        else:
            with _open_source(fs, src_path, url, block_bytes) as src, _open_partial(partial) as dst:
                opened = _opened_stat(src, url)
                if isinstance(src, _Fd) and bytepath.KERNEL_COPY:
                    copy_kernel(src, dst, hasher, inspect, block_bytes, progress)
                elif pump is not None:
                    copy_pumped(src, dst, pump, block_bytes, progress)
                else:
                    copy_buffered(src, dst, hasher, inspect, block_bytes, progress)
                if opened is not None:
                    now = os.fstat(src.fd)
                    end = (*local_identity(now), now.st_size)
                    _check_unchanged(local_identity(opened), end, progress.copied, url)
                    version = local_version(opened)
                _finish_copy(dst.fd, inspect, fsync)
        hasher = pump or hasher
        copied = progress.copied
        if expected_size is not None and copied != expected_size:
            if size_from_manifest:  # the source changed since `stager index`: retrying cannot help
                raise HashMismatch(
                    f"{url}: copied {copied} bytes but the manifest lists {expected_size}; "
                    "the source changed or is truncated (re-run stager index if the change is "
                    "intended)"
                )
            raise SizeMismatch(
                f"{url}: copied {copied} bytes but the source listed {expected_size}; "
                "the file may be changing or truncated on the source"
            )
        digest = f"{algorithm}:{hasher.hexdigest()}"
        if expected_hash is not None and digest != expected_hash:
            raise HashMismatch(
                f"{url}: hash {digest} does not match the manifest's {expected_hash}; "
                "the source changed or is corrupt (re-run stager index if the change is intended)"
            )
        try:
            (publish or os.replace)(partial, os.fspath(final))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # (scratch full, below)
            raise placing_error(exc, os.fspath(final)) from exc
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        written = _size_of(partial, progress.copied) if full else 0
        discard(partial)
        if full:
            where, name = os.path.split(os.fspath(final))
            raise ScratchFull(
                f"no space left on {where} while writing {name} from {url} "
                f"({written} bytes written); free space or pass --dest elsewhere",
                where=where,
            ) from exc
        raise
    except BaseException:
        discard(partial)
        raise
    return CopyResult(
        size=copied,
        hash=digest,
        bytes_read=copied,
        first_byte_s=progress.first_byte_s,
        seconds=time.perf_counter() - started,
        last_byte_s=progress.last_byte_s or progress.first_byte_s,
        version=version,
        process_cpu_s=time.process_time() - cpu_started,
    )


def placing_error(exc: OSError, final: str) -> DestinationError:
    """The rename of a checked copy to its final name failed: scratch's doing, never the
    source's (it was reported as a source error, retried, and exited 3)."""
    if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
        why = "a directory has that name (made in scratch?); rename or remove it"
        return PathBlocked(f"cannot place {final} in scratch: {why}")
    why = f"{exc.strerror or exc}; check the destination, or pass --dest elsewhere"
    return DestinationError(f"cannot place {final} in scratch: {why}")


def _opened_stat(src: object, url: str) -> os.stat_result | None:
    """A local source's ``fstat`` right after opening it; refuses anything not a regular file."""
    if not isinstance(src, _Fd):
        return None
    st = os.fstat(src.fd)
    if not is_regular(st):
        raise _not_regular(url)
    return st


def _size_of(partial: str, counted: int) -> int:
    """How much of the copy reached the disk: the partial's size (the byte pump counts a
    block only once it is written whole, so a block cut by a full disk is not in ``counted``)."""
    try:
        return os.stat(partial).st_size
    except OSError:
        return counted


def _not_regular(url: str) -> SourceError:
    return SourceError(
        f"source shard is not a regular file (a FIFO, a device or a symlink to nothing?): {url}"
    )


def _check_unchanged(
    opened: tuple[int, int, int], end: tuple[int, int, int, int], copied: int, url: str
) -> None:
    """Raise a retryable error if the source changed while it was read (same size or not):
    ``opened`` is its ``(inode, mtime_ns, ctime_ns)`` at the open, ``end`` the same and its
    size after the last read.

    Without this a file rewritten during the copy could be published as a mix of old and new
    bytes: its size may match and no manifest hash may exist to tell.
    """
    if end[:3] != opened or end[3] != copied:
        raise SizeMismatch(
            f"{url}: the source changed while it was copied ({copied} bytes read, now "
            f"{end[3]}); is something still writing it?"
        )


def _end_after_pacing(src_path: str, end: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The source's identity and size now, for a copy the bandwidth cap held after its last
    read (seconds to minutes behind earlier shards in ``--background``): a shard changed,
    replaced or removed meanwhile was published as the bytes the source no longer holds."""
    try:
        st = os.stat(src_path)
    except FileNotFoundError:
        return (*end[:3], -1)  # removed: the retry says so
    return (*local_identity(st), st.st_size)


def _finish_copy(dst_fd: int, inspect: Inspector | None, fsync: bool) -> None:
    """The inspector's end (it may read the copy back), and the ``fsync`` asked for."""
    if inspect is not None:
        inspect.finish(ReadBack(dst_fd))
    if fsync:
        os.fsync(dst_fd)
