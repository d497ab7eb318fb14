"""The on-disk contract and the package layers: stage-in and the loader agree, stager stays
torch-free.

Every spelling of a source that a user may type must give stage-in and the loader the same
dataset name; otherwise the loader does not find the staged copy and every rank reads NFS.
These tests stage for real and then ask the loader, with the source gone, for every sample.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stager
from stager.layout import META_DIR, StagedDataset, dataset_name, source_root
from stager.shards.synth import SyntheticSpec, sample_key, write_synthetic_dataset

from .conftest import BIN, REPO, clean_env

SPEC = SyntheticSpec(num_shards=4, samples_per_shard=5, seed=3)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """``work/d/a/train-00000{0..3}.tar``: the dataset of the reported bug, under a work dir."""
    write_synthetic_dataset(tmp_path / "work" / "d" / "a", SPEC)
    return tmp_path / "work"


def _spellings(work: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """Label -> (spec as typed, or a --from-list file, and the working directory it is typed in)."""
    absolute = work / "d" / "a"
    return {
        "dir": (str(absolute), {}),
        "dir/": (f"{absolute}/", {}),
        "relative dir": ("d/a", {"cwd": str(work)}),
        "relative dir/": ("./d/a/", {"cwd": str(work)}),
        "dotdot": ("d/x/../a", {"cwd": str(work)}),
        "glob": (f"{absolute}/train-*.tar", {}),
        "relative glob": ("d/a/*.tar", {"cwd": str(work)}),
        "brace": (f"{absolute}/train-{{000000..000003}}.tar", {}),
        "relative brace": ("d/a/train-00000{0..3}.tar", {"cwd": str(work)}),
        "brace in a dotdot": ("d/x/../a/train-00000{0..3}.tar", {"cwd": str(work)}),
        "file:// URL": (f"file://{absolute}", {}),
        "one shard": (f"{absolute}/train-000000.tar", {}),
    }


@pytest.mark.parametrize(
    "label",
    list(_spellings(Path("/w"))),
)
def test_stage_in_and_the_loader_agree_on_the_name_and_the_loader_reads_no_source(
    tree: Path, tmp_path: Path, label: str
) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    spec, where = _spellings(tree)[label]
    os.makedirs(tree / "d" / "x", exist_ok=True)
    dest = tmp_path / "scratch"
    result = subprocess.run(
        [str(BIN / "stage-in"), spec, "--dest", str(dest), "--quiet", "--jitter-max", "0"],
        env=clean_env(),
        capture_output=True,
        text=True,
        cwd=where.get("cwd"),
    )
    assert result.returncode == 0, result.stderr
    assert [p.name for p in dest.iterdir() if not p.name.startswith(".")] == ["a"]
    shutil.move(tree / "d" / "a", tmp_path / "renamed-away")  # any read of the source now fails
    cwd = os.getcwd()
    try:
        os.chdir(where.get("cwd", cwd))
        loader = ShardedLoader(
            spec, batch_size=4, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
        )
        keys = [k for (batch,) in loader for k in batch]
    finally:
        os.chdir(cwd)
    assert loader.shards.staged_dir == dest / "a" and loader.shards.from_source == 0
    expected = {sample_key(s, i) for s, n in enumerate(SPEC.shard_sizes()) for i in range(n)}
    if label == "one shard":
        expected = {sample_key(0, i) for i in range(SPEC.shard_sizes()[0])}
    assert set(keys) == expected and len(keys) == len(expected)


def test_a_list_of_shards_and_from_list_give_the_same_name(tree: Path, tmp_path: Path) -> None:
    from stager_loaders import LoaderOptions, ShardedLoader

    urls = [str(p) for p in sorted((tree / "d" / "a").glob("*.tar"))]
    listing = tmp_path / "shards.txt"
    listing.write_text("# the training shards\n" + "\n".join(urls) + "\n")
    dest = tmp_path / "scratch"
    result = subprocess.run(
        [str(BIN / "stage-in"), "--from-list", str(listing), "--dest", str(dest), "--quiet"],
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    shutil.rmtree(tree / "d" / "a")
    loader = ShardedLoader(
        urls, batch_size=4, to_tuple=("__key__",), options=LoaderOptions(dest=str(dest))
    )
    assert loader.shards.staged_dir == dest / "a" and loader.shards.from_source == 0
    assert sum(len(b) for (b,) in loader) == sum(SPEC.shard_sizes())


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("s3://bucket/data/train", "train"),
        ("s3://bucket/data/train/", "train"),
        ("s3://bucket/data/train/.", "train"),  # (was "."; /nfs/ds/. was always ds)
        ("s3://bucket/data/train/././", "train"),
        ("s3://bucket/data/train/shard-{0000..0009}.tar", "train"),
        ("s3://bucket/data/train/*.tar", "train"),
        ("s3://bucket/data/train/shard-0001.tar", "train"),
        ("gs://b/x/{a,b}/s.tar", "x"),
        ("/nfs/ds/../other/x-{0..1}.tar", "other"),
        ("/nfs/{a,b}/s-0.tar", "nfs"),
        ("/", "dataset"),
        (["s3://b/d/t/a.tar", "s3://b/d/t/sub/b.tar"], "t"),
    ],
)
def test_dataset_names_of_remote_and_odd_specs(spec: str | list[str], name: str) -> None:
    assert dataset_name(spec) == name


def test_source_root_is_absolute_and_folds_dotdot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert source_root("d/x/../a/") == f"{tmp_path}/d/a"
    assert source_root("d/a/*.tar") == f"{tmp_path}/d/a"


def test_no_stager_name_is_spelled_outside_the_layout_module() -> None:
    """The on-disk names live in stager/layout.py only (the lesson of the drifted name rule)."""
    offenders = []
    for path in list((REPO / "stager").rglob("*.py")) + list((REPO / "loaders").rglob("*.py")):
        if path.name == "layout.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"""["']\.stager""", code) or re.search(r"""f["'][^"']*\.stager""", code):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert META_DIR == ".stager" and StagedDataset(Path("/r"), "x").manifest_path == Path(
        "/r/x/.stager/manifest.json"
    )


def _stager_modules() -> list[str]:
    names = []
    for module in pkgutil.walk_packages(stager.__path__, "stager."):
        if not module.name.endswith("__main__"):
            names.append(module.name)
    return names


def test_importing_every_stager_module_imports_no_loader_and_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {_stager_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('stager_loaders', 'loaders', "
        "'torch'))\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_stage_in_loads_neither_the_loader_nor_torch(tmp_path: Path) -> None:
    write_synthetic_dataset(tmp_path / "ds", SPEC)
    seen = tmp_path / "modules.txt"
    code = (
        "import atexit, runpy, sys\n"
        f"atexit.register(lambda: open({str(seen)!r}, 'w').write('\\n'.join(sys.modules)))\n"
        f"sys.argv = ['stager', 'stage-in', {str(tmp_path / 'ds')!r}, '--dest', "
        f"{str(tmp_path / 's')!r}, '--quiet']\n"
        "runpy.run_module('stager', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == 0, result.stderr
    modules = seen.read_text().split()
    assert "stager.stagein.run" in modules  # it did run stage-in
    assert not [m for m in modules if m.split(".")[0] in ("stager_loaders", "loaders", "torch")]
    # nor the standard modules it needs only for a tar in doubt, a sha256 manifest, a retry, a
    # fan-out or a user without $USER: ~15 ms of every node's start together
    unneeded = ("tarfile", "gzip", "random", "datetime", "getpass")
    assert not [m for m in modules if m in unneeded]


def test_every_package_is_listed_in_pyproject() -> None:
    """pyproject lists packages (a mapped directory and discovery do not mix): none forgotten."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "stager").rglob("__init__.py")
    } | {"stager_loaders"}
    assert on_disk == listed


def _stager_imports(path: Path) -> set[str]:
    """Modules of stager that ``path`` imports, at module level or inside functions alike
    (a lazy import still ties two modules together), but not under ``if TYPE_CHECKING:``."""
    import ast

    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stager"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stager"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_import_cycles_between_stager_modules() -> None:
    """No two stager modules import each other, directly or around a loop, lazily or not."""
    names = set(_stager_modules())
    graph: dict[str, set[str]] = {}
    for name in names:
        path = Path(importlib.util.find_spec(name).origin)  # type: ignore[union-attr, arg-type]
        if path.suffix != ".py":
            continue  # the compiled tar walk imports nothing of stager's
        graph[name] = {d for d in _stager_imports(path) if d in names and d != name}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, node, dep]))
            if dep not in state:
                visit(dep, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_no_stager_module_is_over_400_lines() -> None:
    long = [
        f"{p.relative_to(REPO)}: {n}"
        for p in (REPO / "stager").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert not long, long
