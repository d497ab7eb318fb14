"""safe_relpath's one-regex fast path accepts nothing the part-by-part check would change or
refuse; the Parquet reader's column checks agree with the row-by-row reader."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import StagerError
from stager.shards.manifest import Manifest, ManifestEntry
from stager.storage.paths import (
    CANONICAL_RELPATH,
    all_canonical,
    normalised_relpath,
    safe_relpath,
)

PIECES = st.sampled_from(
    ["a", "b.tar", ".", "..", "...", "/", "\\", ":", "\x00", "\n", ".partial", "C:", " "]
)


@settings(max_examples=3000, deadline=None)
@given(st.lists(PIECES, max_size=8).map("".join))
def test_fast_path_agrees_with_safe_relpath(relpath: str) -> None:
    try:
        expected: str | None = normalised_relpath(relpath)
    except StagerError:
        expected = None
    if CANONICAL_RELPATH.fullmatch(relpath) and not relpath.endswith(".partial"):
        assert expected == relpath, f"fast path accepted {relpath!r}"
    try:
        got: str | None = safe_relpath(relpath)
    except StagerError:
        got = None
    assert got == expected


# whole parts joined by "/", so that "." and ".." parts land first, inside and last
PARTS = st.lists(
    st.sampled_from(["a", "b.tar", ".", "..", "...", "", "\\", "C:", ":", "\x00", "x.partial"]),
    min_size=1,
    max_size=4,
).map("/".join)


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.one_of(PARTS, st.lists(PIECES, max_size=6).map("".join)), max_size=4))
def test_the_whole_column_check_agrees_with_the_fast_path(relpaths: list[str]) -> None:
    one_by_one = all(
        CANONICAL_RELPATH.fullmatch(p) and not p.endswith(".partial") for p in relpaths
    )
    assert all_canonical(relpaths) == one_by_one, relpaths


def test_examples() -> None:
    for ok in ("a.tar", "d/e/f-000001.tar", ".hidden/x.tar", "a/...", "ab:c.tar"):
        assert CANONICAL_RELPATH.fullmatch(ok) and safe_relpath(ok) == ok
    for odd in ("./a", "a//b", "a/./b", "a\\b", "C:x", "/a", "a/..", "a\n/../b", "a\x00", "..."):
        assert not CANONICAL_RELPATH.fullmatch(odd)
        assert not all_canonical(["a.tar", odd, "b.tar"])
    assert all_canonical(["a.tar", "d/e/f-000001.tar", ".hidden/x.tar", "a/...", "ab:c.tar"])


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
    odd = [
        *plain,
        {"path": "./x//y.tar", "size": 3, "hash": "xxh3_64:" + "0" * 16, "samples": None},
    ]
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


ROWS = st.lists(
    st.fixed_dictionaries(
        {
            "path": st.one_of(
                st.sampled_from(["a.tar", "d/s1.tar", "x:y.tar"]),
                st.lists(PIECES, min_size=1, max_size=4).map("".join),
            ),
            "size": st.integers(min_value=-2, max_value=50),
            "hash": st.sampled_from(
                [
                    None,
                    "xxh3_64:" + "ab" * 8,
                    "sha256:" + "cd" * 32,
                    "EF" * 32,
                    "xxh3_64:" + "AB" * 8,
                ]
                + ["xxh3_64:ab", "sha256:cd", "ef", "", "md5:00", ":x", "xxh64:" + "g" * 16]
            ),
            "samples": st.one_of(st.none(), st.integers(min_value=-1, max_value=9)),
            "version": st.sampled_from([None, "v1", ""]),
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(ROWS, st.sampled_from(["string", "large_string"]))
def test_parquet_column_checks_agree_with_the_json_reader(tmp_path_factory, rows, text) -> None:
    """A Parquet manifest is checked column by column (fast at a million rows); it must accept
    and refuse exactly what the row-by-row JSON reader does, with the same entries (text columns
    as ``string`` or, as polars writes them, ``large_string``)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stager.shards.manifest import Manifest

    where = tmp_path_factory.mktemp("m")
    doc = {"format": "stager-manifest", "version": 1, "meta": {}, "shards": rows}
    (where / "m.json").write_text(json.dumps(doc))
    table = pa.table(
        {
            "path": pa.array([r["path"] for r in rows], getattr(pa, text)()),
            "size": pa.array([r["size"] for r in rows], pa.int64()),
            "hash": pa.array([r["hash"] for r in rows], getattr(pa, text)()),
            "samples": pa.array([r["samples"] for r in rows], pa.int64()),
            "version": pa.array([r["version"] for r in rows], getattr(pa, text)()),
        }
    )
    meta = {b"stager.format": b"stager-manifest", b"stager.version": b"1"}
    pq.write_table(table.replace_schema_metadata(meta), where / "m.parquet")

    def read(name: str) -> object:
        try:
            return Manifest.read(where / name).entries
        except StagerError as exc:
            return type(exc)

    assert read("m.parquet") == read("m.json")


_DIGESTS = st.one_of(
    st.none(),
    st.sampled_from(
        ["xxh3_64:" + "0f" * 8, "xxh64:" + "a1" * 8, "sha256:" + "9b" * 32, "EF" * 32]
        + ["xxh3_64:" + "0f" * 7 + "0", "xxh3_64:" + "0F" * 8, "SHA256:" + "9b" * 32]
        + ["md5:" + "00" * 16, "sha256:", "xxh64:" + "g" * 16, "xxh3_64:" + "0f" * 8 + "\n"]
    ),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_DIGESTS, min_size=1, max_size=5))
def test_the_loaders_json_reader_refuses_the_digests_the_others_refuse(
    tmp_path_factory, digests: list
) -> None:
    """read_columns' whole-column path took any non-empty string as a hash, where
    Manifest.read (JSON and Parquet) refuses what no copy can match: both now agree."""
    import json

    from stager.shards.manifest import Manifest, read_columns

    path = tmp_path_factory.mktemp("m") / "m.json"
    shards = [
        {"path": f"s{i}.tar", "size": 1, "hash": h, "samples": 1} for i, h in enumerate(digests)
    ]
    path.write_text(json.dumps({"format": "stager-manifest", "version": 1, "shards": shards}))

    def outcome(read) -> object:
        try:
            return list(
                read(path).relpaths
                if read is read_columns
                else [e.relpath for e in read(path).entries]
            )
        except StagerError as exc:
            return type(exc)

    assert outcome(read_columns) == outcome(Manifest.read)


TRICKY = ["\udcff", "\ud800", '"', "\\", "\n", "\x00", "\u2028", "\xe9", "}", "{", ","]
ENTRIES = st.lists(
    st.builds(
        ManifestEntry,
        # any text: quotes, backslashes, controls, non-ASCII, and the lone surrogates a name
        # that is not UTF-8 decodes to (st.text leaves those out unless asked)
        st.text(st.characters(exclude_categories=()) | st.sampled_from(TRICKY), max_size=12),
        st.integers(min_value=0, max_value=1 << 70),
        st.none() | st.text(max_size=10),
        st.none() | st.integers(min_value=0, max_value=1 << 70),
        st.none() | st.text(max_size=10),
    ),
    max_size=5,
)


@settings(max_examples=500, deadline=None)
@given(ENTRIES, st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
def test_json_text_is_the_encoders_text_a_shard_per_line(
    entries: list[ManifestEntry], meta: dict[str, str]
) -> None:
    """The manifest's JSON, written out field by field, is what json.dumps of each entry's
    object makes (the layout of the writer it replaced), and reads back as those objects."""
    objects = []
    for e in entries:
        obj: dict[str, object] = {"path": e.relpath, "size": e.size, "hash": e.hash}
        obj["samples"] = e.samples
        if e.version is not None:
            obj["version"] = e.version
        objects.append(obj)
    text = Manifest(tuple(entries), meta)._json_text()
    head = json.dumps({"format": "stager-manifest", "version": 1, "meta": meta}, indent=1)
    shards = "[\n  " + ",\n  ".join(map(json.dumps, objects)) + "]" if objects else "[]"
    assert text == f'{head[:-2]},\n "shards": {shards}\n}}\n'
    assert json.loads(text)["shards"] == objects
