"""The Parquet encoding of a manifest (:mod:`stager.shards.manifest`), for large datasets.

Read column by column where every column is plainly valid (a million rows check in a fraction
of a row-by-row pass); anything odd in a column is checked entry by entry by the JSON reader's
own check (:func:`stager.shards.manifest_entry.check_entry`), so both encodings accept,
normalise and refuse the same entries. pyarrow is imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stager.errors import UsageError
from stager.shards.manifest_entry import FORMAT_VERSION, ManifestEntry, check_entry
from stager.storage.hashing import CANONICAL_DIGEST
from stager.storage.paths import all_canonical

__all__ = ["read_parquet", "write_parquet"]


def write_parquet(entries: Sequence[ManifestEntry], meta: Mapping[str, str], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "path": pa.array([e.relpath for e in entries], pa.string()),
            "size": pa.array([e.size for e in entries], pa.int64()),
            "hash": pa.array([e.hash for e in entries], pa.string()),
            "samples": pa.array([e.samples for e in entries], pa.int64()),
            "version": pa.array([e.version for e in entries], pa.string()),
        }
    )
    tags = {b"stager.format": b"stager-manifest", b"stager.version": str(FORMAT_VERSION).encode()}
    tags.update({f"stager.meta.{k}".encode(): v.encode() for k, v in meta.items()})
    pq.write_table(table.replace_schema_metadata(tags), path)


def read_parquet(path: Path) -> tuple[tuple[ManifestEntry, ...], dict[str, str]]:
    """A Parquet manifest's entries and meta; raises :class:`UsageError` naming a bad one."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    raw_meta = table.schema.metadata or {}
    if raw_meta.get(b"stager.format") != b"stager-manifest":
        raise UsageError(f"{path} is not a stager manifest (missing format tag)")
    columns = table.to_pydict()
    versions = columns.get("version") or [None] * len(columns["path"])  # absent before v1.1
    entries = _entries_checked_by_column(table, columns, versions)
    if entries is None:  # something odd in a column: check entry by entry, naming the bad one
        entries = _entries_checked_by_row(path, columns, versions)
    prefix = b"stager.meta."
    meta = {
        k[len(prefix) :].decode(): v.decode() for k, v in raw_meta.items() if k.startswith(prefix)
    }
    return tuple(entries), meta


_CANONICAL_DIGEST = f"^{CANONICAL_DIGEST}$"


def _entries_checked_by_column(
    table: Any, columns: dict[str, list[Any]], versions: list[Any]
) -> list[ManifestEntry] | None:
    """The entries when every column passes :func:`_entry`'s checks as a whole, else None.

    A million-entry manifest is read before the first copy starts: checking columns at once
    (their types from the schema, ranges with pyarrow's kernels) and building the entries
    with ``map`` takes a fraction of a per-row check.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = table.schema
    if any(schema.get_field_index(name) < 0 for name in ("path", "size", "hash", "samples")):
        return None

    def text(name: str) -> bool:  # polars writes large_string by default
        kind = schema.field(name).type
        return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))

    if not (
        text("path")
        and pa.types.is_integer(schema.field("size").type)
        and text("hash")
        and pa.types.is_integer(schema.field("samples").type)
        and (schema.get_field_index("version") < 0 or text("version"))
    ):
        return None
    paths, sizes, hashes = table.column("path"), table.column("size"), table.column("hash")
    samples = table.column("samples")
    if paths.null_count or sizes.null_count:
        return None
    for numbers in (sizes, samples):
        low = pc.min(numbers).as_py()
        if low is not None and low < 0:
            return None
    if len(hashes) > hashes.null_count:
        if pc.min(pc.utf8_length(hashes)).as_py() == 0:
            return None
        # the algorithm before the first ":", in pyarrow's kernels; a bare digest (sha256) or
        # upper-case hex takes the row path, which writes it the way a copy computes it
        present = hashes.drop_null()
        if not pc.all(pc.match_substring(present, ":")).as_py():
            return None
        if not pc.all(pc.equal(present, pc.utf8_lower(present))).as_py():
            return None
        # each a known algorithm and a digest of its length (the row path says what is wrong)
        if not pc.all(pc.match_substring_regex(present, _CANONICAL_DIGEST)).as_py():
            return None
    paths_list = columns["path"]
    if not all_canonical(paths_list):
        return None
    return list(
        map(ManifestEntry, paths_list, columns["size"], columns["hash"], columns["samples"],
            versions)
    )  # fmt: skip


def _entries_checked_by_row(
    path: Path, columns: dict[str, list[Any]], versions: list[Any]
) -> list[ManifestEntry]:
    return [
        check_entry(p, s, h, n, path, v)
        for p, s, h, n, v in zip(
            columns["path"],
            columns["size"],
            columns["hash"],
            columns["samples"],
            versions,
            strict=True,
        )
    ]
