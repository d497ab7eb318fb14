"""Asking a source what it holds: walking, globbing and stat'ing, local or through fsspec.

A plain path (``/nfs/ds``, ``file://``) is walked and stat'ed with ``os`` directly; fsspec is
imported only for a URL or when something asks for fsspec's view of a local path: importing it
(asyncio included) costs ~0.1 s, which every node's prologue would pay for nothing. Listing
errors become :class:`~stager.errors.SourceError` here, once.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from stager.errors import SourceError, UsageError, one_line
from stager.layout import (
    SHARD_SUFFIXES,
    hidden_worth_naming,
    is_hidden_name,
    is_left_out_tar,
    is_remote_url,
)
from stager.storage.identity import local_version, remote_version
from stager.storage.workers import map_in_threads

T = TypeVar("T")
R = TypeVar("R")

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "Info",
    "FILE",
    "DIRECTORY",
    "OTHER",
    "protocol_of",
    "display",
    "translate",
    "walk_local",
    "drop_listings",
    "stat_one",
    "stat_many",
    "info_of",
    "split_fs",
    "literal_path_note",
    "read_list",
    "fsspec_view",
    "glob_matches",
]

FILE, DIRECTORY, OTHER = "file", "directory", "other"  # OTHER: FIFO, socket, device


@dataclass(frozen=True)
class Info:
    """What one stat of a source entry says: its kind, size and version token."""

    kind: str  # FILE, DIRECTORY or OTHER
    size: int
    version: str | None


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's main protocol name (``"file"`` for fsspec's local filesystem)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return "file" if protocol == "local" else protocol


def display(fs: fsspec.AbstractFileSystem | None, path: str) -> str:
    """The path as a user reads it: plain for local files, a full URL for remote ones."""
    return path if fs is None or protocol_of(fs) == "file" else fs.unstrip_protocol(path)


def translate(exc: BaseException, url: str) -> SourceError:
    """The one line for a failed listing of ``url``, naming the path that failed where it is
    one below the root (a subdirectory without read permission was reported as the root)."""
    failed = getattr(exc, "filename", None)
    where = url
    root = url.rstrip("/")
    if isinstance(failed, str) and failed.rstrip("/") not in ("", root, root.split("://")[-1]):
        where = f"{one_line(failed)} (under the source {url})"
    remote = is_remote_url(url)
    if isinstance(exc, FileNotFoundError):
        check = "the URL (the bucket and prefix)" if remote else "the path (is it mounted?)"
        return SourceError(f"source not found: {where}; check {check}")
    if isinstance(exc, PermissionError):
        check = "the credentials and the bucket's policy" if remote else "its mode and owner"
        return SourceError(f"source not readable: {where} (permission denied); check {check}")
    return SourceError(f"cannot list source {url}: {exc}; check the URL and credentials")


#: A directory read slower than this on average is a network round trip: list in parallel.
SLOW_DIRECTORY_S = 0.005


def walk_local(
    root: str,
    jobs: int = 1,
    on_found: Callable[[list[str]], object] | None = None,
    left_out: list[str] | None = None,
) -> list[str]:
    """Shard file names under ``root``, sorted, from directory reads only (no stat per file).

    The tree is read level by level. On NFS each directory costs a lookup and a read round
    trip, so a dataset of 1,000 directories listed one by one waits 1,000 round trips before
    its first copy: once directory reads prove slow (over :data:`SLOW_DIRECTORY_S` on average),
    the directories of a level are read on up to ``jobs`` threads. On a local filesystem they
    stay on one thread, where threads only contend for the interpreter (a million names on
    tmpfs: 0.8 s on one thread, 1.5 s on 16). Shard-like names are taken without asking whether
    they are directories; the other names are asked, on the same threads (where readdir gives
    no file type, on FUSE and some NFS, each answer is a stat round trip). The parallel stat
    that follows drops the rare directory named like a shard.

    ``on_found(paths)`` is called with each directory's shard paths as soon as they are read
    (in no particular order across directories), so copies can start while the walk goes on.
    Hidden names (:func:`~stager.layout.is_hidden_name`: ``.git``, ``._a.tar``) are neither
    taken nor walked into, as the shell's globs leave them out. ``left_out`` gets what the walk
    saw but did not take, for the caller's warning: hidden shards and directories, files that
    would be shards but for their suffix's case, or are tars compressed as nothing here reads
    (:func:`~stager.layout.is_left_out_tar`)
    and symlinks to directories (not followed: a loop, or a second path to the same shards);
    directories with a trailing ``/``.
    """
    found: list[str] = []
    level = [root]
    threads = 1
    while level:
        started = time.monotonic()
        others: list[os.DirEntry[str]] = []
        read = _list_dir if on_found is None else partial(_list_dir, on_found=on_found)
        for shards, rest in _in_threads(read, level, threads):
            found += shards
            others += rest
        if threads == 1 and (time.monotonic() - started) / len(level) > SLOW_DIRECTORY_S:
            threads = max(1, jobs)
        directories = _in_threads(_is_directory, others, threads)
        level = [
            entry.path
            for entry, yes in zip(others, directories, strict=True)
            if yes and not is_hidden_name(entry.name)  # (.git, .stager: not walked into)
        ]
        if left_out is not None:
            left_out += _left_out(others, directories)
    found.sort()
    return found


def _left_out(others: list[os.DirEntry[str]], directories: list[bool]) -> list[str]:
    """The entries of one level not walked into or taken that a user may have meant as data:
    hidden shards and directories (not this tool's own ``.stager``), shards but for their
    suffix's case, symlinks to directories (directories with a trailing ``/``)."""
    found = []
    for entry, is_directory in zip(others, directories, strict=True):
        if is_hidden_name(entry.name):
            if hidden_worth_naming(entry.name, is_directory):
                found.append(entry.path + ("/" if is_directory else ""))
            continue
        if is_directory:
            continue
        if is_left_out_tar(entry.name):
            found.append(entry.path)
        elif entry.is_symlink() and _is_linked_directory(entry):
            found.append(entry.path + "/")
    return found


def _is_linked_directory(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=True)
    except OSError:
        return False  # a link to nothing: not data either way


def some_file_names(root: str, limit: int = 10_000) -> list[str]:
    """Up to ``limit`` file names under ``root``, relative to it, from at most ``limit``
    directories (an error message's evidence, not a listing: read only after a walk found no
    shards)."""
    names: list[str] = []
    for seen, (directory, _, files) in enumerate(os.walk(root), 1):
        below = os.path.relpath(directory, root)
        below = "" if below == "." else below + "/"
        names += [below + name for name in files[: limit - len(names)]]
        if len(names) >= limit or seen >= limit:
            break
    return names


def _in_threads(fn: Callable[[T], R], items: list[T], jobs: int) -> list[R]:
    if jobs > 1 and len(items) > 1:
        return map_in_threads(fn, items, jobs, name="list")
    return [fn(item) for item in items]


#: A directory's shard paths are handed to ``on_found`` this many at a time while it is read
#: (a directory of a million shards is read in thousands of round trips on NFS).
FOUND_BATCH = 4096


def _list_dir(
    directory: str, on_found: Callable[[list[str]], object] | None = None
) -> tuple[list[str], list[os.DirEntry[str]]]:
    """The shard-like paths in one directory, and its other entries."""
    shards: list[str] = []
    others: list[os.DirEntry[str]] = []
    told = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name  # (is_shard_name and is_hidden_name, inlined: 1M calls)
            if name.endswith(SHARD_SUFFIXES) and not name.startswith("."):
                shards.append(entry.path)
                if on_found is not None and len(shards) - told >= FOUND_BATCH:
                    on_found(shards[told:])
                    told = len(shards)
            else:
                others.append(entry)
    if on_found is not None and len(shards) > told:
        on_found(shards[told:])
    return shards, others


def _is_directory(entry: os.DirEntry[str]) -> bool:
    return entry.is_dir(follow_symlinks=False)


def info_of(info: dict[str, Any]) -> Info:
    """:class:`Info` from an fsspec ``info`` dict."""
    kind = info.get("type")
    kind = DIRECTORY if kind == "directory" else FILE if kind in ("file", None) else OTHER
    return Info(kind, int(info.get("size") or 0), remote_version(info))


def stat_one(fs: fsspec.AbstractFileSystem | None, path: str) -> Info | None:
    """One stat (None: not found). A local path is stat'ed with ``os``, following symlinks."""
    try:
        if fs is not None:
            return info_of(fs.info(path))
        st = os.stat(path)
    except FileNotFoundError:
        # a symlink to nothing is not a shard that vanished: the caller says it skipped it
        return Info(OTHER, 0, None) if fs is None and os.path.islink(path) else None
    if stat.S_ISDIR(st.st_mode):
        return Info(DIRECTORY, 0, None)
    kind = FILE if stat.S_ISREG(st.st_mode) else OTHER
    return Info(kind, st.st_size, local_version(st))


def stat_many(
    fs: fsspec.AbstractFileSystem | None, paths: list[str], jobs: int
) -> list[Info | None]:
    """:func:`stat_one` of each path, in parallel because each is a round trip on NFS."""
    return map_in_threads(lambda path: stat_one(fs, path), paths, jobs, name="stat")


def _local_path(path: str) -> str:
    """Absolute, as fsspec makes local paths, but not normalized: a ``..`` in a list entry must
    survive so that the relative-path check refuses it rather than the listing hiding it."""
    path = os.path.expanduser(path)
    if not path.startswith("/"):
        path = os.getcwd().rstrip("/") + "/" + (path[2:] if path.startswith("./") else path)
    return path.rstrip("/") or "/"


def split_fs(url: str) -> tuple[fsspec.AbstractFileSystem | None, str]:
    """``(filesystem, path)`` for a URL; ``(None, absolute path)`` for a local path."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url and "::" not in url:
        return None, _local_path(url)
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UsageError(
            f"cannot open {url!r}: {exc}; install the fsspec backend (e.g. s3fs)"
        ) from exc
    except OSError as exc:  # (a chained URL opens its outer file here: zip://x::file:///a.zip)
        raise translate(exc, url) from exc
    return (None, path) if protocol_of(fs) == "file" else (fs, path)


def drop_listings(fs: fsspec.AbstractFileSystem | None) -> fsspec.AbstractFileSystem | None:
    """``fs`` with what it cached of earlier listings dropped. fsspec keeps one filesystem per
    process and arguments, with its listings, and s3fs reads an object on the ETag its listing
    held: an object rewritten since could never be read again in this process (a retry failed
    as the first attempt had; a second loader called the shard corrupt)."""
    if fs is not None:
        with contextlib.suppress(Exception):  # (a filesystem without a cache has nothing to drop)
            fs.invalidate_cache()
    return fs


def literal_path_note(spec: str) -> str:
    """What to add to "no match" where a local path of that very name exists: a SOURCE with
    ``*?[{`` is read as a pattern, and the user meant the directory or file itself."""
    fs, path = split_fs(spec)
    if fs is not None or not os.path.lexists(path):
        return ""
    return (
        " (a path of that very name exists, but a SOURCE with * ? [ or { is read as a pattern: "
        "name its shards by --from-list or by a glob that escapes [ as [[] (DIR[[]1]/*.tar), "
        "or rename it)"
    )


def read_list(list_url: str) -> list[str]:
    """The shard URLs of a list file: one per line, blank lines and ``#`` comments skipped.

    ``-`` is standard input; a local path is read with ``open``, so a pipe works too
    (``--from-list <(find ...)``), which fsspec refuses as not seekable.
    """
    import fsspec

    try:
        if list_url == "-":
            lines = sys.stdin.read().splitlines()
        elif "://" not in list_url:
            with open(list_url, encoding="utf-8", errors="surrogateescape") as handle:
                lines = handle.read().splitlines()
        else:
            with fsspec.open(list_url, "rt") as handle:
                lines = handle.read().splitlines()
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise translate(exc, list_url) from exc
    urls = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    for number, line in enumerate(lines, 1):
        if "\0" in line:  # no path holds one; the system calls would refuse it mid-run
            raise UsageError(f"list file {list_url}, line {number}: a NUL byte in a shard name")
    if not urls:
        raise UsageError(f"list file {list_url} names no shards")
    return urls


def fsspec_view(fs: fsspec.AbstractFileSystem | None) -> fsspec.AbstractFileSystem:
    """``fs`` itself, or fsspec's local filesystem for a local path (None), imported only now."""
    if fs is not None:
        return fs
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem()


def glob_matches(fs: fsspec.AbstractFileSystem | None, path: str) -> dict[str, dict[str, Any]]:
    """``path``'s matches by fsspec's glob rules, with their details; locally, a directory the
    glob cannot read raises its ``OSError`` (:mod:`stager.storage.localglob`)."""
    if fs is not None:
        return fs.glob(path, detail=True)
    from stager.storage.localglob import glob_local

    return glob_local(path)
