"""The flat index of a dataset's samples (:class:`FlatIndex`): how it is joined from the
indexes of its shards (a :class:`TarIndex` each, as the loader and the slower indexers give
them, or the compiled walk's columns, as stage-in has them), and mapped from its file.

Why flat numpy arrays: see :mod:`stager.shards.loader_index`, which stores and maps them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import IntegrityError
from stager.shards.arrayfile import map_arrays
from stager.shards.indexfile import ARRAYS, join_walks
from stager.shards.members import TarIndex
from stager.shards.tarheader import name_bytes

__all__ = ["FlatIndex", "flatten", "flatten_walks", "open_dataset_index"]


@dataclass(frozen=True)
class FlatIndex:
    """Members of all shards, sample by sample, in shard order.

    Global sample ``g`` belongs to shard ``shard_of(g)``; its members are
    ``member_start[g]:member_start[g + 1]``, member ``m`` has extension
    ``ext_names[member_ext[m]]`` and ``member_size[m]`` payload bytes at ``member_offset[m]``.
    """

    shard_samples: np.ndarray  # int64 per shard (0 for a skipped shard)
    sample_offsets: np.ndarray  # int64, cumsum of shard_samples with a leading 0
    keys: np.ndarray  # bytes ("S") per sample, utf-8
    # the member arrays are uint32 where the values fit, else int64 (see _narrow)
    member_start: np.ndarray  # num_samples + 1
    member_ext: np.ndarray  # uint8 (int16 past 256 extensions, int32 past 32,767) per member
    member_offset: np.ndarray  # per member
    member_size: np.ndarray  # per member
    ext_names: tuple[str, ...]
    # the mapped file the arrays view, and its stamp; None for an index held in memory
    source: tuple[str, bytes] | None = field(default=None, compare=False)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A spawned worker (or any pickling) maps the same file instead of receiving a copy of
        # every array through a pipe; forked workers inherit the mapping without pickling.
        if self.source is not None:
            return (_reopen, self.source)
        return object.__reduce_ex__(self, protocol)

    @property
    def num_samples(self) -> int:
        return int(self.sample_offsets[-1])

    def shard_of(self, samples: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.sample_offsets, samples, side="right") - 1


_ARRAYS = ARRAYS


def open_dataset_index(path: Path) -> tuple[FlatIndex, list[str], bytes]:
    """Map the dataset index at ``path``: (index, shards skipped when it was built, its stamp).

    Raises ``OSError`` or ``ValueError`` (including ``KeyError``) when it cannot be used.
    """
    arrays, meta = map_arrays(path)
    stamp = bytes.fromhex(meta["stamp"])
    flat = FlatIndex(
        **{name: arrays[name] for name in _ARRAYS},
        ext_names=tuple(meta["ext_names"]),
        source=(os.fspath(path), stamp),
    )
    return flat, list(meta["skipped"]), stamp


def _reopen(path: str, stamp: bytes) -> FlatIndex:
    flat, _, found = open_dataset_index(Path(path))
    if found != stamp:
        raise IntegrityError(
            f"{path}: the dataset index changed while the loader was running; restart the job"
        )
    return flat


def _narrow_strings(strings: np.ndarray) -> np.ndarray:
    """Byte strings at the width of the longest, as ``np.asarray(list, "S")`` makes them."""
    width = int(np.strings.str_len(strings).max()) if strings.size else 1
    return strings.astype(f"S{max(width, 1)}")


def flatten(per_shard: list[TarIndex | None]) -> FlatIndex:
    ext_codes: dict[str, int] = {}
    counts: list[int] = []
    keys: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    exts: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    member_base = 0
    for index in per_shard:
        if index is None:
            counts.append(0)
            continue
        counts.append(index.num_samples)
        starts.append(index.member_start[:-1] + member_base)
        columns = index.columns
        if columns is not None:  # the scanner's arrays: no loop over members
            keys.append(columns.key_bytes)
            ids = [ext_codes.setdefault(e, len(ext_codes)) for e in columns.ext_names]
            exts.append(np.asarray(ids, dtype=np.int32)[columns.ext_codes])
        else:
            keys.append(np.asarray([name_bytes(k) for k in index.keys], dtype="S"))
            exts.append(
                np.asarray(
                    [ext_codes.setdefault(e, len(ext_codes)) for e in index.exts], dtype=np.int32
                )
            )
        offsets.append(index.offsets)
        sizes.append(index.sizes)
        member_base += len(index.exts)

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    return _assemble(
        np.asarray(counts, dtype=np.int64),
        np.concatenate(keys) if keys else np.zeros(0, "S1"),
        np.concatenate([cat(starts, np.int64), np.asarray([member_base], np.int64)]),
        cat(exts, np.int32),
        cat(offsets, np.int64),
        cat(sizes, np.int64),
        tuple(ext_codes),
    )


def flatten_walks(walks: Sequence[dict[str, Any]]) -> FlatIndex:
    """What :func:`flatten` makes of these compiled walks' results, joined column by column
    by the compiled join (:func:`stager.shards.indexfile.join_walks`), as numpy views."""
    columns, ext_names = join_walks(walks)
    arrays = {name: np.frombuffer(c.data, np.dtype(c.dtype)) for name, c in columns.items()}
    return FlatIndex(
        shard_samples=arrays["shard_samples"],
        sample_offsets=arrays["sample_offsets"],
        keys=arrays["keys"],
        member_start=arrays["member_start"],
        member_ext=arrays["member_ext"],
        member_offset=arrays["member_offset"],
        member_size=arrays["member_size"],
        ext_names=ext_names,
    )


def _assemble(
    shard_samples: np.ndarray,
    keys: np.ndarray,
    member_start: np.ndarray,
    member_ext: np.ndarray,
    member_offset: np.ndarray,
    member_size: np.ndarray,
    ext_names: tuple[str, ...],
) -> FlatIndex:
    """The index from whole columns, narrowed to the types it is stored in."""
    return FlatIndex(
        shard_samples=shard_samples,
        sample_offsets=np.concatenate([np.zeros(1, np.int64), np.cumsum(shard_samples)]),
        keys=_narrow_strings(keys) if len(keys) else np.zeros(0, "S1"),
        member_start=_narrow(member_start),
        member_ext=member_ext.astype(_code_type(len(ext_names))),
        member_offset=_narrow(member_offset),
        member_size=_narrow(member_size),
        ext_names=ext_names,
    )


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` as uint32 when they fit (shards under 4 GiB, under 4e9 members), else int64.

    Every worker reads the index pages of the samples it reads, so their size is memory per
    worker: 32-bit offsets and sizes take the index from ~61 to ~37 bytes per sample.
    Readers widen what they take (``astype(np.int64)``) before doing arithmetic.
    """
    if values.size == 0 or (values.min() >= 0 and values.max() < 2**32):
        return values.astype(np.uint32)
    return values


def _code_type(names: int) -> type:
    """The narrowest type for extension codes: every worker maps a byte per member of uint8.
    (A dataset of more than 32,767 distinct extensions is odd, but must not crash the index.)"""
    if names <= 256:
        return np.uint8
    return np.int16 if names <= 2**15 else np.int32
