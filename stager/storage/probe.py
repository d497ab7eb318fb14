"""Short, bounded measurements of the storage a job reads and writes: the source and scratch.

``stager doctor`` (in :mod:`stager_loaders.doctor`) puts them beside the loader's own rate to
say what limits a job. Each probe is bounded in bytes and files, so it is safe on a busy NFS.
"""

from __future__ import annotations

import contextlib
import errno
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stager.errors import DestinationError, ScratchFull, SourceError
from stager.layout import DOCTOR_PROBE_PREFIX, PARTIAL_SUFFIX
from stager.storage.dest import ensure_private_dir
from stager.storage.sources import SourceSet, SourceShard

__all__ = ["SourceProbe", "ScratchProbe", "probe_source", "probe_scratch"]

_BLOCK = 4 << 20


@dataclass(frozen=True)
class SourceProbe:
    files: int
    bytes_read: int
    seconds: float
    streams: int
    first_byte_ms: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ScratchProbe:
    path: str
    bytes_written: int
    seconds: float
    free_bytes: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e6 if self.seconds > 0 else 0.0


def _sample(shards: Sequence[SourceShard], max_files: int) -> list[SourceShard]:
    if len(shards) <= max_files:
        return list(shards)
    step = len(shards) / max_files
    return [shards[int(i * step)] for i in range(max_files)]


def probe_source(
    source: SourceSet, *, max_files: int = 16, max_bytes: int = 256 << 20, streams: int = 8
) -> SourceProbe:
    """Read a spread-out sample of shards (bounded by count and bytes) and time it."""
    picked: list[SourceShard] = []
    total = 0
    for shard in _sample(source.shards, max_files):
        if picked and total + (shard.size or 0) > max_bytes:
            break
        picked.append(shard)
        total += shard.size or 0
    first_bytes: list[float] = []

    def read(shard: SourceShard) -> int:
        started = time.perf_counter()
        nbytes = 0
        try:
            with source.fs.open(shard.path, "rb", block_size=_BLOCK) as handle:
                while block := handle.read(_BLOCK):
                    if not nbytes:
                        first_bytes.append(time.perf_counter() - started)
                    nbytes += len(block)
        except PermissionError as exc:  # (a traceback, exit 1)
            raise SourceError(
                f"{shard.url}: not readable (permission denied); check its mode and owner"
            ) from exc
        except FileNotFoundError as exc:
            raise SourceError(f"{shard.url}: not found on the source (removed?)") from exc
        return nbytes

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(streams, len(picked)))) as pool:
        nbytes = sum(pool.map(read, picked))
    seconds = time.perf_counter() - started
    return SourceProbe(
        files=len(picked),
        bytes_read=nbytes,
        seconds=seconds,
        streams=max(1, min(streams, len(picked))),
        first_byte_ms=1000 * statistics.median(first_bytes) if first_bytes else 0.0,
    )


def probe_scratch(dest_root: Path, *, nbytes: int = 128 << 20) -> ScratchProbe:
    """Write (and fsync) a temporary file of ``nbytes`` (at most a quarter of the free space)
    under ``dest_root``, then delete it. Raises :class:`DestinationError` (or
    :class:`ScratchFull`) naming ``dest_root`` where it cannot be written."""
    path = dest_root / f"{DOCTOR_PROBE_PREFIX}{os.getpid()}{PARTIAL_SUFFIX}"
    try:
        root = ensure_private_dir(dest_root)
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        nbytes = max(1, min(nbytes, free // 4))  # (a nearly full scratch: what a quarter allows)
        block = memoryview(os.urandom(min(_BLOCK, nbytes)))
        started = time.perf_counter()
        try:
            with open(path, "wb", buffering=0) as handle:
                written = 0
                while written < nbytes:
                    written += handle.write(block[: nbytes - written])
                os.fsync(handle.fileno())
            seconds = time.perf_counter() - started
        finally:
            with contextlib.suppress(OSError):  # (never made on a read-only one)
                path.unlink()
    except OSError as exc:
        reason = f"cannot write a probe file under {dest_root}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ScratchFull(reason, where=str(dest_root)) from exc
        raise DestinationError(f"{reason}; check the scratch (read-only? full?)") from exc
    return ScratchProbe(path=str(root), bytes_written=written, seconds=seconds, free_bytes=free)
