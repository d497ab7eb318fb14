"""A manifest's columns in one mapped file, so that reading it does not parse its JSON.

Why: every rank of a job reads the staged manifest when its loader starts, and with
``stage-in --background`` the copier's plan (``staging.json``, a manifest too), which the
loader and ``stage-in --wait-first`` read again while they wait. At a million shards such a
JSON is ~170 MB; ``json.loads`` builds a dict per shard, and the columns taken from them cost
each read ~2.6 s and a ~630 MB peak (eight ranks on a node: ~5 GB at once), to learn three or
four columns and a few strings. This file holds those columns as they are used: the paths
joined by NUL in one UTF-8 buffer with their start offsets, sizes and sample counts as int64
arrays, and, for a plan, the shards' digests as raw bytes (:mod:`stager.shards.digests`), in
one :mod:`stager.shards.arrayfile`. Mapped read-only, the node's ranks share one copy in the
page cache, and each pays a few tens of MB for the buffers it decodes.

The manifest stays the record; this file is a cache of it, in the loader-index directory
(``<dataset>/.stager/index/``): :data:`COLUMNS_NAME` for the manifest, written by the
stage-in that wrote it or by the first loader that had to parse it, :data:`PLAN_COLUMNS_NAME`
for the plan, written with it. Datasets of fewer than :data:`COLUMNS_FROM` shards get none. It
holds only for the manifest whose bytes it was made from: its key is the manifest's size and
content hash, read again at each use (~0.05 s at a million shards, against ~2.6 s of parsing).
A file that does not match, is cut short, is not ours or names a path outside the copy is
passed by: the manifest is then parsed as before.

Written without numpy where no digests are kept (stage-in's finish does not import it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from array import array
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.shards.arrayfile import RawArray, map_arrays, write_arrays
from stager.shards.manifest import Manifest, ManifestColumns, parse_columns, read_columns
from stager.storage.hashing import new_hasher
from stager.storage.paths import discard, joined_canonical

if TYPE_CHECKING:
    from stager.shards.digests import DigestColumn

__all__ = [
    "COLUMNS_FROM",
    "COLUMNS_NAME",
    "PLAN_COLUMNS_NAME",
    "bytes_key",
    "cached_columns",
    "columns_path",
    "file_key",
    "keep_columns",
    "load_columns",
    "save_columns",
]

#: The staged manifest's columns file, in the loader-index directory.
COLUMNS_NAME = "manifest.columns"
#: A ``stage-in --background`` plan's columns file, beside it.
PLAN_COLUMNS_NAME = "staging.columns"

#: Manifests of fewer shards get no columns file: their JSON parses in under ~50 ms, and a
#: stage-in's finish at 10,000 shards would pay the write for nothing.
COLUMNS_FROM = 20_000

_FORMAT = "stager-manifest-columns"
_VERSION = 1
_KEY_ALGORITHM = "xxh3_64"
_BLOCK = 1 << 20


def columns_path(index_dir: Path, name: str = COLUMNS_NAME) -> Path:
    """Where the columns file ``name`` of the copy whose loader index is in ``index_dir`` is."""
    return index_dir / name


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
    path: Path,
    relpaths: Sequence[str],
    sizes: Sequence[int],
    samples: Sequence[int | None],
    meta: dict[str, str],
    digests: DigestColumn | None = None,
) -> None:
    """Write at ``path`` the columns file of the manifest whose :func:`file_key` (or
    :func:`bytes_key`) is ``key``, from its columns and ``meta`` as parsed or written: the key
    must be of those very bytes, never of the file as it is later (another run may have
    replaced it meanwhile). ``digests``: kept too (a plan's). Nothing is written for paths a
    reader would refuse (a backslash, a drive-like ``X:``: stage-in keeps such names, which
    then take the manifest's own path). Raises ``OSError`` where it cannot be written; a
    caller treats that as a slower next read, not a failure."""
    text = "\0".join(relpaths) + "\0" if relpaths else ""
    if not joined_canonical("\0" + text, len(relpaths)):  # (names no reader would take)
        discard(path)  # (nor an older one, which its key would only make every reader hash)
        return
    starts = array("q", [0])
    if text.isascii():  # a byte a character: no bytes object per path
        starts.extend(accumulate(len(p) + 1 for p in relpaths))
    else:
        starts.extend(accumulate(len(p.encode("utf-8", "surrogatepass")) + 1 for p in relpaths))
    joined = text.encode("utf-8", "surrogatepass")
    del text
    counts = array("q", (-1 if n is None else n for n in samples))
    columns: dict[str, Any] = {
        "paths": RawArray("|u1", joined),
        "starts": RawArray("<i8", _little(starts)),
        "sizes": RawArray("<i8", _little(array("q", sizes))),
        "samples": RawArray("<i8", _little(counts)),
    }
    header: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "key": key}
    header["meta"] = dict(meta)
    if digests is not None:
        names, widths, codes, raw = digests.parts()
        columns["digest_codes"], columns["digest_raw"] = codes, raw.reshape(-1)
        header["digests"] = {"names": list(names), "widths": list(widths), "row": raw.shape[1]}
    write_arrays(path, columns, header)


def keep_columns(
    manifest: Manifest, manifest_path: Path, path: Path, *, digests: bool = False
) -> None:
    """Best effort: the columns file at ``path`` of ``manifest``, just written at
    ``manifest_path`` by its one writer (a stage-in's finish, a copier's plan: under the node's
    lock, so the file is still those bytes), ``digests`` kept too (a plan's). A manifest of
    fewer than :data:`COLUMNS_FROM` shards gets none, and an earlier, larger one's is removed:
    its key holds it stale, but each reader would map it and hash the manifest for nothing.
    """
    entries = manifest.entries
    if len(entries) < COLUMNS_FROM:
        discard(path)
        return
    with contextlib.suppress(OSError, ValueError, OverflowError):  # (readers parse it then)
        kept = None
        if digests:
            from stager.shards.digests import DigestColumn  # (numpy: a large plan's only)

            kept = DigestColumn([e.hash for e in entries])
        save_columns(
            file_key(manifest_path),
            path,
            [e.relpath for e in entries],
            [e.size for e in entries],
            [e.samples for e in entries],
            dict(manifest.meta),
            kept,
        )


def _little(values: array[int]) -> bytes:
    """Little-endian int64 bytes (the file's type says ``<i8`` on every machine)."""
    if values.itemsize != 8:
        raise RuntimeError("this platform's array('q') is not 8 bytes")
    if sys.byteorder != "little":
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


def load_columns(
    manifest_path: Path, path: Path, *, digests: bool = False
) -> ManifestColumns | None:
    """The columns of the manifest at ``manifest_path`` from the columns file at ``path``
    (the paths packed: :class:`~stager.shards.packedstrings.PackedStrings`), or None where
    there is none, it was made from other bytes, it does not hold together, or ``digests``
    are asked for and it has none (then the manifest is to be parsed). ``hashes`` is a
    :class:`~stager.shards.digests.DigestColumn` where asked for, else None."""
    try:
        arrays, header = map_arrays(path)
        if not isinstance(header, dict) or not isinstance(header.get("meta"), dict):
            return None
        if header.get("format") != _FORMAT or header.get("version") != _VERSION:
            return None
        if header.get("key") != file_key(manifest_path):
            return None
        return _checked(arrays, header, digests)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None  # (a file that does not hold together, however it fails)


def _checked(
    arrays: dict[str, Any], header: dict[str, Any], want_digests: bool
) -> ManifestColumns | None:
    """The file's columns where they are whole and every path is canonical, else None."""
    import numpy as np

    from stager.shards.digests import DigestColumn
    from stager.shards.packedstrings import PackedStrings

    for name, dtype in (("paths", "|u1"), ("starts", "<i8"), ("sizes", "<i8"), ("samples", "<i8")):
        if arrays[name].dtype != np.dtype(dtype) or arrays[name].ndim != 1:
            return None  # (unsigned starts would wrap np.diff; floats cannot index)
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
    if count and (np.frombuffer(buffer, np.uint8)[starts[1:] - 1] != 0).any():
        return None
    try:
        text = buffer.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    if not joined_canonical("\0" + text, count):
        return None
    del text
    hashes = None
    if want_digests:
        kept = header.get("digests")
        if not isinstance(kept, dict):
            return None
        if any(arrays[n].dtype != np.uint8 for n in ("digest_codes", "digest_raw")):
            return None
        raw = arrays["digest_raw"].reshape(count, int(kept["row"]))
        hashes = DigestColumn.from_parts(kept["names"], kept["widths"], arrays["digest_codes"], raw)
        if len(hashes) != count:
            return None
    listed = samples.tolist()
    if (samples < 0).any():
        listed = [None if n < 0 else n for n in listed]
    return ManifestColumns(
        PackedStrings.from_terminated(buffer, np.asarray(starts)),
        sizes.tolist(),
        listed,
        dict(meta),
        hashes,
    )


def cached_columns(
    manifest_path: Path, index_dir: Path, name: str = COLUMNS_NAME, *, digests: bool = False
) -> ManifestColumns:
    """The columns of the manifest at ``manifest_path``: from its columns file ``name`` in
    ``index_dir`` where that is current, else parsed (and, for a large manifest, the columns
    file written for the next read, best effort). ``digests``: the hashes are wanted, as one
    :class:`~stager.shards.digests.DigestColumn` (else they may be left out).
    Raises what :func:`~stager.shards.manifest.read_columns` raises."""
    path = columns_path(index_dir, name)
    mapped = load_columns(manifest_path, path, digests=digests)
    if mapped is not None:
        return mapped
    try:
        data = manifest_path.read_bytes()
        key, text = bytes_key(data), data.decode("utf-8")
    except (OSError, ValueError):
        return _digested(read_columns(manifest_path), digests)  # (which says what is wrong)
    del data  # (the text and its bytes both held: ~170 MB each at 1e6 shards, avoidable)
    columns = parse_columns(text)
    del text
    if columns is None:
        return _digested(read_columns(manifest_path), digests)  # (refused, or normalised)
    columns = _digested(columns, digests)
    if len(columns.relpaths) >= COLUMNS_FROM:
        # (a read-only copy is read as it is; a size or count past int64 is parsed each time)
        with contextlib.suppress(OSError, ValueError, OverflowError):
            save_columns(
                key,
                path,
                columns.relpaths,
                columns.sizes,
                columns.samples,
                columns.meta,
                columns.hashes if digests else None,  # type: ignore[arg-type]  # (a column)
            )
    return columns


def _digested(columns: ManifestColumns, digests: bool) -> ManifestColumns:
    """``columns``, with their hashes as one :class:`~stager.shards.digests.DigestColumn` where
    ``digests`` asks for them so, as a columns file gives them."""
    if not digests:
        return columns
    from stager.shards.digests import DigestColumn  # (numpy: only where digests are wanted)

    if isinstance(columns.hashes, DigestColumn):
        return columns
    assert columns.hashes is not None  # (the readers keep them)
    return dataclasses.replace(columns, hashes=DigestColumn(columns.hashes))
