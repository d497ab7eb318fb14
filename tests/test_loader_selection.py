"""The loader keeps the staged shards its SOURCE selects (a glob, a brace pattern, a file, a list
of a directory staged whole), reading nothing of the source; a staged part is not taken for
another selection. Before, every one of them was given every staged shard, without a word."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import SourceError, UsageError
from stager.layout import canonical_spec
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sources import resolve_source
from stager_loaders import LoaderOptions, ShardedLoader
from stager_loaders.selection import staged_selection

from .conftest import run_cli

FAST = ["--jitter-max", "0", "--quiet"]


def _shards_of(spec: str | list[str], dest: Path) -> list[str]:
    loader = ShardedLoader(spec, batch_size=4, options=LoaderOptions(dest=str(dest), world_size=1))
    return [Path(s.location).name for s in loader.shards.shards]


@pytest.fixture
def staged_whole(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4, prefix="train"))
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=4, prefix="val"))
    dest = tmp_path / "scratch"
    result = run_cli("stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    return src, dest


def test_a_part_of_a_directory_staged_whole_is_read_from_the_staged_copy_alone(
    staged_whole: tuple[Path, Path],
) -> None:
    src, dest = staged_whole
    moved = src.with_name("gone")
    src.rename(moved)  # any read of the source now fails
    try:
        assert _shards_of(f"{src}/train-*.tar", dest) == [
            "train-000000.tar",
            "train-000001.tar",
            "train-000002.tar",
        ]
        assert _shards_of(f"{src}/val-*.tar", dest) == ["val-000000.tar", "val-000001.tar"]
        assert _shards_of(f"{src}/train-{{000000..000001}}.tar", dest) == [
            "train-000000.tar",
            "train-000001.tar",
        ]
        assert _shards_of(f"{src}/val-000001.tar", dest) == ["val-000001.tar"]
        listed = [f"{src}/train-000002.tar", f"{src}/val-000000.tar"]
        assert _shards_of(listed, dest) == ["train-000002.tar", "val-000000.tar"]
        assert len(_shards_of(str(src), dest)) == 5
        assert len(_shards_of("/" + str(src), dest)) == 5  # (a leading // is the same path)
        with pytest.raises(SourceError, match="no shard of the staged copy"):
            _shards_of(f"{src}/test-*.tar", dest)
    finally:
        moved.rename(src)


def test_a_shard_named_but_not_staged_is_read_from_the_source(
    staged_whole: tuple[Path, Path], caplog
) -> None:
    src, dest = staged_whole
    (dest / "ds" / "val-000001.tar").unlink()
    loader = ShardedLoader(
        [f"{src}/train-000000.tar", f"{src}/val-000001.tar"],
        batch_size=4,
        options=LoaderOptions(dest=str(dest), world_size=1),
    )
    by_name = {Path(s.location).name: s.from_source for s in loader.shards.shards}
    assert by_name == {"train-000000.tar": False, "val-000001.tar": True}
    assert sum(1 for _ in loader) == 2


def test_a_staged_part_is_not_taken_for_another_selection(tmp_path: Path) -> None:
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=4))
    dest = tmp_path / "scratch"
    part = f"{src}/train-00000[01].tar"
    assert run_cli("stage-in", part, "--dest", str(dest), *FAST).returncode == 0
    assert _shards_of(part, dest) == ["train-000000.tar", "train-000001.tar"]
    for other in (f"{src}/train-00000[23].tar", str(src)):
        with pytest.raises(UsageError, match="holds a staged copy of .*00000\\[01\\]"):
            _shards_of(other, dest)


NAMES = st.sampled_from(["a", "b", "ab", ".h", "x1"])
TREES = st.lists(
    st.tuples(st.sampled_from(["", "d/", "d/e/", ".git/", "d/.c/"]), NAMES), min_size=1, max_size=8
)
PATTERNS = st.sampled_from(
    ["*.tar", "a*.tar", "*/*.tar", "**/*.tar", "d/**/*.tar", "[ab]*.tar", "?.tar", ".*.tar"]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tree=TREES, pattern=PATTERNS)
def test_the_selection_is_what_stage_ins_listing_of_the_pattern_finds(
    tmp_path_factory: pytest.TempPathFactory, tree: list[tuple[str, str]], pattern: str
) -> None:
    """Over random trees (hidden names and directories among them), the staged relpaths a
    glob selects are the shards stage-in lists for that glob."""
    root = tmp_path_factory.mktemp("tree") / "ds"
    for directory, name in tree:
        path = root / directory / f"{name}.tar"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    staged = sorted({f"{d}{n}.tar" for d, n in tree})  # (hidden ones too, staged when named)
    try:
        listed = sorted(s.path for s in resolve_source(f"{root}/{pattern}").shards)
    except SourceError:
        listed = []  # (nothing matches)
    selection = staged_selection(canonical_spec(str(root)), str(root), f"{root}/{pattern}", root)
    assert selection is not None
    assert sorted(f"{root}/{r}" for r in staged if selection.test(r)) == listed
    shutil.rmtree(root.parent)


def test_a_source_reached_through_a_symlink_finds_its_staged_copy(
    staged_whole: tuple[Path, Path],
) -> None:
    """Staged as /src/ds, loaded as a symlink to it: under another name (dslink) every shard
    was read from the source; under the same name (other/ds) it was refused as another
    dataset. The real path is tried once where the plain lookup finds nothing."""
    src, dest = staged_whole
    (src.parent / "dslink").symlink_to("ds")
    (src.parent.parent / "other").mkdir()
    (src.parent.parent / "other" / "ds").symlink_to(src)
    for spelling in (src.parent / "dslink", src.parent.parent / "other" / "ds"):
        loader = ShardedLoader(
            str(spelling), batch_size=4, options=LoaderOptions(dest=str(dest), world_size=1)
        )
        assert loader.shards.from_source == 0 and loader.shards.staged_dir == dest / "ds"
        assert len(loader.shards.shards) == 5
    for link in (src.parent / "dslink", src.parent.parent / "other" / "ds"):
        # (a glob, a file or a list through the link: their root is respelled as recorded,
        # where they matched nothing or read /staged/root//link/... from the source)
        assert _shards_of(f"{link}/val-*.tar", dest) == ["val-000000.tar", "val-000001.tar"]
        assert _shards_of(f"{link}/train-000001.tar", dest) == ["train-000001.tar"]
        listed = [f"{link}/train-000002.tar", f"{link}/val-000000.tar"]
        assert _shards_of(listed, dest) == ["train-000002.tar", "val-000000.tar"]


def test_a_brace_pattern_names_its_shards_as_written_as_stage_in_takes_them() -> None:
    """Its names are looked up in a set (one fnmatch per name per shard took 7 s at 4,000
    shards, an hour at 100k), and taken literally, as stage-in takes them: a '*' inside is a
    character of the name, not a wildcard."""
    spec = "file:///nfs/ds"
    selection = staged_selection(spec, "/nfs/ds", "/nfs/ds/{a/*,c}/s-{000000..099999}.tar", "x")
    assert selection is not None and selection.named is not None
    assert len(selection.named) == 200_000
    assert selection.test("c/s-000001.tar") and not selection.test("a/b/s-000001.tar")
    assert selection.test("a/*/s-000001.tar")
