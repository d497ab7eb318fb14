"""Where every sample's members sit inside an uncompressed tar shard.

Local, staged shards allow random access, so reading a sample is one ``pread`` per member once
its offset is known. This module walks the tar headers once (Python's ``tarfile`` handles
ustar, GNU long names and PAX headers; the payloads are seeked over, never read) and groups
members into samples the way WebDataset does: the key is the path up to the first dot of the
file name, the extension is the rest.

Compressed shards (``.tgz``/``.tar.gz``) cannot be indexed by offset; :func:`count_samples`
still counts their samples by streaming them once.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["TarIndex", "index_tar", "count_samples", "split_key", "is_compressed"]

_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


def split_key(member_name: str) -> tuple[str, str] | None:
    """``"a/b/000012.jpg"`` -> ``("a/b/000012", "jpg")``; None for names without an extension."""
    match = _KEY_EXT.match(member_name)
    if not match:
        return None
    return match.group(1), match.group(2)


def is_compressed(path: str | Path) -> bool:
    """True for gzip-compressed shards, which are streamed rather than indexed."""
    name = str(path)
    return name.endswith(".tgz") or name.endswith(".tar.gz")


@dataclass(frozen=True)
class TarIndex:
    """Offsets of every sample member of one shard.

    Sample ``i`` owns members ``member_start[i]:member_start[i + 1]``; member ``j`` has the
    extension ``exts[j]`` and its payload is ``sizes[j]`` bytes at byte ``offsets[j]``.
    """

    keys: list[str]
    member_start: np.ndarray  # int64, len(keys) + 1
    exts: list[str]
    offsets: np.ndarray  # int64, one per member
    sizes: np.ndarray  # int64, one per member

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    def members(self, sample: int) -> list[tuple[str, int, int]]:
        """``(ext, offset, size)`` of each member of sample number ``sample``."""
        lo, hi = int(self.member_start[sample]), int(self.member_start[sample + 1])
        return [(self.exts[j], int(self.offsets[j]), int(self.sizes[j])) for j in range(lo, hi)]


def _open_tar(path: Path, mode: str) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode)  # noqa: SIM115 - closed by the caller's with
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise IntegrityError(f"{path}: not a readable tar ({exc}); re-stage or re-create this shard") from exc


def index_tar(path: str | Path) -> TarIndex:
    """Walk the headers of an uncompressed tar and return the offsets of its samples.

    Raises :class:`IntegrityError` naming the shard and the member for a truncated or corrupt
    tar, so a bad shard never turns into silently missing samples.
    """
    path = Path(path)
    if is_compressed(path):
        raise IntegrityError(f"{path}: compressed shards cannot be indexed; stream them instead")
    file_size = path.stat().st_size
    keys: list[str] = []
    starts: list[int] = []
    exts: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    last_name = "<start of archive>"
    with _open_tar(path, "r:") as tar:
        try:
            for info in tar:
                last_name = info.name
                if not info.isfile():
                    continue
                if info.offset_data + info.size > file_size:
                    raise IntegrityError(
                        f"{path}: member {info.name!r} is truncated "
                        f"(needs {info.offset_data + info.size} bytes, file has {file_size})"
                    )
                parts = split_key(info.name)
                if parts is None:
                    continue
                key, ext = parts
                if not keys or keys[-1] != key:
                    keys.append(key)
                    starts.append(len(exts))
                exts.append(ext)
                offsets.append(info.offset_data)
                sizes.append(info.size)
        except (tarfile.TarError, EOFError) as exc:
            raise IntegrityError(
                f"{path}: corrupt tar header after member {last_name!r} ({exc}); "
                "re-stage this shard or pass on_error='skip'"
            ) from exc
    starts.append(len(exts))
    import numpy as np  # deferred: stage-in's start-up should not pay for numpy

    return TarIndex(
        keys=keys,
        member_start=np.asarray(starts, dtype=np.int64),
        exts=exts,
        offsets=np.asarray(offsets, dtype=np.int64),
        sizes=np.asarray(sizes, dtype=np.int64),
    )


def count_samples(path: str | Path) -> int:
    """Number of samples in a shard, compressed or not."""
    path = Path(path)
    mode = "r|gz" if is_compressed(path) else "r:"
    count, last_key, last_name = 0, None, "<start of archive>"
    file_size = path.stat().st_size
    with _open_tar(path, mode) as tar:
        try:
            for info in tar:
                last_name = info.name
                if mode == "r:" and info.offset_data + info.size > file_size:
                    raise IntegrityError(f"{path}: member {info.name!r} is truncated")
                parts = split_key(info.name) if info.isfile() else None
                if parts and parts[0] != last_key:
                    count += 1
                    last_key = parts[0]
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise IntegrityError(f"{path}: corrupt or truncated after member {last_name!r} ({exc})") from exc
    return count
