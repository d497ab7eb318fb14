"""Put a cached file at its place in scratch: a hard link, else a reflink, else a copy.

A hard link costs no bytes and no time, but needs the cache and the scratch directory on one
filesystem (and mount); the two names then share one read-only inode. A reflink (the
``FICLONE`` ioctl of btrfs, XFS, bcachefs...) shares the blocks copy-on-write across mounts of
one filesystem. Otherwise the bytes are copied, and hashed as they go: a copy that does not
hash to the record's value is refused, so a cached file damaged on disk is never published.
Whatever the method, the file appears under its final name by one rename, whole.
"""

from __future__ import annotations

import errno
import fcntl
import os

from stager.errors import HashMismatch
from stager.storage.hashing import new_hasher, split_digest
from stager.storage.paths import discard, partial_of

__all__ = ["place_file", "LINK", "REFLINK", "COPY"]

LINK, REFLINK, COPY = "link", "reflink", "copy"
#: ``_IOW(0x94, 9, int)`` from linux/fs.h: clone all of one file's extents into another.
FICLONE = 0x40049409
#: Errors that mean "this method does not apply here", so the next one is tried.
_UNSUPPORTED = {
    errno.EXDEV,
    errno.EPERM,
    errno.EMLINK,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EINVAL,
    errno.ENOTTY,
    errno.ENOSYS,
    errno.EACCES,
}
_BLOCK = 4 << 20


def place_file(src: str, final: str, *, digest: str, link: bool = True, fsync: bool = False) -> str:
    """Publish the bytes of ``src`` as ``final``; return how (:data:`LINK`, ...).

    ``digest``: the ``"<algorithm>:<hex>"`` the bytes must hash to, checked when they are
    copied. Raises ``FileNotFoundError`` when ``src`` is gone (evicted meanwhile: the caller
    copies from the source instead), :class:`HashMismatch` when a copy does not match, and
    other ``OSError`` as they come (ENOSPC included). Nothing is left under ``.partial``.
    ``fsync``: a copy or clone reaches the disk before its rename (``--fsync``; a link shares
    the cached file's blocks, made durable when it was filled).
    """
    partial = partial_of(final)
    discard(partial)
    try:
        if link:
            try:
                _link(src, partial)
                method = LINK
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                method = _clone_or_copy(src, partial, digest, fsync)
        else:
            method = _clone_or_copy(src, partial, digest, fsync)
        os.replace(partial, final)
    except BaseException:
        discard(partial)
        raise
    return method


def _link(src: str, partial: str) -> None:
    try:
        os.link(src, partial)
    except FileNotFoundError:
        if not os.path.exists(src):
            raise
        os.makedirs(os.path.dirname(partial), exist_ok=True)  # the first file of a directory
        os.link(src, partial)


def _clone_or_copy(src: str, partial: str, digest: str, fsync: bool) -> str:
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    with open(src, "rb", buffering=0) as reader:
        fd = os.open(partial, flags, 0o666)
        try:
            try:
                fcntl.ioctl(fd, FICLONE, reader.fileno())
                method = REFLINK
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                _copy(reader, fd, src, digest)
                method = COPY
            if fsync:
                os.fsync(fd)
            return method
        finally:
            os.close(fd)


def _copy(reader, fd: int, src: str, digest: str) -> None:  # noqa: ANN001 - a raw file
    algorithm = split_digest(digest)[0]
    hasher = new_hasher(algorithm)
    while block := reader.read(_BLOCK):
        hasher.update(block)
        view = memoryview(block)
        while view:
            view = view[os.write(fd, view) :]
    got = f"{algorithm}:{hasher.hexdigest()}"
    if got != digest:
        raise HashMismatch(
            f"cached copy {src} hashes to {got}, not {digest} as recorded; it is dropped from the "
            "cache and copied from the source again"
        )
