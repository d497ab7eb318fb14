"""PackedStrings: a sequence of str held in one buffer must read back exactly what it was given."""

from __future__ import annotations

import os
import pickle

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from stager.shards.packedstrings import PackedStrings

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


@given(lists, st.sampled_from(["", "/scratch/42/ds/", "\udcff/"]))
def test_joined_whole_as_one_join_of_its_items(items: list[str], prefix: str) -> None:
    """nul_joined (keys and fingerprints hash it) is the join of the items, prefix included;
    native_paths is the filesystem's bytes of them where it can be (no lone surrogate)."""
    from stager.storage.paths import nul_joined

    packed = PackedStrings.prefixed(prefix, items)
    want = [prefix + s for s in items]
    assert packed.nul_joined() == "\0".join(want) == nul_joined(packed) == nul_joined(want)
    for parts in (1, 3):
        runs = packed.native_paths(parts)
        if runs is None:
            continue
        assert sum(count for _, _, count in runs) == len(want) and len(runs) <= parts
        named = [head + n for head, names, count in runs if count for n in names.split(b"\0")]
        assert named == [os.fsencode(w) for w in want]
    if packed.native_paths() is None and not any("\0" in s for s in items):
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in "".join(items))


@given(st.lists(texts.filter(lambda s: "\0" not in s), max_size=20))
def test_from_terminated_reads_back_a_columns_file_buffer(items: list[str]) -> None:
    """The columns file's buffer (each item then a NUL, and its starts) read without a str
    per item gives the items, and shares its buffer with a prefixed copy."""
    encoded = [s.encode("utf-8", "surrogatepass") for s in items]
    buffer = b"".join(e + b"\0" for e in encoded)
    starts = np.concatenate([[0], np.cumsum([len(e) + 1 for e in encoded])]).astype(np.int64)
    packed = PackedStrings.from_terminated(buffer, starts)
    assert list(packed) == items and packed == PackedStrings(items)
    assert list(PackedStrings.prefixed("/x/", packed)) == ["/x/" + s for s in items]
    assert list(PackedStrings(packed)) == items


@given(
    lists, st.sampled_from(["", "/d/", "/d/x.tgz"]), st.sampled_from([(".tgz", ".tar.gz"), ("b",)])
)
def test_any_endswith_as_the_items_say(items: list[str], prefix: str, suffixes: tuple) -> None:
    packed = PackedStrings.prefixed(prefix, items)
    assert packed.any_endswith(suffixes) == any(s.endswith(suffixes) for s in packed)
