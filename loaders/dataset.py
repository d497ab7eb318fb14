"""Random access to samples of local, uncompressed tar shards by byte offset.

Staged shards sit on node-local disk, so a sample is a few byte ranges of its shard at offsets
known from the index, read from a mapped shard or with ``pread`` (:mod:`stager_loaders.shardio`
chooses by shard count): no per-member tar parsing on the hot path, any order is as cheap as
sequential order, and a batch can be fetched in one call (``__getitems__``).

With nothing to decode, a whole batch is copied into one uint8 buffer (:class:`PackedBatch`),
which the main process cuts into per-member tensor views (``torch.split``), so no payload is
copied again. How the buffer leaves a worker depends on its size: a large one is a tensor in
shared memory (torch hands over a file descriptor, no copy), a small one a numpy array pickled
through the worker's pipe, because setting up a shared-memory segment per batch (open,
truncate, map, pass the descriptor, map again) costs more than copying a few hundred KB.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from stager.errors import IntegrityError
from stager.shards.loader_index import FlatIndex
from stager.shards.packedstrings import PackedStrings
from stager.shards.tarheader import name_text

from .samples import SamplePipeline, select_columns
from .shardio import open_shards

__all__ = ["StagedTarDataset", "PackedBatch"]

#: Batches of at least this many payload bytes leave workers through shared memory.
SHARED_MEMORY_MIN_BYTES = 1 << 20


def batch_buffer(nbytes: int) -> tuple[torch.Tensor | np.ndarray, np.ndarray]:
    """A batch's payload and a numpy view to copy its members into.

    In a worker, a large batch is allocated in shared memory up front: otherwise torch copies
    it into shared memory again when the worker hands it to the main process.
    """
    if get_worker_info() is not None and nbytes >= SHARED_MEMORY_MIN_BYTES:
        shared = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        return shared, shared.numpy()
    out = np.empty(nbytes, dtype=np.uint8)
    return out, out


@dataclass
class PackedBatch:
    """A batch of undecoded samples: one payload tensor plus where each member lies in it."""

    payload: torch.Tensor | np.ndarray  # uint8, every member of every sample, back to back
    keys: list[str]
    member_sample: np.ndarray  # int32: which sample of the batch owns each member
    member_ext: np.ndarray  # small integer codes into ext_names
    member_size: np.ndarray  # int64
    ext_names: tuple[str, ...]

    def pin_memory(self, device: str | None = None) -> PackedBatch:
        """Called by DataLoader's pin-memory thread (``pin_memory=True``): pin the one payload."""
        payload = self.tensor()
        pinned = payload.pin_memory(device) if device else payload.pin_memory()
        return PackedBatch(
            pinned, self.keys, self.member_sample, self.member_ext, self.member_size, self.ext_names
        )

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor (a numpy payload is wrapped, not copied)."""
        payload = self.payload
        return torch.from_numpy(payload) if isinstance(payload, np.ndarray) else payload

    def columns(self) -> dict[str, list[torch.Tensor | None]]:
        """``{"__key__": [...], ext: [uint8 tensor or None per sample]}`` (views, no copy)."""
        views = (
            torch.split(self.tensor(), self.member_size.tolist()) if len(self.member_size) else ()
        )
        count = len(self.keys)
        out: dict[str, list[Any]] = {"__key__": self.keys}
        layout = self._uniform_layout()
        if layout is not None:  # every sample has the same members in the same order
            width = len(layout)
            for j, code in enumerate(layout):
                out[self.ext_names[code]] = list(views[j::width])
            return out
        for code in np.unique(self.member_ext).tolist():
            column: list[Any] = [None] * count
            for m in np.flatnonzero(self.member_ext == code).tolist():
                column[self.member_sample[m]] = views[m]
            out[self.ext_names[code]] = column
        return out

    def _uniform_layout(self) -> list[int] | None:
        """The extension codes of one sample when all samples share them, in order; else None."""
        count = len(self.keys)
        if count == 0 or len(self.member_ext) % count:
            return None
        width = len(self.member_ext) // count
        grid = self.member_ext.reshape(count, width)
        if width == 0 or not (grid == grid[0]).all() or len(set(grid[0].tolist())) != width:
            return None
        return grid[0].tolist()

    def unpack(self, to_tuple: Sequence[str] | None) -> Any:
        """The batch as the user sees it: a dict of lists, or a tuple of lists."""
        columns = self.columns()
        if to_tuple is None:
            return columns
        return select_columns(columns, to_tuple)


class StagedTarDataset(Dataset):
    """Map-style dataset over local tar shards; index ``g`` is the global sample number.

    ``pipeline=None`` means raw batches (:class:`PackedBatch`); otherwise each sample dict
    (``__key__``, ``__shard__`` and one ``bytes`` per member) goes through ``pipeline``.
    """

    def __init__(
        self,
        shard_paths: Sequence[str | os.PathLike[str]],
        index: FlatIndex,
        pipeline: SamplePipeline | None = None,
    ):
        self.index = index
        self.pipeline = pipeline
        # per process (a fork or a pickle reopens); holds the paths without a str per shard
        if not isinstance(shard_paths, PackedStrings):
            shard_paths = PackedStrings([os.fspath(p) for p in shard_paths])
        self.files = open_shards(shard_paths)

    def __len__(self) -> int:
        return self.index.num_samples

    def _members(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Member numbers of ``samples`` in order, the batch position owning each, and shards."""
        # the index stores narrow unsigned types: widen before subtracting
        starts = self.index.member_start[samples].astype(np.int64)
        counts = self.index.member_start[samples + 1].astype(np.int64) - starts
        owner = np.repeat(np.arange(len(samples), dtype=np.int32), counts)
        first = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        members = first + np.arange(int(counts.sum()), dtype=np.int64)
        return members, owner, self.index.shard_of(samples)

    def _truncated(self, shard: int, offset: int, size: int, sample: int) -> IntegrityError:
        key = name_text(self.index.keys[sample])
        return IntegrityError(
            f"{self.files.path(shard)}: member of sample {key!r} is truncated "
            f"(wanted {size} bytes at {offset}); re-stage this shard"
        )

    def __getitems__(self, indices: Sequence[int]) -> Any:
        samples = np.asarray(indices, dtype=np.int64)
        if self.pipeline is not None:
            return [self._sample_dict(int(g)) for g in samples]
        members, owner, shards = self._members(samples)
        sizes = self.index.member_size[members].astype(np.int64)
        offsets = self.index.member_offset[members].astype(np.int64)
        member_shard = shards[owner]
        payload, out = batch_buffer(int(sizes.sum()))
        shard_list, offset_list, size_list = member_shard.tolist(), offsets.tolist(), sizes.tolist()
        short = self.files.copy_members(shard_list, offset_list, size_list, out)
        if short >= 0:  # a truncated shard: name it and the sample
            raise self._truncated(
                shard_list[short], offset_list[short], size_list[short], int(samples[owner[short]])
            )
        return PackedBatch(
            payload=payload,
            keys=[name_text(k) for k in self.index.keys[samples].tolist()],
            member_sample=owner,
            member_ext=self.index.member_ext[members],
            member_size=sizes,
            ext_names=self.index.ext_names,
        )

    def _sample_dict(self, g: int) -> Any:
        shard = int(self.index.shard_of(np.asarray([g]))[0])
        sample: dict[str, Any] = {
            "__key__": name_text(self.index.keys[g]),
            "__shard__": self.files.path(shard),
        }
        lo, hi = int(self.index.member_start[g]), int(self.index.member_start[g + 1])
        for m in range(lo, hi):
            ext = self.index.ext_names[self.index.member_ext[m]]
            offset, size = int(self.index.member_offset[m]), int(self.index.member_size[m])
            payload = self.files.read(shard, offset, size)
            if len(payload) != size:
                raise self._truncated(shard, offset, size, g)
            sample[ext] = payload
        return self.pipeline(sample) if self.pipeline is not None else sample

    def __getitem__(self, g: int) -> Any:
        """One sample as a dict of bytes (or through the pipeline): for tools that index singly."""
        if not 0 <= g < len(self):
            raise IndexError(g)
        return self._sample_dict(int(g))
