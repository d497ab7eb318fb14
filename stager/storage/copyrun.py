"""Copy a run of small local shards in one compiled call, each verified, none yet published.

Why: copied one by one (:func:`stager.storage.copy.copy_file`), a 20 KB shard from a
memory-speed source costs ~85 us of Python around ~25 us of compiled copy, and one
interpreter runs that Python one thread at a time: stage-in ran at a quarter of ``cp -r``
whatever the cores. :func:`copy_run` copies a run of shards with the interpreter lock
released once (``_copyrun.c``), checks each as ``copy_file`` does (unchanged while copied,
the size and hash expected, the tar walk's end), and leaves the caller one pass of
bookkeeping for the run.

It takes only the plain case. A shard that fails in any way here is not reported here: its
partial is removed and its result is None, and the caller copies it with ``copy_file``,
whose retries and errors say what is wrong. The copies it returns are ``.partial`` files the
caller must publish (:func:`publish_run`) or discard.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stager.storage import bytepath
from stager.storage.bytepath import ReadBack
from stager.storage.copy import CopyResult, Inspector
from stager.storage.paths import PARTIAL_SUFFIX, discard

__all__ = ["RunJob", "available", "walks", "copy_run", "publish_run", "fits"]

#: The hash the compiled run makes (a manifest with another cannot be checked by it).
ALGORITHM = bytepath.PUMP_ALGORITHM


@dataclass(slots=True)
class RunJob:
    """One shard of a run: copy ``src_path`` to ``final`` + ``.partial``. Treated as immutable
    but not declared frozen (a frozen ``__init__`` costs three times as much, per shard)."""

    src_path: str
    final: str
    expected_size: int
    expected_hash: str | None = None
    inspect: Inspector | None = None  # with a compiled walk (``compiled_walk()``)

    @property
    def partial(self) -> str:
        return self.final + PARTIAL_SUFFIX


def available() -> bool:
    """Whether runs can be copied here: the compiled pump is built and not switched off."""
    return bytepath._pump is not None and hasattr(bytepath._pump, "copy_run")


def walks() -> bool:
    """Whether a run can also feed each shard to its compiled tar walk (both are built)."""
    return available() and bool(bytepath._pump.WALKS)


def fits(size: int | None, expected_hash: str | None, block_bytes: int) -> bool:
    """Whether a shard of ``size`` bytes can be part of a run: known, smaller than the buffer
    (read whole in one pass), and with no hash to check but the one the run makes."""
    if size is None or size >= block_bytes:
        return False
    return expected_hash is None or expected_hash.startswith(ALGORITHM + ":")


def copy_run(
    jobs: Sequence[RunJob], *, block_bytes: int, fsync: bool, budget_s: float
) -> list[CopyResult | None]:
    """Copy ``jobs`` in order until they are done, one fails, or ``budget_s`` has passed.

    Returns a result for each job reached, in order (the rest were not started): a
    :class:`CopyResult` with the copy checked and left as the job's ``.partial``, or None
    where the job must be copied one by one (nothing of it is left). Every ``inspect`` of a
    job with a result has been finished. On an exception (a signal handler's) no partial of
    the run is left.
    """
    partials = [job.partial for job in jobs]
    arguments = [
        (job.src_path, partial, _walk_of(job.inspect))
        for job, partial in zip(jobs, partials, strict=True)
    ]
    view = bytepath._buffer(block_bytes)
    pieces = bytepath._WRITE_BYTES  # (as the one-by-one path writes)
    copied, failed = bytepath._pump.copy_run(arguments, view, pieces, fsync, budget_s)
    results: list[CopyResult | None] = []
    read_back = _OpenedOnUse()  # (one for the run: only a walk in doubt opens its copy)
    try:
        for job, partial, copy in zip(jobs, partials, copied, strict=False):
            read_back.path = partial
            results.append(_checked(job, read_back, *copy))
    except BaseException:
        for partial in partials[: len(copied)]:
            discard(partial)
        raise
    if failed:
        results.append(None)  # (its partial was removed in C)
    return results


def _walk_of(inspect: Inspector | None) -> Any:
    if inspect is None:
        return None
    compiled_walk = getattr(inspect, "compiled_walk", None)
    walk = compiled_walk() if compiled_walk is not None else None
    if walk is None:
        raise ValueError("a run's inspector must offer a compiled walk")
    return walk


def _checked(
    job: RunJob,
    read_back: _OpenedOnUse,
    size: int,
    digest: str,
    version: str,
    first_byte_s: float,
    seconds: float,
) -> CopyResult | None:
    """The result, or None with the partial discarded where a check fails (the one-by-one
    copy then says which, or finds the source as expected after all)."""
    wrong = size != job.expected_size or (
        job.expected_hash is not None and digest != job.expected_hash
    )
    if not wrong and job.inspect is not None:
        try:
            job.inspect.finish(read_back)
        finally:
            read_back.close()
    if wrong:
        discard(read_back.path)
        return None
    return CopyResult(
        size=size,
        hash=digest,
        bytes_read=size,
        first_byte_s=first_byte_s,
        seconds=seconds,
        last_byte_s=seconds,  # (the writes and closes too: a run's shard is CPU work)
        version=version,
    )


class _OpenedOnUse(ReadBack):
    """A :class:`ReadBack` of the closed partial at :attr:`path`, opened at its first read:
    only a walk in doubt reads its copy back, and an open per shard is one more hand-over of
    the lock. :meth:`close` it before :attr:`path` names the next shard's."""

    __slots__ = ("path",)

    def __init__(self) -> None:
        super().__init__(-1)
        self.path = ""

    def __call__(self, offset: int, nbytes: int) -> bytes:
        self._open()
        return super().__call__(offset, nbytes)

    def readinto(self, offset: int, view: memoryview) -> int:
        self._open()
        return super().readinto(offset, view)

    def _open(self) -> None:
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def publish_run(pairs: Sequence[tuple[str, str]]) -> list[OSError | None]:
    """Rename each ``(partial, final)``, in one compiled call where the pump is built; per
    pair, None or the error (its partial discarded)."""
    codes = bytepath._pump.rename_run(pairs) if bytepath._pump is not None else map(_rename, pairs)
    errors: list[OSError | None] = []
    for (partial, final), code in zip(pairs, codes, strict=True):
        if code:
            discard(partial)
            errors.append(OSError(code, os.strerror(code), partial, None, final))
        else:
            errors.append(None)
    return errors


def _rename(pair: tuple[str, str]) -> int:
    try:
        os.replace(*pair)
    except OSError as exc:
        return exc.errno or errno.EIO
    return 0
