"""One copier per node: an ``flock`` on a file in node-local scratch.

If a user starts several ``stage-in`` tasks on one node (``--ntasks-per-node=4``), exactly one
takes the lock and copies; the others block on the same lock and, when it is released, adopt
the result the copier wrote beside it. ``flock`` is released by the kernel when the holder
dies, even by ``kill -9``, so a crashed copier never leaves the node stuck; the next holder
sees no fresh result and does the work itself. The lock lives on the node-local filesystem,
never on the shared one, where flock semantics are unreliable.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from stager.errors import LockTimeout

__all__ = ["NodeLock"]


class NodeLock:
    """An exclusive advisory lock; ``contended`` says whether someone else held it first."""

    def __init__(
        self, path: str | os.PathLike[str], *, timeout_s: float = 24 * 3600, poll_s: float = 0.05
    ):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.contended = False
        self._fd: int | None = None

    def acquire(self) -> NodeLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    self.contended = True
                    if time.monotonic() > deadline:
                        raise LockTimeout(
                            f"waited {self.timeout_s:.0f} s for {self.path} held by another "
                            "stage-in; "
                            "check for a hung process on this node (lsof the lock file)"
                        ) from None
                    time.sleep(self.poll_s)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
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
