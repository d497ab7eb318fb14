"""The manifest's fast path for shard paths accepts nothing safe_relpath would change or refuse."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import StagerError
from stager.shards.manifest import _CANONICAL, _checked_relpath
from stager.storage.paths import safe_relpath

PIECES = st.sampled_from(
    ["a", "b.tar", ".", "..", "...", "/", "\\", ":", "\x00", "\n", ".partial", "C:", " "]
)


@settings(max_examples=3000, deadline=None)
@given(st.lists(PIECES, max_size=8).map("".join))
def test_fast_path_agrees_with_safe_relpath(relpath: str) -> None:
    try:
        expected: str | None = safe_relpath(relpath)
    except StagerError:
        expected = None
    if _CANONICAL.fullmatch(relpath) and not relpath.endswith(".partial"):
        assert expected == relpath, f"fast path accepted {relpath!r}"
    try:
        got: str | None = _checked_relpath(relpath)
    except StagerError:
        got = None
    assert got == expected


def test_examples() -> None:
    for ok in ("a.tar", "d/e/f-000001.tar", ".hidden/x.tar", "a/...", "ab:c.tar"):
        assert _CANONICAL.fullmatch(ok) and _checked_relpath(ok) == ok
    for odd in ("./a", "a//b", "a/./b", "a\\b", "C:x", "/a", "a/..", "a\n/../b", "a\x00", "..."):
        assert not _CANONICAL.fullmatch(odd)
