"""stat_many: the compiled run of stats answers exactly as ``os.stat`` does, path by path, on
random trees (files, directories, FIFOs, symlinks dangling and looping, missing paths, a file
used as a directory, names too long, names that are not UTF-8, times past 2262), and stops at
its time budget after at least one path."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stager.storage import statmany

_KINDS = st.sampled_from(
    ["file", "empty", "dir", "fifo", "link", "dangling", "loop", "missing", "under-file", "long"]
)


def _make(root: Path, index: int, kind: str) -> str:
    """One path of ``kind`` under ``root`` (as a str, which is what the probe passes)."""
    name = root / f"p{index}-{kind}"
    if kind == "file":
        name.write_bytes(b"x" * (index * 37 % 1000))
    elif kind == "empty":
        name.touch()
        os.utime(name, ns=(0, 10**19 + 123))  # 10^10 s: past int64 nanoseconds' 2262
    elif kind == "dir":
        name.mkdir()
    elif kind == "fifo":
        os.mkfifo(name)
    elif kind == "link":
        (root / f"t{index}").write_bytes(b"target")
        name.symlink_to(root / f"t{index}")
    elif kind == "dangling":
        name.symlink_to(root / "nowhere")
    elif kind == "loop":
        name.symlink_to(name)
    elif kind == "under-file":
        name.write_bytes(b"")
        return str(name / "child")  # ENOTDIR
    elif kind == "long":
        return str(root / ("n" * 300))  # ENAMETOOLONG
    return str(name)


def _expected(path: str) -> statmany.StatRow | int:
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.errno or errno.EIO
    return (st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kinds=st.lists(_KINDS, min_size=1, max_size=20))
def test_the_compiled_runs_answer_as_os_stat_does(tmp_path: Path, kinds: list[str]) -> None:
    assert statmany.available(), "stager/storage/_statmany.c was not built: pip install -e ."
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh tree per example
    paths = [_make(root, i, kind) for i, kind in enumerate(kinds)]
    raw = os.fsencode(str(root / "caf\udce9"))  # not UTF-8: os.stat takes it surrogate-escaped
    Path(os.fsdecode(raw)).write_bytes(b"latin-1 name")
    paths.append(os.fsdecode(raw))
    want = [_expected(path) for path in paths]
    for stat_run in (statmany.stat_many, statmany.stat_many_python):
        got, spent_s = stat_run(paths, 60.0)
        assert got == want and spent_s >= 0


@pytest.mark.parametrize("stat_run", [statmany.stat_many, statmany.stat_many_python])
def test_a_spent_budget_ends_the_run_after_at_least_one_path(tmp_path: Path, stat_run) -> None:
    paths = [_make(tmp_path, i, "file") for i in range(50)]
    got, _ = stat_run(paths, 0.0)
    assert got == [_expected(paths[0])]
    assert stat_run([], 0.0)[0] == []


def test_a_path_like_that_changes_the_list_cannot_crash_it(tmp_path: Path) -> None:
    """Encoding an item may run Python (``__fspath__``); the helper reads a copy of the list."""
    paths: list = []

    class Shrinking:
        def __fspath__(self) -> str:
            paths.clear()
            return str(tmp_path)

    paths.extend([Shrinking()] + [str(tmp_path)] * 10)
    got, _ = statmany.stat_many(paths, 60.0)
    assert got == [_expected(str(tmp_path))] * 11


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kinds=st.lists(_KINDS, min_size=1, max_size=12), cache_links=st.integers(0, 3))
@example(kinds=["file", "link", "dir", "fifo", "file"], cache_links=2)  # (every stat succeeds)
def test_key_stats_packs_what_the_key_takes_from_os_stat_or_says_none(
    tmp_path: Path, kinds: list[str], cache_links: int
) -> None:
    """The loader key's ``(size, changed_ns)`` pairs from C equal ``indexkey.changed_ns`` of
    ``os.stat`` path by path, read-only files with other links (``--cache`` objects) keyed
    by their mtime; any path that fails (or a time past int64's 2262) gives None."""
    from array import array

    from stager.shards.indexkey import changed_ns

    assert statmany.available(), "stager/storage/_statmany.c was not built: pip install -e ."
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    paths = [_make(root, i, kind) for i, kind in enumerate(kinds)]
    for number in range(cache_links):  # a cache object: 0444, linked twice
        target = root / f"cache-{number}"
        target.write_bytes(b"c" * number)
        os.utime(target, ns=(5, 10**18 + number))  # its mtime far behind its ctime
        target.chmod(0o444)
        os.link(target, root / f"cache-{number}-link")
        paths.append(str(root / f"cache-{number}-link"))
    stats = []
    for path in paths:
        try:
            stats.append(os.stat(path))
        except OSError:
            stats.append(None)
    packed = statmany.key_stats(paths)
    # the same rows from the names joined behind one prefix (a loader's packed paths)
    head = os.fsencode(str(root) + os.sep)
    names = [os.fsencode(p).removeprefix(head) for p in paths]
    assert all(os.fsencode(p) == head + n for p, n in zip(paths, names, strict=True))
    assert statmany.key_stats_joined(head, b"\0".join(names), len(names)) == packed
    assert statmany.key_stats_joined(head, b"\0".join(names), len(names) + 1) is None
    if any(st is None or max(st.st_mtime_ns, st.st_ctime_ns) >= 2**63 for st in stats):
        assert packed is None
        return
    want = [v for st in stats if st is not None for v in (st.st_size, changed_ns(st))]
    assert packed is not None and array("q", packed).tolist() == want
    assert statmany.key_stats([]) == b"" == statmany.key_stats_joined(head, b"", 0)


def test_key_stats_runs_on_threads_equal_one_pass(tmp_path: Path) -> None:
    """A large copy's stats split into runs on threads give the rows of one pass, in order;
    a run that fails (a copy not there) makes the whole answer None."""
    names = [f"s{i:03d}" for i in range(40)]
    for number, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x" * number)
    head = os.fsencode(str(tmp_path) + os.sep)
    runs = [(head, "\0".join(names[a:b]).encode(), b - a) for a, b in ((0, 13), (13, 27), (27, 40))]
    whole = statmany.key_stats([str(tmp_path / name) for name in names])
    assert whole is not None and statmany.key_stats_runs(runs) == whole
    assert statmany.key_stats_runs(runs[:1]) == statmany.key_stats_joined(*runs[0])
    (tmp_path / names[20]).unlink()
    assert statmany.key_stats_runs(runs) is None
