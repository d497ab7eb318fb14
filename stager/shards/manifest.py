"""The dataset manifest: per shard its relative path, size, content hash and sample count.

Two encodings of the same table, chosen by file suffix:

* ``.json`` for small datasets: readable, diffable, written by default up to
  :data:`JSON_MAX_ENTRIES` shards;
* ``.parquet`` (pyarrow) for large ones: 1M shards fit in a few tens of MB and load in well
  under a second, which a JSON list does not.

``meta`` holds a few string facts about how the data was produced (source URL, subset mode),
stored as Parquet schema metadata or a JSON object. Entries are validated on read: a manifest
is input like any other, so a hostile relative path is refused
(:func:`stager.storage.paths.safe_relpath`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import StagerError, UsageError
from stager.shards.manifest_entry import FORMAT_VERSION, ManifestEntry, check_entry, json_text
from stager.storage.hashing import CANONICAL_DIGEST, HEX_DIGITS
from stager.storage.listing import translate
from stager.storage.paths import all_canonical

if TYPE_CHECKING:
    from stager.shards.digests import DigestColumn  # (numpy: imported where one is made)

__all__ = [
    "ManifestEntry",
    "Manifest",
    "ManifestColumns",
    "read_columns",
    "parse_columns",
    "MANIFEST_NAMES",
    "JSON_MAX_ENTRIES",
    "find_manifest",
    "default_manifest_name",
]

MANIFEST_NAMES = ("stager-manifest.parquet", "stager-manifest.json")
JSON_MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Manifest:
    """An ordered table of shards plus a little string metadata."""

    entries: tuple[ManifestEntry, ...]
    meta: Mapping[str, str] = field(default_factory=dict)

    def by_relpath(self) -> dict[str, ManifestEntry]:
        return {e.relpath: e for e in self.entries}

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def total_samples(self) -> int | None:
        if any(e.samples is None for e in self.entries):
            return None
        return sum(e.samples or 0 for e in self.entries)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file + rename) as JSON or Parquet by suffix."""
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        if path.suffix not in (".parquet", ".json"):
            raise UsageError(f"manifest path {path} must end in .json or .parquet")
        try:
            self._write_to(tmp, path.suffix)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. ENOSPC half-way: leave no .partial behind
            raise
        return path

    def _write_to(self, tmp: Path, suffix: str) -> None:
        if suffix == ".parquet":
            from stager.shards.manifest_parquet import write_parquet

            write_parquet(self.entries, self.meta, tmp)
        else:
            tmp.write_text(self._json_text())

    def _json_text(self) -> str:
        """The JSON manifest, a shard per line (:func:`_json_line`). Not ``indent=1``: it runs
        the encoder in Python (100k shards: 0.63 s, against 0.09 s here)."""
        head = json.dumps(
            {"format": "stager-manifest", "version": FORMAT_VERSION, "meta": dict(self.meta)},
            indent=1,
        )
        shards = ",\n  ".join(map(_json_line, self.entries))
        shards = f"[\n  {shards}]" if shards else "[]"
        return f'{head[:-2]},\n "shards": {shards}\n}}\n'

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest:
        """Read and validate a manifest; raises :class:`UsageError` naming the file on bad input."""
        path = Path(path)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # (/dev/zero filled the memory, a FIFO
                raise UsageError(f"manifest {path} is not a regular file")  # hung the run)
            if path.suffix == ".parquet":
                from stager.shards.manifest_parquet import read_parquet

                manifest = Manifest(*read_parquet(path))
            else:
                manifest = _from_json(json.loads(path.read_text()), path)
            _refuse_repeats([e.relpath for e in manifest.entries], path)
            return manifest
        except StagerError:
            raise  # UsageError, or UnsafePath for a hostile entry: keep its meaning and exit code
        except FileNotFoundError as exc:
            raise UsageError(f"manifest not found: {path}") from exc
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad manifest
            raise UsageError(
                f"manifest {path} is unreadable ({type(exc).__name__}: {exc}); re-run stager index"
            ) from exc


def _refuse_repeats(relpaths: list[str], where: Path) -> None:
    """A shard listed twice (the same path, or two spellings of it) is refused: the last entry
    would silently win for its size and hash, and a loader would read its samples twice."""
    if len(set(relpaths)) == len(relpaths):
        return
    seen: set[str] = set()
    for relpath in relpaths:
        if relpath in seen:
            raise UsageError(f"manifest {where}: shard {relpath!r} is listed more than once")
        seen.add(relpath)


@dataclass(frozen=True)
class ManifestColumns:
    """A manifest's shards as columns: what a loader needs, without an object per shard."""

    relpaths: Sequence[str]  # a list, or packed strings (stager.shards.manifestcolumns)
    sizes: list[int]
    samples: list[int | None]
    meta: dict[str, str]
    #: each shard's canonical digest, as read (None where the columns were derived, as by a
    #: selection): a reader that copies shards itself keeps them compact (shards.digests), as
    #: a columns file gives them (shards.manifestcolumns)
    hashes: list[str | None] | DigestColumn | None = None


def read_columns(path: str | os.PathLike[str]) -> ManifestColumns:
    """The shard columns of a manifest, validated in bulk: ~3x faster than :meth:`Manifest.read`.

    A loader starting on 100k shards spent ~0.4 s in ``Manifest.read`` building and checking an
    entry object per shard. Here a JSON manifest whose every entry is plainly valid (canonical
    paths, integer sizes and counts) is checked column by column; anything else goes through
    :meth:`Manifest.read`, so the checks, the normalisation and the errors are the same.
    """
    path = Path(path)
    if path.suffix != ".parquet":
        try:
            fast = parse_columns(path.read_text())
        except (OSError, ValueError):
            fast = None  # Manifest.read says what is wrong
        if fast is not None:
            return fast
    manifest = Manifest.read(path)
    return ManifestColumns(
        [e.relpath for e in manifest.entries],
        [e.size for e in manifest.entries],
        [e.samples for e in manifest.entries],
        dict(manifest.meta),
        [e.hash for e in manifest.entries],
    )


def parse_columns(text: str) -> ManifestColumns | None:
    """:func:`read_columns` of a JSON manifest's text where every entry is plainly valid; None
    where it is not (then :meth:`Manifest.read` of the file says what is wrong, or normalises
    it)."""
    try:
        return _fast_columns(json.loads(text))
    except ValueError:
        return None


def _fast_columns(payload: object) -> ManifestColumns | None:
    if not isinstance(payload, dict) or payload.get("format") != "stager-manifest":
        return None
    shards, meta = payload.get("shards"), payload.get("meta") or {}
    if not isinstance(shards, list) or not isinstance(meta, dict):
        return None
    # Whole-column checks in C (set(map(type, ...)), min, all(map(...))): at 100k shards the
    # per-item generator checks cost ~0.2 s of a loader's start. type(...) is int refuses
    # bools, as _entry does.
    if set(map(type, shards)) - {dict}:
        return None
    relpaths = [item.get("path") for item in shards]
    sizes = [item.get("size") for item in shards]
    samples = [item.get("samples") for item in shards]
    hashes = [item.get("hash") for item in shards]
    counts = [n for n in samples if n is not None]
    digests = [h for h in hashes if h is not None]
    valid = (
        set(map(type, relpaths)) <= {str}
        and all_canonical(relpaths)
        and set(map(type, sizes)) <= {int}
        and min(sizes, default=0) >= 0
        and set(map(type, counts)) <= {int}
        and min(counts, default=0) >= 0
        and set(map(type, digests)) <= {str}
        and _canonical_digests(digests)
        and len(set(relpaths)) == len(relpaths)  # else Manifest.read names the one repeated
    )
    if not valid:
        return None
    return ManifestColumns(
        relpaths,
        sizes,
        samples,
        {str(k): str(v) for k, v in meta.items()},
        hashes,
    )


def _canonical_digests(digests: list[str]) -> bool:
    """Whether every digest is as a copy computes it (a known algorithm, lower-case hex of its
    length): else :meth:`Manifest.read` normalises it or refuses it, as for the other readers.

    Column by column in C where every digest has one length (one algorithm: each has its own),
    ~0.12 s at a million against ~0.23 s for a regular expression over them.
    """
    if not digests:
        return True
    lengths = set(map(len, digests))
    if len(lengths) > 1:  # several algorithms in one manifest: rare, checked one by one
        return all(map(_ONE_DIGEST.fullmatch, digests))
    (length,) = lengths
    heads = [f"{name}:" for name, n in HEX_DIGITS.items() if len(name) + 1 + n == length]
    if not heads:
        return False
    joined, count = "".join(digests), len(digests)
    if any(joined[i::length] != c * count for i, c in enumerate(heads[0])):
        return False
    tail = "".join(joined[i::length] for i in range(len(heads[0]), length))
    return tail.isascii() and not tail.encode().translate(None, b"0123456789abcdef")


_ONE_DIGEST = re.compile(CANONICAL_DIGEST)


def default_manifest_name(num_entries: int) -> str:
    """JSON while it stays small, Parquet beyond :data:`JSON_MAX_ENTRIES` shards."""
    return MANIFEST_NAMES[1] if num_entries <= JSON_MAX_ENTRIES else MANIFEST_NAMES[0]


def find_manifest(directory: str | os.PathLike[str]) -> Path | None:
    """The manifest inside ``directory`` (Parquet preferred), or None. A directory its user
    may not search is a :class:`SourceError` (one line, exit 3), not a traceback."""
    for name in MANIFEST_NAMES:
        candidate = Path(directory) / name
        try:
            if candidate.is_file():
                return candidate
        except PermissionError as exc:  # (the directory's search permission: said of it)
            denied = PermissionError(exc.errno, exc.strerror)
            raise translate(denied, os.fspath(directory)) from exc
    return None


def _json_line(entry: ManifestEntry) -> str:
    """``json.dumps`` of the entry's object (``version`` only where it has one), written out:
    a dict per shard through the C encoder cost ~4.5 us, three times this, and most of a
    10,000-shard finish. Strings go through the json module's own C escaper."""
    samples = "null" if entry.samples is None else int(entry.samples)
    version = "" if entry.version is None else f', "version": {json_text(entry.version)}'
    return (
        f'{{"path": {json_text(entry.relpath)}, "size": {int(entry.size)}, '
        f'"hash": {json_text(entry.hash)}, "samples": {samples}{version}}}'
    )


def _from_json(payload: object, where: Path) -> Manifest:
    if not isinstance(payload, dict) or payload.get("format") != "stager-manifest":
        raise UsageError(f"{where} is not a stager manifest (missing format tag)")
    shards = payload.get("shards")
    meta = payload.get("meta") or {}
    if not isinstance(shards, list) or not isinstance(meta, dict):
        raise UsageError(f"manifest {where}: 'shards' must be a list and 'meta' an object")
    entries = []
    for item in shards:
        if not isinstance(item, dict):
            raise UsageError(f"manifest {where}: shard entry {item!r} is not an object")
        entries.append(
            check_entry(
                item.get("path"),
                item.get("size"),
                item.get("hash"),
                item.get("samples"),
                where,
                item.get("version"),
            )
        )
    return Manifest(tuple(entries), {str(k): str(v) for k, v in meta.items()})
