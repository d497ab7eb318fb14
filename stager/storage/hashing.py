"""Content hashes for shards and checkpoints: fast xxh3 by default, sha256 on request.

A hash string carries its algorithm (``xxh3_64:9f2c...``), so a manifest written with one
algorithm is verified with the same one whatever the current default is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import xxhash

from stager.errors import UsageError

__all__ = [
    "Hasher",
    "new_hasher",
    "hash_file",
    "ALGORITHMS",
    "CANONICAL_DIGEST",
    "DEFAULT_ALGORITHM",
    "HEX_DIGITS",
    "split_digest",
]

ALGORITHMS = ("xxh3_64", "xxh64", "sha256")
DEFAULT_ALGORITHM = "xxh3_64"
_BLOCK = 4 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A fresh incremental hasher for ``algorithm``."""
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64()
    if algorithm == "xxh64":
        return xxhash.xxh64()
    if algorithm == "sha256":
        import hashlib  # (only for sha256 manifests: ~5 ms of every stage-in's start)

        return hashlib.sha256()
    raise UsageError(f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def split_digest(digest: str) -> tuple[str, str]:
    """``"xxh3_64:abcd"`` -> ``("xxh3_64", "abcd")``; a bare hex string is taken as sha256."""
    algorithm, sep, hexpart = digest.partition(":")
    if not sep:
        algorithm, hexpart = "sha256", digest
    if algorithm not in ALGORITHMS:
        raise UsageError(
            f"unknown hash algorithm in {digest!r}; expected one of {', '.join(ALGORITHMS)}"
        )
    # A digest no copy can ever produce (a typo, a cut line, a hash of another kind) is bad
    # input, said as such; else every copy would fail its check as if the data were damaged.
    want = HEX_DIGITS[algorithm]
    if len(hexpart) != want or hexpart.strip(_HEX):
        raise UsageError(f"{digest!r} is not a {algorithm} digest ({want} hex digits)")
    return algorithm, hexpart


#: The length of each algorithm's digest in hex.
HEX_DIGITS = {"xxh3_64": 16, "xxh64": 16, "sha256": 64}
#: A digest as a copy writes it (a known algorithm, lower-case hex of its length), unanchored:
#: the manifest readers' whole-column checks use it, and anything else takes the row path,
#: where :func:`split_digest` normalises or refuses it.
CANONICAL_DIGEST = "(?:" + "|".join(f"{a}:[0-9a-f]{{{n}}}" for a, n in HEX_DIGITS.items()) + ")"
_HEX = "0123456789abcdefABCDEF"


def hash_file(path: str | Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """``"<algorithm>:<hex>"`` of a local file, read in large blocks."""
    hasher = new_hasher(algorithm)
    with open(path, "rb", buffering=0) as handle:
        while block := handle.read(_BLOCK):
            hasher.update(block)
    return f"{algorithm}:{hasher.hexdigest()}"
