"""Build a dataset's manifest: every shard read once, in parallel, for size, hash and samples.

Each shard is streamed exactly once through fsspec: the bytes pass through the hasher on their
way into a streaming tar reader that counts samples, so a remote (``s3://``) dataset costs one
GET per shard and local shards are read at disk speed, never twice. The result is the
:class:`~stager.shards.manifest.Manifest` that ``stage-in`` verifies against and the loader reads
sample counts from.

Failures follow stage-in's rules: transient read errors are retried with backoff; a shard that
still fails, or whose tar is corrupt, becomes one line of the error
(:class:`~stager.errors.ShardsCorrupt`, exit 4, if any
shard is corrupt, else :class:`~stager.errors.ShardsFailed`, exit 3), and no manifest
is written (a manifest that silently leaves a shard out would later turn into missing data).
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec.core import url_to_fs

from stager.errors import (
    DestinationError,
    IntegrityError,
    ScratchFull,
    ShardFailure,
    SizeMismatch,
    SourceError,
    StagerError,
    UsageError,
    one_line,
    shard_failures,
)
from stager.shards.manifest import Manifest, ManifestEntry, default_manifest_name
from stager.shards.tarindex import count_samples_stream, is_compressed
from stager.storage.copy import DEFAULT_BLOCK_BYTES
from stager.storage.hashing import ALGORITHMS, DEFAULT_ALGORITHM, new_hasher
from stager.storage.retry import RetryPolicy, call_with_retries
from stager.storage.sources import SourceSet, SourceShard, is_shard_name, protocol_of

__all__ = [
    "IndexOptions",
    "scan_shard",
    "build_manifest",
    "source_root_url",
    "default_manifest_url",
    "write_manifest",
    "index_source",
]


@dataclass(frozen=True)
class IndexOptions:
    """How to scan: hash algorithm, parallel streams, retries, read size, sample counting."""

    algorithm: str = DEFAULT_ALGORITHM
    jobs: int = 8
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    block_bytes: int = DEFAULT_BLOCK_BYTES
    count_samples: bool = True


class _HashingReader:
    """A read-only stream that hashes and counts every byte it hands out."""

    def __init__(self, raw: BinaryIO, algorithm: str):
        self._raw = raw
        self._hasher = new_hasher(algorithm)
        self.algorithm = algorithm
        self.nbytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._hasher.update(data)
        self.nbytes += len(data)
        return data

    def drain(self, block_bytes: int) -> None:
        while self.read(block_bytes):
            pass

    @property
    def digest(self) -> str:
        return f"{self.algorithm}:{self._hasher.hexdigest()}"


def scan_shard(
    fs: fsspec.AbstractFileSystem, shard: SourceShard, options: IndexOptions = IndexOptions()
) -> ManifestEntry:
    """Read one shard once and return its manifest entry.

    Raises :class:`IntegrityError` for a corrupt tar (naming shard and member),
    :class:`SizeMismatch` (transient) when the bytes read differ from the listed size, and
    lets I/O errors through for the retry loop.
    """
    try:
        handle = fs.open(shard.path, "rb", block_size=options.block_bytes)
    except FileNotFoundError as exc:
        raise SourceError(f"shard not found: {shard.url}") from exc
    except PermissionError as exc:
        raise SourceError(f"shard not readable (permission denied): {shard.url}") from exc
    with handle:
        reader = _HashingReader(handle, options.algorithm)
        samples = None
        if options.count_samples and is_shard_name(shard.relpath):
            samples = count_samples_stream(
                reader,  # type: ignore[arg-type]  # read() is all the tar reader uses
                shard.url,
                compressed=is_compressed(shard.relpath),
            )
        reader.drain(options.block_bytes)
    if shard.size is not None and reader.nbytes != shard.size:
        raise SizeMismatch(
            f"{shard.url}: read {reader.nbytes} bytes but the listing said {shard.size}; "
            "the file may be changing on the source"
        )
    return ManifestEntry(shard.relpath, reader.nbytes, reader.digest, samples)


def build_manifest(
    source: SourceSet,
    options: IndexOptions = IndexOptions(),
    *,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> Manifest:
    """Scan every shard of ``source`` with ``options.jobs`` parallel streams.

    Entries keep the source's order. Raises :class:`~stager.errors.ShardsFailed` (one line per
    shard) when any shard fails after retries or was listed explicitly but does not exist, or
    :class:`~stager.errors.ShardsCorrupt` when any is corrupt; no manifest is built then.
    """
    if options.algorithm not in ALGORITHMS:
        raise UsageError(
            f"unknown hash algorithm {options.algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
        )
    if options.jobs < 1:
        raise UsageError("--jobs must be at least 1")
    results: dict[str, ManifestEntry] = {}
    failures = [ShardFailure(url, "not found on the source") for url in source.missing]
    lock = threading.Lock()

    def one(shard: SourceShard) -> None:
        try:
            entry = call_with_retries(
                lambda: scan_shard(source.fs, shard, options), options.retry, on_retry=on_retry
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes one report line
            kind = "corrupt" if isinstance(exc, IntegrityError) and not exc.transient else "source"
            with lock:  # (ShardFailure drops a leading URL: the FAILED line names it already)
                failures.append(ShardFailure(shard.url, one_line(exc), kind))
            return
        with lock:
            results[shard.relpath] = entry

    with ThreadPoolExecutor(
        max_workers=max(1, min(options.jobs, len(source.shards))), thread_name_prefix="index"
    ) as pool:
        list(pool.map(one, source.shards))
    if failures:
        raise shard_failures(
            failures,
            message=f"{len(failures)} shard(s) could not be indexed; no manifest was written. "
            "Fix or remove them and re-run stager index",
        )
    meta = {"source": source.root_url, "hash": options.algorithm, "created_by": "stager index"}
    return Manifest(tuple(results[s.relpath] for s in source.shards), meta)


def source_root_url(source: SourceSet) -> str:
    """The dataset root the shards' relative paths hang from, as a URL (plain path if local)."""
    if not source.shards:
        raise UsageError(f"source {source.root_url} has no shards")
    first = source.shards[0]
    root = first.path[: len(first.path) - len(first.relpath)].rstrip("/") or "/"
    return root if source.is_local else source.fs.unstrip_protocol(root)


def default_manifest_url(source: SourceSet, num_entries: int) -> str:
    """Beside the dataset (where stage-in looks): JSON while small, Parquet when large."""
    return f"{source_root_url(source).rstrip('/')}/{default_manifest_name(num_entries)}"


def write_manifest(manifest: Manifest, out: str) -> str:
    """Write ``manifest`` to a local path or any fsspec URL; the suffix picks the format.

    Local files are published atomically by :meth:`Manifest.write`; remote ones are written
    to a local temporary file first and uploaded in one piece (an object store's PUT is atomic).
    """
    if not out.endswith((".json", ".parquet")):
        raise UsageError(f"--out {out} must end in .json or .parquet")
    fs, path = url_to_fs(out)
    try:
        if protocol_of(fs) == "file":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            manifest.write(path)
            return path
        with tempfile.TemporaryDirectory(prefix="stager-index-") as tmp:
            local = manifest.write(Path(tmp) / os.path.basename(path))
            fs.put_file(str(local), path)
        return out
    except StagerError:
        raise
    except OSError as exc:  # a place to write to: exit 6 full, else 5 (was 3, the source's)
        reason = f"cannot write the manifest to {out}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ScratchFull(f"{reason}; free space or pass another --out", where=out) from exc
        raise DestinationError(f"{reason}; check the location and permissions") from exc


def index_source(
    source: SourceSet, out: str | None = None, options: IndexOptions = IndexOptions(), **kwargs
) -> tuple[Manifest, str, float]:
    """Build and write the manifest of ``source``; return it, where it went, and seconds taken."""
    started = time.monotonic()
    manifest = build_manifest(source, options, **kwargs)
    where = write_manifest(manifest, out or default_manifest_url(source, len(manifest.entries)))
    return manifest, where, time.monotonic() - started
