"""fsspec's glob of a local path, except that a directory it cannot read is an error.

fsspec's walk leaves out a directory whose listing fails, as if it held nothing, and passes its
``on_error`` to the top directory's listing only. A glob source with a subdirectory without
read permission (``/data/*/train-*.tar``) so lost that directory's shards, and stage-in ended
with exit 0 on a partial dataset. Here the walk raises the listing's ``OSError`` at every
depth; a directory gone meanwhile still matches nothing, as before. Imported only for a glob:
fsspec's import is not free.
"""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem

__all__ = ["glob_local"]


class _ReadEveryDirectory(LocalFileSystem):
    cachable = False  # (fsspec caches instances per class and arguments: none needed here)

    def walk(
        self, path: str, maxdepth: int | None = None, topdown: bool = True, **kwargs: Any
    ) -> Any:
        kwargs.pop("on_error", None)  # (every level's, including those fsspec recurses into)
        return super().walk(path, maxdepth=maxdepth, topdown=topdown, on_error=_raise, **kwargs)


def _raise(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc


def glob_local(path: str) -> dict[str, dict[str, Any]]:
    """``path``'s matches by fsspec's glob rules, with their details; raises the ``OSError`` of
    a directory it cannot read."""
    return _ReadEveryDirectory().glob(path, detail=True)
