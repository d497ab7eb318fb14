"""The on-disk contract: a dataset's name, and where its copy and bookkeeping live.

stage-in, fan-out, stage-out, restore, doctor and the loader must agree on these names to the
byte: the loader finds a staged copy only under the name stage-in gave it, and a mismatch
silently sends every rank back to NFS. So the rules live here once, and no other module spells
a ``.stager`` name or derives a dataset name itself.

Under a destination root (``/scratch/$SLURM_JOB_ID`` in a job)::

    ROOT/NAME/                        the staged copy: the source's shards at their relpaths
    ROOT/NAME/.stager/manifest.json   what was staged (sizes, hashes, samples, source identity)
    ROOT/NAME/.stager/journal         shards published since (stager.stagein.journal)
    ROOT/NAME/.stager/staging.json    a background stage-in's plan (stager.stagein.status)
    ROOT/NAME/.stager/index/          the loader's sample index (stager.shards.loader_index)
    ROOT/.stager-NAME.lock            one copier per node (stager.storage.lock)
    ROOT/.stager-NAME.result.json     the copier's outcome, adopted by tasks that waited
    ROOT/.stager-source-manifest/     a remote source's manifest, fetched once
    ROOT/.stager-restored/            restore's record of the checkpoint it restored

At a checkpoint destination (persistent storage): ``DEST/.stager/commits/NAME.json`` (the commit
record, written last) and ``DEST/.stager/staging/`` (attempts in flight); beside a checkpoint on
scratch, ``.stager-stageout/`` caches its file hashes.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stager.errors import UsageError
from stager.patterns import expand_pattern

__all__ = [
    "META_DIR",
    "is_hidden_name",
    "has_hidden_part",
    "hidden_worth_naming",
    "PARTIAL_SUFFIX",
    "SHARD_SUFFIXES",
    "CORRUPT_META",
    "StagedDataset",
    "dataset_name",
    "canonical_spec",
    "canonical_root",
    "source_root",
    "source_path",
    "is_remote_url",
    "glob_root",
    "is_shard_name",
    "is_other_tar",
    "is_left_out_tar",
    "is_bookkeeping",
    "RESTORED_DIR",
    "RESTORE_LOCK",
    "RESTORE_STAGING_PREFIX",
    "STAGEOUT_STATE_DIR",
    "DOCTOR_PROBE_PREFIX",
]

#: Bookkeeping inside a staged dataset, and inside a checkpoint destination.
META_DIR = ".stager"
#: Suffix of a file still being written; never a staged shard, never a final name.
PARTIAL_SUFFIX = ".partial"
#: File names that a directory source contributes as shards.
SHARD_SUFFIXES = (".tar", ".tgz", ".tar.gz")
#: Under the restore root: what restore restored (content ids), its lock, its temporary copies.
RESTORED_DIR = ".stager-restored"
RESTORE_LOCK = ".stager-restore.lock"
RESTORE_STAGING_PREFIX = ".stager-restore-"
#: Beside a checkpoint on scratch: stage-out's hash cache.
STAGEOUT_STATE_DIR = ".stager-stageout"
#: doctor's temporary write probe under the destination root.
DOCTOR_PROBE_PREFIX = ".stager-doctor-"
_RESERVED_PREFIX = ".stager"
_GLOB_CHARS = "*?["


#: The staged manifest's ``meta`` key recording the shards this node's last finished stage-in
#: found corrupt (a JSON list of relpaths): the loader refuses or leaves them out even after a
#: later run failed before its end and wrote a result without them (the result alone held it).
CORRUPT_META = "corrupt"


def is_shard_name(name: str) -> bool:
    """True for the file names stage-in treats as shards in a directory source."""
    return name.endswith(SHARD_SUFFIXES)


def is_shard_name_but_for_case(name: str) -> bool:
    """True for ``SHARD-0.TAR``: a shard name if its suffix were lower case. Suffixes are
    matched as written (the loader tells compressed shards by them), so such files are not
    staged, and stage-in says so."""
    return not is_shard_name(name) and is_shard_name(name.lower())


#: Tars compressed in ways neither stage-in's count nor the loader reads: never shards, but
#: named in a warning where a walk finds them (a directory of both staged half of it silently).
OTHER_TAR_SUFFIXES: tuple[str, ...] = (".tar.zst", ".tar.zstd", ".tzst", ".tar.bz2", ".tbz2")
OTHER_TAR_SUFFIXES += (".tar.xz", ".txz", ".tar.lz4", ".tar.lzma", ".tar.Z")


def is_other_tar(name: str) -> bool:
    """True for ``a.tar.zst`` and its like (:data:`OTHER_TAR_SUFFIXES`, in any case)."""
    return name.lower().endswith(tuple(s.lower() for s in OTHER_TAR_SUFFIXES))


def is_left_out_tar(name: str) -> bool:
    """True for a tar a walk leaves out but names in a warning: a shard's name but for its
    suffix's case, or a tar compressed in a way that is not read (:func:`is_other_tar`)."""
    return is_shard_name_but_for_case(name) or is_other_tar(name)


def is_hidden_name(name: str) -> bool:
    """True for a name a directory walk and a glob's wildcards leave out, as the shell's and
    Python's globs do: ``.git``, ``.b.tar``, and the ``._a.tar`` AppleDouble files a Mac
    leaves beside each file it copies to a share, which are no tars. Named explicitly (a list,
    braces, a pattern whose part starts with ``.``), such a file is staged."""
    return name.startswith(".")


def has_hidden_part(path: str) -> bool:
    """True for a relative path a walk leaves out: one of its parts is hidden."""
    return any(map(is_hidden_name, path.split("/")))


def hidden_worth_naming(name: str, directory: bool) -> bool:
    """Whether a hidden entry a listing left out goes in its warning: a directory (not this
    tool's own ``.stager``), or a file named like a shard (in any case)."""
    return name != META_DIR if directory else is_shard_name(name.lower())


def is_bookkeeping(name: str) -> bool:
    """True for the names stager keeps beside staged datasets (locks, results, restores...):
    ``stager ls`` counts them in a job's size but lists only datasets and the user's files."""
    return name.startswith(_RESERVED_PREFIX)


def is_remote_url(url: str) -> bool:
    """Whether ``url`` names an fsspec store other than the local filesystem (``s3://...``),
    not a path or a ``file://`` URL."""
    return "://" in url and not url.startswith("file://")


def source_path(url: str) -> str:
    """The path part of a source URL; a local one made absolute (against the working directory,
    without touching the disk), with ``..`` folded and a leading ``//`` made one (POSIX leaves
    its meaning open and keeps it; Linux reads it as ``/``, and ``//nfs/ds`` was another
    dataset than ``/nfs/ds``)."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" in url:
        return url.split("://", 1)[1]
    path = os.path.expanduser(url)
    path = posixpath.normpath(path if path.startswith("/") else posixpath.join(os.getcwd(), path))
    return "/" + path.lstrip("/") if path.startswith("//") else path


def _common_dir(dirs: Sequence[str]) -> str:
    """The deepest directory containing all of ``dirs`` (component-wise, never mid-name)."""
    split = [d.rstrip("/").split("/") for d in dirs]
    out: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out) or ("/" if all(d.startswith("/") for d in dirs) else "")


def source_root(spec: str | Sequence[str]) -> str:
    """The directory a source's shards are placed relative to, from the spec alone (no I/O).

    A directory is its own root; a shard file's root is its directory; a glob's is the
    directory before its first wildcard; a brace pattern's, and a list of shard URLs', is the
    deepest directory holding all of them. Local relative paths are resolved against the
    working directory and ``..`` is folded, so ``d/x/../a/`` and ``/abs/d/a`` agree.
    """
    if not isinstance(spec, str):
        urls = list(spec)
        if not urls:
            raise UsageError("an empty list of shards names no dataset")
        return _common_dir([posixpath.dirname(source_path(u)) for u in urls])
    if "{" in spec and "}" in spec:
        return _common_dir([posixpath.dirname(source_path(u)) for u in expand_pattern(spec)])
    path = source_path(spec)
    root = glob_root(path)
    if root is not None:
        return posixpath.normpath(root)
    if is_shard_name(path):
        return posixpath.dirname(path)
    return path.rstrip("/") or path  # (a URL's directory as stage-in's s3://b/ds/: s3://b/ds)


def glob_root(path: str) -> str | None:
    """The directory every match of the glob ``path`` lies under: its fixed prefix up to the
    last ``/`` before the first wildcard (``*``, ``?``, ``[``). None where ``path`` has none."""
    wildcards = [path.index(c) for c in _GLOB_CHARS if c in path]
    if not wildcards:
        return None
    fixed = path[: min(wildcards)]
    return fixed if fixed.endswith("/") else posixpath.dirname(fixed)


def canonical_spec(spec: str, *, listed: bool = False) -> str:
    """What a source spec asks for, spelled one way: the same text for every spelling of it.

    Recorded in the staged manifest, so that a rerun that asks for something else under the
    same name is refused instead of mixing two datasets. A local path becomes an absolute
    ``file://`` URL with ``..`` folded and no trailing slash; a URL keeps its text (without a
    trailing slash); ``listed``: ``spec`` is a list file, whose own location is the identity.
    """
    if is_remote_url(spec):
        text = spec.rstrip("/")
    else:
        text = "file://" + source_path(spec)
    return f"list:{text}" if listed else text


def canonical_root(spec: str | Sequence[str]) -> str:
    """:func:`source_root` as a URL: ``file:///abs/root`` or ``s3://bucket/root`` (no I/O).

    Compared with the ``source`` a staged manifest records, to tell a staged copy of this
    source from one of another source that happens to have the same name.
    """
    first = spec if isinstance(spec, str) else next(iter(spec), "")
    root = source_root(spec)
    if is_remote_url(first):  # (a store's root has no leading /: a list over two buckets
        return f"{first.split('://', 1)[0]}://{root.lstrip('/')}"  # recorded s3:///, named s3://)
    return f"file://{root}"


def dataset_name(spec: str | Sequence[str]) -> str:
    """The name stage-in stages ``spec`` under, and the loader looks it up by: its root's basename.

    ``spec`` is what the user typed (directory, glob, brace pattern, shard file, any of them as
    an fsspec URL) or a list of shard URLs (``--from-list``). Pure: the same text gives the same
    name on a login node, in the prologue and in every rank.
    """
    root = source_root(spec).rstrip("/")
    while root.endswith("/."):  # (a URL keeps its dots: s3://b/ds/. is ds, as /nfs/ds/. is)
        root = root[:-2].rstrip("/")
    name = posixpath.basename(root)
    return name or "dataset"


@dataclass(frozen=True)
class StagedDataset:
    """Where one dataset staged under ``root`` lives, and the files that go with it."""

    root: Path
    name: str

    def __post_init__(self) -> None:
        check_name(self.name)

    @property
    def dir(self) -> Path:
        """The staged copy: shards at their relative paths."""
        return self.root / self.name

    @property
    def meta_dir(self) -> Path:
        return self.dir / META_DIR

    @property
    def manifest_path(self) -> Path:
        """The staged manifest: what the copy holds, and from which source."""
        return self.meta_dir / "manifest.json"

    @property
    def journal_path(self) -> Path:
        """A line per shard published by a run that has not written its manifest yet."""
        return self.meta_dir / "journal"

    @property
    def staging_path(self) -> Path:
        """What a running (or the last) ``stage-in --background`` will publish, in its order."""
        return self.meta_dir / "staging.json"

    @property
    def index_dir(self) -> Path:
        """The loader's sample index of the staged copy."""
        return self.meta_dir / "index"

    @property
    def lock_path(self) -> Path:
        """Held by the node's one copier; outside the dataset so ``rm -r NAME`` cannot race it."""
        return self.root / f"{_RESERVED_PREFIX}-{self.name}.lock"

    @property
    def result_path(self) -> Path:
        """The copier's outcome, which tasks that waited on the lock adopt."""
        return self.root / f"{_RESERVED_PREFIX}-{self.name}.result.json"

    @property
    def source_manifest_dir(self) -> Path:
        """Where a remote source's manifest is fetched to before it is read."""
        return self.root / f"{_RESERVED_PREFIX}-source-manifest" / self.name

    @classmethod
    def of(cls, dataset_dir: str | os.PathLike[str]) -> StagedDataset:
        """The layout of an existing staged directory (``ROOT/NAME``)."""
        path = Path(dataset_dir)
        return cls(path.parent, path.name)


def check_name(name: str) -> str:
    """Refuse a dataset name that is not one plain path component, or that is reserved."""
    if not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise UsageError(
            f"dataset name {name!r} must be one plain path component (no '/'); pass --name"
        )
    if name.startswith(_RESERVED_PREFIX) or name.endswith(PARTIAL_SUFFIX):
        raise UsageError(
            f"dataset name {name!r} is reserved for stager's own files (starts with "
            f"{_RESERVED_PREFIX!r} or ends with {PARTIAL_SUFFIX!r}); pass --name"
        )
    if len(name.encode("utf-8", "surrogateescape")) > 255:  # (a file name's limit: exit 5 said
        raise UsageError(  # "pass --dest", which could not help)
            f"dataset name {name[:40]!r}... is {len(name.encode('utf-8', 'surrogateescape'))} "
            "bytes long, past the 255 a directory name may have; pass a shorter --name"
        )
    return name
