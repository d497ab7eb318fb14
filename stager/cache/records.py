"""What the cache knows about a shard it holds and about a dataset that uses it, on disk as JSON.

An object's record is written after its bytes are in place, and names the file it describes
(inode, size, mtime): a kill before the record leaves bytes no run trusts, and bytes changed
after it (a write through a hard link in some job's scratch) no longer match, so they are
copied again rather than served. A dataset's record is what eviction works from: which object
keys it holds (per relative path, the newest identity), when it was last used and which jobs
used it; it is only changed under the cache lock.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.layout import PARTIAL_SUFFIX

__all__ = ["ObjectRecord", "DatasetRecord", "write_json", "read_json"]


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` to ``path`` atomically (a private temp file, then a rename)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{PARTIAL_SUFFIX}")
    try:
        tmp.write_text(json.dumps(payload, separators=(",", ":")))
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is missing or unreadable (treated as absent)."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ObjectRecord:
    """One cached shard: the source identity it was copied from, its verified hash, its file."""

    key: str
    url: str
    size: int
    hash: str  # "<algorithm>:<hex>" of the bytes, computed while they were copied
    samples: int | None
    version: str | None  # the source's version token the bytes were copied at
    ino: int
    mtime_ns: int
    stored_at: float

    def describes(self, st: os.stat_result) -> bool:
        """True when ``st`` is the file this record was written for, unchanged since."""
        return (st.st_ino, st.st_size, st.st_mtime_ns) == (self.ino, self.size, self.mtime_ns)

    def write(self, path: Path) -> None:
        """Write in place, in one ``write`` (its writer holds the shard's fill lock).

        Not through a temp file and a rename: that would be one more file created per shard
        filled. A kill mid-write leaves JSON that does not parse, which :meth:`read` takes for
        no record: the shard is then copied again, never served.
        """
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(f"short write of {path}")
        finally:
            os.close(fd)

    @classmethod
    def read(cls, path: Path) -> ObjectRecord | None:
        payload = read_json(path)
        try:
            record = cls(**payload)
        except TypeError:
            return None  # missing, cut by a kill, or from another version: not a record
        return record if record.well_formed() else None

    def well_formed(self) -> bool:
        """Whether the fields have the types this version writes: a record edited or damaged
        by hand (a sample count of ``"ten"`` or ``-3``, a hash without its algorithm) is no
        record, so the shard is copied again; it was served, and the run ended in a traceback
        (exit 1) or staged a manifest that the loader refused."""

        def within(x: Any, low: int, high: int) -> bool:
            return type(x) is int and low <= x < high  # (not a bool, a float or a str)

        return (
            all(isinstance(x, str) for x in (self.key, self.url, self.hash))
            and ":" in self.hash
            and within(self.size, 0, 1 << 63)
            and within(self.ino, 0, 1 << 64)  # (st_ino is unsigned: overlayfs, FUSE go past 2^63)
            and within(self.mtime_ns, -(1 << 63), 1 << 63)  # (a time before 1970 is negative)
            and (self.samples is None or within(self.samples, 0, 1 << 63))
            and (self.version is None or isinstance(self.version, str))
        )

    def compact(self) -> list[Any]:
        """The record without its key and URL, as a dataset record keeps a copy of it."""
        return [self.size, self.hash, self.samples, self.version, self.ino, self.mtime_ns]

    @classmethod
    def from_compact(cls, key: str, url: str, values: Any) -> ObjectRecord | None:
        try:
            size, digest, samples, version, ino, mtime_ns = values
            record = cls(key, url, size, digest, samples, version, ino, mtime_ns, 0.0)
        except (TypeError, ValueError):
            return None
        return record if record.well_formed() else None


@dataclass
class DatasetRecord:
    """A source spec as the cache holds it (see the module doc)."""

    key: str
    spec: str
    name: str = ""
    source: str = ""
    #: relpath -> [object key, size]: the newest identity this node staged for that shard.
    shards: dict[str, list[Any]] = field(default_factory=dict)
    last_used: float = 0.0
    #: Slurm job id -> when it first used the dataset; a running one keeps it from eviction.
    jobs: dict[str, float] = field(default_factory=dict)
    #: Object key -> :meth:`ObjectRecord.compact` of the records the last runs used: a run then
    #: checks a hit with one stat of the object instead of reading a record file per shard (a
    #: thousand small reads from a cold disk cost more than the rest of a cached staging).
    known: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def objects(self) -> dict[str, int]:
        """Object key -> size, for every shard of the dataset."""
        return {str(key): int(size) for key, size in self.shards.values()}

    @property
    def total_bytes(self) -> int:
        return sum(self.objects.values())

    def write(self, path: Path) -> None:
        write_json(path, dict(vars(self)))  # not asdict(): it deep-copies thousands of entries

    @classmethod
    def read(cls, path: Path) -> DatasetRecord | None:
        payload = read_json(path)
        try:
            record = cls(**payload)
        except TypeError:
            return None
        return record if _well_formed(record) else None


def _well_formed(record: DatasetRecord) -> bool:
    """Whether a record read as JSON has the shape this version writes (one of another
    version, or damaged, is no record: every command that reads records passes it by)."""
    if not all(isinstance(x, dict) for x in (record.shards, record.jobs, record.known)):
        return False
    if not all(isinstance(x, str) for x in (record.key, record.spec, record.name, record.source)):
        return False
    numbers = (int, float)
    if not isinstance(record.last_used, numbers) or isinstance(record.last_used, bool):
        return False
    if not all(isinstance(t, numbers) for t in record.jobs.values()):
        return False
    return all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and type(v[1]) is int
        for v in record.shards.values()
    )
