"""Random trees for the property tests of the local walk and of stage-in: shards, garbage
named like shards, directories named like shards, FIFOs, symlink loops, links to a shard
outside the tree and names that are not UTF-8."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path


def tar_bytes(members: list[tuple[str, bytes]], tar_format: int = tarfile.USTAR_FORMAT) -> bytes:
    """A tar of ``(name, data)`` regular files, in order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tar_format) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def v7_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """:func:`tar_bytes` in the old v7 format: no ``ustar`` magic in any header (GNU tar
    ``--format=v7``), each header's checksum made again."""
    data = bytearray(tar_bytes(members))
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        offsets = [info.offset for info in tar.getmembers()]
    for at in offsets:
        header = data[at : at + 512]
        header[257:265] = bytes(8)  # magic and version
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        data[at : at + 512] = header
    return bytes(data)


def build_tree(
    root: Path, entries: list[tuple[list[str], str, str]], shard: Path | None = None
) -> None:
    """Create ``entries`` (``(directories, name, kind)``) under ``root``; an entry whose path
    is taken already (or lies under a file) is skipped.

    Kinds: ``shard`` (``shard``'s bytes), ``file`` (one byte), ``garbage`` (not a tar), ``dir``,
    ``fifo``, ``loop`` (a symlink to ``root``: a loop, if it were followed), ``link`` (a
    symlink to ``shard``, outside the tree), ``bad name`` (``shard``'s bytes under the name
    with a byte that is not UTF-8 before it).
    """
    template = shard.read_bytes() if shard is not None else b""
    root.mkdir(parents=True, exist_ok=True)
    for parts, name, kind in entries:
        path = root.joinpath(*parts, name)
        if os.path.lexists(path):
            continue  # taken already: writing to a FIFO there would block forever
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "dir":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "loop":
                path.symlink_to(root, target_is_directory=True)
            elif kind == "link":
                assert shard is not None
                path.symlink_to(shard)
            elif kind == "bad name":
                with open(os.fsencode(path.parent) + b"/\xff" + os.fsencode(name), "wb") as out:
                    out.write(template)
            elif kind == "file":
                path.write_bytes(b"x")
            else:
                path.write_bytes(template if kind == "shard" else b"not a tar" * 70)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            continue
