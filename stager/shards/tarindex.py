"""Where every sample's members sit inside an uncompressed tar shard.

Local, staged shards allow random access, so reading a sample is one ``pread`` per member once
its offset is known. This module walks the tar headers once (Python's ``tarfile`` handles
ustar, GNU long names and PAX headers; the payloads are seeked over, never read) and groups
members into samples the way WebDataset does: the key is the path up to the first dot of the
file name, the extension is the rest.

Compressed shards (``.tgz``/``.tar.gz``) cannot be indexed by offset; :func:`count_samples`
still counts their samples by streaming them once, and :func:`count_samples_stream` does the
same for any readable stream (a remote shard being indexed).

``tarfile`` stops *silently* at a damaged header or a file cut at a member boundary, as if the
archive had ended there. Both readers therefore check that the archive really ends with a
zero block where ``tarfile`` stopped; otherwise they raise :class:`IntegrityError` naming the
shard and the last good member, so a bad shard never turns into silently missing samples.
"""

from __future__ import annotations

import gzip
import os
import re
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from stager.errors import IntegrityError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "TarIndex",
    "index_tar",
    "count_samples",
    "count_samples_stream",
    "split_key",
    "is_compressed",
]

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
        raise IntegrityError(
            f"{path}: not a readable tar ({exc}); re-stage or re-create this shard"
        ) from exc


def _check_end(tail: bytes, where: str, offset: int, last_name: str) -> None:
    """Raise unless ``tail`` (the bytes where tarfile stopped) is an end-of-archive zero block."""
    if len(tail) < tarfile.BLOCKSIZE:
        raise IntegrityError(
            f"{where}: truncated after member {last_name!r} (no end-of-archive block at byte {offset}); "
            "re-stage or re-create this shard"
        )
    if any(tail[: tarfile.BLOCKSIZE]):
        raise IntegrityError(
            f"{where}: corrupt tar header at byte {offset}, after member {last_name!r}; "
            "re-stage or re-create this shard"
        )


#: Shards up to this size are read whole by the fast indexer (one read); larger ones are walked
#: header by header, seeking over the payloads.
WHOLE_READ_BYTES = 1 << 20
_WALK_READ_BYTES = 64 << 10


def _index_fast(path: Path) -> TarIndex | None:
    """The index from stage-in's stream parser (:class:`stager.shards.tarparse.TarSampleCounter`), or
    None for anything it does not vouch for, which :func:`index_tar` then leaves to ``tarfile``.

    Why: ``tarfile`` builds a ``TarInfo`` per member and costs ~0.35 ms per small shard; this
    costs ~0.1 ms, which is seconds before the first batch of a 10,000-shard dataset.
    """
    from stager.shards.tarparse import TarSampleCounter  # tarcount imports this module

    counter = TarSampleCounter()
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        if os.fstat(fd).st_size <= WHOLE_READ_BYTES:
            counter.feed(handle.readall())
        else:
            offset = 0
            while not counter.finished:
                offset += counter.skip_ahead()
                chunk = os.pread(fd, _WALK_READ_BYTES, offset)
                if not chunk:
                    break
                counter.feed(chunk)
                offset += len(chunk)
    return counter.index()


def index_tar(path: str | Path) -> TarIndex:
    """Walk the headers of an uncompressed tar and return the offsets of its samples.

    Raises :class:`IntegrityError` naming the shard and the member for a truncated or corrupt
    tar, so a bad shard never turns into silently missing samples.
    """
    path = Path(path)
    if is_compressed(path):
        raise IntegrityError(f"{path}: compressed shards cannot be indexed; stream them instead")
    try:
        fast = _index_fast(path)
    except OSError:
        fast = None  # tarfile's open below reports it with the shard's name
    if fast is not None:
        return fast
    return _index_tarfile(path)


def _index_tarfile(path: Path) -> TarIndex:
    """:func:`index_tar` by ``tarfile``: slower, but it names the member where a tar breaks."""
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
        tar.fileobj.seek(tar.offset)
        _check_end(tar.fileobj.read(tarfile.BLOCKSIZE), str(path), tar.offset, last_name)
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
    if not is_compressed(path):
        return index_tar(path).num_samples
    with open(path, "rb") as handle:
        return count_samples_stream(handle, str(path), compressed=True)


class _TailReader:
    """A read-only stream that remembers its position and the last bytes it returned.

    ``tarfile`` in stream mode cannot seek back to the block where it stopped; this keeps the
    recent bytes so :func:`_check_end` can look at them after the fact.
    """

    _KEEP = 1 << 16

    def __init__(self, raw: BinaryIO):
        self._raw = raw
        self.pos = 0
        self._recent = b""

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.pos += len(data)
        self._recent = (self._recent + data)[-self._KEEP :]
        return data

    def bytes_from(self, offset: int, count: int) -> bytes:
        """Up to ``count`` bytes starting at absolute ``offset``, reading ahead if needed."""
        while self.pos < offset + count and self.read(count):
            pass
        start = offset - (self.pos - len(self._recent))
        if start < 0:
            raise IntegrityError(
                f"cannot re-read byte {offset} of the tar stream"
            )  # never with tarfile's buffers
        return self._recent[start : start + count]


def count_samples_stream(stream: BinaryIO, name: str, *, compressed: bool = False) -> int:
    """Count the samples of a tar read sequentially from ``stream``, to its very end.

    The whole stream is consumed (a caller hashing the bytes as they pass gets the full
    file's hash), and for gzip the trailer's CRC is checked. Corruption raises
    :class:`IntegrityError` naming ``name`` and the member; I/O errors of ``stream`` propagate
    unchanged so the caller can retry them.
    """
    source: BinaryIO = gzip.GzipFile(fileobj=stream, mode="rb") if compressed else stream  # type: ignore[assignment]
    reader = _TailReader(source)
    count, last_key, last_name = 0, None, "<start of archive>"
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:  # type: ignore[call-overload]
            for info in tar:
                last_name = info.name
                parts = split_key(info.name) if info.isfile() else None
                if parts and parts[0] != last_key:
                    count += 1
                    last_key = parts[0]
            _check_end(
                reader.bytes_from(tar.offset, tarfile.BLOCKSIZE), name, tar.offset, last_name
            )
            while reader.read(1 << 20):
                pass  # the padding, and for gzip the trailer whose CRC is checked on the way
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise IntegrityError(
            f"{name}: corrupt or truncated tar after member {last_name!r} ({exc}); re-create this shard"
        ) from exc
    return count
