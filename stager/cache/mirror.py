"""A directory's files hard-linked (else copied) to the same places under another: how the
node cache keeps a staged copy's loader index (and the manifest's columns) for the next job,
and gives them back to it (:meth:`stager.cache.store.ShardCache.keep_index`). Best effort:
what cannot be linked or copied is left, the loader then builds it again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stager.layout import PARTIAL_SUFFIX
from stager.storage.paths import discard

__all__ = ["mirror_files"]


def mirror_files(src_dir: Path, dst_dir: Path, *, replace: bool) -> None:
    """Hard-link (else copy) every file under ``src_dir`` to the same place under ``dst_dir``."""
    try:
        files = [p for p in src_dir.rglob("*") if p.is_file() and PARTIAL_SUFFIX not in p.name]
    except OSError:
        return
    for path in files:
        target = dst_dir / path.relative_to(src_dir)
        if not replace and target.exists():
            continue
        tmp = target.with_name(f"{target.name}.{os.getpid()}{PARTIAL_SUFFIX}")
        try:
            if _same_file(path, target):
                continue  # (a copy made from the cache links its index: the cache's own file)
            target.parent.mkdir(parents=True, exist_ok=True)
            discard(tmp)
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        except OSError:
            pass  # best effort (keep_index)
        finally:
            # rename() of one link of a file over another of the same file does nothing and
            # leaves both names (another job linked the same file there meanwhile)
            discard(tmp)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
