"""Turn what the user typed into a list of shards: directory, glob, brace pattern or list file.

A URL (``s3://``, ``https://``, any fsspec protocol) goes through fsspec (``url_to_fs``); a
plain path (``/nfs/ds``, ``file://``) is listed and stat'ed with ``os`` directly, and fsspec is
imported only if something asks for :attr:`SourceSet.fs`: importing it (asyncio included) costs
~0.1 s, which every node's prologue would pay for nothing. Listing errors are translated into
:class:`SourceError` here, once.
The shard's *relative path* (where it lands under ``DEST/<name>/``) is its path relative to the
source root: the directory for a directory source, the fixed prefix for a glob, the common
parent directory for a brace pattern or a list.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import stat
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stager.errors import SourceError, UsageError
from stager.layout import SHARD_SUFFIXES, dataset_name, is_shard_name
from stager.patterns import expand_pattern, is_pattern
from stager.storage.paths import safe_relpath
from stager.storage.workers import map_in_threads

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "SourceShard",
    "SourceSet",
    "resolve_source",
    "fill_sizes",
    "SHARD_SUFFIXES",
    "is_shard_name",
]

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class SourceShard:
    """One shard to stage: where it is read from and where it lands relative to the dataset."""

    url: str  # full URL (with protocol for remote filesystems), shown to the user
    path: str  # the path as the filesystem object understands it
    relpath: str  # POSIX path under DEST/<name>/
    size: int | None  # None when the listing could not tell; the copy finds out


@dataclass(frozen=True)
class SourceSet:
    """The resolved source: its root, its shards and, for a URL, its fsspec filesystem."""

    root_url: str
    name: str
    shards: tuple[SourceShard, ...]
    missing: tuple[str, ...] = ()  # URLs named explicitly (brace/list) that do not exist
    remote_fs: fsspec.AbstractFileSystem | None = None  # None: a local path (NFS mounts too)

    @property
    def is_local(self) -> bool:
        return self.remote_fs is None

    @property
    def protocol(self) -> str:
        return "file" if self.remote_fs is None else protocol_of(self.remote_fs)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """fsspec's view of the source (for a local path, built on first use)."""
        return _fsspec_view(self.remote_fs)

    @property
    def total_bytes(self) -> int:
        return sum(s.size or 0 for s in self.shards)


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's main protocol name (``"file"`` for fsspec's local filesystem)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return "file" if protocol == "local" else protocol


def _display(fs: fsspec.AbstractFileSystem | None, path: str) -> str:
    return path if fs is None or protocol_of(fs) == "file" else fs.unstrip_protocol(path)


def _translate(exc: Exception, url: str) -> SourceError:
    if isinstance(exc, FileNotFoundError):
        return SourceError(f"source not found: {url}; check the path (is the filesystem mounted?)")
    if isinstance(exc, PermissionError):
        return SourceError(
            f"source not readable: {url} (permission denied); check its mode and owner"
        )
    return SourceError(f"cannot list source {url}: {exc}; check the URL and credentials")


def _walk_local(root: str) -> list[str]:
    """Shard file names under ``root``, sorted, from directory reads only (no stat per file)."""
    found, pending = [], [root]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                # Shard-like names are taken without asking is_dir(): where readdir gives no file
                # type (FUSE, some NFS), each is_dir() is a serial stat round trip. The parallel
                # stat that follows drops the rare directory named like a shard.
                if is_shard_name(entry.name):
                    found.append(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return sorted(found)


def _has_glob(text: str) -> bool:
    return any(c in _GLOB_CHARS for c in text)


def _common_dir(paths: list[str]) -> str:
    dirs = [posixpath.dirname(p) for p in paths]
    common = (
        posixpath.commonpath(dirs) if all(d.startswith("/") for d in dirs) else _prefix_dir(dirs)
    )
    return common


def _prefix_dir(dirs: list[str]) -> str:
    split = [d.split("/") for d in dirs]
    out: list[str] = []
    for parts in zip(*split, strict=False):  # stops at the shortest path
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out)


def _local_info(path: str) -> dict:
    """``fs.info``'s two fields that listing needs, from one ``os.stat``."""
    st = os.stat(path)
    return {"size": st.st_size, "type": "directory" if stat.S_ISDIR(st.st_mode) else "file"}


def _stat_many(
    fs: fsspec.AbstractFileSystem | None, paths: list[str], jobs: int
) -> list[dict | None]:
    """``fs.info`` for each path, in parallel because each is a metadata round trip on NFS."""

    def info(path: str) -> dict | None:
        try:
            return _local_info(path) if fs is None else fs.info(path)
        except FileNotFoundError:
            return None

    return map_in_threads(info, paths, jobs, name="stat")


def _from_paths(
    fs: fsspec.AbstractFileSystem | None,
    paths: list[str],
    root: str,
    name: str,
    jobs: int,
    root_url: str,
) -> SourceSet:
    """Stat ``paths`` (named by the user) in parallel; those that do not exist are ``missing``."""
    infos = _stat_many(fs, paths, jobs)
    shards, missing = [], []
    for path, info in zip(paths, infos, strict=True):
        if info is None or info.get("type") == "directory":
            missing.append(_display(fs, path))
            continue
        rel = posixpath.relpath(path, root) if root else path
        shards.append(
            SourceShard(_display(fs, path), path, safe_relpath(rel), int(info.get("size") or 0))
        )
    return SourceSet(root_url, name, tuple(shards), tuple(missing), fs)


def fill_sizes(
    source: SourceSet, shards: Sequence[SourceShard], jobs: int, *, known: Container[str] = ()
) -> list[SourceShard]:
    """``shards`` with every unknown size stat'ed (in parallel), except relpaths in ``known``.

    For shards from a directory walk (:func:`resolve_source` with ``stat_listed=False``): one
    that vanished since the listing, or turned out to be a directory, is dropped, as the walk
    would have dropped it.
    """
    todo = [i for i, s in enumerate(shards) if s.size is None and s.relpath not in known]
    if not todo:
        return list(shards)
    infos = _stat_many(source.remote_fs, [shards[i].path for i in todo], jobs)
    sized: dict[int, dict | None] = dict(zip(todo, infos, strict=True))
    out = []
    for i, shard in enumerate(shards):
        if i not in sized:
            out.append(shard)
            continue
        info = sized[i]
        if info is None or info.get("type") == "directory":
            continue
        out.append(dataclasses.replace(shard, size=int(info.get("size") or 0)))
    return out


def _fsspec_view(fs: fsspec.AbstractFileSystem | None) -> fsspec.AbstractFileSystem:
    """``fs`` itself, or fsspec's local filesystem for a local path (None), imported only now."""
    if fs is not None:
        return fs
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem()


def _common_url(fs: fsspec.AbstractFileSystem | None, root: str) -> str:
    """The root of a list of shards, as a URL, for the report and the staged manifest."""
    return _display(fs, root)


def _local_path(path: str) -> str:
    """Absolute, as fsspec makes local paths, but not normalized: a ``..`` in a list entry must
    survive so that the relative-path check refuses it rather than the listing hiding it."""
    path = os.path.expanduser(path)
    if not path.startswith("/"):
        path = os.getcwd().rstrip("/") + "/" + (path[2:] if path.startswith("./") else path)
    return path.rstrip("/") or "/"


def _split_fs(url: str) -> tuple[fsspec.AbstractFileSystem | None, str]:
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
    return (None, path) if protocol_of(fs) == "file" else (fs, path)


def _read_list(list_url: str) -> list[str]:
    import fsspec

    try:
        with fsspec.open(list_url, "rt") as handle:
            lines = handle.read().splitlines()
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise _translate(exc, list_url) from exc
    urls = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not urls:
        raise UsageError(f"list file {list_url} names no shards")
    return urls


def resolve_source(
    spec: str | Sequence[str] | None = None,
    *,
    from_list: str | None = None,
    name: str | None = None,
    jobs: int = 16,
    stat_listed: bool = True,
) -> SourceSet:
    """Resolve a stage-in source into shards with sizes.

    ``stat_listed=False``: shards found by walking a local directory keep ``size=None`` and are
    not stat'ed here; the caller sizes them with :func:`fill_sizes` after consulting a manifest,
    which saves a metadata round trip per shard that the manifest already describes.

    ``spec`` is a directory, a glob, a brace pattern (``train-{000000..000099}.tar``) or a single
    file, each optionally an fsspec URL, or a list of shard URLs; ``from_list`` is a file listing
    URLs instead. The dataset's name is ``name``, else :func:`stager.layout.dataset_name` of the
    spec (or of the listed URLs), the rule the loader looks the staged copy up by.
    Raises :class:`SourceError` when the source does not exist or lists no shards.
    """
    if (spec is None) == (from_list is None):
        raise UsageError("give exactly one of SOURCE or --from-list")
    urls: list[str] | None = None
    if from_list is not None:
        urls = _read_list(from_list)
    elif not isinstance(spec, str):
        urls = list(spec or ())
        if not urls:
            raise UsageError("an empty list of shard URLs names no dataset")
    name = name or dataset_name(urls if urls is not None else spec)  # type: ignore[arg-type]
    if urls is not None:
        fs, _ = _split_fs(urls[0])
        paths = []
        for url in urls:
            other_fs, path = _split_fs(url)
            if type(other_fs) is not type(fs):
                raise UsageError(
                    f"list {from_list or 'of shards'} mixes filesystems ({url}); use one list per "
                    "filesystem"
                )
            paths.append(path)
        root = _common_dir(paths)
        return _from_paths(fs, paths, root, name, jobs, from_list or _common_url(fs, root))

    assert isinstance(spec, str)
    if is_pattern(spec):
        expanded = expand_pattern(spec)
        fs, _ = _split_fs(expanded[0])
        paths = [_split_fs(u)[1] for u in expanded]
        root = _common_dir(paths)
        result = _from_paths(fs, paths, root, name, jobs, spec)
        if not result.shards:
            raise SourceError(
                f"source not found: none of the {len(paths)} files of {spec} exist; check the "
                "pattern"
            )
        return result

    fs, path = _split_fs(spec)
    if _has_glob(path):
        try:
            matches = sorted(
                _fsspec_view(fs).glob(path, detail=True).items()
            )  # fsspec's glob rules
        except Exception as exc:  # noqa: BLE001 - translated at this boundary
            raise _translate(exc, spec) from exc
        files = [(p, info) for p, info in matches if info.get("type") != "directory"]
        if not files:
            raise SourceError(f"source not found: no file matches {spec}; check the pattern")
        fixed = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)]
        root = fixed if fixed.endswith("/") else posixpath.dirname(fixed)
        shards = tuple(
            SourceShard(
                _display(fs, p),
                p,
                safe_relpath(posixpath.relpath(p, root)),
                int(info.get("size") or 0),
            )
            for p, info in files
        )
        return SourceSet(spec, name, shards, remote_fs=fs)

    try:
        info = _local_info(path) if fs is None else fs.info(path)
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise _translate(exc, spec) from exc
    if info.get("type") != "directory":
        root = posixpath.dirname(path)
        shard = SourceShard(
            _display(fs, path),
            path,
            safe_relpath(posixpath.basename(path)),
            int(info.get("size") or 0),
        )
        return SourceSet(spec, name, (shard,), remote_fs=fs)
    root = path.rstrip("/")
    if fs is None:
        # NFS answers each stat with a round trip: list names (readdir) serially, stat in parallel.
        try:
            names = _walk_local(root)
        except OSError as exc:
            raise _translate(exc, spec) from exc
        shards = tuple(
            SourceShard(p, p, safe_relpath(posixpath.relpath(p, root)), None) for p in names
        )
        result = SourceSet(spec, name, shards)
        if stat_listed:
            result = dataclasses.replace(result, shards=tuple(fill_sizes(result, shards, jobs)))
        if not result.shards:
            raise SourceError(
                f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}; check the directory"
            )
        return result
    try:
        found = fs.find(path, detail=True)
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise _translate(exc, spec) from exc
    shards = tuple(
        SourceShard(
            _display(fs, p), p, safe_relpath(posixpath.relpath(p, root)), int(info.get("size") or 0)
        )
        for p, info in sorted(found.items())
        if is_shard_name(p) and info.get("type") != "directory"
    )
    if not shards:
        raise SourceError(f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}; check the directory")
    return SourceSet(spec, name, shards, remote_fs=fs)
