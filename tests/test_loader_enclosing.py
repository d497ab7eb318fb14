"""A directory staged whole serves the loaders of the directories inside it: ``stage-in
/nfs/ds``, then ``ShardedLoader("/nfs/ds/train")``. Before, the loader looked the copy up by
the name ``train``, found none, and every rank read every shard from the source with one
warning, while the copy sat on scratch."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import SourceError, UsageError
from stager.shards.build import build_manifest, write_manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sources import resolve_source
from stager_loaders import LoaderOptions, ShardedLoader
from stager_loaders.resolve import resolve_dataset

from . import background_util as bg
from .conftest import run_cli
from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--quiet"]


def _loader(spec: str | list[str], dest: Path) -> ShardedLoader:
    return ShardedLoader(spec, batch_size=4, options=LoaderOptions(dest=str(dest), world_size=1))


def _keys(loader: ShardedLoader) -> list[str]:
    return sorted(key for batch in loader for key in batch["__key__"])


@pytest.fixture
def staged_tree(tmp_path: Path) -> tuple[Path, Path]:
    """``src/ds`` with ``train/`` (3 shards), ``val/`` (2) and ``.cache/`` (1, hidden), staged."""
    src = tmp_path / "src" / "ds"
    for sub, shards, seed in (("train", 3, 1), ("val", 2, 2), (".cache", 1, 3)):
        prefix = sub.strip(".")[:3]
        spec = SyntheticSpec(num_shards=shards, samples_per_shard=4, seed=seed, prefix=prefix)
        write_synthetic_dataset(src / sub, spec)
    dest = tmp_path / "scratch"
    result = run_cli("stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    return src, dest


def test_a_directory_inside_a_copy_staged_whole_is_read_from_it_alone(
    staged_tree: tuple[Path, Path],
) -> None:
    src, dest = staged_tree
    nowhere = dest.parent / "nothing-staged"  # (loaders that read the source, to compare with)
    names = {
        sub: list(_loader(str(src / sub), nowhere).shards.relpaths) for sub in ("train", "val")
    }
    keys = {sub: _keys(_loader(str(src / sub), nowhere)) for sub in ("train", "val")}
    half_read = _loader(str(src / "train"), nowhere)
    batches = iter(half_read)
    next(batches)
    state = half_read.state_dict()
    rest = sorted(key for batch in batches for key in batch["__key__"])
    moved = src.with_name("gone")
    src.rename(moved)  # any read of the source now fails
    try:
        for spelling in ("train", "train/", "train/*.tar", "train/tra-{000000..000002}.tar"):
            loader = _loader(f"{src}/{spelling}", dest)
            assert loader.shards.from_source == 0 and loader.shards.staged_dir == dest / "ds"
            # named from the source's own root, as the source names them: a state saved by a
            # loader that read the source resumes here
            assert list(loader.shards.relpaths) == names["train"]
            assert _keys(loader) == keys["train"]
        resumed = _loader(f"{src}/train", dest)
        resumed.load_state_dict(state)
        assert _keys(resumed) == rest
        loader = _loader(f"{src}/val", dest)
        assert list(loader.shards.relpaths) == names["val"] == ["val-000000.tar", "val-000001.tar"]
        assert _keys(loader) == keys["val"]
        assert [
            Path(s.location).parent
            for s in _loader(f"{src}/val/val-000001.tar", dest).shards.shards
        ] == [dest / "ds" / "val"]
        listed = [f"{src}/train/tra-000002.tar", f"{src}/val/val-000000.tar"]
        shards = _loader(listed, dest).shards
        assert shards.from_source == 0 and list(shards.relpaths) == [
            "train/tra-000002.tar",
            "val/val-000000.tar",
        ]
        # what the copy lacks is still the source's: here, gone
        for absent in (f"{src}/.cache", f"{src}/test", f"{src}/train/*.tgz"):
            with pytest.raises(SourceError):
                _loader(absent, dest)
    finally:
        moved.rename(src)


def test_only_a_copy_of_that_very_directory_staged_whole_serves_it(
    staged_tree: tuple[Path, Path], tmp_path: Path, caplog
) -> None:
    """Another source's copy under the directory's name, or a copy of a part of it (a glob),
    answers for nothing inside: the source is read, as without a copy, and no error is raised
    for a name the user never gave."""
    src, dest = staged_tree
    other = tmp_path / "other" / "ds"
    shutil.copytree(src, other)
    elsewhere = tmp_path / "scratch2"
    assert run_cli("stage-in", str(src), "--dest", str(elsewhere), *FAST).returncode == 0
    loader = _loader(f"{other}/train", elsewhere)  # (ds there is src's, not other's)
    assert loader.shards.from_source == 3 and "no staged copy" in caplog.text
    part = tmp_path / "scratch3"
    assert run_cli("stage-in", f"{src}/*/*.tar", "--dest", str(part), *FAST).returncode == 0
    assert _loader(f"{src}/train", part).shards.from_source == 3
    assert _loader(f"{src}/*/*.tar", part).shards.from_source == 0


def test_an_explicit_name_is_looked_up_alone(staged_tree: tuple[Path, Path]) -> None:
    """LoaderOptions(name=...) says where the copy is: no directory above is tried."""
    src, dest = staged_tree
    loader = ShardedLoader(
        str(src / "train"),
        batch_size=4,
        options=LoaderOptions(dest=str(dest), world_size=1, name="train"),
    )
    assert loader.shards.from_source == 3


DIRS = st.sampled_from(["", "d/", "d/e/", "f/", ".git/", "d/.c/"])
TREES = st.lists(st.tuples(DIRS, st.sampled_from(["a", "b", ".h"])), min_size=1, max_size=8)
INSIDE = st.sampled_from(["d", "d/e", "f", "d/*.tar", "d/**/*.tar", "d/e/*.tar", "f/a.tar"])


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tree=TREES, inside=INSIDE)
def test_a_copy_of_the_directory_above_serves_what_stage_in_lists_for_the_source(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tree: list[tuple[str, str]],
    inside: str,
) -> None:
    """Over random trees (hidden names and directories among them): the shards a SOURCE inside
    a copy staged whole gets from it are the shards stage-in lists for that SOURCE, under the
    names the source gives them, and nothing is read from the source."""
    clean_process_env(monkeypatch)
    base = tmp_path_factory.mktemp("tree")
    root = base / "ds"
    for directory, name in [("", "z"), *tree]:  # (one shard outside: something to stage)
        path = root / directory / f"{name}.tar"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    try:
        listed = sorted(s.relpath for s in resolve_source(f"{root}/{inside}").shards)
    except SourceError:
        listed = []
    try:
        dest = str(base / "scratch")
        result = run_main(capsys, "stage-in", str(root), "--dest", dest, "--no-count", *FAST)
        assert result.returncode == 0, result.stderr
        try:
            found = resolve_dataset(f"{root}/{inside}", dest=dest)
        except SourceError:
            assert not listed
        else:
            if listed:
                assert found.from_source == 0 and found.staged_dir == base / "scratch" / "ds"
                assert sorted(found.relpaths) == listed
            else:  # (a file named that is in neither: the source's, which then says it is not)
                assert found.from_source == len(found)
    finally:
        shutil.rmtree(base)


def test_a_part_named_by_its_path_on_scratch_comes_from_the_copys_manifest(
    staged_tree: tuple[Path, Path],
) -> None:
    """The templates hand a script the staged copy ($DATA_DIR) and it loads $DATA_DIR/train:
    read as a plain directory, as it stood; while a copier still filled it, a part of the
    shards, and the job trained on them and ended well."""
    src, dest = staged_tree
    copy = dest / "ds"
    for spelling in ("train", "train/", "train/*.tar"):
        shards = resolve_dataset(f"{copy}/{spelling}")
        assert shards.staged_dir == copy and shards.from_source == 0
        assert list(shards.relpaths) == ["tra-000000.tar", "tra-000001.tar", "tra-000002.tar"]
    (copy / "train" / "tra-000001.tar").unlink()  # (missing: read from the recorded source)
    shards = resolve_dataset(f"{copy}/train")
    assert shards.from_source == 1 and str(src / "train") in shards.locations[1]
    (copy / ".stager" / "manifest.json").unlink()  # (a stage-in killed before its manifest
    (copy / ".stager" / "journal").write_text("")  # leaves its journal)
    with pytest.raises(UsageError, match="has not finished"):
        resolve_dataset(f"{copy}/train")
    # A stage-out destination has a .stager too (its commits): no staged copy above a source
    elsewhere = src.parent.parent / "runs"
    (elsewhere / ".stager" / "commits").mkdir(parents=True)
    shutil.copytree(src / "val", elsewhere / "val")
    assert resolve_dataset(str(elsewhere / "val")).staged_dir is None


def test_a_part_of_a_copy_being_made_in_the_background_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src" / "ds"
    for sub, seed in (("sub", 1), ("other", 2)):
        write_synthetic_dataset(src / sub, dataclasses.replace(bg.SPEC, seed=seed))
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    dest = tmp_path / "scratch"
    copier = bg.start_copier(src, dest, "--bw-limit", "0.2")  # (~2 MB: seconds)
    try:
        bg.wait_plan(dest)
        with pytest.raises(UsageError, match="still copying"):
            resolve_dataset(str(dest / "ds" / "sub"))
    finally:
        bg.stop(copier)
