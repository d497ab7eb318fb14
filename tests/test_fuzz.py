"""Fuzz the parsers of user input with hypothesis: hostlists, source patterns, manifests.

The contract under test: any input either parses or raises a :class:`StagerError` (whose
message the CLI prints as one line with a documented exit code), never anything else.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import StagerError
from stager.shards.manifest import Manifest
from stager.slurm import parse_hostlist
from stager.storage.sources import SourceSet, resolve_source

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_JSON = settings(FUZZ, max_examples=150)


# -- hostlists ----------------------------------------------------------------------------------
@FUZZ
@given(st.text(alphabet="nodeg-[],0123456789 .\t", max_size=40))
def test_parse_hostlist_parses_or_raises_usage_error(spec: str) -> None:
    try:
        hosts = parse_hostlist(spec)
    except StagerError:
        return
    assert isinstance(hosts, list) and all(isinstance(h, str) and h for h in hosts)


@st.composite
def hostlists(draw) -> tuple[str, list[str]]:
    """A valid hostlist and the hosts it names, built independently of the parser."""
    items, expected = [], []
    for _ in range(draw(st.integers(1, 3))):
        prefix = draw(st.sampled_from(["node", "gpu-a", "n"]))
        width = draw(st.integers(1, 3))
        ranges, names = [], []
        for _ in range(draw(st.integers(1, 3))):
            lo = draw(st.integers(0, 10**width - 1))
            hi = draw(st.integers(lo, min(lo + 5, 10**width - 1)))
            ranges.append(f"{lo:0{width}d}" if lo == hi else f"{lo:0{width}d}-{hi:0{width}d}")
            names += [f"{prefix}{i:0{width}d}" for i in range(lo, hi + 1)]
        items.append(f"{prefix}[{','.join(ranges)}]")
        expected += names
    return ",".join(items), expected


@FUZZ
@given(hostlists())
def test_parse_hostlist_expands_valid_lists_like_slurm(case: tuple[str, list[str]]) -> None:
    spec, expected = case
    assert parse_hostlist(spec) == expected


# -- source patterns (brace, glob, plain) on an in-memory filesystem ----------------------------
@pytest.fixture(scope="module")
def memfs_root() -> str:
    fs = fsspec.filesystem("memory")
    for name in ("a1.tar", "a2.tar", "b1.tar", "sub/c1.tar"):
        fs.pipe_file(f"/fuzzsrc/{name}", b"x" * 10)
    yield "memory://fuzzsrc"
    fs.rm("/fuzzsrc", recursive=True)


@FUZZ
@given(pattern=st.text(alphabet="{}.,ab12-/*?[]", max_size=24))
def test_source_patterns_resolve_or_raise_stager_error(memfs_root: str, pattern: str) -> None:
    try:
        source = resolve_source(f"{memfs_root}/{pattern}", jobs=2)
    except StagerError:
        return
    assert isinstance(source, SourceSet)
    assert all(not s.relpath.startswith(("/", "..")) for s in source.shards)


@FUZZ
@given(lo=st.integers(0, 3), hi=st.integers(0, 3), width=st.integers(1, 2))
def test_brace_ranges_name_exactly_the_files_they_should(
    memfs_root: str, lo: int, hi: int, width: int
) -> None:
    try:
        source = resolve_source(f"{memfs_root}/a{{{lo:0{width}d}..{hi:0{width}d}}}.tar", jobs=2)
    except StagerError:
        wanted = {n for n in range(min(lo, hi), max(lo, hi) + 1) if n in (1, 2) and width == 1}
        assert not wanted
        return
    assert width == 1
    assert sorted(s.relpath for s in source.shards) == [
        f"a{n}.tar" for n in (1, 2) if min(lo, hi) <= n <= max(lo, hi)
    ]


# -- manifests ----------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
FIELD = (
    st.none()
    | st.booleans()
    | st.integers(-5, 2**64)
    | st.text(max_size=16)
    | st.lists(st.integers(), max_size=2)
)
ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "path": st.text(alphabet="ab./\\:\x00-_", max_size=16) | FIELD,
        "size": FIELD,
        "hash": FIELD,
        "samples": FIELD,
    },
)
NEAR_VALID = st.fixed_dictionaries(
    {"format": st.just("stager-manifest"), "shards": st.lists(ENTRY, max_size=4) | JSON_VALUES},
    optional={
        "version": JSON_VALUES,
        "meta": st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3) | JSON_VALUES,
    },
)


_SCRATCH = Path(tempfile.mkdtemp(prefix="stager-fuzz-"))
atexit.register(shutil.rmtree, _SCRATCH, True)


def _read(payload: bytes) -> Manifest | None:
    path = _SCRATCH / "m.json"
    path.write_bytes(payload)
    try:
        manifest = Manifest.read(path)
    except StagerError:
        return None
    for entry in manifest.entries:
        assert not entry.relpath.startswith(("/", "..")) and "\x00" not in entry.relpath
        assert isinstance(entry.size, int) and entry.size >= 0
    return manifest


@FUZZ_JSON
@given(NEAR_VALID)
def test_near_valid_manifests_parse_or_raise_stager_error(payload: dict) -> None:
    _read(json.dumps(payload).encode())


@FUZZ_JSON
@given(JSON_VALUES)
def test_any_json_document_parses_or_raises_stager_error(payload: object) -> None:
    _read(json.dumps(payload).encode())


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_raise_stager_error(payload: bytes) -> None:
    _read(payload)


@settings(max_examples=50, deadline=None)
@given(lo=st.integers(0, 10**12), span=st.integers(2 * 10**6, 10**12))
def test_huge_brace_ranges_are_refused_before_expanding(lo: int, span: int) -> None:
    with pytest.raises(StagerError, match="more than"):
        resolve_source(f"memory://fuzzsrc/a{{{lo}..{lo + span}}}.tar")
