"""Relative shard paths that can never escape the dataset root.

Every path that comes from a source listing, a list file or a manifest goes through
:func:`safe_relpath` before it touches the destination, so ``../../etc/passwd`` or an absolute
name in a hostile manifest is refused instead of written.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from stager.errors import SourceError, UnsafePath
from stager.layout import PARTIAL_SUFFIX

__all__ = [
    "check_encodable",
    "all_canonical",
    "safe_relpath",
    "normalised_relpath",
    "CANONICAL_RELPATH",
    "safe_join",
    "SafeJoiner",
    "PARTIAL_SUFFIX",
    "partial_of",
    "discard",
    "within",
    "not_utf8",
]


def not_utf8(name: str) -> str | None:
    """``name`` with its bytes that are not UTF-8 escaped (``bad\\xff.tar``), for a message;
    None when it is UTF-8. Names read from the OS hold such bytes as lone surrogates, which
    manifests, records and reports (JSON in UTF-8) cannot hold."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def check_encodable(text: str, what: str) -> None:
    """Refuse a name with bytes that are not UTF-8 (read from the OS as lone surrogates)."""
    shown = not_utf8(text)
    if shown is not None:
        raise SourceError(
            f"{what} is not valid UTF-8: '{shown}'; rename it (manifests, indexes and reports "
            "record names as UTF-8)"
        )


#: The longest file name (bytes) Linux file systems take.
NAME_MAX = 255
_PARTIAL_BYTES = len(PARTIAL_SUFFIX.encode())


def partial_of(final: str) -> str:
    """Where ``final`` is written before it is renamed into place: ``final`` + ``.partial``.

    A name of 248-255 bytes is legal on the source, and with the suffix past the limit: each
    copy failed with ENAMETOOLONG, retried as a source error (exit 3) after seconds of back-off.
    Such a name is cut to fit, at a character, and told apart by a digest of the whole name;
    it still ends in ``.partial``, so a rerun deletes it as a killed run's leftover."""
    name = final[final.rfind("/") + 1 :]
    # (the first test, at most 4 bytes a character: no encoding for the usual names)
    if (
        4 * len(name) + _PARTIAL_BYTES <= NAME_MAX
        or len(name.encode()) + _PARTIAL_BYTES <= NAME_MAX
    ):
        return final + PARTIAL_SUFFIX
    import hashlib

    digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    room = NAME_MAX - _PARTIAL_BYTES - len(digest) - 1
    head = name.encode()[:room].decode("utf-8", "ignore")
    return f"{final[: len(final) - len(name)]}{head}~{digest}{PARTIAL_SUFFIX}"


def within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or below it (both resolved, as strings)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def discard(path: str | os.PathLike[str]) -> None:
    """Remove a file that may already be gone (a ``.partial`` after a failed copy)."""
    try:
        os.unlink(path)
    except OSError:  # gone already, or on a read-only filesystem where it never was created:
        pass  # discard runs on error paths, and must never mask the error being reported


#: A relative path that :func:`normalised_relpath` returns unchanged: no empty, ``.`` or ``..``
#: part, no NUL, not absolute. One regex match instead of a split and a join: planning a
#: million shards or opening a million-entry manifest checks every path.
#: tests/test_manifest_paths.py pins the equivalence.
CANONICAL_RELPATH = re.compile(
    r"(?!.:)(?!\.\.)(?!(?:.*/)?\.\.?(?:/|\Z))[^/\\\x00]+(?:/[^/\\\x00]+)*", re.DOTALL
)


# What all_canonical looks for in the NUL-joined paths: a substring that some path holds
# exactly where it is not canonical. Every path sits between two NULs (no path holds a NUL).
_NOT_CANONICAL = (
    "\x00\x00",  # an empty path
    "\x00/",  # absolute
    "/\x00",  # a trailing slash
    "//",  # an empty part
    "\\",  # a backslash
    "\x00./",  # a "." part: first,
    "/./",  # inside,
    "/.\x00",  # last,
    "\x00.\x00",  # alone
    "\x00..",  # starts with ".." (as the regex's (?!\.\.) refuses)
    "/../",  # a ".." part inside,
    "/..\x00",  # last
    PARTIAL_SUFFIX + "\x00",  # the reserved suffix
)
_DRIVE_PREFIX = re.compile("\x00[^\x00]:")  # the regex's (?!.:)


def all_canonical(relpaths: Sequence[str]) -> bool:
    """True when :func:`safe_relpath` returns every path unchanged, without a call per path.

    The same verdict as ``CANONICAL_RELPATH.fullmatch(p) and not p.endswith(".partial")`` for
    each ``p`` (tests/test_manifest_paths.py pins it), found by substring searches over the
    paths joined by NUL: ~0.05 s for a million paths where the regex takes ~0.4 s.
    """
    if not relpaths:
        return True
    return joined_canonical("\x00" + "\x00".join(relpaths) + "\x00", len(relpaths))


def nul_joined(strings: Sequence[str]) -> str:
    """``"\\0".join(strings)``, from one buffer where ``strings`` hold their items so (the
    loader's :class:`~stager.shards.packedstrings.PackedStrings` has a ``nul_joined``): a key or a
    fingerprint of a million paths then makes no str per path (~100 MB and ~0.1 s each)."""
    joined = getattr(strings, "nul_joined", None)
    return joined() if callable(joined) else "\0".join(map(str, strings))


def joined_canonical(joined: str, count: int) -> bool:
    """:func:`all_canonical` of ``count`` paths given joined as it joins them: each between two
    NULs, one NUL first (a columns file holds them so: :mod:`stager.shards.manifestcolumns`)."""
    if not count:
        return joined in ("", "\x00")
    if joined.count("\x00") != count + 1:
        return False  # a NUL inside a path
    if any(bad in joined for bad in _NOT_CANONICAL):
        return False
    return _DRIVE_PREFIX.search(joined) is None


def safe_relpath(relpath: str) -> str:
    """Normalise a POSIX relative path, refusing anything that is absolute or climbs out.

    Names are kept as they are otherwise: a backslash or a colon is an ordinary character in a
    POSIX file name, and turning ``x\\y.tar`` into ``x/y.tar`` made two shards one.
    """
    if CANONICAL_RELPATH.fullmatch(relpath) and not relpath.endswith(PARTIAL_SUFFIX):
        return relpath
    return normalised_relpath(relpath)


def normalised_relpath(relpath: str) -> str:
    """:func:`safe_relpath` the long way, part by part (it names what it refuses)."""
    if not relpath or "\x00" in relpath:
        raise UnsafePath(f"empty or NUL-containing shard path {relpath!r}; fix the source listing")
    if relpath.startswith("/"):
        raise UnsafePath(
            f"absolute shard path {relpath!r} refused; paths must be relative to the dataset"
        )
    parts = relpath.split("/")
    if any(p == ".." for p in parts):
        raise UnsafePath(
            f"shard path {relpath!r} contains '..' and could escape the dataset root; refused"
        )
    norm = "/".join(p for p in parts if p not in ("", "."))
    if not norm:
        raise UnsafePath(f"shard path {relpath!r} does not name a file inside the dataset; refused")
    if norm.endswith(PARTIAL_SUFFIX):
        raise UnsafePath(f"shard path {relpath!r} ends with the reserved suffix {PARTIAL_SUFFIX!r}")
    return norm


def safe_join(root: str | os.PathLike[str], relpath: str) -> Path:
    """``root / relpath`` after :func:`safe_relpath`, checked again after resolution."""
    return SafeJoiner(root)(relpath)


class SafeJoiner:
    """:func:`safe_join` for many paths under one root.

    Resolving a path costs an ``lstat`` per component in Python (~70 us); a dataset of thousands
    of shards in a few directories needs the root and each directory resolved once, plus one
    ``lstat`` per file to see whether the file itself is a symlink (only then is it resolved).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self._root = str(self.root)
        self._inside = (
            os.path.realpath(self._root).rstrip("/") + "/"
        )  # what a shard path must start with
        self._resolved_dirs: dict[str, str] = {}

    def __call__(self, relpath: str) -> Path:
        target, st = self.lstat(relpath)
        return Path(target)

    def lstat(self, relpath: str) -> tuple[str, os.stat_result | None]:
        """``(path, lstat of it or None)``, refusing a path that resolves outside the root.

        One ``lstat`` per shard: the caller gets it too, so planning a million shards makes
        one metadata call each rather than three.
        """
        rel = safe_relpath(relpath)
        target = self._root + "/" + rel
        parent, name = target.rsplit("/", 1)
        resolved_parent = self._resolved_dirs.get(parent)
        if resolved_parent is None:
            resolved_parent = self._resolved_dirs[parent] = os.path.realpath(parent)
        try:
            st: os.stat_result | None = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            resolved = os.path.realpath(target)
        else:
            resolved = resolved_parent + "/" + name
        if not resolved.startswith(self._inside):
            raise UnsafePath(
                f"shard path {relpath!r} resolves outside {self.root} (a symlink?); refused"
            )
        return target, st
