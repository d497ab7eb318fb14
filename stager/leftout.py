"""The lines that say what a listing left out, and why a source holds no shards.

A walk takes only shard names (:func:`stager.layout.is_shard_name`) and leaves out hidden names,
suffixes in upper case, tars compressed in ways nothing here reads, symlinked directories and
directories named like shards: each kind is named in one warning, so that a source never
stages part of what it holds without a word.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence

from stager.errors import one_line
from stager.layout import (
    has_hidden_part,
    is_hidden_name,
    is_other_tar,
    is_shard_name,
    is_shard_name_but_for_case,
)

__all__ = [
    "left_out_warnings",
    "hidden_in_manifest",
    "no_shards_message",
    "not_regular_message",
    "skipped_message",
]


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
    compressed = [p for p in files if is_other_tar(posixpath.basename(p))]
    cased = [p for p in files if is_shard_name_but_for_case(posixpath.basename(p))]
    # (what a glob matches that is no shard: a walk never takes those)
    not_shards = [p for p in files if p not in set(compressed).union(cased)]
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
    if cased:
        lines.append(
            f"not {done}: {_first(cased)}, named like shards but for the case of the suffix "
            "(suffixes are matched as written); rename them to lower case"
        )
    if not_shards:
        lines.append(
            f"not {done}: {_first(not_shards)}, matched by the pattern but not shards (*.tar, "
            "*.tgz, *.tar.gz); name them in --from-list to stage them as they are"
        )
    if compressed:
        lines.append(f"not {done}: {_first(compressed)}, {_OTHER_COMPRESSION}")
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


_OTHER_COMPRESSION = (
    "tars compressed in a way stage-in and the loader do not read (zstd, bzip2, xz, lz4); "
    "decompress them to .tar, or recompress them as .tar.gz"
)


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
        if is_other_tar(base):
            where = f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}"
            return f"{where}: {base} and its like are {_OTHER_COMPRESSION}"
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
    what = "pattern" if any(c in spec for c in "*?[") else "directory"
    return f"no shards (*.tar, *.tgz, *.tar.gz) under {spec}; check the {what}"
