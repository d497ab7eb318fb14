"""PackedStrings: a sequence of str held in one buffer must read back exactly what it was given."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from stager_loaders.packedstrings import PackedStrings

# any text, NULs (the separator) and lone surrogates (undecodable names from the OS) included
texts = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
lists = st.lists(texts | st.sampled_from(["", "\0", "a\0b", "\udcc3\udca9", "é"]), max_size=30)


@given(lists, st.sampled_from(["", "/scratch/42/ds/", "\udcff/", "a\0"]))
def test_reads_back_what_it_was_given(items: list[str], prefix: str) -> None:
    packed = PackedStrings(items) if not prefix else PackedStrings.prefixed(prefix, items)
    want = [prefix + s for s in items]
    assert len(packed) == len(want)
    assert list(packed) == want
    assert [packed[i] for i in range(len(want))] == want
    assert [packed[-i - 1] for i in range(len(want))] == want[::-1]
    assert packed[1:5] == want[1:5]
    assert packed == want and want == packed
    assert pickle.loads(pickle.dumps(packed)) == packed
    assert list(pickle.loads(pickle.dumps(packed))) == want


@given(lists, lists)
def test_equal_only_to_the_same_strings(a: list[str], b: list[str]) -> None:
    assert (PackedStrings(a) == PackedStrings(b)) == (a == b)
    assert (PackedStrings(a) == b) == (a == b)


def test_out_of_range_is_an_index_error() -> None:
    packed = PackedStrings(["a", "b"])
    for index in (2, -3):
        try:
            packed[index]
        except IndexError:
            continue
        raise AssertionError(f"{index} did not raise")
