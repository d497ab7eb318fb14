"""Reading sample members out of many local shard files: mapped when few, ``pread`` when many.

Two ways, chosen once per dataset by :func:`open_shards`, both with a bounded number of files
held open, because the first design (a memory map per shard, kept for the life of the process)
failed at scale: CPython's ``mmap`` keeps a duplicate descriptor per map, so a worker that
visited 100k shards in an epoch died with ``EMFILE`` after ~20k of them (the kernel's 65,530
maps per process come next), with every page it had read still counted in its PSS.

* :class:`MappedShards`, when the dataset has at most :func:`open_limit` shards (at most
  4,096: the usual case of large shards): each shard mapped once, a member is a slice, and a
  batch is one C loop over slices. Mapped pages count in the worker's RSS/PSS while it runs
  (shared with the page cache and the other workers, reclaimable); the number of maps is
  bounded by the shard count.
* :class:`PreadShards`, beyond that (e.g. 100k small shards): at most ``open_limit()``
  descriptors, least recently used closed first, and one ``preadv`` per member straight into
  the batch buffer: nothing stays mapped, so a worker's PSS does not grow with what it read.

Measured on this project's 2-core VMs (see docs/benchmarks.md): a slice of a mapped shard costs
~0.3 us, ``pread`` of 1 KB ~5 us, opening and closing a file ~9 us, mapping, touching and
unmapping one ~33 us: maps win while they can all stay, reads once files must be reopened.

Descriptors and maps never cross processes: a forked worker drops the inherited ones and opens
its own (for a map the parent's stays valid in the parent; a descriptor is closed in the child
only); pickling drops them.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from stager.errors import IntegrityError
from stager.shards.packedstrings import PackedStrings

__all__ = ["MappedShards", "PreadShards", "MAX_OPEN", "COALESCE_GAP", "open_limit", "open_shards"]

_PROCESS_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

#: Members at most this far apart in one shard are read together (a tar header is 512 bytes,
#: a PAX record one or two more blocks).
COALESCE_GAP = 4096


#: The most shard files a process holds at once, whatever its descriptor limit allows.
MAX_OPEN = 4096


def open_limit() -> int:
    """Shard files a process holds at once: a quarter of its descriptor limit, at most 4,096.

    A quarter leaves room for the rest of the process (sockets, pipes, torch's shared-memory
    descriptors); eight ranks of nine processes each then hold at most ~300k per node.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN
    return max(8, min(MAX_OPEN, soft // 4))


def _refused(path: str, exc: Exception) -> Exception:
    if isinstance(exc, OSError) and exc.errno in _PROCESS_LIMITS:
        return exc  # the process's limits, not the shard: say so as the OS does
    return IntegrityError(f"{path}: cannot open shard ({exc}); re-stage it")


class _PerProcess:
    """Paths plus per-process handles that a fork or a pickle must not carry over.

    The paths are one :class:`PackedStrings` buffer, not a list of str: a forked worker that
    opened shards by a list's str objects wrote to each one's reference count, copying the
    pages holding them (~10 MiB of private memory per worker at 100k shards); the buffer's
    pages stay shared, and a path is encoded for the OS without building a str.
    """

    def __init__(self, paths: Sequence[str]):
        self.paths = paths if isinstance(paths, PackedStrings) else PackedStrings(paths)
        self._pid = os.getpid()
        self._reset()

    def path(self, shard: int) -> str:
        """The path of shard number ``shard``."""
        return self.paths[shard]

    def _reset(self) -> None:
        raise NotImplementedError

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._inherited()
            self._pid = os.getpid()
            self._reset()

    def _inherited(self) -> None:
        """Release what a forked child inherited (default: nothing to release)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _PerProcess.__init__(self, state["paths"])


class MappedShards(_PerProcess):
    """Every shard mapped on first use and kept (only chosen for few shards)."""

    def _reset(self) -> None:
        self._maps: dict[int, np.ndarray] = {}
        self._mmaps: dict[int, mmap.mmap] = {}

    def _map(self, shard: int) -> np.ndarray:
        array = self._maps.get(shard)
        if array is None:
            path = self.path(shard)
            try:
                with open(path, "rb") as handle:
                    mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
                raise _refused(path, exc) from exc
            self._mmaps[shard] = mapped
            array = self._maps[shard] = np.frombuffer(mapped, dtype=np.uint8)
        return array

    def _cut_short(self, ends: dict[int, int]) -> dict[int, int]:
        """The mapped shards whose file now ends before ``ends[shard]``, with that length.

        A map keeps the length the file had when it was mapped (an earlier epoch, with
        persistent workers or ``num_workers=0``): touching its pages past a truncated file's
        new end raises SIGBUS, which killed the training process (or a worker, reported as
        "insufficient shared memory") instead of an IntegrityError naming the shard. One
        ``fstat`` per shard of the batch (``mmap.size()``) asks for the file's length now.
        """
        short = {}
        for shard, end in ends.items():
            try:
                now = self._mmaps[shard].size()
            except OSError:  # (the descriptor the map keeps cannot be asked: treat as gone)
                now = 0
            if now < end:
                short[shard] = now
        return short

    def copy_members(
        self, shards: list[int], offsets: list[int], sizes: list[int], out: np.ndarray
    ) -> int:
        """Members back to back into ``out``; -1, or the first member that came up short."""
        self._check_pid()
        views: list[np.ndarray] = []
        ends: dict[int, int] = {}
        for s, a, n in zip(shards, offsets, sizes, strict=True):
            views.append(self._map(s)[a : a + n])
            if a + n > ends.get(s, 0):
                ends[s] = a + n
        short = self._cut_short(ends)
        if short:  # name the first member past its shard's end now
            members = enumerate(zip(shards, offsets, sizes, strict=True))
            return next(i for i, (s, a, n) in members if s in short and a + n > short[s])
        try:
            # one C loop copies them all (half the time of assigning slice by slice)
            np.concatenate(views, out=out) if views else None
        except ValueError:  # a view cut short by a truncated shard: the total came out wrong
            return next(i for i, (v, n) in enumerate(zip(views, sizes, strict=True)) if len(v) != n)
        return -1

    def read(self, shard: int, offset: int, size: int) -> bytes:
        self._check_pid()
        array = self._map(shard)
        if self._cut_short({shard: offset + size}):
            return b""
        return array[offset : offset + size].tobytes()

    def __len__(self) -> int:
        """Shards mapped now."""
        return len(self._maps)


class PreadShards(_PerProcess):
    """At most ``open_limit()`` descriptors (LRU), one positional read per member."""

    def _reset(self) -> None:
        self.limit = open_limit()
        self._fds: OrderedDict[int, int] = OrderedDict()

    def _inherited(self) -> None:
        self.close()  # the child's copies; the parent's descriptors stay open in the parent

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        if len(self._fds) >= self.limit:
            os.close(self._fds.popitem(last=False)[1])
        path = self.path(shard)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _refused(path, exc) from exc
        self._fds[shard] = fd
        return fd

    def copy_members(
        self, shards: list[int], offsets: list[int], sizes: list[int], out: np.ndarray
    ) -> int:
        """Members back to back into ``out``; -1, or the first member that came up short."""
        self._check_pid()
        target = memoryview(out)  # type: ignore[arg-type]  # numpy arrays are buffers
        position, i, count = 0, 0, len(shards)
        while i < count:
            # A sample's members lie close together in its shard (a 512-byte header, maybe a
            # PAX record, between them): one read covers them all, which halves the system
            # calls for two-member samples.
            shard, start, stop = shards[i], offsets[i], offsets[i] + sizes[i]
            j = i + 1
            while j < count and shards[j] == shard and 0 <= offsets[j] - stop <= COALESCE_GAP:
                stop = offsets[j] + sizes[j]
                j += 1
            fd = self._fd(shard)
            if j == i + 1:
                if os.preadv(fd, [target[position : position + sizes[i]]], start) != sizes[i]:
                    return i
                position += sizes[i]
            else:
                span = memoryview(os.pread(fd, stop - start, start))
                for k in range(i, j):
                    lo = offsets[k] - start
                    if lo + sizes[k] > len(span):
                        return k
                    target[position : position + sizes[k]] = span[lo : lo + sizes[k]]
                    position += sizes[k]
            i = j
        return -1

    def read(self, shard: int, offset: int, size: int) -> bytes:
        self._check_pid()
        return os.pread(self._fd(shard), size, offset)

    def __del__(self) -> None:
        # A dropped reader's descriptors: with num_workers=0 the training process itself holds
        # up to open_limit() of them, and a loader made again (each epoch, an evaluation pass)
        # left them all open, the fourth failing with EMFILE. Only the process that opened
        # them closes them (a forked child's copies are released by _check_pid on first use).
        try:
            if self._pid == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001 - (interpreter shutdown, a half-made object)
            pass

    def close(self) -> None:
        while self._fds:
            try:
                os.close(self._fds.popitem()[1])
            except OSError:
                pass

    def __len__(self) -> int:
        """Descriptors open now (at most ``limit``)."""
        return len(self._fds)


def open_shards(paths: Sequence[str]) -> MappedShards | PreadShards:
    """Maps when every shard can stay mapped within :func:`open_limit`, positional reads else."""
    return MappedShards(paths) if len(paths) <= open_limit() else PreadShards(paths)
