"""SampleGrouper finds a member named twice in one sample while it groups, as the array check
(:func:`duplicate_member` on an index without that finding) does."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from stager.shards.members import SampleGrouper, duplicate_member

_NAMES = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d/e"]), st.sampled_from(["jpg", "cls", "x.y"])),
    max_size=30,
)


@given(_NAMES)
def test_the_grouper_finds_the_duplicate_the_array_check_finds(
    names: list[tuple[str, str]],
) -> None:
    grouper = SampleGrouper()
    for position, (key, ext) in enumerate(names):
        grouper.add(f"{key}.{ext}", 512 * position, 1)
    walked = grouper.index()
    assert walked.duplicates_checked
    by_arrays = duplicate_member(dataclasses.replace(walked, duplicates_checked=False))
    assert duplicate_member(walked) == by_arrays
    assert grouper.num_samples == walked.num_samples


def test_a_member_named_twice_in_one_sample_is_named() -> None:
    grouper = SampleGrouper()
    for name in ("k0.jpg", "k0.cls", "k0.jpg", "k1.jpg", "k1.jpg"):
        grouper.add(name, 0, 1)
    assert duplicate_member(grouper.index()) == "k0.jpg"
