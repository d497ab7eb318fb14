"""Which of a staged copy's shards the loader's SOURCE selects, from the two specs alone (no I/O).

A directory is staged whole; its train and validation shards are then loaded by a glob, a
brace pattern, a file or a list of files of that directory (``ds/train-*.tar``,
``ds/val-*.tar``): each names the same dataset, so both found the one staged copy, and both
loaders were given every shard in it, train and validation alike, without a word. The staged
manifest records what stage-in was asked for (:func:`stager.layout.canonical_spec`), so the
loader keeps the shards its own SOURCE selects, matched as stage-in's listing matches them: a
wildcard stays within one path part and does not match a hidden name, ``**`` spans parts, and
a brace pattern is its names as written (as stage-in takes them), looked up in a set. A staged
copy of a part (a glob, a list) holds too little to answer for another selection, and is
refused with a line saying what it holds.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stager.errors import UsageError
from stager.layout import canonical_spec, is_shard_name, source_path, source_root
from stager.patterns import expand_pattern, is_pattern
from stager.shards.manifest import ManifestColumns

__all__ = ["Selection", "is_whole_directory", "staged_selection", "url_prefix"]

_GLOB_CHARS = ("*", "?", "[")


@dataclass(frozen=True)
class Selection:
    """The staged relpaths a SOURCE selects: ``test`` keeps them; ``named``, where the SOURCE
    names its shards one by one (a file, a list), is every name, staged or not."""

    test: Callable[[str], bool]
    named: frozenset[str] | None = None

    def apply(
        self, columns: ManifestColumns, failures: list[dict[str, str]], root: str
    ) -> tuple[ManifestColumns, list[dict[str, str]], list[str]]:
        """The staged shards (and stage-in's failures, by URL under ``root``) it selects, and
        the shards it names that the staged copy lacks (read from the source, as a missing
        copy is)."""
        relpaths = list(columns.relpaths)  # (an item of packed paths costs ~0.7 us to take)
        keep = [i for i, relpath in enumerate(relpaths) if self.test(relpath)]
        picked = ManifestColumns(
            [relpaths[i] for i in keep],
            [columns.sizes[i] for i in keep],
            [columns.samples[i] for i in keep],
            columns.meta,
            None if columns.hashes is None else [columns.hashes[i] for i in keep],
        )
        prefix = url_prefix(root)
        failed = [f for f in failures if self.test(f["url"].removeprefix(prefix))]
        unstaged: list[str] = []
        if self.named is not None:
            have = set(picked.relpaths).union(f["url"].removeprefix(prefix) for f in failed)
            unstaged = sorted(self.named - have)
        return picked, failed, unstaged


def staged_selection(
    staged_spec: str | None,
    staged_root: str,
    spec: str | Sequence[str] | None,
    where: object,
) -> Selection | None:
    """The staged relpaths ``spec`` selects, or None where it selects them all.

    ``staged_spec`` and ``staged_root``: what the staged manifest records as asked for and as
    the root its relpaths hang from (no spec, from an older manifest, or ``spec`` None, the
    staged directory itself: all of it is meant). A list of shards names them: those staged
    are kept, the others are to be read from the source. Raises :class:`UsageError` where the
    staged copy holds a part (a glob, a list) that is not ``spec``'s.
    """
    if not staged_spec or spec is None:
        return None
    if isinstance(spec, str) and canonical_spec(spec) == staged_spec:
        return None
    root = source_path(staged_root) if staged_root else source_root(staged_spec)
    if not isinstance(spec, str):
        named = frozenset(_relative(source_path(u), root) for u in spec)
        return Selection(named.__contains__, named)
    if not is_whole_directory(staged_spec):
        raise UsageError(
            f"{where} holds a staged copy of {staged_spec}, not of {spec}: it cannot tell "
            "which shards that selects; load it by the SOURCE it was staged from, or stage "
            "this one under its own name (stage-in --name, LoaderOptions(name=...))"
        )
    if is_pattern(spec):  # (its names as written, as stage-in takes them: one set lookup each)
        named = frozenset(_relative(source_path(p), root) for p in expand_pattern(spec))
        return Selection(named.__contains__, named)
    path = source_path(spec)
    if any(c in path for c in _GLOB_CHARS):
        return Selection(_any_of([_relative(path, root)]))
    if is_shard_name(path):
        named = frozenset([_relative(path, root)])
        return Selection(named.__contains__, named)
    below = _relative(path.rstrip("/"), root)
    if below != path.rstrip("/"):  # a directory inside the copy (loaders/enclosing.py)
        prefix = below + "/"
        return Selection(lambda relpath: relpath.startswith(prefix))
    return None  # the directory itself (a spelling canonical_spec does not fold)


def url_prefix(root: str) -> str:
    """What a shard's URL starts with under a staged copy's recorded source root (stage-in's
    failures name them so; the loader reads a shard from the source there)."""
    return root.removeprefix("file://").rstrip("/") + "/"


def is_whole_directory(staged_spec: str) -> bool:
    """Whether the recorded spec asked for a directory (not a glob, a pattern, a file, a list)."""
    if staged_spec.startswith("list:"):
        return False
    path = staged_spec.split("://", 1)[1] if "://" in staged_spec else staged_spec
    patterned = is_pattern(path) or any(c in path for c in _GLOB_CHARS)
    return not patterned and not is_shard_name(path)


def _relative(path: str, root: str) -> str:
    root = root.rstrip("/")
    return path[len(root) + 1 :] if root and path.startswith(root + "/") else path


def _any_of(patterns: list[str]) -> Callable[[str], bool]:
    parts = [p.split("/") for p in patterns]
    return lambda relpath: any(_matches(p, relpath.split("/")) for p in parts)


def _matches(pattern: list[str], names: list[str]) -> bool:
    """Shell-glob match of path parts: ``**`` spans any number of parts; a wildcard does not
    match a name starting with ``.`` unless its pattern part does too."""
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(
            _matches(rest, names[i:])
            for i in range(len(names) + 1)
            if not any(n.startswith(".") for n in names[:i])
        )
    if not names:
        return False
    name = names[0]
    if name.startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and _matches(rest, names[1:])
