"""The commit record of one checkpoint at the destination, and how records are ordered.

A checkpoint ``NAME`` (a file or a directory) is *committed* at ``DEST`` when
``DEST/.stager/commits/NAME.json`` exists: that small JSON file lists every file of the
checkpoint (path relative to ``DEST``, size, content hash) and is always written last. Readers
trust nothing else, so a half-copied ``DEST/NAME`` without a record is invisible to them.

"Newest" means the checkpoint whose source files were modified last (``source_mtime_ns``), not
the one committed last: ``stage-out --all`` copies the newest first, so commit order runs
backwards. Ties fall back to commit time, then to the name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stager.errors import CheckpointError
from stager.shards.manifest import ManifestEntry
from stager.storage.hashing import new_hasher
from stager.storage.paths import not_utf8, safe_relpath

__all__ = [
    "CommitRecord",
    "KIND_FILE",
    "KIND_DIR",
    "content_id",
    "newest_first",
    "plan_prune",
    "plan_keep",
    "check_checkpoint_name",
    "check_new_checkpoint_name",
]

KIND_FILE = "file"
KIND_DIR = "dir"
_FORMAT = "stager-checkpoint"
_VERSION = 1


def check_checkpoint_name(name: str) -> str:
    """A checkpoint name is one path component, not hidden (``.stager`` lives beside it)."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise CheckpointError(
            f"checkpoint name {name!r} must be one non-hidden path component; rename the checkpoint"
        )
    return safe_relpath(name)


def check_new_checkpoint_name(name: str) -> str:
    """:func:`check_checkpoint_name`, and on one line in UTF-8: what a new commit may be named
    (records committed under other names stay readable)."""
    if "\n" in name or "\r" in name or not_utf8(name) is not None:
        raise CheckpointError(
            f"checkpoint name {ascii(name)} has a line break or a byte that is not UTF-8; "
            "rename the checkpoint (logs and records name it on one line, in UTF-8)"
        )
    return check_checkpoint_name(name)


def content_id(entries: Iterable[ManifestEntry]) -> str:
    """One hash over (path, size, hash) of every file: equal ids mean the same checkpoint bytes."""
    hasher = new_hasher("xxh3_64")
    for entry in sorted(entries, key=lambda e: e.relpath):
        hasher.update(f"{entry.relpath}\0{entry.size}\0{entry.hash}\n".encode())
    return f"xxh3_64:{hasher.hexdigest()}"


@dataclass(frozen=True)
class CommitRecord:
    """What was committed as ``DEST/name``: every file with its size and hash."""

    name: str
    kind: str  # KIND_FILE | KIND_DIR
    entries: tuple[ManifestEntry, ...]  # paths relative to DEST: "name" or "name/sub/file"
    source_mtime_ns: int
    committed_at: float
    host: str = ""
    job_id: str = ""

    @property
    def content_id(self) -> str:
        return content_id(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def sort_key(self) -> tuple[int, float, str]:
        return (self.source_mtime_ns, self.committed_at, self.name)

    def to_json(self) -> str:
        payload = {
            "format": _FORMAT,
            "version": _VERSION,
            "name": self.name,
            "kind": self.kind,
            "content_id": self.content_id,
            "source_mtime_ns": self.source_mtime_ns,
            "committed_at": self.committed_at,
            "host": self.host,
            "job_id": self.job_id,
            "files": [{"path": e.relpath, "size": e.size, "hash": e.hash} for e in self.entries],
        }
        return json.dumps(payload, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> CommitRecord:
        """Parse and validate a record; a record is input, so hostile paths are refused."""
        try:
            payload = json.loads(text)
            if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
                raise ValueError("missing format tag")
            name = check_checkpoint_name(str(payload["name"]))
            kind = payload["kind"]
            if kind not in (KIND_FILE, KIND_DIR):
                raise ValueError(f"unknown kind {kind!r}")
            entries = tuple(_entry(item, name, kind) for item in payload["files"])
            if kind == KIND_FILE and len(entries) != 1:
                raise ValueError("a file checkpoint must list exactly one file")
            record = cls(
                name=name,
                kind=kind,
                entries=entries,
                source_mtime_ns=int(payload["source_mtime_ns"]),
                committed_at=float(payload["committed_at"]),
                host=str(payload.get("host", "")),
                job_id=str(payload.get("job_id", "")),
            )
            if payload.get("content_id") != record.content_id:
                raise ValueError("content_id does not match the listed files")
            return record
        except Exception as exc:  # noqa: BLE001 - any parse or validation failure is a bad record
            raise CheckpointError(
                f"commit record {where} is unreadable ({type(exc).__name__}: {exc}); "
                "delete it to drop that checkpoint"
            ) from exc


def _entry(item: object, name: str, kind: str) -> ManifestEntry:
    if not isinstance(item, dict):
        raise ValueError(f"file entry {item!r} is not an object")
    relpath = safe_relpath(str(item["path"]))
    size, hash_ = item["size"], item["hash"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size {size!r} of {relpath!r} is not a non-negative integer")
    if not isinstance(hash_, str) or ":" not in hash_:
        raise ValueError(f"hash {hash_!r} of {relpath!r} is not '<algorithm>:<hex>'")
    inside = relpath == name if kind == KIND_FILE else relpath.startswith(name + "/")
    if not inside:
        raise ValueError(f"file {relpath!r} lies outside checkpoint {name!r}")
    return ManifestEntry(relpath, size, hash_)


def newest_first(records: Iterable[CommitRecord]) -> list[CommitRecord]:
    """Records ordered newest checkpoint first (see the module docstring for "newest")."""
    return sorted(records, key=CommitRecord.sort_key, reverse=True)


def plan_prune(records: Sequence[CommitRecord], keep: int) -> list[str]:
    """Names of the committed checkpoints that ``--keep keep`` removes: all but the newest ``keep``.

    ``keep`` must be at least 1, so the newest is never in the result.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: the newest checkpoint is never pruned")
    return [r.name for r in newest_first(records)[keep:]]


def plan_keep(
    candidates: Sequence[tuple[str, int]], records: Sequence[CommitRecord], keep: int
) -> list[str]:
    """Which source checkpoints ``(name, mtime_ns)`` are worth staging under ``--keep keep``.

    Only those that would survive the prune that follows: among the ``keep`` newest on the
    source, and not older than ``keep`` committed checkpoints of other names. Without this,
    ``--watch --all --keep N`` would copy old checkpoints still on scratch and prune them
    again on every pass. Returned newest first.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: the newest checkpoint is never pruned")
    ordered = sorted(candidates, key=lambda c: (c[1], c[0]), reverse=True)[:keep]
    chosen: list[str] = []
    for name, mtime_ns in ordered:
        # Newer after this run: the candidates chosen so far, and committed checkpoints they
        # do not replace.
        replaced = {name, *chosen}
        newer = len(chosen) + sum(
            1 for r in records if r.name not in replaced and r.source_mtime_ns > mtime_ns
        )
        if newer < keep:
            chosen.append(name)
    return chosen
