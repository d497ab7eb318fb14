"""One flat, numpy-only index of every sample member of a list of local tar shards.

Why flat numpy arrays rather than a list of :class:`stager.shards.tarindex.TarIndex`: DataLoader
workers are forked, and arrays (unlike millions of Python strings and ints) are not touched by
reference counting. Why one memory-mapped file per dataset (``<dataset>/.stager/index/``
:data:`DATASET_INDEX_NAME`, :mod:`stager.shards.arrayfile`): the index grows with the dataset
(~40 bytes per sample), so a copy per rank (eight per node) or per worker would make memory
grow with the dataset; mapped read-only, the node holds it once, in the page cache, and each
process pays only for the pages it reads. stage-in writes it from the offsets it parsed in
flight; otherwise the first loader writes it. Walking tar headers costs ~60 us per member in
Python, so a slow shard's own index is also cached (``<relpath>.idx.npz``). Every cache is
published atomically (temp file + rename); racing writers write identical content, so the
loser's rename is harmless.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import IntegrityError
from stager.shards.arrayfile import map_arrays, write_arrays
from stager.shards.indexkey import dataset_key
from stager.shards.tarindex import TarIndex, duplicate_member, index_tar
from stager.shards.tarnative import WalkResult
from stager.shards.tarscan import scan_tar  # noqa: F401 - loaded with numpy, not on first use

__all__ = [
    "DATASET_INDEX_NAME",
    "FlatIndex",
    "build_flat_index",
    "cached_index",
    "dataset_index_path",
    "open_dataset_index",
    "save_dataset_index",
]

log = logging.getLogger("stager_loaders")

_CACHE_VERSION = 2  # 2: the dataset index narrows offsets and sizes to 32 bits where they fit

#: The dataset's one index file, in the loader-index directory beside the staged copy.
DATASET_INDEX_NAME = "dataset.index"


def dataset_index_path(cache_dir: Path) -> Path:
    """Where the dataset's mapped index lives in the loader-index directory ``cache_dir``."""
    return cache_dir / DATASET_INDEX_NAME


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
    member_ext: np.ndarray  # uint8 (or int16 past 256 extensions) per member
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


def _cache_path(shard: Path, cache_dir: Path | None, relpath: str) -> Path | None:
    if cache_dir is None:
        return None
    return cache_dir / (relpath + ".idx.npz")


#: A shard's index is cached on disk only if building it took this long: writing a cache file
#: costs ~0.6 ms and reading one back ~1 ms, more than indexing a small shard (~0.1 ms).
CACHE_AFTER_S = 0.005


def cached_index(
    shard: Path, *, cache_dir: Path | None = None, relpath: str | None = None
) -> TarIndex:
    """:func:`stager.shards.tarindex.index_tar`, memoised on disk by the shard's size and mtime."""
    stat = shard.stat()
    stamp = np.asarray([_CACHE_VERSION, stat.st_size, stat.st_mtime_ns], dtype=np.int64)
    path = _cache_path(shard, cache_dir, relpath or shard.name)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                if np.array_equal(stored["stamp"], stamp):
                    return TarIndex(
                        keys=[k.decode() for k in stored["keys"].tolist()],
                        member_start=stored["member_start"],
                        exts=[e.decode() for e in stored["exts"].tolist()],
                        offsets=stored["offsets"],
                        sizes=stored["sizes"],
                    )
        except (OSError, ValueError, KeyError) as exc:
            log.info("ignoring unreadable index cache %s (%s); rebuilding it", path, exc)
    started = time.perf_counter()
    index = index_tar(shard)
    if path is not None and time.perf_counter() - started >= CACHE_AFTER_S:
        _write_cache(path, index, stamp)
    return index


def _write_cache(path: Path, index: TarIndex, stamp: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial.npz")
        np.savez(
            tmp,
            stamp=stamp,
            keys=np.asarray([k.encode() for k in index.keys], dtype="S")
            if index.keys
            else np.zeros(0, "S1"),
            member_start=index.member_start,
            exts=np.asarray([e.encode() for e in index.exts], dtype="S")
            if index.exts
            else np.zeros(0, "S1"),
            offsets=index.offsets,
            sizes=index.sizes,
        )
        os.replace(tmp, path)
    except OSError as exc:  # a read-only staged copy still loads, only slower next time
        log.info("cannot cache the index of %s at %s (%s)", path.name, path, exc)


def build_flat_index(
    shards: Sequence[str | os.PathLike[str]],
    *,
    relpaths: Sequence[str] | None = None,
    expected_samples: Sequence[int | None] | None = None,
    cache_dir: Path | None = None,
    on_error: str = "raise",
    stats: Sequence[tuple[int, int] | None] | np.ndarray | None = None,
) -> tuple[FlatIndex, list[str]]:
    """Index ``shards`` and flatten them; returns the index and the shards skipped as corrupt.

    A shard whose tar headers are corrupt or truncated raises :class:`IntegrityError` naming
    the shard and the member, or with ``on_error="skip"`` contributes zero samples and is
    listed. A sample count that differs from the manifest's is corruption too (a stale copy).
    ``stats`` are the shards' ``(size, mtime_ns)`` when the caller has just stat'ed them (the
    loader's resolver does), saving a second stat per shard: ~0.3 s at 100k shards.
    """
    relpaths = list(relpaths) if relpaths is not None else [Path(p).name for p in shards]
    expected = list(expected_samples) if expected_samples is not None else [None] * len(shards)
    stamp = None
    if cache_dir is not None:
        stamp = dataset_key(shards, relpaths, expected, on_error, stats, version=_CACHE_VERSION)
    if stamp is not None and cache_dir is not None:
        loaded = _load_flat(dataset_index_path(cache_dir), stamp)
        if loaded is not None:
            return loaded
    per_shard: list[TarIndex | None] = []
    skipped: list[str] = []
    for path, rel, want in zip(shards, relpaths, expected, strict=True):
        try:
            index = cached_index(Path(path), cache_dir=cache_dir, relpath=rel)
            twice = duplicate_member(index)
            if twice is not None:
                raise IntegrityError(
                    f"{path}: member {twice!r} appears twice in one sample; one would be read "
                    "and the other silently lost. Fix the shard, or pass on_error='skip'"
                )
            if want is not None and index.num_samples != want:
                raise IntegrityError(
                    f"{path}: has {index.num_samples} samples but the manifest says {want} "
                    "(truncated or replaced; last member "
                    f"{index.keys[-1] if index.keys else None!r}); "
                    "re-stage this shard or pass on_error='skip'"
                )
        except IntegrityError:
            if on_error != "skip":
                raise
            skipped.append(rel)
            per_shard.append(None)
            continue
        per_shard.append(index)
    if skipped:
        log.warning("skipped %d corrupt shard(s): %s", len(skipped), ", ".join(skipped[:5]))
    flat = _flatten(per_shard)
    if stamp is not None and cache_dir is not None:
        path = dataset_index_path(cache_dir)
        if _save_flat(path, stamp, flat, skipped):
            # the rest of this process reads the mapped file, like every other rank and worker
            reloaded = _load_flat(path, stamp, warn=False)
            if reloaded is not None:
                return reloaded
    return flat, skipped


# One file for the whole dataset: with 10k small shards, opening 10k per-shard caches costs
# ~1 ms each (seconds before the first batch); one mapped file opens in milliseconds. It is
# keyed by every shard's path, size and mtime (and the manifest's counts), so any change
# rebuilds it.


def save_dataset_index(
    shards: Sequence[str | os.PathLike[str]],
    relpaths: Sequence[str],
    expected_samples: Sequence[int | None],
    per_shard: Sequence[TarIndex | WalkResult],
    cache_dir: Path,
) -> None:
    """Write the one-file index a loader would build, from indexes made elsewhere.

    stage-in calls this with the indexes it parsed from the bytes in flight, so the first
    loader on the node starts without walking any tar header. Keyed exactly as
    :func:`build_flat_index` keys it (the loader's default ``on_error="raise"``); any mismatch
    only means the loader rebuilds it.
    """
    stamp = dataset_key(shards, relpaths, expected_samples, "raise", version=_CACHE_VERSION)
    if all(isinstance(index, WalkResult) for index in per_shard):
        flat = _flatten_walks([index.parts for index in per_shard])  # type: ignore[union-attr]
    else:
        flat = _flatten([i.index() if isinstance(i, WalkResult) else i for i in per_shard])
    _save_flat(dataset_index_path(cache_dir), stamp, flat, [])


_ARRAYS = (
    "shard_samples",
    "sample_offsets",
    "keys",
    "member_start",
    "member_ext",
    "member_offset",
    "member_size",
)


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


def _load_flat(
    path: Path, stamp: bytes, *, warn: bool = True
) -> tuple[FlatIndex, list[str]] | None:
    if not path.is_file():
        return None
    try:
        flat, skipped, found = open_dataset_index(path)
    except (OSError, ValueError, KeyError) as exc:
        log.info("ignoring unreadable dataset index %s (%s); rebuilding it", path, exc)
        return None
    if found != stamp:
        return None
    if skipped and warn:
        log.warning("skipped %d corrupt shard(s): %s", len(skipped), ", ".join(skipped[:5]))
    return flat, skipped


def _save_flat(path: Path, stamp: bytes, flat: FlatIndex, skipped: list[str]) -> bool:
    """Publish the index; False (logged) when the directory is read-only or full."""
    meta = {"stamp": stamp.hex(), "ext_names": list(flat.ext_names), "skipped": list(skipped)}
    try:
        write_arrays(path, {name: getattr(flat, name) for name in _ARRAYS}, meta)
    except OSError as exc:  # a read-only staged copy still loads, only slower next time
        log.info("cannot cache the dataset index at %s (%s)", path, exc)
        return False
    return True


def _narrow_strings(strings: np.ndarray) -> np.ndarray:
    """Byte strings at the width of the longest, as ``np.asarray(list, "S")`` makes them."""
    width = int(np.strings.str_len(strings).max()) if strings.size else 1
    return strings.astype(f"S{max(width, 1)}")


def _flatten(per_shard: list[TarIndex | None]) -> FlatIndex:
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
            exts.append(np.asarray(ids, dtype=np.int16)[columns.ext_codes])
        else:
            keys.append(np.asarray([k.encode() for k in index.keys], dtype="S"))
            exts.append(
                np.asarray(
                    [ext_codes.setdefault(e, len(ext_codes)) for e in index.exts], dtype=np.int16
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
        cat(exts, np.int16),
        cat(offsets, np.int64),
        cat(sizes, np.int64),
        tuple(ext_codes),
    )


def _flatten_walks(walks: Sequence[dict[str, Any]]) -> FlatIndex:
    """What :func:`_flatten` makes of these compiled walks' results, joined column by column.

    Why: a :class:`TarIndex` per shard and the numpy calls on each cost ~25 us per shard, most
    of the finish of 10,000 shards of 20 KB; joining the walks' bytes costs ~1 us per shard,
    with numpy calls per distinct set of extensions and key width (one, for a dataset written by
    one writer), not per shard.
    """
    shards = len(walks)
    counts = np.fromiter((len(w["keys"]) for w in walks), np.int64, shards)
    members = np.fromiter((len(w["sizes"]) // 8 for w in walks), np.int64, shards)
    member_base = np.concatenate([np.zeros(1, np.int64), np.cumsum(members)])
    starts = np.frombuffer(b"".join(memoryview(w["member_start"])[:-8] for w in walks), np.int64)
    starts = starts + np.repeat(member_base[:-1], counts)
    widths = {w["key_width"] for w in walks}
    if len(widths) <= 1:
        width = widths.pop() if widths else 1
        keys = np.frombuffer(b"".join(w["key_bytes"] for w in walks), f"S{width}")
    else:  # numpy widens each to the longest
        keys = np.concatenate([np.frombuffer(w["key_bytes"], f"S{w['key_width']}") for w in walks])
    # Extension codes are per shard; the flat index numbers them in order of first appearance,
    # as _flatten does. One lookup table per distinct tuple of names, laid end to end.
    ext_codes: dict[str, int] = {}
    table_at: dict[tuple[str, ...], int] = {}
    tables: list[list[int]] = []
    for w in walks:
        names = w["ext_names"]
        if names not in table_at:
            table_at[names] = sum(map(len, tables))
            tables.append([ext_codes.setdefault(e, len(ext_codes)) for e in names])
    codes = np.frombuffer(b"".join(w["ext_codes"] for w in walks), np.int16).astype(np.int64)
    lookup = np.asarray([code for table in tables for code in table] or [0], np.int16)
    if len(tables) > 1:
        base = np.fromiter((table_at[w["ext_names"]] for w in walks), np.int64, shards)
        codes = codes + np.repeat(base, members)
    return _assemble(
        counts,
        keys,
        np.concatenate([starts, member_base[-1:]]),
        lookup[codes] if len(codes) else np.zeros(0, np.int16),
        np.frombuffer(b"".join(w["offsets"] for w in walks), np.int64),
        np.frombuffer(b"".join(w["sizes"] for w in walks), np.int64),
        tuple(ext_codes),
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
        member_ext=member_ext.astype(np.uint8 if len(ext_names) <= 256 else np.int16),
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
