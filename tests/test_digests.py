"""DigestColumn gives back every digest exactly as given: one algorithm (the array path),
several, shards without a hash, none at all."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from stager.shards.digests import DigestColumn
from stager.storage.hashing import HEX_DIGITS

_DIGESTS = st.one_of(
    st.none(),
    st.sampled_from(sorted(HEX_DIGITS)).flatmap(
        lambda name: st.binary(min_size=HEX_DIGITS[name] // 2, max_size=HEX_DIGITS[name] // 2).map(
            lambda raw: f"{name}:{raw.hex()}"
        )
    ),
)


@given(st.lists(_DIGESTS, max_size=40))
def test_every_digest_reads_back_as_given(digests: list[str | None]) -> None:
    column = pickle.loads(pickle.dumps(DigestColumn(digests)))
    assert len(column) == len(digests)
    assert [column[i] for i in range(len(column))] == digests


def test_one_algorithm_is_held_as_its_raw_bytes() -> None:
    """8 bytes of xxh3_64 and one byte of algorithm per shard, where an entry object per shard
    cost a worker ~670 bytes (a dict of ManifestEntry, 1e6 shards: 672 MB)."""
    digests = [f"xxh3_64:{i:016x}" for i in range(1000)]
    column = DigestColumn(digests)
    assert column.nbytes == 1000 * (8 + 1)
    assert column[999] == digests[999]
    assert len(pickle.dumps(column)) < 1000 * (8 + 1) + 500
