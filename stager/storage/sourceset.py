"""What a resolved source is: its shards (:class:`SourceShard`), each read from a path and
staged at a relative path, and the set of them with what the listing left out
(:class:`SourceSet`). :mod:`stager.storage.sources` makes one from what the user typed."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stager.errors import UnsafePath, UsageError
from stager.storage.listing import Info, display, fsspec_view, info_of, protocol_of
from stager.storage.paths import safe_relpath

if TYPE_CHECKING:
    import fsspec

__all__ = ["SourceShard", "SourceSet", "unique_shards", "shard_at"]


@dataclass(slots=True, unsafe_hash=True)
class SourceShard:
    """One shard to stage: where it is read from and where it lands relative to the dataset.

    Treated as immutable (changed copies come from ``dataclasses.replace``) but not declared
    frozen: a frozen dataclass's ``__init__`` costs 0.7 s per million, before the first copy.
    """

    url: str  # full URL (with protocol for remote filesystems), shown to the user
    path: str  # the path as the filesystem object understands it
    relpath: str  # POSIX path under DEST/<name>/
    size: int | None  # None when the listing could not tell; the copy finds out
    version: str | None = None  # stager.storage.identity: changes when the bytes may have


@dataclass(frozen=True)
class SourceSet:
    """The resolved source: its root, its shards and, for a URL, its fsspec filesystem."""

    root_url: str  # the absolute root the relpaths hang from (a URL for remote sources)
    name: str
    shards: tuple[SourceShard, ...]
    missing: tuple[str, ...] = ()  # URLs named explicitly (brace/list) that do not exist
    remote_fs: fsspec.AbstractFileSystem | None = None  # None: a local path (NFS mounts too)
    spec: str = ""  # stager.layout.canonical_spec of what was asked for: same spec, same set
    skipped: tuple[str, ...] = ()  # entries that are not regular files (FIFOs, devices)
    left_out: tuple[str, ...] = ()  # seen by a walk, not taken (walk_local's left_out)
    walked: bool = False  # a whole directory: every shard under the root belongs to the set
    named: bool = False  # every shard named (a list, braces, one file): no other file joins it

    @property
    def is_local(self) -> bool:
        return self.remote_fs is None

    @property
    def protocol(self) -> str:
        return "file" if self.remote_fs is None else protocol_of(self.remote_fs)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """fsspec's view of the source (for a local path, built on first use)."""
        return fsspec_view(self.remote_fs)

    @property
    def total_bytes(self) -> int:
        return sum(s.size or 0 for s in self.shards)

    def listed_now(self, path: str) -> Info | None:
        """What the object store lists at ``path`` now, its cached listing dropped (a retry
        of an object rewritten since its listing); None for a local source, whose copy stats
        what it opens. Raises as ``info`` does."""
        fs = self.remote_fs
        if fs is None:
            return None
        with contextlib.suppress(Exception):  # (no cache: nothing to drop)
            fs.invalidate_cache(path)
        return info_of(fs.info(path))


def unique_shards(shards: Sequence[SourceShard], exact: bool = False) -> tuple[SourceShard, ...]:
    """Collapse entries naming the same file; refuse two files that would land on one path.
    ``exact``: an object store's keys (``x//y.tar`` is not ``x/y.tar`` there), where a key can
    also name a file that another's path needs as a directory (``a.tar``, ``a.tar/b.tar``)."""
    by_relpath: dict[str, SourceShard] = {}
    out: list[SourceShard] = []
    for shard in shards:
        seen = by_relpath.get(shard.relpath)
        if seen is None:
            by_relpath[shard.relpath] = shard
            out.append(shard)
        elif exact or posixpath.normpath(seen.path) != posixpath.normpath(shard.path):
            raise UsageError(
                f"two source files would be staged as {shard.relpath!r}: {seen.url!r} and "
                f"{shard.url!r}; stage them as separate datasets or rename one"
            )
    for shard in out if exact else ():
        parts = shard.relpath.split("/")
        for depth in range(1, len(parts)):
            above = by_relpath.get("/".join(parts[:depth]))
            if above is not None:
                raise UsageError(
                    f"{above.url!r} and {shard.url!r} cannot both be staged: {above.relpath!r} "
                    "would be a file and a directory; stage them as separate datasets or "
                    "rename one"
                )
    return tuple(out)


def shard_at(fs: fsspec.AbstractFileSystem | None, path: str, root: str, info: Info) -> SourceShard:
    """The shard at ``path`` (as ``fs`` names it), staged at its path relative to ``root``.

    An object store's key is a name, not a path: ``a/../b.tar``, ``a/./b.tar`` and ``a//b.tar``
    are keys of their own, which ``posixpath.relpath`` would turn into ``b.tar`` and
    ``a/b.tar`` (other keys, read by the loader's source fallback), so such keys are refused by
    name.
    """
    if fs is not None and root and path.startswith(root):
        parts = path[len(root) :].removeprefix("/").split("/")
        if {"", ".", ".."} & set(parts):
            raise UnsafePath(
                f"key {display(fs, path)!r} has an empty, '.' or '..' part and cannot be staged "
                "under its own name; rename it, or stage it as a separate dataset"
            )
    relpath = safe_relpath(posixpath.relpath(path, root) if root else path)
    return SourceShard(display(fs, path), path, relpath, info.size, info.version)
