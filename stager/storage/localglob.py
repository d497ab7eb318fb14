"""fsspec's glob of a local path, except that a directory it cannot read is an error.

fsspec's walk leaves out a directory whose listing fails, as if it held nothing, and passes its
``on_error`` to the top directory's listing only. A glob source with a subdirectory without
read permission (``/data/*/train-*.tar``) so lost that directory's shards, and stage-in ended
with exit 0 on a partial dataset. Here the walk raises the listing's ``OSError`` at every
depth, for the directories the pattern can reach: fsspec walks every directory under the
pattern's fixed prefix, and one the pattern cannot match (``private/`` beside ``shard-*/``)
is not descended into, so it cannot fail the glob. A directory gone meanwhile, or replaced
by a file, still matches nothing. Imported only for a glob: fsspec's import is not free.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from stager.layout import glob_root

__all__ = ["glob_local"]


class _ReadEveryDirectory(LocalFileSystem):
    cachable = False  # (fsspec caches instances per class and arguments: none needed here)
    reachable: _Reachable | None = None

    def walk(
        self, path: str, maxdepth: int | None = None, topdown: bool = True, **kwargs: Any
    ) -> Any:
        kwargs.pop("on_error", None)  # (every level's, including those fsspec recurses into)
        walked = super().walk(path, maxdepth=maxdepth, topdown=topdown, on_error=_raise, **kwargs)
        for directory, dirs, files in walked:
            if topdown and self.reachable is not None:  # pruned in place: fsspec recurses over it
                for name in [n for n in dirs if not self.reachable(f"{directory}/{n}")]:
                    dirs.pop(name) if isinstance(dirs, dict) else dirs.remove(name)
            yield directory, dirs, files


class _Reachable:
    """Whether the pattern can match below a directory: each of its path components matches
    the pattern's component at that depth (``fnmatch``, case-sensitive; kept without a test
    from a ``**`` or a ``[`` class on, where the two might read the pattern differently)."""

    def __init__(self, pattern: str, root: str) -> None:
        self.root = root
        self.parts = pattern[len(root) :].strip("/").split("/")

    def __call__(self, directory: str) -> bool:
        if not directory.startswith(self.root):
            return True
        for depth, name in enumerate(directory[len(self.root) :].strip("/").split("/")):
            if depth >= len(self.parts) or "**" in self.parts[depth] or "[" in self.parts[depth]:
                return True
            if not fnmatchcase(name, self.parts[depth]):
                return False
        return True


def _raise(exc: OSError) -> None:
    if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        raise exc


def glob_local(path: str) -> dict[str, dict[str, Any]]:
    """``path``'s matches by fsspec's glob rules, with their details; raises the ``OSError`` of
    a directory it cannot read that the pattern can reach."""
    fs = _ReadEveryDirectory()
    pattern = fs._strip_protocol(path)
    root = glob_root(pattern)
    if root is not None:
        fs.reachable = _Reachable(pattern, root)
    return fs.glob(path, detail=True)
