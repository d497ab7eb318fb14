"""``flock`` locks for the node cache: exclusive or shared, safe against a lock file's removal.

Why not :class:`stager.storage.lock.NodeLock`: the cache needs shared locks too (every stage-in
using a dataset holds its lock shared; eviction needs it exclusive), a non-blocking test, and
lock files that ``stager clean --cache`` may delete. A lock taken on a file that was unlinked
meanwhile protects nothing (the next process locks a new file of that name), so after taking
the lock we check that the path still names the file we locked, and retry if not. ``flock``
is released by the kernel when its holder dies, even by ``kill -9``: a dead job never keeps
a dataset or a shard locked.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from stager.errors import LockTimeout

__all__ = ["FileLock", "lock_is_held"]


class FileLock:
    """An advisory lock on ``path`` (created if missing). ``timeout_s=None``: wait for ever.

    The wait blocks in the kernel when there is no timeout; with one, it retries a
    non-blocking ``flock`` with a short back-off (as :class:`~stager.storage.lock.NodeLock`
    does), since a blocking ``flock`` cannot be interrupted from a thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shared: bool = False,
        timeout_s: float | None = None,
        what: str = "",
    ):
        self.path = Path(path)
        self.shared = shared
        self.timeout_s = timeout_s
        self.what = what or str(self.path)
        self.contended = False
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock; ``blocking=False``: return False at once if someone else holds it."""
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not self._lock(fd, mode, blocking, deadline):
                    os.close(fd)
                    return False
                if _same_file(fd, self.path):
                    self._fd = fd
                    return True
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed or replaced while we waited: lock the file there now

    def _lock(self, fd: int, mode: int, blocking: bool, deadline: float | None) -> bool:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            self.contended = True
            if not blocking:
                return False
        if deadline is None:
            fcntl.flock(fd, mode)
            return True
        pause_s = 0.002
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"waited {self.timeout_s:.0f} s for {self.what} held by another process "
                        "of yours on this node; check for a hung stage-in (lsof the lock file)"
                    ) from None
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.05)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def lock_is_held(path: str | os.PathLike[str]) -> bool:
    """True when some process holds ``path`` locked (shared or exclusive), without waiting.

    The test takes the lock for an instant when it is free, so a process wanting it may
    wait that long. A missing or unreadable file is not held.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases it
    return False
