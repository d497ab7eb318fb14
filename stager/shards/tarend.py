"""What ends a tar archive, and what may follow its end.

``tarfile`` (and GNU tar, and webdataset) stop at the first zero block, as if the archive had
ended there. A damaged header, a file cut at a member boundary, two tars joined with ``cat``
and a header zeroed inside an archive all end it early, and every sample after that point is
lost without a word. The indexers (:mod:`stager.shards.tarindex`) therefore check where
``tarfile`` stopped: :func:`check_end`, a real end-of-archive block there; :func:`check_after_end`,
no header after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from stager.errors import IntegrityError
from stager.shards.tarheader import BLOCK

__all__ = ["RESTAGE_HELPS", "check_end", "check_after_end", "zeros_from"]

#: When re-staging helps: every copy is checked against its source as it is made, so a shard
#: found corrupt is corrupt at its source unless the staged copy was changed afterwards.
RESTAGE_HELPS = "re-staging it helps only where the staged copy was changed after staging"


def check_end(
    tail: bytes, where: str, offset: int, last_name: str, compressed: bool = False
) -> None:
    """Raise unless ``tail`` (the bytes where tarfile stopped) is an end-of-archive zero block.
    ``compressed``: the tar was read out of a gzip stream (``offset`` is in the tar)."""
    if len(tail) < BLOCK:
        # A cut at a member boundary and a tar its writer never closed look the same. Staging
        # cannot cause it (every copy is checked against its source), so "re-stage" never
        # helps: say what can. Zeros appended to a gzip file would only corrupt it.
        append = (
            "decompress the source shard, append them (head -c 1024 /dev/zero >> SHARD.tar) "
            "and compress it again"
            if compressed
            else "append them to the source shard (head -c 1024 /dev/zero >> SHARD)"
        )
        raise IntegrityError(
            f"{where}: ends after member {last_name!r} at byte {offset} without the "
            "end-of-archive blocks (cut there, losing any later samples, or never closed by "
            f"its writer); re-create the shard, or if it is whole, {append}, re-run stager "
            "index where a manifest lists it, and stage it again"
        )
    if any(tail[:BLOCK]):
        raise IntegrityError(
            f"{where}: corrupt tar header at byte {offset}, after member {last_name!r}; "
            f"re-create this shard ({RESTAGE_HELPS})"
        )


def check_after_end(chunks: Iterable[bytes], where: str, offset: int, last_name: str) -> None:
    """Raise where a tar header follows the end-of-archive block at ``offset``; ``chunks``: the
    bytes from there to the end of the file, in order.

    tar, tarfile and webdataset all stop at the first zero block: the samples of a second tar
    joined after the first (``cat a.tar b.tar``), or those after a header zeroed inside the
    archive, would be lost with no word. Bytes after the end that are no header (a writer's
    padding, or junk) lose nothing and are let be.
    """
    import tarfile

    at, pending = offset, b""
    for chunk in chunks:
        data = pending + chunk
        whole = len(data) - len(data) % BLOCK
        if data.count(0, 0, whole) != whole:  # (zeros, nearly always: one C pass)
            for start in range(0, whole, BLOCK):
                block = data[start : start + BLOCK]
                if block.count(0) == BLOCK:
                    continue
                try:
                    found = tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
                except tarfile.HeaderError:
                    continue
                raise IntegrityError(
                    f"{where}: a tar header ({found.name!r}) at byte {at + start}, after the "
                    f"end-of-archive block at byte {offset} that follows member {last_name!r}: "
                    "tar, tarfile and webdataset stop at that block, so the samples after it "
                    "would be lost. Two tars joined with cat, or a header zeroed inside the "
                    "archive? Re-create this shard (tar --concatenate joins tars)"
                )
        at += whole
        pending = data[whole:]


def zeros_from(read_at: Callable[[int, int], bytes], offset: int) -> bool:
    """Whether every byte from ``offset`` to the end is zero: what a fast indexer must see after
    the end-of-archive block to vouch for a tar (anything else is left to :func:`check_after_end`,
    on the tarfile path, which says whether it is a header and where)."""
    while chunk := read_at(offset, 1 << 16):
        if chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True
