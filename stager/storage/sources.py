"""Turn what the user typed into a list of shards: directory, glob, brace pattern or list.

The shard's *relative path* (where it lands under ``DEST/<name>/``) is its path relative to the
source root: the directory for a directory source, the fixed prefix for a glob, the common
parent directory for a brace pattern or a list. File names are kept as they are (a backslash is
a character, not a separator). Two entries naming the same file collapse into one; two
different files that would land on one relative path are refused before any byte moves,
naming both. Entries that are not regular files (a FIFO named ``x.tar`` would block a reader
forever) are skipped and listed in :attr:`SourceSet.skipped` for a warning, as are in
``left_out`` names like shards' but for their suffix's case (``x.TAR``), linked directories,
hidden names (``.git/``, ``._x.tar``) and directories named like shards (``x.tar/``).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Container, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from stager.errors import SourceError, StagerError, UsageError
from stager.layout import (
    SHARD_SUFFIXES,
    canonical_spec,
    dataset_name,
    glob_root,
    is_left_out_tar,
    is_shard_name,
    is_shard_name_but_for_case,
)
from stager.leftout import no_shards_message
from stager.patterns import expand_pattern, is_pattern
from stager.storage.hidden import hidden_note, leave_out_hidden
from stager.storage.listing import (
    DIRECTORY,
    OTHER,
    display,
    drop_listings,
    glob_matches,
    info_of,
    literal_path_note,
    protocol_of,
    read_list,
    some_file_names,
    split_fs,
    stat_many,
    stat_one,
    translate,
    walk_local,
)
from stager.storage.paths import check_encodable
from stager.storage.sourceset import SourceSet, SourceShard, shard_at, unique_shards

if TYPE_CHECKING:
    import fsspec

__all__ = [
    "SourceShard",
    "SourceSet",
    "resolve_source",
    "fill_sizes",
    "protocol_of",
    "SHARD_SUFFIXES",
    "is_shard_name",
]


def _common_dir(paths: list[str]) -> str:
    dirs = [posixpath.dirname(p) for p in paths]
    if all(d.startswith("/") for d in dirs):
        return posixpath.commonpath(dirs)
    split = [d.split("/") for d in dirs]
    out: list[str] = []
    for parts in zip(*split, strict=False):  # stops at the shortest path
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out)


def _from_paths(
    fs: fsspec.AbstractFileSystem | None,
    paths: list[str],
    root: str,
    name: str,
    jobs: int,
    spec: str,
) -> SourceSet:
    """Stat ``paths`` (named by the user) in parallel; those that do not exist are ``missing``."""
    unique = list(dict.fromkeys(paths))  # a name listed twice is one shard
    _refuse_cased(unique, spec)
    try:
        infos = stat_many(fs, unique, jobs)
    except StagerError:
        raise
    except Exception as exc:  # noqa: BLE001 - a store's own errors (botocore's are no OSError)
        raise translate(exc, spec) from exc  # (a traceback, exit 1, for braces and lists)
    shards, missing, skipped = [], [], []
    for path, info in zip(unique, infos, strict=True):
        if info is None or info.kind == DIRECTORY:
            missing.append(display(fs, path))
        elif info.kind == OTHER:
            skipped.append(display(fs, path))
        else:
            shards.append(shard_at(fs, path, root, info))
    where = display(fs, root or "/")
    distinct = unique_shards(shards, exact=fs is not None)  # (keys: x//y.tar is not x/y.tar)
    return SourceSet(where, name, distinct, tuple(missing), fs, spec, tuple(skipped), named=True)


def _also_a_prefix(fs: fsspec.AbstractFileSystem | None, path: str, spec: str) -> bool:
    """Whether an object store's key ``path`` is also the prefix of other keys (``ds`` beside
    ``ds/x.tar``, a folder marker) that SOURCE means: it ends in ``/``, or the object is no
    shard. (That object alone was staged, exit 0, the dataset under the prefix left out.)"""
    if fs is None or protocol_of(fs) in ("http", "https"):
        return False
    if not spec.endswith("/") and is_shard_name(posixpath.basename(path)):
        return False
    try:
        return bool(fs.isdir(path))
    except Exception:  # noqa: BLE001 - the object is there: staged as named, as before
        return False


def _refuse_cased(paths: list[str], spec: str) -> None:
    """Refuse a shard named explicitly with its suffix not in lower case (``X.TAR``), as a
    walk and a glob leave such a file out: it was staged as a file "as it is", its samples
    neither counted nor checked, under a dataset name of its own, and the loader then refused
    that copy as another dataset's."""
    cased = [p for p in paths if is_shard_name_but_for_case(posixpath.basename(p))]
    if cased:
        raise SourceError(
            f"{cased[0]!r} (in {spec}) is named like a shard but for the case of its suffix, "
            "and suffixes are matched as written (*.tar, *.tgz, *.tar.gz); rename it to lower case"
        )


def fill_sizes(
    source: SourceSet,
    shards: Sequence[SourceShard],
    jobs: int,
    *,
    known: Container[str] = (),
    skipped: list[str] | None = None,
    directories: list[str] | None = None,
) -> list[SourceShard]:
    """``shards`` with every unknown size stat'ed (in parallel), except relpaths in ``known``.

    For shards from a directory walk (:func:`resolve_source` with ``stat_listed=False``): one
    gone since the listing is dropped as the walk would have dropped it; one not a regular
    file is dropped and its URL appended to ``skipped``, and a directory (named like a shard,
    which a walk takes unasked) with a ``/`` to ``directories``, for a warning.
    """
    todo = [i for i, s in enumerate(shards) if s.size is None and s.relpath not in known]
    if not todo:
        return list(shards)
    paths = [shards[i].path for i in todo]
    infos = dict(zip(todo, stat_many(source.remote_fs, paths, jobs), strict=True))
    out = []
    for i, shard in enumerate(shards):
        if i not in infos:
            out.append(shard)
            continue
        info = infos[i]
        if info is None or info.kind == DIRECTORY:
            if info is not None and directories is not None:
                directories.append(shard.url + "/")
            continue
        if info.kind == OTHER:
            if skipped is not None:
                skipped.append(shard.url)
            continue
        out.append(replace(shard, size=info.size, version=info.version))
    return out


def _list_urls(urls: list[str], name: str, jobs: int, spec: str, where: str) -> SourceSet:
    fs = drop_listings(split_fs(urls[0])[0])
    paths = []
    for url in urls:
        other_fs, path = split_fs(url)
        if type(other_fs) is not type(fs):
            raise UsageError(f"{where} mixes filesystems ({url}); use one list per filesystem")
        paths.append(path)
    return _from_paths(fs, paths, _common_dir(paths), name, jobs, spec)


def _glob(
    spec: str, fs: fsspec.AbstractFileSystem | None, path: str, name: str, sized: bool
) -> SourceSet:
    try:
        matches = sorted(glob_matches(fs, path).items())
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise translate(exc, spec) from exc
    unknown: set[str] = set()  # (remote shards whose size is left for the caller to ask)
    if fs is None:
        # Stat'ed again: fsspec's version (mtime, created) never equals the copy's (inode, mtime,
        # ctime); a --cache fill took that for a source changing under it, and cached nothing.
        try:
            found = [(p, stat_one(None, p)) for p, _ in matches]
        except Exception as exc:  # noqa: BLE001 - translated at this boundary
            raise translate(exc, spec) from exc
        infos = [(p, info) for p, info in found if info is not None]
    else:
        infos = [(p, info_of(info)) for p, info in matches]
        # An HTTP listing's links carry no size (0 here): each copy was then retried, "copied
        # 10240 bytes but the source listed 0", and every rerun copied everything again. Asked
        # of each (a HEAD) where sizes are wanted now, else left unknown for the caller to ask
        # (stage-in's fill_sizes; a loader reading the source needs none: a HEAD per shard per
        # rank at every start)
        unsized = [i for i, (_, info) in enumerate(matches) if info.get("size") is None]
        if not sized:
            unknown = {matches[i][0] for i in unsized}
        elif unsized:
            try:
                asked = stat_many(fs, [matches[i][0] for i in unsized], 8)
            except Exception as exc:  # noqa: BLE001 - translated at this boundary
                raise translate(exc, spec) from exc
            for i, info in zip(unsized, asked, strict=True):
                if info is not None:
                    infos[i] = (matches[i][0], info)
    root = glob_root(path) or ""  # (path is a glob here: never None)
    # A wildcard matches no hidden name (.git/, ._a.tar), as in the shell; fsspec's glob does
    files, hidden = leave_out_hidden(fs, [m for m in infos if m[1].kind != DIRECTORY], root, path)
    if not files:
        note = literal_path_note(spec) + hidden_note(tuple(sorted(hidden)))
        raise SourceError(f"source not found: no file matches {spec}; check the pattern{note}")
    # Shard names only, as a walk takes them: `ds/*` matched the stager-manifest.json that
    # `stager index` writes beside the shards, staged it with exit 0, and the loader then
    # failed on it as a corrupt tar. The others are named in a warning.
    not_shards = [display(fs, p) for p, _ in files if not is_shard_name(posixpath.basename(p))]
    files = [(p, info) for p, info in files if is_shard_name(posixpath.basename(p))]
    if not files:
        raise SourceError(no_shards_message(spec, not_shards))
    left_out = tuple(sorted([*hidden, *not_shards]))
    matched = [shard_at(fs, p, root, info) for p, info in files if info.kind != OTHER]
    if unknown:
        matched = [replace(m, size=None) if m.path in unknown else m for m in matched]
    shards = unique_shards(matched, exact=fs is not None)  # (keys: x//y.tar is not x/y.tar)
    skipped = tuple(display(fs, p) for p, info in files if info.kind == OTHER)
    spec_id = canonical_spec(spec)
    return SourceSet(display(fs, root), name, shards, (), fs, spec_id, skipped, left_out)


def _walk(
    spec: str, fs: fsspec.AbstractFileSystem | None, root: str, name: str, jobs: int, stat: bool
) -> SourceSet:
    spec_id = canonical_spec(spec)
    if fs is None:
        # NFS answers each stat with a round trip: names from readdir (walk_local), then stats.
        left_out: list[str] = []
        try:
            names = walk_local(root, jobs, left_out=left_out)
        except OSError as exc:
            raise translate(exc, spec) from exc
        # The walk joins readdir names with "/" under root: the tail is already a canonical
        # relative path (no "..", no empty or "." parts, no NUL), so it is sliced, not parsed
        # (posixpath.relpath cost ~60 us a shard: a minute at 1M shards).
        cut = len(root.rstrip("/")) + 1
        walked = tuple(SourceShard(p, p, p[cut:], None) for p in names)
        result = SourceSet(root, name, walked, spec=spec_id, walked=True)
        others: list[str] = []
        if stat:
            walked = tuple(fill_sizes(result, walked, jobs, skipped=others, directories=left_out))
        result = replace(result, shards=walked, skipped=(*others,), left_out=(*sorted(left_out),))
    else:
        try:
            found = fs.find(root, detail=True)
        except Exception as exc:  # noqa: BLE001 - translated at this boundary
            raise translate(exc, spec) from exc
        entries = [(p, info_of(i)) for p, i in sorted(found.items())]
        shown, hidden = leave_out_hidden(fs, entries, root)  # (as a local walk leaves them out)
        infos = [(p, info) for p, info in shown if is_shard_name(p)]
        kinds = (DIRECTORY, OTHER)
        keyed = [shard_at(fs, p, root, i) for p, i in infos if i.kind not in kinds]
        shards = unique_shards(keyed, exact=True)  # (keys: x//y.tar is not x/y.tar)
        skipped = tuple(display(fs, p) for p, info in infos if info.kind == OTHER)
        case_only = [display(fs, p) for p, _ in shown if is_left_out_tar(p)]
        remote_left_out = tuple(sorted(case_only + hidden))
        result = SourceSet(
            *(display(fs, root), name, shards, (), fs, spec_id, skipped, remote_left_out),
            walked=True,
        )
    if not result.shards:
        listed = (
            some_file_names(root) if fs is None else [p[len(root) :].lstrip("/") for p in found]
        )
        raise SourceError(no_shards_message(spec, listed, result.skipped))
    return result


def resolve_source(
    spec: str | Sequence[str] | None = None,
    *,
    from_list: str | None = None,
    name: str | None = None,
    jobs: int = 16,
    stat_listed: bool = True,
) -> SourceSet:
    """Resolve a stage-in source into shards with sizes and versions.

    ``spec`` is a directory, a glob, a brace pattern (``train-{000000..000099}.tar``) or a single
    file, each optionally an fsspec URL, or a list of shard URLs; ``from_list`` is a file listing
    URLs instead. The dataset's name is ``name``, else :func:`stager.layout.dataset_name` of the
    spec (or of the listed URLs), the rule the loader looks the staged copy up by.

    ``stat_listed=False``: shards found by walking a local directory keep ``size=None`` and are
    not stat'ed here; the caller sizes them with :func:`fill_sizes` after consulting a manifest,
    which saves a metadata round trip per shard that the manifest already describes. Raises
    :class:`SourceError` when the source does not exist, lists no shards, or names a shard not
    valid UTF-8 (no manifest, index or report could record it).
    """
    source = _resolve(spec, from_list=from_list, name=name, jobs=jobs, stat_listed=stat_listed)
    check_encodable(source.root_url, "source")
    check_encodable(source.name, "dataset name")
    for shard in source.shards:
        if not shard.relpath.isascii():
            check_encodable(shard.url, "source shard name")
    return source


def _urls_spec(urls: list[str]) -> str:
    """The spec of a dataset given as its shards' URLs: a digest of them."""
    import hashlib  # (only here: ~5 ms of every stage-in's start)

    digest = hashlib.sha256("\n".join(canonical_spec(u) for u in urls).encode()).hexdigest()
    return f"urls:{digest[:32]}"


def _is_file(list_url: str) -> bool:
    """Whether a list names a place that holds it (a URL, or a regular local file)."""
    return "://" in list_url or (list_url != "-" and os.path.isfile(list_url))


def _resolve(
    spec: str | Sequence[str] | None,
    *,
    from_list: str | None,
    name: str | None,
    jobs: int,
    stat_listed: bool,
) -> SourceSet:
    if (spec is None) == (from_list is None):
        raise UsageError("give exactly one of SOURCE or --from-list")
    if from_list is not None:
        urls = read_list(from_list)
        # A list file is identified by where it is; one read from a pipe or standard input
        # (`--from-list <(find ...)`, `-`) has no stable place: by the shards it names.
        spec_id = (
            canonical_spec(from_list, listed=True) if _is_file(from_list) else _urls_spec(urls)
        )
        return _list_urls(urls, name or dataset_name(urls), jobs, spec_id, f"list {from_list}")
    if not isinstance(spec, str):
        urls = list(spec or ())
        if not urls:
            raise UsageError("an empty list of shard URLs names no dataset")
        return _list_urls(urls, name or dataset_name(urls), jobs, _urls_spec(urls), "the list")
    if not spec.strip() or "\0" in spec or spec.endswith("://"):  # "", "file://", "s3://"
        raise UsageError(f"SOURCE {spec!r} names no path; give a directory, file or URL")
    name = name or dataset_name(spec)
    if is_pattern(spec):
        expanded = expand_pattern(spec)
        fs = drop_listings(split_fs(expanded[0])[0])
        paths = [split_fs(u)[1] for u in expanded]
        result = _from_paths(fs, paths, _common_dir(paths), name, jobs, canonical_spec(spec))
        if not result.shards and not result.skipped:
            raise SourceError(
                f"source not found: none of the {len(paths)} files of {spec} exist; check the "
                f"pattern{literal_path_note(spec)}"
            )
        return result
    fs, path = split_fs(spec)
    drop_listings(fs)  # (listed afresh: an object may have changed since an earlier listing)
    if glob_root(path) is not None:
        return _glob(spec, fs, path, name, stat_listed)
    try:
        info = stat_one(fs, path)
    except Exception as exc:  # noqa: BLE001 - translated at this boundary
        raise translate(exc, spec) from exc
    if info is None:
        raise translate(FileNotFoundError(path), spec)
    if info.kind == DIRECTORY or _also_a_prefix(fs, path, spec):
        return _walk(spec, fs, path.rstrip("/") or "/", name, jobs, stat_listed)
    if fs is not None and protocol_of(fs) in ("http", "https") and not is_shard_name(path):
        # (HTTP has no directories: http://host/ds answers with its listing page, which was
        # staged as a "file" named ds, and the loader refused that copy)
        raise SourceError(
            f"source {spec} is a web page, not a shard (an HTTP server's directory listing?): "
            "HTTP has no directories; name the shards in a list (--from-list) or a brace pattern"
        )
    _refuse_cased([path], spec)
    root = posixpath.dirname(path)
    if info.kind == OTHER:
        raise SourceError(
            f"source {spec} is not a regular file (a FIFO, a device or a symlink to nothing?); "
            "refused"
        )
    shard = shard_at(fs, path, root, info)
    return SourceSet(display(fs, root), name, (shard,), (), fs, canonical_spec(spec), named=True)
