"""Security: hostile names never escape the dataset root, scratch is private and ours, and no
shell ever sees a user-provided string."""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stager.errors import EXIT_DEST, EXIT_SOURCE, StagerError, UnsafePath
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .conftest import REPO
from .inproc import clean_process_env, run_main

HOSTILE_NAMES = [
    "../evil.tar",
    "a/../../evil.tar",
    "/etc/passwd",
    "ok/\x00.tar",
    "",
    ".",
    "a/./../..",
    "train-000000.tar.partial",
]
FAST = ["--jitter-max", "0", "--quiet"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sec") / "ds"
    write_synthetic_dataset(root, SyntheticSpec(num_shards=3, samples_per_shard=4, image_bytes=500))
    return root


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


def _json_manifest(path: Path, name: str) -> Path:
    shard = {"path": name, "size": 10, "hash": None, "samples": None}
    path.write_text(
        json.dumps({"format": "stager-manifest", "version": 1, "meta": {}, "shards": [shard]})
    )
    return path


def _parquet_manifest(path: Path, name: str) -> Path:
    table = pa.table({"path": [name], "size": [10], "hash": [None], "samples": [None]})
    table = table.replace_schema_metadata(
        {b"stager.format": b"stager-manifest", b"stager.version": b"1"}
    )
    pq.write_table(table, path)
    return path


#: Odd on Windows, ordinary on POSIX: a backslash and a colon are characters of one file name.
#: They are kept as they are and stay inside the dataset (turning ``\\`` into ``/`` once made
#: two different shards land on one path).
ODD_BUT_INSIDE = ["..\\evil.tar", "C:/evil.tar", "x\\y.tar", "a:b.tar", " lead.tar", "nl\n.tar"]


@pytest.mark.parametrize("name", ODD_BUT_INSIDE)
def test_odd_posix_names_are_kept_and_stay_inside(tmp_path: Path, name: str) -> None:
    from stager.storage.paths import safe_join, safe_relpath

    assert safe_relpath(name) == name
    root = tmp_path / "root"
    root.mkdir()
    assert safe_join(root, name).resolve().is_relative_to(root.resolve())


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("writer", [_json_manifest, _parquet_manifest], ids=["json", "parquet"])
def test_hostile_manifest_entries_are_refused(tmp_path: Path, name: str, writer) -> None:
    suffix = ".json" if writer is _json_manifest else ".parquet"
    with pytest.raises(StagerError) as info:
        Manifest.read(writer(tmp_path / f"m{suffix}", name))
    assert isinstance(info.value, UnsafePath) or "manifest" in str(info.value)


def test_stage_in_with_a_hostile_manifest_writes_nothing(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _json_manifest(tmp_path / "m.json", "../../../escaped.tar")
    dest = tmp_path / "deep" / "er" / "scratch"
    result = run_main(
        capsys, "stage-in", str(dataset), "--dest", str(dest), "--manifest", str(manifest), *FAST
    )
    assert result.returncode == EXIT_DEST, result.stderr
    assert "../../../escaped.tar" in result.stderr and "refused" in result.stderr
    assert not list(tmp_path.rglob("escaped.tar")) and not list(dest.rglob("*.tar"))


def test_list_file_naming_a_path_outside_the_dataset_is_refused(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src" / "ds"
    src.mkdir(parents=True)
    (src / "train-000000.tar").write_bytes((dataset / "train-000000.tar").read_bytes())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.tar").write_bytes((dataset / "train-000000.tar").read_bytes())
    listing = tmp_path / "list.txt"
    listing.write_text(f"{src}/train-000000.tar\n{src}/../../outside/evil.tar\n")
    dest = tmp_path / "scratch"
    result = run_main(
        capsys, "stage-in", "--from-list", str(listing), "--dest", str(dest), "--name", "ds", *FAST
    )
    assert result.returncode == EXIT_DEST, result.stderr
    assert "evil.tar" in result.stderr and "refused" in result.stderr
    assert not list(dest.rglob("*.tar")) if dest.exists() else True
    assert sorted(p.name for p in tmp_path.rglob("evil.tar")) == ["evil.tar"]  # only the original


def test_dest_that_is_a_symlink_is_refused(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    link = tmp_path / "scratch"
    link.symlink_to(target)
    result = run_main(capsys, "stage-in", str(dataset), "--dest", str(link), *FAST)
    assert result.returncode == EXIT_DEST and "symlink" in result.stderr
    assert not list(target.iterdir())


def test_dataset_dir_pre_created_as_a_symlink_is_refused(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    dest = tmp_path / "scratch"
    dest.mkdir(mode=0o700)
    (dest / "ds").symlink_to(target)  # another user planted DEST/<name> -> their directory
    result = run_main(capsys, "stage-in", str(dataset), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_DEST and "symlink" in result.stderr
    assert not list(target.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_dest_owned_by_another_user_is_refused(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "scratch"
    dest.mkdir(mode=0o777)
    os.chown(dest, 12345, 12345)
    result = run_main(capsys, "stage-in", str(dataset), "--dest", str(dest), *FAST)
    assert result.returncode == EXIT_DEST and "owned by uid 12345" in result.stderr
    assert not list(dest.iterdir())


def test_scratch_dirs_stage_in_creates_are_private_and_existing_ones_keep_their_mode(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "scratch"
    dest.mkdir(mode=0o755)
    os.chmod(dest, 0o755)  # pre-existing (think --dest /tmp): its mode is its owner's choice
    result = run_main(capsys, "stage-in", str(dataset), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "ds").stat().st_mode) == 0o700  # what stage-in creates is private


def test_paths_with_spaces_quotes_and_newlines(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = "my ds 'single' \"double\" $HOME `x` ;\nline2"
    src = tmp_path / odd
    src.mkdir()
    for shard in dataset.glob("*.tar"):
        (src / shard.name).write_bytes(shard.read_bytes())
    dest = tmp_path / f"scratch {odd}"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (dest / odd).glob("*.tar")) == sorted(
        p.name for p in dataset.glob("*.tar")
    )
    index = run_main(capsys, "stager", "index", str(src))
    assert index.returncode == 0 and (src / "stager-manifest.json").is_file()


# -- no shell, anywhere -------------------------------------------------------------------------
_SHELL_CALLS = {
    ("os", "system"),
    ("os", "popen"),
    ("subprocess", "getoutput"),
    ("subprocess", "getstatusoutput"),
}


def shell_uses(source: str, filename: str = "<source>") -> list[str]:
    """Places in ``source`` that start a shell: ``shell=<anything but False>``, os.system & co."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg == "shell" and not (
                isinstance(keyword.value, ast.Constant) and keyword.value.value is False
            ):
                found.append(f"{filename}:{node.lineno}: shell=...")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if (func.value.id, func.attr) in _SHELL_CALLS or (
                func.value.id == "os" and func.attr.startswith("spawn")
            ):
                found.append(f"{filename}:{node.lineno}: {func.value.id}.{func.attr}")
    return found


def test_the_detector_finds_shell_uses() -> None:
    sample = (
        "import os, subprocess\nsubprocess.run(cmd, shell=True)\nos.system('x')\n"
        "subprocess.run(['ls'])\n"
    )
    assert shell_uses(sample) == ["<source>:2: shell=...", "<source>:3: os.system"]


@pytest.mark.parametrize("package", ["stager", "loaders"])
def test_no_shell_anywhere_in_the_package(package: str) -> None:
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    found = []
    for path in files:
        text = path.read_text()
        found += shell_uses(text, str(path.relative_to(REPO)))
        found += [
            f"{path.relative_to(REPO)}: text 'shell=True'"
            for line in text.splitlines()
            if "shell=True" in line
        ]
    assert found == []


@pytest.mark.parametrize("planted", ["sub", "train-000001.tar"])
def test_symlink_planted_inside_the_dataset_is_refused_not_followed(
    tmp_path: Path, planted: str
) -> None:
    from stager.errors import UnsafePath
    from stager.storage.paths import SafeJoiner

    root = tmp_path / "ds"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    join = SafeJoiner(root)
    assert (
        join("sub/train-000000.tar") == root / "sub" / "train-000000.tar"
    )  # directory resolved and cached
    (root / planted).symlink_to(outside if planted == "sub" else outside / "victim.tar")
    target = "sub/train-000000.tar" if planted == "sub" else planted
    fresh = SafeJoiner(root)
    with pytest.raises(UnsafePath, match="resolves outside"):
        fresh(target)
    assert join("train-000002.tar") == root / "train-000002.tar"


@pytest.mark.parametrize("planted", ["sub", "sub/deeper", "sub/deeper/s1.tar"])
def test_stage_in_never_writes_through_a_symlink_planted_in_the_staged_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str
) -> None:
    """The plan lists the staged tree once and skips per-shard checks only when that tree holds
    no symlink at all: a link planted at any depth still makes the run refuse, not follow it."""
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(
        src / "sub" / "deeper", SyntheticSpec(num_shards=2, samples_per_shard=2)
    )
    (src / "sub" / "deeper" / "s1.tar").write_bytes(
        (src / "sub" / "deeper" / "train-000000.tar").read_bytes()
    )
    dest = tmp_path / "scratch"
    outside = tmp_path / "outside"
    (outside / "deeper").mkdir(parents=True)
    link = dest / "ds" / planted
    link.parent.mkdir(parents=True)
    link.symlink_to(outside / "deeper" / "s1.tar" if planted.endswith(".tar") else outside)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--no-count", *FAST)
    assert result.returncode == EXIT_DEST, result.stderr
    assert "resolves outside" in result.stderr
    assert not list(outside.rglob("*.tar*")), "wrote outside the dataset"


@pytest.mark.parametrize("where", ["shard", "directory"])
def test_a_name_that_is_not_utf8_is_refused_in_one_line(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """POSIX names are bytes; manifests, indexes and reports hold UTF-8. A shard (or source
    directory) whose name is not UTF-8 is refused before anything is staged, naming it, rather
    than crashing with a traceback after the copies."""
    bad = os.fsdecode(b"bad\xff")
    src = tmp_path / (bad if where == "directory" else "src")
    src.mkdir()
    for shard in sorted(dataset.glob("*.tar")):
        (src / shard.name).write_bytes(shard.read_bytes())
    if where == "shard":
        (src / "train-000000.tar").rename(src / f"{bad}.tar")
    dest = tmp_path / "scratch"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--name", "ds", *FAST)
    assert result.returncode == EXIT_SOURCE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not valid UTF-8" in lines[0] and "bad\\xff" in lines[0], lines
    assert not dest.exists() or not list(dest.rglob("*.tar*"))
