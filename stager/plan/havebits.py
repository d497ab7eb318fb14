"""Which node holds which shard, packed as the fan-out's handshake all-gathers it.

The matrix is nodes x shards: 512 nodes x 1e6 shards is 64 MB of bits, where a list of bools
per node was 4 GB and minutes of Python on every node before any byte moved. So it stays
packed, and readers unpack a bounded block at a time (:data:`UNPACK_BYTES`): nothing here
grows with nodes x shards beyond the bits themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["UNPACK_BYTES", "HaveBits"]

#: Most bytes of unpacked bits (one per (node, shard) pair) held at once.
UNPACK_BYTES = 1 << 23


class HaveBits:
    """One row per node, 8 shards a byte in ``numpy.packbits`` order; bits past ``count`` (the
    handshake's padding byte) are no shard's."""

    __slots__ = ("bits", "count")

    def __init__(self, bits: npt.NDArray[np.uint8], count: int) -> None:
        if bits.ndim != 2 or bits.dtype != np.uint8 or bits.shape[0] < 1:
            raise ValueError("have-bits are a 2-D uint8 array with one row per node")
        if count < 0 or bits.shape[1] * 8 < count:
            raise ValueError("every node's have-bits must cover every shard")
        self.bits = bits
        self.count = count

    @classmethod
    def from_lists(cls, have: Sequence[Sequence[bool]]) -> HaveBits:
        """Pack ``have[node][i]`` (node ``node`` holds shard ``i``): for tests and small worlds."""
        if not have:
            raise ValueError("a fan-out needs at least one node")
        count = len(have[0])
        if any(len(row) != count for row in have):
            raise ValueError("every node's have-list must cover every shard")
        rows = np.zeros((len(have), count), dtype=bool)
        for node, row in enumerate(have):
            rows[node] = row
        return cls(np.packbits(rows, axis=1).reshape(len(have), -1), count)

    @property
    def num_nodes(self) -> int:
        return int(self.bits.shape[0])

    def _shards_per_block(self, unpack_bytes: int | None) -> int:
        """Shards per block, a multiple of 8 (whole bytes of every row)."""
        budget = UNPACK_BYTES if unpack_bytes is None else unpack_bytes
        return max(8, budget // self.num_nodes // 8 * 8)

    def holder_counts(self, unpack_bytes: int | None = None) -> npt.NDArray[np.int64]:
        """Per shard, how many nodes hold it."""
        counts = np.zeros(self.count, dtype=np.int64)
        step = self._shards_per_block(unpack_bytes)
        for first in range(0, self.count, step):
            last = min(first + step, self.count)
            block = np.unpackbits(self.bits[:, first // 8 : (last + 7) // 8], axis=1)
            counts[first:last] = block[:, : last - first].sum(axis=0, dtype=np.int64)
        return counts

    def holder_rows(
        self, shards: npt.NDArray[np.intp], unpack_bytes: int | None = None
    ) -> Iterator[tuple[list[int], npt.NDArray[np.bool_]]]:
        """``shards`` (any order) a block at a time, with one row per shard: ``row[node]``, node
        ``node`` holds it. Rows, not columns, so a planner reads each shard's row contiguously."""
        step = self._shards_per_block(unpack_bytes)
        for first in range(0, len(shards), step):
            block = shards[first : first + step]
            masks = (0x80 >> (block & 7)).astype(np.uint8)
            yield block.tolist(), np.ascontiguousarray(((self.bits[:, block >> 3] & masks) != 0).T)
