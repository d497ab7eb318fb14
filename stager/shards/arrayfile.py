"""One file of named numpy arrays, written atomically and memory-mapped when read.

Why not ``np.savez``/``np.load``: ``np.load`` of an ``.npz`` reads every array into the memory of
the process that loads it, so eight ranks on a node held eight copies of a per-sample index
(at 2e9 samples, tens of GB each), and every forked worker touched its copy. Mapped read-only
from one file, the arrays live once, in the page cache of the node, shared by every rank and
worker; a process pays (in RSS/PSS) only for the pages it reads.

Layout: ``MAGIC`` (8 bytes); each array's bytes at a 64-byte aligned offset; a JSON footer
(``{"meta": {...}, "arrays": {name: {"dtype", "shape", "offset"}}}``); the footer's length (8
bytes, little endian) last, so the arrays can be streamed out before their table is known.
Written to ``<name>.<pid>.partial`` and renamed over the final name, so a file with the final
name is always whole; concurrent writers of the same content are harmless (the last rename
wins, and a reader keeps whichever file it mapped). Writing needs no numpy (a
:class:`RawArray` is a column's bytes with its numpy type string: stage-in writes the loader
index without importing numpy); mapping makes numpy arrays. No torch.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.layout import PARTIAL_SUFFIX
from stager.storage.paths import discard

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MAGIC", "RawArray", "write_arrays", "map_arrays"]


@dataclass(frozen=True)
class RawArray:
    """A one-dimensional column as bytes, with its numpy type string (``"<u4"``, ``"|S12"``):
    what :func:`write_arrays` stores without numpy."""

    dtype: str
    data: bytes

    @property
    def shape(self) -> tuple[int, ...]:
        width = int(self.dtype[2:])
        return (len(self.data) // width,)


MAGIC = b"STGARR01"
_ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def write_arrays(
    path: Path, arrays: Mapping[str, np.ndarray | RawArray], meta: Mapping[str, Any]
) -> None:
    """Publish ``arrays`` and ``meta`` (JSON-able) at ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    table: dict[str, dict[str, Any]] = {}
    try:
        with open(tmp, "wb") as handle:
            handle.write(MAGIC)
            for name, array in arrays.items():
                offset = _aligned(handle.tell())
                handle.write(b"\0" * (offset - handle.tell()))
                if isinstance(array, RawArray):
                    handle.write(array.data)
                    dtype = array.dtype
                else:
                    import numpy as np

                    handle.write(np.ascontiguousarray(array).data)
                    dtype = array.dtype.str
                table[name] = {
                    "dtype": dtype,
                    "shape": list(array.shape),
                    "offset": offset,
                }
            footer = json.dumps({"meta": dict(meta), "arrays": table}).encode()
            handle.write(footer + len(footer).to_bytes(8, "little"))
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)  # a full scratch must not keep half an index either
        raise


def map_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of ``path`` as read-only views of one shared mapping, and its ``meta``.

    Raises ``ValueError`` for a file that is not one of ours or is cut short, ``OSError`` when
    it cannot be read.
    """
    import numpy as np

    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < len(MAGIC) + 8 or handle.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not an array file (bad magic or cut short)")
        handle.seek(size - 8)
        footer_len = int.from_bytes(handle.read(8), "little")
        if footer_len > size - len(MAGIC) - 8:
            raise ValueError(f"{path}: footer length {footer_len} does not fit; cut short?")
        handle.seek(size - 8 - footer_len)
        header = json.loads(handle.read(footer_len))
        # the mapping keeps its own reference to the file; the descriptor can close
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    arrays: dict[str, np.ndarray] = {}
    for name, entry in header["arrays"].items():
        dtype = np.dtype(entry["dtype"])
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if entry["offset"] + count * dtype.itemsize > size - 8 - footer_len:
            raise ValueError(f"{path}: array {name!r} runs past the end of the file")
        array = np.frombuffer(mapped, dtype=dtype, count=count, offset=entry["offset"])
        arrays[name] = array.reshape(shape)
    return arrays, header["meta"]
