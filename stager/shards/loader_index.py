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
from pathlib import Path

import numpy as np

from stager.errors import IntegrityError
from stager.shards.arrayfile import write_arrays
from stager.shards.flatindex import (
    _ARRAYS,
    FlatIndex,
    flatten,
    flatten_walks,
    open_dataset_index,
)
from stager.shards.indexfile import CACHE_VERSION, DATASET_INDEX_NAME, dataset_index_path
from stager.shards.indexkey import changed_ns, dataset_key
from stager.shards.members import split_message, split_sample
from stager.shards.tarheader import name_bytes, name_text
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

_CACHE_VERSION = CACHE_VERSION  # one version for both writers (stager.shards.indexfile)


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
    """:func:`stager.shards.tarindex.index_tar`, memoised on disk by the shard's size and last
    change (:func:`stager.shards.indexkey.changed_ns`)."""
    stat = shard.stat()
    stamp = np.asarray([_CACHE_VERSION, stat.st_size, changed_ns(stat)], dtype=np.int64)
    path = _cache_path(shard, cache_dir, relpath or shard.name)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                if np.array_equal(stored["stamp"], stamp):
                    return TarIndex(
                        keys=[name_text(k) for k in stored["keys"].tolist()],
                        member_start=stored["member_start"],
                        exts=[name_text(e) for e in stored["exts"].tolist()],
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
            keys=np.asarray([name_bytes(k) for k in index.keys], dtype="S")
            if index.keys
            else np.zeros(0, "S1"),
            member_start=index.member_start,
            exts=np.asarray([name_bytes(e) for e in index.exts], dtype="S")
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
    ``stats`` are the shards' ``(size, changed_ns)`` when the caller has just stat'ed them (the
    loader's resolver does), saving a second stat per shard: ~0.3 s at 100k shards.
    """
    # (a packed sequence stays packed: its key hashes its buffer, no str made per shard)
    relpaths = relpaths if relpaths is not None else [Path(p).name for p in shards]
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
            split = split_sample(index)
            if split is not None:
                raise IntegrityError(f"{path}: {split_message(split)}, or pass on_error='skip'")
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
    flat = flatten(per_shard)
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
    walks = [index.parts for index in per_shard if isinstance(index, WalkResult)]
    if len(walks) == len(per_shard):
        flat = flatten_walks(walks)
    else:
        flat = flatten([i.index() if isinstance(i, WalkResult) else i for i in per_shard])
    _save_flat(dataset_index_path(cache_dir), stamp, flat, [])


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
