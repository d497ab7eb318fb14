"""Hidden names in listings fsspec makes: left out as the shell's globs leave them out.

A local directory's walk (:func:`stager.storage.listing.walk_local`) neither takes nor enters a
hidden name. A remote walk and a glob are fsspec's, which keep them: here they are left out
the same way, and named for the warning, so a source lists the same shards however it is read.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from stager.layout import hidden_worth_naming, is_hidden_name
from stager.storage.listing import Info, display

if TYPE_CHECKING:
    import fsspec

__all__ = ["hidden_part", "leave_out_hidden", "hidden_note"]


def hidden_part(path: str, root: str, pattern: str = "") -> str | None:
    """Where a listed ``path`` is hidden below ``root``: itself (``root/._a.tar``) or its first
    hidden directory (``root/.git/``), or None. ``pattern``: a glob's. As in the shell, a part
    of the path may be hidden where the pattern's part at its depth starts with ``.`` and
    matches it (``.*.tar``, ``.cache``); a ``**`` matches no hidden directory. For remote
    listings and globs, which fsspec makes without leaving hidden names out."""
    if not path.startswith(root):
        return None
    parts = path[len(root) :].strip("/").split("/")
    wanted = pattern[len(root) :].strip("/").split("/") if pattern else []
    for depth, name in enumerate(parts):
        if is_hidden_name(name) and not _named(name, depth, len(parts), wanted):
            below = "/".join(parts[: depth + 1])
            return f"{root.rstrip('/')}/{below}" + ("/" if depth < len(parts) - 1 else "")
    return None


def _named(name: str, depth: int, depths: int, wanted: list[str]) -> bool:
    """Whether the pattern's part at ``depth`` of a path ``depths`` parts long names a hidden
    ``name``: counted from the front before a ``**``, from the back after it."""
    if "**" in wanted:
        star = wanted.index("**")
        after = len(wanted) - star - 1
        if depth < star:
            part = wanted[depth]
        elif depth >= depths - after:
            part = wanted[len(wanted) - (depths - depth)]
        else:
            return False  # (under the **)
    elif depth < len(wanted):
        part = wanted[depth]
    else:
        return False
    return is_hidden_name(part) and fnmatchcase(name, part)


def leave_out_hidden(
    fs: fsspec.AbstractFileSystem | None,
    listed: list[tuple[str, Info]],
    root: str,
    pattern: str = "",
) -> tuple[list[tuple[str, Info]], list[str]]:
    """The entries of a remote listing or a glob (fsspec's, which keep hidden names) that are
    not hidden below ``root`` (:func:`hidden_part`), and what a warning names of the others:
    hidden shards, and each hidden directory once (not this tool's own ``.stager``)."""
    hidden = {path: hidden_part(path, root, pattern) for path, _ in listed}
    parts = {part for part in hidden.values() if part is not None}
    named = [
        display(fs, part)
        for part in sorted(parts)
        if hidden_worth_naming(posixpath.basename(part.rstrip("/")), part.endswith("/"))
    ]
    return [entry for entry in listed if hidden[entry[0]] is None], named


def hidden_note(left_out: Sequence[str]) -> str:
    """What to add to a glob's "no match" where only hidden files matched it."""
    hidden = [p for p in left_out if is_hidden_name(posixpath.basename(p.rstrip("/")))]
    if not hidden:
        return ""
    return (
        f"; only hidden names match it ({hidden[0]!r}...): a wildcard matches no name starting "
        "with '.'; write the '.' in the pattern"
    )
