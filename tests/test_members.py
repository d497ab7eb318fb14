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


_ORDERS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["jpg", "cls", "txt"])),
    max_size=12,
)


@given(_ORDERS)
def test_the_walk_the_grouper_and_the_array_check_find_the_same_split_sample(
    names: list[tuple[str, str]],
) -> None:
    """A sample whose members lie apart, another sample between them and no extension in
    common (GNU tar's directory order): the compiled walk, the grouper and the check of an
    index without that finding name the same key, or none."""
    import io
    import tarfile

    from stager.shards.members import split_sample
    from stager.shards.tarnative import native_walk

    grouper = SampleGrouper()
    for position, (key, ext) in enumerate(names):
        grouper.add(f"{key}.{ext}", 512 * position, 1)
    grouped = grouper.index()
    by_arrays = split_sample(dataclasses.replace(grouped, duplicates_checked=False))
    assert grouped.split == by_arrays
    walker = native_walk()
    if walker is not None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, ext in names:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        walker.feed(buffer.getvalue())
        parts = walker.finish()
        assert parts is not None and parts["split"] == by_arrays


def test_a_sample_scattered_by_directory_order_is_found_and_one_stored_twice_is_not() -> None:
    grouper = SampleGrouper()
    for name in ("k1.jpg", "k2.jpg", "k1.cls", "k2.cls"):
        grouper.add(name, 0, 1)
    assert grouper.index().split == "k1"
    again = SampleGrouper()
    for name in ("k1.jpg", "k1.cls", "k2.jpg", "k1.jpg", "k1.cls"):
        again.add(name, 0, 1)
    assert again.index().split is None
