"""The header an owner broadcasts before each shard's bytes: a status, the size, and the hash
(or, where the owner has no copy to send, why), in one fixed-size block every node receives.
"""

from __future__ import annotations

import struct

__all__ = [
    "HEADER_BYTES",
    "OK",
    "FAILED",
    "CORRUPT",
    "OWNER_SCRATCH",
    "status_of",
    "encode",
    "decode",
]

HEADER_BYTES = 512
_HEADER = struct.Struct("<qqH")
#: sent / unreadable at the source / failed its check / the owner's own scratch failed (each
#: receiver then reads that shard from the source itself: the source is fine)
OK, FAILED, CORRUPT, OWNER_SCRATCH = 0, 1, 2, 3


def status_of(kind: str) -> int:
    """The status an owner sends for a shard that failed with a failure of ``kind``
    (:func:`stager.errors.failure_kind`): its own scratch's (``dest``, ``full``), so the others
    read it from the source; corrupt; else unreadable at the source."""
    return {"dest": OWNER_SCRATCH, "full": OWNER_SCRATCH, "corrupt": CORRUPT}.get(kind, FAILED)


def encode(status: int, size: int, text: str) -> bytes:
    payload = text.encode("utf-8", "replace")[: HEADER_BYTES - _HEADER.size]
    return (_HEADER.pack(status, size, len(payload)) + payload).ljust(HEADER_BYTES, b"\0")


def decode(raw: bytes) -> tuple[int, int, str]:
    status, size, length = _HEADER.unpack_from(raw)
    return status, size, raw[_HEADER.size : _HEADER.size + length].decode("utf-8", "replace")
