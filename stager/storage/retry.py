"""Retries with exponential backoff and jitter, for transient source errors.

Only errors that can plausibly succeed on a second try are retried: a missing file, a
permission error or a full scratch will not fix themselves, and retrying them would only
delay the one-line report the user needs.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from stager.errors import IntegrityError, StagerError

if TYPE_CHECKING:
    import random

__all__ = ["RetryPolicy", "is_transient", "call_with_retries"]

T = TypeVar("T")

_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ENOSPC,
    errno.EDQUOT,
}


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (I/O hiccups, timeouts, dropped connections)."""
    if isinstance(exc, IntegrityError):
        # A size mismatch can be a file still being written or an NFS hiccup: retry it.
        # A hash mismatch against a manifest is reported as it is (see copy.HashMismatch).
        return getattr(exc, "transient", False)
    if isinstance(exc, StagerError):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    return isinstance(exc, (TimeoutError, ConnectionError))


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the wait doubles from ``base_delay_s`` up to ``max_delay_s``."""

    attempts: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Wait before retry number ``attempt`` (1-based), with +-25% jitter."""
        if rng is None:
            import random  # (only on a retry: ~2 ms of every stage-in's start)

            draw = random.random()
        else:
            draw = rng.random()
        delay = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return delay * (0.75 + 0.5 * draw)


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[int, BaseException], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, a permanent error occurs, or attempts run out."""
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            if attempt >= policy.attempts or not is_transient(exc):
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(policy.delay_s(attempt))
            attempt += 1
