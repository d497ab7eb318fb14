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


def test_read_columns_agrees_with_manifest_read(tmp_path) -> None:
    import json

    import pytest

    from stager.shards.manifest import Manifest, read_columns

    def write(shards: list[dict]) -> object:
        path = tmp_path / "m.json"
        doc = {"format": "stager-manifest", "version": 1, "meta": {"subset": "all"}}
        path.write_text(json.dumps({**doc, "shards": shards}))
        return path

    plain = [{"path": f"d/s{i}.tar", "size": 10 + i, "hash": None, "samples": i} for i in range(5)]
    odd = [*plain, {"path": "./x//y.tar", "size": 3, "hash": "xxh3_64:00", "samples": None}]
    for shards in (plain, odd):
        path = write(shards)
        columns, manifest = read_columns(path), Manifest.read(path)
        assert columns.relpaths == [e.relpath for e in manifest.entries]
        assert columns.sizes == [e.size for e in manifest.entries]
        assert columns.samples == [e.samples for e in manifest.entries]
        assert columns.meta == dict(manifest.meta)
    assert read_columns(write(odd)).relpaths[-1] == "x/y.tar"  # normalised by the slow path
    for bad in ({"path": "../up.tar", "size": 1}, {"path": "a.tar", "size": True}):
        path = write([*plain, bad])
        with pytest.raises(StagerError) as slow:
            Manifest.read(path)
        with pytest.raises(type(slow.value), match="manifest|refused|path"):
            read_columns(path)
