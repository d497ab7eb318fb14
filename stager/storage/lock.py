"""One copier per node: an ``flock`` on a file in node-local scratch.

If a user starts several ``stage-in`` tasks on one node (``--ntasks-per-node=4``), exactly one
takes the lock and copies; the others block on the same lock and, when it is released, adopt
the result the copier wrote beside it. ``flock`` is released by the kernel when the holder
dies, even by ``kill -9``, so a crashed copier never leaves the node stuck; the next holder
sees no fresh result and does the work itself. The lock lives on the node-local filesystem,
never on the shared one, where flock semantics are unreliable.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from stager.errors import DestinationError, LockTimeout

__all__ = ["NodeLock"]


class NodeLock:
    """An exclusive advisory lock; ``contended`` says whether someone else held it first.

    ``timeout_s`` bounds the wait *without progress*: the holder calls :meth:`heartbeat` as it
    works (stage-in: at every shard published), which moves the lock file's mtime, and a
    waiter's clock restarts at each. A holder that hangs (on a dead NFS server, say) stops
    beating and its waiters give up with :class:`LockTimeout` (exit 8); one that copies
    terabytes keeps them waiting as long as it needs.

    ``read_only_ok``: on a read-only filesystem, where the lock file cannot be created, go on
    without it (``locked`` stays False): nobody can write there, so there is nothing to exclude.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        timeout_s: float = 24 * 3600,
        poll_s: float = 0.05,
        read_only_ok: bool = False,
    ):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.read_only_ok = read_only_ok
        self.contended = False
        self.locked = False
        self._fd: int | None = None
        self._beat_at = 0.0

    def _open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise DestinationError(
                    f"cannot open the lock {self.path}: {exc.strerror or exc}; "
                    "check the destination"
                ) from exc
            try:  # an existing lock file can be flock'ed through a read-only descriptor
                return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                if exc.errno == errno.EROFS and self.read_only_ok:
                    return None
                raise DestinationError(
                    f"cannot create the lock {self.path}: {exc.strerror or exc}; the destination "
                    "is read-only or not ours: pass --dest to a writable directory"
                ) from exc

    def _progress_at(self, started: float) -> float:
        """When the holder last showed progress, or when we started waiting if that is later."""
        try:
            return max(started, os.stat(self.path).st_mtime)
        except OSError:
            return started

    def heartbeat(self) -> None:
        """Tell waiters the holder is alive and working (a ``utime`` at most once a second)."""
        now = time.monotonic()
        if self._fd is None or now - self._beat_at < 1.0:
            return
        self._beat_at = now
        try:
            os.utime(self._fd)
        except OSError:
            pass  # a read-only lock file: waiters fall back to the plain timeout

    def acquire(self) -> NodeLock:
        fd = self._open()
        if fd is None:
            return self  # a read-only filesystem: no writer can exist
        started = time.time()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.contended = True
                    if time.time() - self._progress_at(started) > self.timeout_s:
                        raise LockTimeout(
                            f"waited {self.timeout_s:.0f} s without progress for {self.path}, "
                            "held by another process on this node; check for a hung process "
                            "(lsof the lock file) or raise --lock-timeout"
                        ) from None
                    time.sleep(self.poll_s)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.locked = True
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> NodeLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
