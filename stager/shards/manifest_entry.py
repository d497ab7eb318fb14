"""One manifest entry (:class:`ManifestEntry`) and the check every reader makes of one.

Apart from :mod:`stager.shards.manifest` so that both encodings' readers (JSON there, Parquet
in :mod:`stager.shards.manifest_parquet`) use the same check without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path

from stager.errors import UsageError
from stager.storage.hashing import split_digest
from stager.storage.paths import safe_relpath

__all__ = ["FORMAT_VERSION", "ManifestEntry", "check_entry", "json_text"]

FORMAT_VERSION = 1


@dataclass(slots=True, unsafe_hash=True)
class ManifestEntry:
    """One shard: where it lives relative to the dataset root and what it must contain.

    Treated as immutable (changed copies come from ``dataclasses.replace``) but not declared
    frozen: a frozen dataclass's ``__init__`` costs 0.7 s per million, before the first copy.
    """

    relpath: str
    size: int
    hash: str | None = None  # "<algorithm>:<hex>"
    samples: int | None = None
    #: In a staged manifest: the source's version of the bytes copied
    #: (:mod:`stager.storage.identity`); a rerun copies again when the source's differs.
    version: str | None = None


def check_entry(
    relpath: object,
    size: object,
    hash_: object,
    samples: object,
    where: Path,
    version: object = None,
) -> ManifestEntry:
    if not isinstance(relpath, str):
        raise UsageError(f"manifest {where}: shard path {relpath!r} is not a string")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise UsageError(
            f"manifest {where}: size {size!r} of {relpath!r} is not a non-negative integer"
        )
    if hash_ is not None and (not isinstance(hash_, str) or not hash_):
        raise UsageError(f"manifest {where}: hash {hash_!r} of {relpath!r} is not a string")
    if samples is not None and (
        not isinstance(samples, int) or isinstance(samples, bool) or samples < 0
    ):
        raise UsageError(
            f"manifest {where}: samples {samples!r} of {relpath!r} is not a non-negative integer"
        )
    if hash_ is not None:
        try:
            algorithm, hexpart = split_digest(hash_)
        except UsageError as exc:
            raise UsageError(f"manifest {where}: {exc} (shard {relpath!r})") from None
        # one spelling, the one a copy computes: a bare or upper-case sha256sum digest would
        # otherwise never equal "sha256:<lower-case hex>", and every copy would be refused
        hash_ = f"{algorithm}:{hexpart.lower()}"
    if version is not None and not isinstance(version, str):
        raise UsageError(f"manifest {where}: version {version!r} of {relpath!r} is not a string")
    return ManifestEntry(safe_relpath(relpath), size, hash_, samples, version)


def json_text(value: str | None) -> str:
    """``json.dumps(value)`` of a string or None, by the json module's own C escaper: the
    staged manifest and the journal write their entries' JSON out field by field."""
    return "null" if value is None else encode_basestring_ascii(value)
