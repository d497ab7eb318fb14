"""What identifies a source shard's bytes without reading them: its version token.

A staged copy is trusted because the source still has the same version, never because a file of
that name exists (the lesson of a rerun that kept another dataset's bytes). The token is what
the source says about the object, compared for equality only:

* a local or NFS path: ``inode:mtime_ns:ctime_ns``. ``mtime`` alone is not enough: ``cp -p``,
  ``rsync -a`` and coarse timestamps keep it while the bytes change, but every write (and
  every ``utime``) moves ``ctime``, and a file replaced by rename has a new inode;
* an object store or other fsspec filesystem: its ETag / generation / version id, plus its
  modification time, whichever the filesystem reports.

A different token means "copy again" (a false alarm costs one copy, never wrong bytes). When a
source reports none (some HTTP servers), identity falls back to the size and, where a manifest
gives one, the hash.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

__all__ = [
    "local_version",
    "local_identity",
    "version_of",
    "node_neutral",
    "remote_version",
    "is_regular",
]

#: fsspec ``info`` fields that change when an object's bytes change, by backend:
#: s3fs (ETag, VersionId, LastModified), gcsfs (generation, md5Hash, updated), adlfs (etag,
#: last_modified), http (ETag, Content-MD5, Digest, Last-Modified: a server that sends no ETag,
#: as Python's http.server, had no version, and a rewritten shard stayed staged, exit 0), and
#: the generic mtime/created of others.
_VERSION_KEYS = (
    "VersionId",
    "version_id",
    "generation",
    "ETag",
    "etag",
    "md5Hash",
    "Content-MD5",
    "Digest",
    "LastModified",
    "Last-Modified",
    "last_modified",
    "updated",
    "mtime",
    "created",
)


def local_version(st: os.stat_result) -> str:
    """The version token of a local file from one ``stat``."""
    return version_of(*local_identity(st))


def local_identity(st: os.stat_result) -> tuple[int, int, int]:
    """What :func:`local_version` is made of, to compare two stats without the string."""
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def node_neutral(version: str | None, local: bool) -> str | None:
    """The part of a version that every node sees alike for the same bytes: a local file's
    modification time, whose inode and change time differ on a per-node copy (``cp -a``) or a
    FUSE mount that numbers inodes itself; an object store's whole token."""
    return version.split(":")[1] if local and version and version.count(":") == 2 else version


def version_of(inode: int, mtime_ns: int, ctime_ns: int) -> str:
    """:func:`local_version` from the fields it reads."""
    return f"{inode}:{mtime_ns}:{ctime_ns}"


def remote_version(info: Mapping[str, Any]) -> str | None:
    """The version token of an fsspec object from its ``info``; None when it reports none."""
    parts = [f"{key}={info[key]}" for key in _VERSION_KEYS if info.get(key) not in (None, "")]
    return "|".join(parts) or None


def is_regular(st: os.stat_result) -> bool:
    """A regular file: not a FIFO, socket or device, whose open or read could block forever."""
    return stat.S_ISREG(st.st_mode)
