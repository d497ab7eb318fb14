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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stager.errors import UsageError, one_line
from stager.patterns import expand_pattern

__all__ = [
    "META_DIR",
    "is_hidden_name",
    "has_hidden_part",
    "hidden_worth_naming",
    "hidden_in_manifest",
    "PARTIAL_SUFFIX",
    "SHARD_SUFFIXES",
    "CORRUPT_META",
    "StagedDataset",
    "dataset_name",
    "canonical_spec",
    "canonical_root",
    "source_root",
    "source_path",
    "glob_root",
    "is_shard_name",
    "no_shards_message",
    "not_regular_message",
    "skipped_message",
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


def left_out_warnings(left_out: Sequence[str], done: str = "staged") -> list[str]:
    """The warnings for what a walk saw but did not take (``SourceSet.left_out``): a source of
    ``a.tar`` and ``B.TAR``, or with a subdirectory that is a symlink, or with hidden shards or
    directories, or with a directory named like a shard (``train.tar/``), staged only part of
    what it holds without a word. One line per kind, naming the first; directories end in
    ``/``."""
    hidden: list[str] = []
    others: list[str] = []
    for path in left_out:
        (hidden if is_hidden_name(posixpath.basename(path.rstrip("/"))) else others).append(path)
    hidden.sort()
    files = sorted(p for p in others if not p.endswith("/"))
    # (a walk takes a name like a shard's unasked, and its stat finds a directory)
    shard_like = sorted(p for p in others if p.endswith("/") and is_shard_name(p[:-1]))
    linked = sorted(p for p in others if p.endswith("/") and not is_shard_name(p[:-1]))
    lines = []
    if hidden:
        lines.append(
            f"not {done}: {_first(hidden)}, hidden (a name starting with '.', left out by a "
            "walk or a glob's wildcard as the shell leaves it out); name them in --from-list "
            "or in the pattern to stage them"
        )
    if files:
        lines.append(
            f"not {done}: {_first(files)}, named like shards but for the case of the suffix "
            "(suffixes are matched as written); rename them to lower case"
        )
    if linked:
        lines.append(
            f"not {done}: {_first(linked)}, symlinks to directories, which a walk does not "
            "follow; name their shards by a glob or a list, or give each as a source of its own"
        )
    if shard_like:
        lines.append(
            f"not {done}: {_first(shard_like)}, directories named like shards, which a walk "
            "takes for shards and does not enter; rename them, or name their shards by a glob "
            "or a list"
        )
    return lines


def hidden_in_manifest(relpaths: Sequence[str]) -> str:
    """The warning for shards a manifest lists that a walk leaves out as hidden."""
    return (
        f"not staged: {_first(relpaths)}, listed in the manifest but hidden (a name starting "
        "with '.', which a walk leaves out); re-run stager index, or name them in --from-list"
    )


def _first(paths: Sequence[str]) -> str:
    more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
    return f"{one_line(paths[0])!r}{more}"


def skipped_message(url: str) -> str:
    """The warning for one would-be shard that is not a regular file, skipped unopened."""
    return (
        f"skipped {one_line(url)!r}: not a regular file (a FIFO, a device or a symlink to nothing?)"
    )


def not_regular_message(root: str, skipped: Sequence[str]) -> str:
    """The error for a source whose every would-be shard is a FIFO, a device, a broken link or
    a directory named like a shard."""
    first = f"no shards to stage from {one_line(root)}: {one_line(min(skipped))!r}"
    if len(skipped) == 1:
        return (
            f"{first} is not a regular file (a FIFO, a device, a symlink to nothing or a "
            "directory named like a shard?)"
        )
    return (
        f"{first} and {len(skipped) - 1} more are not regular files (FIFOs, devices, symlinks "
        "to nothing or directories named like shards?)"
    )


def no_shards_message(spec: str, names: Iterable[str], skipped: Sequence[str] = ()) -> str:
    """The one line for a source without shards. Where some of ``names`` (the files found)
    would be shards but for the case of their suffix (``SHARD-0.TAR``), it names one: shard
    names are matched as written, and "check the directory" did not say what was wrong. Where
    the walk skipped some (``skipped``: not regular files), it names one of those instead; where
    the only shards are hidden (``._a.tar``, ``.cache/a.tar``), one of them."""
    if skipped:
        return not_regular_message(spec, skipped)
    hidden = None
    for name in names:
        base = name.rsplit("/", 1)[-1]
        if is_shard_name_but_for_case(base):
            return (
                f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}: {base} and its like have "
                "suffixes not in lower case, and suffixes are matched as written; rename them "
                "to lower case"
            )
        if hidden is None and is_shard_name(base) and has_hidden_part(name):
            hidden = name
    if hidden is not None:
        return (
            f"no shards (*.tar, *.tgz, *.tar.gz) under {spec} but hidden ones ({one_line(hidden)!r}"
            " and its like: a name starting with '.', which a walk leaves out); name them in "
            "--from-list to stage them"
        )
    return f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}; check the directory"


def is_bookkeeping(name: str) -> bool:
    """True for the names stager keeps beside staged datasets (locks, results, restores...):
    ``stager ls`` counts them in a job's size but lists only datasets and the user's files."""
    return name.startswith(_RESERVED_PREFIX)


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
    if "://" in spec and not spec.startswith("file://"):
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
    if "://" in first and not first.startswith("file://"):
        return f"{first.split('://', 1)[0]}://{root}"
    return f"file://{root}"


def dataset_name(spec: str | Sequence[str]) -> str:
    """The name stage-in stages ``spec`` under, and the loader looks it up by: its root's basename.

    ``spec`` is what the user typed (directory, glob, brace pattern, shard file, any of them as
    an fsspec URL) or a list of shard URLs (``--from-list``). Pure: the same text gives the same
    name on a login node, in the prologue and in every rank.
    """
    name = posixpath.basename(source_root(spec).rstrip("/"))
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
    return name
