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
zero block where ``tarfile`` stopped, and that no header follows it
(:mod:`stager.shards.tarend`); otherwise they raise :class:`IntegrityError` naming the shard and
the last good member, so a bad shard never turns into silently missing samples.
"""

from __future__ import annotations

import itertools
import mmap
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from stager.errors import IntegrityError, SourceError
from stager.shards.members import (
    SampleGrouper,
    SampleRuns,
    TarIndex,
    any_compressed,
    duplicate_member,
    grouping_problem,
    is_compressed,
    repeated_member,
    split_key,
    split_message,
)
from stager.shards.tarend import RESTAGE_HELPS, check_after_end, check_end
from stager.shards.tarheader import BLOCK

if TYPE_CHECKING:
    import tarfile

__all__ = [
    "duplicate_member",
    "grouping_problem",
    "repeated_member",
    "TarIndex",
    "index_tar",
    "count_samples",
    "count_samples_stream",
    "split_key",
    "is_compressed",
    "any_compressed",
    "RESTAGE_HELPS",
]


def _open_tar(path: Path, mode: str, fileobj: BinaryIO | None = None) -> tarfile.TarFile:
    import tarfile  # (with gzip, ~6 ms of every stage-in's start: only a tar in doubt needs it)

    try:
        if fileobj is not None:
            return tarfile.open(fileobj=fileobj, mode=mode)  # type: ignore[call-overload]  # noqa: SIM115
        return tarfile.open(path, mode)  # type: ignore[call-overload]  # noqa: SIM115 - closed by the caller
    except PermissionError as exc:  # not the shard's bytes: "re-create this shard" misled
        raise SourceError(
            f"{path}: not readable (permission denied); check its mode and owner"
        ) from exc
    except (tarfile.TarError, EOFError, OSError, UnicodeError) as exc:
        raise IntegrityError(
            f"{path}: not a readable tar ({exc}){_what_it_is(path, fileobj)}"
        ) from exc


def _what_it_is(path: Path, fileobj: BinaryIO | None) -> str:
    """What to do about a file that is not a tar: a compressed tar under a plain ``.tar`` name
    is said as such (webdataset reads it by its bytes, the loader by offset into plain tars)."""
    try:
        if fileobj is not None:
            fileobj.seek(0)
            head = fileobj.read(6)
        else:
            with open(path, "rb") as handle:
                head = handle.read(6)
    except OSError:
        head = b""
    if head.startswith(b"\x1f\x8b"):
        return "; it is gzip-compressed: name it *.tar.gz (read as a stream) or decompress it"
    for magic, kind in _COMPRESSED:
        if head.startswith(magic):
            return f"; it is {kind}-compressed: decompress it (shards are .tar or .tar.gz)"
    return f"; re-create this shard ({RESTAGE_HELPS})"


_COMPRESSED = ((b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


#: Shards up to this size are read whole by the fast indexer (one read); larger ones are mapped,
#: or walked header by header where their members are large.
WHOLE_READ_BYTES = 1 << 20
#: Walking headers one ``pread`` at a time beats mapping and scanning every block only where
#: members are large: then the walk reads a few KB where a scan would read (from a cold disk)
#: the whole shard. Past ``_WALK_PROBE`` headers, a walk that averaged less than this many bytes
#: per member stops, and the shard is scanned instead.
_WALK_MIN_STRIDE = 32 << 10
_WALK_PROBE = 64


def _index_fast(path: Path) -> TarIndex | None:
    """The index from the small-shard walk (:mod:`stager.shards.tarwalk`) or the vectorised
    scanner (:mod:`stager.shards.tarscan`), or None for anything neither vouches for, which
    :func:`index_tar` then leaves to ``tarfile``.

    Why: ``tarfile`` builds a ``TarInfo`` per member (~0.35 ms per small shard, ~60 us per
    member). The walk costs a few microseconds per header, the scanner ~0.7 ms per shard but
    no Python per member; the walk goes first and hands over past a few dozen headers. On
    shards of large samples both read only the headers.
    """
    from stager.shards.tarnative import walk_bytes  # the compiled walk, where it was built
    from stager.shards.tarscan import TarScanner, scan_tar  # numpy: imported on first use
    from stager.shards.tarwalk import walk_index

    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        size = os.fstat(fd).st_size
        if size <= WHOLE_READ_BYTES:
            data = handle.readall()
            return walk_bytes(data) or walk_index(data) or scan_tar(data)

        def read_at(offset: int, nbytes: int) -> bytes:
            return os.pread(fd, nbytes, offset)

        walked = walk_index(read_at)
        if walked is not None:
            return walked
        headers = _walk_headers(read_at, size)
        if headers is not None:
            scanner = TarScanner()
            scanner.feed_headers(*headers)
            return scanner.finish(read_at)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
            # small members: the compiled walk reads the headers where they lie, in place
            return walk_bytes(mapped) or scan_tar(mapped)  # type: ignore[arg-type]


def _walk_headers(read_at, size: int):
    """Header blocks and their block numbers, found by following the sizes from block 0; None
    once the members turn out small (then scanning every block is cheaper than a read each).

    The walk only chooses which blocks the scanner sees; the scanner checks them exactly, and
    a walk misled by an odd header ends in a chain the scanner does not vouch for.
    """
    import numpy as np

    headers: list[bytes] = []
    numbers: list[int] = []
    offset = 0
    while offset + BLOCK <= size:
        header = read_at(offset, BLOCK)
        if len(header) < BLOCK or not any(header):
            break
        headers.append(header)
        numbers.append(offset // BLOCK)
        kind = header[156:157]
        skips = kind in (b"0", b"\0", b"7", b"x", b"X", b"L", b"K")
        if kind == b"\0" and header[:100].split(b"\0", 1)[0].endswith(b"/"):
            skips = False  # tarfile reads it as a directory
        payload = _walk_size(header[124:136]) if skips else 0
        if payload is None:
            break
        offset += BLOCK + -(-payload // BLOCK) * BLOCK
        if len(headers) == _WALK_PROBE and offset < _WALK_PROBE * _WALK_MIN_STRIDE:
            return None
    blocks = np.frombuffer(b"".join(headers), dtype=np.uint8).reshape(-1, BLOCK)
    return blocks, np.asarray(numbers, dtype=np.int64)


def _walk_size(field: bytes) -> int | None:
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


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
    return index_with_tarfile(path)


def index_with_tarfile(path: Path, fileobj: BinaryIO | None = None) -> TarIndex:
    """:func:`index_tar` by ``tarfile``: slower, but it names the member where a tar breaks.

    ``fileobj``: read the tar from it (seekable) rather than from ``path``, which then only
    names the shard in errors (stage-in indexes a copy before it has its final name).
    """
    if fileobj is None:
        file_size = path.stat().st_size
    else:
        file_size = fileobj.seek(0, os.SEEK_END)
        fileobj.seek(0)
    import tarfile

    samples = SampleGrouper()
    last_name = "<start of archive>"
    with _open_tar(path, "r:", fileobj) as tar:
        try:
            for info in tar:
                last_name = info.name
                if not info.isfile():
                    continue
                if info.issparse():  # (its size is the expanded one, not the stored bytes)
                    raise _sparse_member(str(path), info.name)
                if info.offset_data + info.size > file_size:
                    raise IntegrityError(
                        f"{path}: member {info.name!r} is truncated "
                        f"(needs {info.offset_data + info.size} bytes, file has {file_size})"
                    )
                samples.add(info.name, info.offset_data, info.size)
        except (tarfile.TarError, EOFError, UnicodeError) as exc:  # (a PAX hdrcharset)
            raise IntegrityError(
                f"{path}: corrupt tar header after member {last_name!r} ({exc}); "
                f"re-create this shard ({RESTAGE_HELPS}), or pass on_error='skip' to the loader"
            ) from exc
        tar.fileobj.seek(tar.offset)
        check_end(tar.fileobj.read(BLOCK), str(path), tar.offset, last_name)
        tar.fileobj.seek(tar.offset)
        rest = iter(lambda: tar.fileobj.read(1 << 16), b"")
        check_after_end(rest, str(path), tar.offset, last_name)
    return samples.index()


def count_samples(path: str | Path) -> int:
    """Number of samples in a shard, compressed or not; :class:`IntegrityError` for a member
    twice in one sample (as :func:`count_samples_stream`: the loader refuses such a shard)."""
    path = Path(path)
    if not is_compressed(path):
        index = index_tar(path)
        problem = grouping_problem(index)
        if problem is not None:
            raise IntegrityError(f"{path}: {problem}")
        return index.num_samples
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


def _sparse_member(shard: str, member: str) -> IntegrityError:
    return IntegrityError(
        f"{shard}: member {member!r} is a sparse file (tar --sparse): its bytes are not stored "
        "in one piece, which the loader reads by offset; re-create the shard without --sparse"
    )


def _end_sample(runs: SampleRuns, key: str | None, exts: set[str], name: str) -> None:
    """Refuse a sample whose members lie apart (:func:`stager.shards.members.split_message`)."""
    if key is not None and runs.apart(key, exts):
        raise IntegrityError(f"{name}: {split_message(key)}")


def count_samples_stream(stream: BinaryIO, name: str, *, compressed: bool = False) -> int:
    """Count the samples of a tar read sequentially from ``stream``, to its very end.

    The whole stream is consumed (a caller hashing the bytes as they pass gets the full
    file's hash), and for gzip the trailer's CRC is checked. Corruption raises
    :class:`IntegrityError` naming ``name`` and the member; I/O errors of ``stream`` propagate
    unchanged so the caller can retry them.
    """
    import gzip
    import tarfile

    source: BinaryIO = gzip.GzipFile(fileobj=stream, mode="rb") if compressed else stream  # type: ignore[assignment]
    reader = _TailReader(source)
    count, last_key, last_name = 0, None, "<start of archive>"
    tar_ended = False  # (bytes after it that are no gzip: said as such, not "truncated")
    exts: set[str] = set()  # the current sample's, to refuse a member twice (as the loader)
    runs = SampleRuns()
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:  # type: ignore[call-overload]
            for info in tar:
                last_name = info.name
                if not compressed and info.issparse():  # (as the loader's index refuses it)
                    raise _sparse_member(name, info.name)
                parts = split_key(info.name) if info.isfile() else None
                if parts and parts[0] != last_key:
                    _end_sample(runs, last_key, exts, name)
                    count += 1
                    last_key = parts[0]
                    exts = set()
                if parts:
                    if parts[1] in exts:
                        twice = f"{parts[0]}.{parts[1]}"
                        raise IntegrityError(f"{name}: {repeated_member(twice)}")
                    exts.add(parts[1])
            _end_sample(runs, last_key, exts, name)
            tail = reader.bytes_from(tar.offset, BLOCK)
            check_end(tail, name, tar.offset, last_name, compressed)
            tar_ended = True
            # the rest: the padding, and for gzip the trailer whose CRC is checked on the way
            read = reader.bytes_from(tar.offset, reader.pos - tar.offset)
            rest = itertools.chain([read], iter(lambda: reader.read(1 << 20), b""))
            check_after_end(rest, name, tar.offset, last_name)
    except gzip.BadGzipFile as exc:
        if reader.pos == 0:  # not gzip from its first bytes: a plain tar under a .tgz name?
            raise IntegrityError(
                f"{name}: not gzip-compressed ({exc}), though named so: if it is a plain tar, "
                "name it *.tar (shards are read by their suffixes), else re-create this shard"
            ) from exc
        if tar_ended:
            raise IntegrityError(
                f"{name}: bytes after the end of its gzip stream that are not gzip ({exc}): the "
                "tar inside is whole, but something was appended to the file; re-create this "
                "shard, or cut the bytes after the gzip stream"
            ) from exc
        raise IntegrityError(
            f"{name}: corrupt or truncated tar after member {last_name!r} ({exc}); "
            "re-create this shard"
        ) from exc
    except (tarfile.TarError, EOFError, UnicodeError, zlib.error) as exc:
        raise IntegrityError(
            f"{name}: corrupt or truncated tar after member {last_name!r} ({exc}); "
            "re-create this shard"
        ) from exc
    return count
