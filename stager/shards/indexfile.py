"""Where a dataset's loader index lives, and how stage-in writes it from the compiled walks'
columns without numpy.

Why without numpy: stage-in needs numpy for nothing else once the compiled walk indexed the
copies, and its import cost every run ~70 ms (~0.15 s with the page cache dropped, as at a
job's start), about a third of a small stage-in's whole time. The joined columns equal what
:func:`stager.shards.flatindex.flatten` makes of the same shards, array for array, and the file
is the one the loader writes (:mod:`stager.shards.loader_index`, which uses this module's names
and version, so neither can drift from the other).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stager.shards import tarnative
from stager.shards.arrayfile import RawArray, write_arrays
from stager.shards.indexkey import dataset_key, int_bytes

__all__ = [
    "ARRAYS",
    "CACHE_VERSION",
    "DATASET_INDEX_NAME",
    "dataset_index_path",
    "join_walks",
    "save_walked_index",
]

# 2: the dataset index narrows offsets and sizes to 32 bits where they fit; 3: extensions are
# lower-cased (stager.shards.members.split_key), and keys use each shard's ctime too
CACHE_VERSION = 3

#: The dataset's one index file, in the loader-index directory beside the staged copy.
DATASET_INDEX_NAME = "dataset.index"

#: The index's arrays, in stored order (:class:`~stager.shards.flatindex.FlatIndex` says each).
ARRAYS = (
    "shard_samples",
    "sample_offsets",
    "keys",
    "member_start",
    "member_ext",
    "member_offset",
    "member_size",
)

_ORDER = "<" if sys.byteorder == "little" else ">"


def dataset_index_path(cache_dir: Path) -> Path:
    """Where the dataset's mapped index lives in the loader-index directory ``cache_dir``."""
    return cache_dir / DATASET_INDEX_NAME


def join_walks(walks: Sequence[dict[str, Any]]) -> tuple[dict[str, RawArray], tuple[str, ...]]:
    """The dataset index's columns joined from these compiled walks, and its extension names.

    Extension codes are per shard; the index numbers them in order of first appearance (as
    :func:`~stager.shards.flatindex.flatten` does), through one lookup table per distinct tuple
    of names, laid end to end (one, for a dataset written by one writer).
    """
    ext_codes: dict[str, int] = {}
    table_at: dict[tuple[str, ...], int] = {}
    lookup: list[int] = []
    bases: list[int] = []
    # Each walk has a tuple of its own (equal to its neighbours' nearly always), and a tuple's
    # hash is not cached: compared with the last one first, ~0.9 us a shard less than two
    # dict lookups each (~9 ms of a 10,000-shard finish)
    last: tuple[str, ...] | None = None
    base = 0
    for walk in walks:
        names = walk["ext_names"]
        if names != last:
            found = table_at.get(names)
            if found is None:
                found = table_at[names] = len(lookup)
                lookup.extend(ext_codes.setdefault(e, len(ext_codes)) for e in names)
            last, base = names, found
        bases.append(base)
    joined = tarnative.join_columns(
        walks, int_bytes(lookup, 4), int_bytes(bases, 8), len(ext_codes)
    )
    width = joined.pop("key_width")
    columns = {}
    for name, (kind, data) in joined.items():
        if kind == "S":
            dtype = f"|S{width}"
        else:
            dtype = f"{'|' if kind == 'u1' else _ORDER}{kind}"
        columns[name] = RawArray(dtype, data)
    return columns, tuple(ext_codes)


def save_walked_index(
    shards: Sequence[str | os.PathLike[str]],
    relpaths: Sequence[str],
    expected_samples: Sequence[int | None],
    walks: Sequence[dict[str, Any]],
    cache_dir: Path,
    stats: Sequence[tuple[int, int] | None] | bytes | None = None,
) -> None:
    """Write the loader's one-file index of a dataset every shard of which was walked.

    Keyed as the loader keys it (its default ``on_error="raise"``); any mismatch only means
    the loader rebuilds it. ``stats``: :func:`~stager.shards.indexkey.dataset_key`'s. Raises
    ``OSError`` when it cannot be written.
    """
    stamp = dataset_key(shards, relpaths, expected_samples, "raise", stats, version=CACHE_VERSION)
    columns, ext_names = join_walks(walks)
    meta = {"stamp": stamp.hex(), "ext_names": list(ext_names), "skipped": []}
    write_arrays(dataset_index_path(cache_dir), {name: columns[name] for name in ARRAYS}, meta)
