"""The staged manifest's columns in one mapped file, so a rank's start does not parse its JSON.

Why: every rank of a job reads the staged manifest when its loader starts. At a million shards
the JSON is ~170 MB; ``json.loads`` builds a dict per shard, and the columns taken from them
cost each rank ~2.6 s and a ~630 MB peak (eight ranks on a node: ~5 GB at once), to learn
three columns and a few strings. This file holds those columns as they are used: the paths
joined by NUL in one UTF-8 buffer with their start offsets, sizes and sample counts as int64
arrays (:mod:`stager.shards.arrayfile`). Mapped read-only, the node's ranks share one copy in
the page cache, and each pays a few tens of MB for the buffers it decodes.

The manifest stays the record; this file is a cache of it, written beside the loader index
(``<dataset>/.stager/index/``) by the stage-in that wrote the manifest (datasets of at least
:data:`COLUMNS_FROM` shards), or by the first loader that had to parse it. It holds only for the
manifest whose bytes it was made from: its key is the manifest's size and content hash, read
again at each start (~0.05 s at a million shards, against ~2.6 s of parsing). A file that does
not match, is cut short or is not ours is passed by: the manifest is then parsed as before.

Written without numpy (stage-in does not import it); read with numpy.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.shards.arrayfile import RawArray, map_arrays, write_arrays
from stager.storage.hashing import new_hasher
from stager.storage.paths import joined_canonical

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "COLUMNS_FROM",
    "COLUMNS_NAME",
    "MappedColumns",
    "bytes_key",
    "file_key",
    "load_columns",
    "save_columns",
]

#: The file's name in the loader-index directory.
COLUMNS_NAME = "manifest.columns"

#: Datasets of fewer shards are not given the file by stage-in: their JSON parses in under
#: ~50 ms, and stage-in's finish at 10,000 shards would pay the write for nothing.
COLUMNS_FROM = 20_000

_FORMAT = "stager-manifest-columns"
_VERSION = 1
_KEY_ALGORITHM = "xxh3_64"
_BLOCK = 1 << 20


@dataclass(frozen=True)
class MappedColumns:
    """The columns of a manifest, read from its columns file: ``paths`` (UTF-8, each path
    followed by a NUL) with ``starts`` (``count + 1`` offsets, the last one past the end),
    ``sizes`` and ``samples`` (-1 where the manifest has no count), and its ``meta``."""

    paths: bytes
    starts: np.ndarray
    sizes: np.ndarray
    samples: np.ndarray
    meta: dict[str, str]

    def __len__(self) -> int:
        return len(self.starts) - 1


def columns_path(index_dir: Path) -> Path:
    """Where the columns file of the manifest whose loader index lives in ``index_dir`` is."""
    return index_dir / COLUMNS_NAME


def file_key(manifest_path: Path) -> str:
    """The key of the manifest file at ``manifest_path``: its size and content hash."""
    hasher, size = new_hasher(_KEY_ALGORITHM), 0
    with open(manifest_path, "rb", buffering=0) as handle:
        while block := handle.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return f"{size}:{_KEY_ALGORITHM}:{hasher.hexdigest()}"


def bytes_key(data: bytes) -> str:
    """:func:`file_key` of a manifest whose bytes are ``data`` (as read, then parsed)."""
    hasher = new_hasher(_KEY_ALGORITHM)
    hasher.update(data)
    return f"{len(data)}:{_KEY_ALGORITHM}:{hasher.hexdigest()}"


def save_columns(
    key: str,
    index_dir: Path,
    relpaths: Sequence[str],
    sizes: Sequence[int],
    samples: Sequence[int | None],
    meta: dict[str, str],
) -> None:
    """Write the columns file of the manifest whose :func:`file_key` (or :func:`bytes_key`) is
    ``key``, from its columns and ``meta`` as parsed or written: the key must be of those very
    bytes, never of the file as it is later (another run may have replaced it meanwhile).
    Raises ``OSError`` where it cannot be written; a caller treats that as a slower next start,
    not a failure."""
    text = "\0".join(relpaths) + "\0" if relpaths else ""
    starts = array("q", [0])
    if text.isascii():  # a byte a character: no bytes object per path
        starts.extend(accumulate(len(p) + 1 for p in relpaths))
    else:
        starts.extend(accumulate(len(p.encode("utf-8", "surrogatepass")) + 1 for p in relpaths))
    joined = text.encode("utf-8", "surrogatepass")
    del text
    counts = array("q", (-1 if n is None else n for n in samples))
    columns = {
        "paths": RawArray("|u1", joined),
        "starts": RawArray("<i8", _native(starts)),
        "sizes": RawArray("<i8", _native(array("q", sizes))),
        "samples": RawArray("<i8", _native(counts)),
    }
    header = {"format": _FORMAT, "version": _VERSION, "key": key, "meta": dict(meta)}
    write_arrays(columns_path(index_dir), columns, header)


def _native(values: array[int]) -> bytes:
    """Little-endian int64 bytes (the file's type says ``<i8`` on every machine)."""
    if values.itemsize != 8:
        raise RuntimeError("this platform's array('q') is not 8 bytes")
    if sys.byteorder != "little":
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


def load_columns(manifest_path: Path, index_dir: Path) -> MappedColumns | None:
    """The columns of the manifest at ``manifest_path`` from its columns file, or None where
    there is none, it was made from other bytes, or it does not hold together (then the
    manifest is to be parsed)."""
    path = columns_path(index_dir)
    try:
        arrays, header = map_arrays(path)
        if header.get("format") != _FORMAT or header.get("version") != _VERSION:
            return None
        if header.get("key") != file_key(manifest_path):
            return None
        return _checked(arrays, header)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _checked(arrays: dict[str, Any], header: dict[str, Any]) -> MappedColumns | None:
    """The file's columns where they are whole and every path is canonical, else None."""
    import numpy as np

    paths, starts = arrays["paths"], arrays["starts"]
    sizes, samples = arrays["sizes"], arrays["samples"]
    count = len(starts) - 1
    meta = header["meta"]
    if count < 0 or len(sizes) != count or len(samples) != count or not isinstance(meta, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        return None
    buffer = paths.tobytes()
    if starts[0] != 0 or starts[-1] != len(buffer) or (np.diff(starts) < 2).any():
        return None  # (every path is at least one byte and its NUL)
    if count and (sizes.min() < 0 or samples.min() < -1):
        return None
    ends = starts[1:] - 1
    if count and (np.frombuffer(buffer, np.uint8)[ends] != 0).any():
        return None
    try:
        text = buffer.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    if not joined_canonical("\0" + text, count):
        return None
    return MappedColumns(
        buffer, np.asarray(starts), np.asarray(sizes), np.asarray(samples), dict(meta)
    )
