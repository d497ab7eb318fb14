"""Copy a run of small local shards in one compiled call, each verified, and publish them.

Why: copied one by one (:func:`stager.storage.copy.copy_file`), a 20 KB shard from a
memory-speed source costs ~85 us of Python around ~25 us of compiled copy, and one
interpreter runs that Python one thread at a time: stage-in ran at a quarter of ``cp -r``
whatever the cores. :func:`copy_run` copies a run of shards with the interpreter lock
released once (``_copyrun.c``), checks each as ``copy_file`` does (unchanged while copied,
the size, hash and sample count expected, the tar walk's end) and renames it, and leaves the
caller one pass of bookkeeping for the run.

It takes only the plain case. A shard that fails in any way here is not reported here: its
partial is removed and its result is None, and the caller copies it with ``copy_file``,
whose retries and errors say what is wrong. Without ``publish`` the copies it returns are
``.partial`` files the caller must publish (:func:`publish_run`) or discard.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stager.storage import bytepath
from stager.storage.bytepath import ReadBack
from stager.storage.copy import CopyResult, Inspector
from stager.storage.paths import discard, partial_of

__all__ = ["RunJob", "CountingInspector", "available", "walks", "copy_run", "publish_run", "fits"]

#: The hash the compiled run makes (a manifest with another cannot be checked by it).
ALGORITHM = bytepath.PUMP_ALGORITHM


class CountingInspector(Inspector, Protocol):
    """An inspector that counts a tar's samples (``stager.shards.tarparse.TarSampleCounter``):
    None where the bytes were not a complete, well-formed tar."""

    @property
    def samples(self) -> int | None: ...


@dataclass(slots=True)
class RunJob:
    """One shard of a run: copy ``src_path`` to ``final`` (through ``final`` + ``.partial``).
    Treated as immutable but not declared frozen (a frozen ``__init__`` costs three times as
    much, per shard)."""

    src_path: str
    final: str
    expected_size: int
    expected_hash: str | None = None
    inspect: CountingInspector | None = None  # with a compiled walk (``compiled_walk()``)
    #: The manifest's sample count: a walk that counts others refuses the copy (where the walk
    #: found no tar, the finish, which reads the copy once more, says what it is)
    expected_samples: int | None = None

    @property
    def partial(self) -> str:
        return partial_of(self.final)


#: What became of a job the compiled run copied (its result's first field; ``_copyrun.c``).
_PUBLISHED, _CHECKED, _UNCHECKED, _REFUSED = range(4)


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
    jobs: Sequence[RunJob], *, block_bytes: int, fsync: bool, budget_s: float, publish: bool
) -> list[CopyResult | None]:
    """Copy ``jobs`` in order until they are done, one fails, or ``budget_s`` has passed.

    Returns a result for each job reached, in order (the rest were not started): a
    :class:`CopyResult` where the copy is what the job expects (its size, hash and sample
    count), renamed to its final name where ``publish``, else left as its ``.partial``; or
    None where the job must be copied one by one (nothing of it is left). Every ``inspect`` of
    a job with a result has been finished. On an exception (a signal handler's) no partial of
    the run is left; what was published stays (each copy whole and checked).
    """
    partials = [job.partial for job in jobs]
    arguments = [
        (
            job.src_path,
            partial,
            job.final,
            job.expected_size,
            job.expected_hash,
            -1 if job.expected_samples is None else job.expected_samples,
            _walk_of(job.inspect),
        )
        for job, partial in zip(jobs, partials, strict=True)
    ]
    view = bytepath._buffer(block_bytes)
    pieces = bytepath._WRITE_BYTES  # (as the one-by-one path writes)
    copied, failed = bytepath._pump.copy_run(arguments, view, pieces, fsync, budget_s, publish)
    results: list[CopyResult | None] = []
    unchecked: list[int] = []  # copies whose walk did not vouch, checked here, not renamed yet
    read_back = _OpenedOnUse()  # (one for the run: only a walk in doubt opens its copy)
    try:
        for job, partial, copy in zip(jobs, partials, copied, strict=False):
            state, size, digest, version, first_byte_s, seconds = copy
            if state == _REFUSED:  # (its partial was removed in C)
                results.append(None)
                continue
            inspect = job.inspect
            if inspect is not None:
                read_back.path = partial
                try:
                    inspect.finish(read_back)  # (a walk that vouched reads nothing back)
                finally:
                    read_back.close()
                if state == _UNCHECKED:
                    if not _samples_as_expected(job, inspect):
                        discard(partial)
                        results.append(None)
                        continue
                    unchecked.append(len(results))
            results.append(
                CopyResult(
                    size=size,
                    hash=digest,
                    bytes_read=size,
                    first_byte_s=first_byte_s,
                    seconds=seconds,
                    last_byte_s=seconds,  # (the writes and closes too: a run's shard is CPU work)
                    version=version,
                )
            )
        if publish and unchecked:  # (a tar its walk did not vouch for: rare)
            pairs = [(partials[i], jobs[i].final) for i in unchecked]
            for i, error in zip(unchecked, publish_run(pairs), strict=True):
                if error is not None:
                    results[i] = None  # (its partial discarded: copied one by one)
    except BaseException:
        for partial, copy in zip(partials, copied, strict=False):
            if copy[0] in (_CHECKED, _UNCHECKED):
                discard(partial)
        raise
    if failed:
        results.append(None)  # (its partial was removed in C)
    return results


def _samples_as_expected(job: RunJob, inspect: CountingInspector) -> bool:
    """Whether a copy's walk, finished in Python, counted the samples the job expects (or
    found no tar: the finish then reads the copy once more and says what it is)."""
    counted = inspect.samples
    return job.expected_samples is None or counted is None or counted == job.expected_samples


def _walk_of(inspect: Inspector | None) -> Any:
    if inspect is None:
        return None
    compiled_walk = getattr(inspect, "compiled_walk", None)
    walk = compiled_walk() if compiled_walk is not None else None
    if walk is None:
        raise ValueError("a run's inspector must offer a compiled walk")
    return walk


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
