"""Property: after every stage-in run, each staged file is the source's current bytes, or the run
failed naming it.

Hypothesis draws a source tree (odd names: backslashes, colons, spaces, non-ASCII, a directory
named like a partial file, subdirectories) and a sequence of mutations, each followed by a
stage-in run into the same destination: shards rewritten at the same size with their mtime put
back (as ``cp -p`` or ``rsync -a`` leave them), replaced, removed, added, duplicated in a
``--from-list``, and the source swapped for another one under the same name. After each run:

* nothing ``.partial`` is left, and the staged manifest lists exactly the files staged;
* every staged file with its final name holds the current bytes of the source shard of that
  name, unless the run exited non-zero naming it;
* a run that exited 0 staged exactly the source's shards;
* a swapped source is refused (exit 2), and the staged copy stays the first source's, whole;
* a shard cut inside a member (no longer a readable tar) is never staged, and every run while
  the source holds it fails naming it.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import EXIT_USAGE
from stager.layout import META_DIR, StagedDataset
from stager.shards.manifest import Manifest

from .inproc import clean_process_env, run_main

NAMES = [
    "a.tar",
    "b.tar",
    "x\\y.tar",
    "x/y.tar",
    "sub/c.tar",
    "sp ace.tar",
    "col:on.tar",
    "ünï.tar",
    "x.partial/z.tar",
    "deep/er/d.tar",
]
FAST = ["--jitter-max", "0", "--quiet", "--retry-delay", "0.01", "--retries", "1"]


def _tar(fill: int, samples: int, stem: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            data = bytes([fill]) * 700
            info = tarfile.TarInfo(f"{stem}-{i:03d}.bin")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _write(root: Path, name: str, fill: int, samples: int) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_tar(fill, samples, Path(name).stem))


def _source_files(root: Path, *, listed: bool = False) -> dict[str, bytes]:
    """The source's shards by the relative path they are staged at: under ``root`` for a
    directory, under the deepest directory holding them all for a list (as stage-in places a
    list)."""
    files = sorted(p for p in root.rglob("*.tar") if p.is_file())
    base = Path(os.path.commonpath([p.parent for p in files])) if listed and files else root
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in files}


def _staged_files(dataset: Path) -> dict[str, bytes]:
    return {
        p.relative_to(dataset).as_posix(): p.read_bytes()
        for p in dataset.rglob("*")
        if p.is_file() and META_DIR not in p.relative_to(dataset).parts
    }


mutation = st.one_of(
    st.tuples(st.just("rewrite"), st.sampled_from(NAMES)),
    st.tuples(st.just("replace"), st.sampled_from(NAMES), st.integers(1, 4)),
    st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    st.tuples(st.just("add"), st.sampled_from(NAMES), st.integers(1, 4)),
    st.tuples(st.just("swap")),
    st.tuples(st.just("cut"), st.sampled_from(NAMES)),
    st.tuples(st.just("nothing")),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    initial=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 4), min_size=1, max_size=6),
    listed=st.booleans(),
    duplicates=st.booleans(),
    steps=st.lists(mutation, min_size=1, max_size=6),
)
def test_staged_files_are_the_current_source_bytes_or_the_run_named_them(
    initial: dict[str, int],
    listed: bool,
    duplicates: bool,
    steps: list[tuple],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_process_env(monkeypatch)
    work = Path(tempfile.mkdtemp(prefix="trust-"))
    try:
        _run_sequence(work, initial, listed, duplicates, steps, capsys)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_sequence(
    work: Path,
    initial: dict[str, int],
    listed: bool,
    duplicates: bool,
    steps: list[tuple],
    capsys: pytest.CaptureFixture[str],
) -> None:
    src, other, dest = work / "one" / "ds", work / "two" / "ds", work / "scratch"
    for fill, (name, samples) in enumerate(sorted(initial.items()), start=1):
        _write(src, name, fill, samples)
        _write(other, name, 200 + fill, samples)  # same names, other bytes: another dataset
    next_fill = 50

    def stage(root: Path) -> tuple[int, str]:
        if listed:
            names = sorted(p for p in root.rglob("*.tar") if p.is_file())
            lines = [str(p) for p in names] + ([str(names[0])] if duplicates and names else [])
            listing = work / f"list-{root.parent.name}.txt"
            listing.write_text("\n".join(lines) + "\n")
            argv = ["--from-list", str(listing)]
        else:
            argv = [str(root)]
        result = run_main(capsys, "stage-in", *argv, "--dest", str(dest), "--name", "ds", *FAST)
        return result.returncode, result.stderr

    code, err = stage(src)
    _check(src, dest / "ds", code, err, listed)
    cut: set[str] = set()  # shards cut inside a member: no longer readable tars
    for step in steps:
        op, name = step[0], step[1] if len(step) > 1 else None
        target = src / name if name else None
        if name is not None and op in ("replace", "add", "remove"):
            cut.discard(name)
        if op == "cut" and target is not None and target.is_file():
            target.write_bytes(target.read_bytes()[:600])  # inside the first member's payload
            cut.add(name)
        elif op == "rewrite" and target is not None and target.is_file() and name not in cut:
            before = target.stat()
            data = bytearray(target.read_bytes())
            data[600] ^= 0xFF  # a payload byte: same size, other bytes, a valid tar still
            target.write_bytes(bytes(data))
            os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
        elif op in ("replace", "add") and name is not None and not (src / name).is_dir():
            next_fill += 1
            _write(src, name, next_fill, step[2])
        elif op == "remove" and target is not None and target.is_file():
            target.unlink()
        if not _source_files(src):
            _write(src, "a.tar", 99, 1)  # an empty source is another test's business
            cut.discard("a.tar")
        if op == "swap":
            before_swap = _staged_files(dest / "ds")
            code, err = stage(other)
            assert code == EXIT_USAGE, err
            assert str(dest / "ds") in err
            assert _staged_files(dest / "ds") == before_swap
            continue
        code, err = stage(src)
        _check(src, dest / "ds", code, err, listed)
        for name in cut:
            assert code != 0 and name in err, (name, code, err)
            assert not any(path.endswith(name) for path in _staged_files(dest / "ds")), err


def _check(src: Path, dataset: Path, code: int, err: str, listed: bool) -> None:
    assert "Traceback" not in err, err
    assert not [p for p in dataset.parent.rglob("*.partial") if p.is_file()], err
    staged = _staged_files(dataset)
    source = _source_files(src, listed=listed)
    for relpath, data in staged.items():
        if source.get(relpath) != data:
            assert code != 0 and relpath in err, (relpath, code, err)
    manifest = Manifest.read(StagedDataset.of(dataset).manifest_path)
    assert {e.relpath for e in manifest.entries} <= set(staged), err
    if code == 0:
        assert staged == source, err
        assert {e.relpath for e in manifest.entries} == set(source)
