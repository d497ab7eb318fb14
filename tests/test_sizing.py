"""Sizing walked shards while they copy: the probe's results, and the gate that holds copies back
until the free-space check on those sizes has passed."""

from __future__ import annotations

import errno
import filecmp
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import EXIT_FULL, EXIT_SOURCE
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.stagein.sizing import DROPPED, UNKNOWN, DeferredPreflight, PublishGate, SizeProbe
from stager.storage.identity import local_version
from stager.storage.statmany import StatRow, stat_many, stat_many_python

from .inproc import clean_process_env, run_main


def _files(root: Path, sizes: list[int]) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, size in enumerate(sizes):
        path = root / f"s{i}.tar"
        path.write_bytes(b"x" * size)
        paths.append(str(path))
    return paths


def _partial(root: Path, name: str, data: bytes = b"data") -> tuple[str, str]:
    partial = root / f"{name}.partial"
    partial.write_bytes(data)
    return str(partial), str(root / name)


def test_probe_gives_sizes_and_drops_what_a_walk_would_not_list(tmp_path: Path) -> None:
    paths = _files(tmp_path / "src", [10, 0, 300])
    (tmp_path / "src" / "dir.tar").mkdir()
    paths += [str(tmp_path / "src" / "dir.tar"), str(tmp_path / "src" / "gone.tar")]
    sized: list[int] = []
    done = threading.Event()
    probe = SizeProbe(paths, 3, on_size=sized.append, on_done=done.set).start()
    assert [probe.get(i) for i in range(len(paths))] == [10, 0, 300, DROPPED, DROPPED]
    probe.join()
    assert done.is_set() and sum(sized) == 310  # (a call per run of sizes: their total)


def test_a_run_of_stats_mixing_files_and_others_is_entered_path_by_path(tmp_path: Path) -> None:
    """One run (the paths statted together, as on a fast filesystem) of regular files, a
    directory, a FIFO, a vanished path and an unstattable one: each gets its own result,
    version and warning, as when they were entered one at a time."""
    paths = _files(tmp_path / "src", [5, 7])
    (tmp_path / "src" / "dir.tar").mkdir()
    os.mkfifo(tmp_path / "src" / "pipe.tar")
    odd = ["dir.tar", "pipe.tar", "gone.tar", "x" * 5000]
    paths = [paths[0], *(str(tmp_path / "src" / n) for n in odd), paths[1]]
    sized: list[int] = []
    probe = SizeProbe(paths, 1, on_size=sized.append)
    probe._record_run(list(range(len(paths))), stat_many(paths, 10.0)[0])
    assert [probe.get(i) for i in range(len(paths))] == [5, DROPPED, DROPPED, DROPPED, UNKNOWN, 7]
    assert sized == [12]
    assert probe.not_regular == [2]  # the FIFO: a directory or a vanished path is not said
    assert "cannot stat it" in probe.error(4)
    versions = [probe.version(i) for i in range(len(paths))]
    assert versions == [
        local_version(os.stat(paths[0])),
        None,
        None,
        None,
        None,
        local_version(os.stat(paths[5])),
    ]


def test_probe_marks_an_entry_it_cannot_stat_unknown(tmp_path: Path) -> None:
    # Not "gone": the copy's own open reports the real error (here: name too long).
    assert SizeProbe([str(tmp_path / ("x" * 5000))], 1).start().get(0) == UNKNOWN


def test_get_waits_for_a_result_still_to_come(tmp_path: Path) -> None:
    paths = _files(tmp_path, [7] * 50)
    probe = SizeProbe(paths, 1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(probe.get(49)))
    waiter.start()  # before the probe starts: it must wait, not read a placeholder
    probe.start()
    waiter.join(timeout=10)
    assert got == [7]


def test_gate_holds_copies_until_it_passes_then_renames_them(tmp_path: Path) -> None:
    gate = PublishGate()
    held = _partial(tmp_path, "a.tar")
    gate.publish(*held)
    assert os.path.exists(held[0]) and not os.path.exists(held[1])
    assert gate.pass_() == []
    assert Path(held[1]).read_bytes() == b"data" and not os.path.exists(held[0])
    later = _partial(tmp_path, "b.tar")
    gate.publish(*later)
    assert os.path.exists(later[1]) and not os.path.exists(later[0])


def test_gate_refused_deletes_held_and_later_copies(tmp_path: Path) -> None:
    gate = PublishGate()
    held = _partial(tmp_path, "a.tar")
    gate.publish(*held)
    gate.refuse()
    later = _partial(tmp_path, "b.tar")
    gate.publish(*later)
    assert gate.refused
    assert not any(os.path.exists(p) for p in (*held, *later))
    assert gate.pass_() == [] and gate.refused  # the verdict is final


@pytest.mark.parametrize("verdict", [None, "passed", "refused"])
def test_gate_publishes_a_run_as_it_publishes_one_copy(tmp_path: Path, verdict: str | None) -> None:
    """A run's copies (stager/stagein/smallruns.py): held before the verdict, renamed after a
    pass (a failed rename reported, its partial gone), deleted after a refusal."""
    gate = PublishGate()
    if verdict == "passed":
        gate.pass_()
    elif verdict == "refused":
        gate.refuse()
    pairs = [_partial(tmp_path, f"{name}.tar") for name in "abc"]
    Path(pairs[1][1]).mkdir()
    (Path(pairs[1][1]) / "x").write_bytes(b"")  # b.tar's name is taken by a directory
    renamed, errors = gate.publish_run(pairs)
    assert renamed is (verdict == "passed")
    exists = [(os.path.exists(p), os.path.isfile(f)) for p, f in pairs]
    if verdict is None:
        assert exists == [(True, False)] * 3 and errors == [None] * 3
        assert [f for f, _ in gate.pass_()] == [pairs[1][1]]  # renamed at the pass
        assert os.path.isfile(pairs[0][1]) and os.path.isfile(pairs[2][1])
    elif verdict == "passed":
        assert exists == [(False, True), (False, False), (False, True)]
        assert errors[0] is None and errors[2] is None and isinstance(errors[1], OSError)
    else:
        assert exists == [(False, False)] * 3 and errors == [None] * 3


def test_deferred_preflight_passes_when_the_sizes_fit(tmp_path: Path) -> None:
    paths = _files(tmp_path / "src", [100, 200, 300])
    totals: list[tuple[int, int]] = []
    check = DeferredPreflight(
        paths,
        2,
        known_bytes=50,
        free_bytes=700,
        min_free_bytes=50,
        on_sized=lambda b, n: totals.append((b, n)),
    )
    held = _partial(tmp_path, "a.tar")
    check.gate.publish(*held)  # a copy that finished before the verdict
    check.start().finish()
    assert not check.refused and check.needed_bytes == 650 and totals == [(600, 0)]
    assert os.path.exists(held[1]) and not os.path.exists(held[0])


def test_deferred_preflight_refuses_when_the_sizes_do_not_fit(tmp_path: Path) -> None:
    paths = _files(tmp_path / "src", [100, 200, 300])
    check = DeferredPreflight(paths, 2, known_bytes=0, free_bytes=599)
    held = _partial(tmp_path, "a.tar")
    check.gate.publish(*held)
    check.start().finish()
    assert check.refused and check.needed_bytes == 600 and check.free_bytes == 599
    assert not os.path.exists(held[0]) and not os.path.exists(held[1])


# -- stage-in with copies held back: the last shard's stat is slow, so the others finish first --


def _patch_stat(monkeypatch: pytest.MonkeyPatch, name: str, before: Callable[[], None]) -> None:
    """Run ``before()`` ahead of the probe's stat of the shard called ``name``."""
    import stager.stagein.sizing

    def stat_(path: str) -> os.stat_result:
        if path.endswith(name):
            before()
        return os.stat(path)

    def stat_run(paths: list[str], budget_s: float) -> tuple[list[StatRow | int], float]:
        return stat_many_python(paths, budget_s, stat=stat_)

    monkeypatch.setattr(stager.stagein.sizing, "_stat_run", stat_run)


def _slow_last_stat(monkeypatch: pytest.MonkeyPatch, last: str, delay_s: float = 0.6) -> None:
    _patch_stat(monkeypatch, last, lambda: time.sleep(delay_s))


def test_held_compressed_shards_are_counted_once_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Compressed shards are counted from the staged file after the copy; a copy held back by
    # the pending space check has no staged file yet, so its count must wait for the rename.
    clean_process_env(monkeypatch)
    src = tmp_path / "gz"
    shards = write_synthetic_dataset(
        src, SyntheticSpec(num_shards=3, samples_per_shard=4, compress=True)
    )
    _slow_last_stat(monkeypatch, shards[-1].name)
    dest = tmp_path / "scratch"
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(dest), "--jitter-max", "0", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    staged = Manifest.read(StagedDataset.of(dest / "gz").manifest_path)
    assert [(e.relpath, e.samples) for e in staged.entries] == [(p.name, 4) for p in shards]
    assert all(filecmp.cmp(p, dest / "gz" / p.name, shallow=False) for p in shards)


def test_refusal_after_held_copies_reports_nothing_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import stager.stagein.guards

    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    shards = write_synthetic_dataset(src, SyntheticSpec(num_shards=4, samples_per_shard=4))
    (src / "odd.tar").mkdir()  # dropped, as a walk drops it: not in the totals either
    total = sum(p.stat().st_size for p in shards)
    _slow_last_stat(monkeypatch, shards[-1].name)
    monkeypatch.setattr(stager.stagein.guards, "free_bytes", lambda path: total - 1)
    dest, report_path = tmp_path / "scratch", tmp_path / "report.json"
    result = run_main(
        capsys,
        "stage-in",
        str(src),
        "--dest",
        str(dest),
        "--jitter-max",
        "0",
        "--quiet",
        "--report",
        str(report_path),
    )
    assert result.returncode == EXIT_FULL, result.stderr
    assert f"({total} bytes)" in result.stderr
    assert not list(dest.rglob("*.tar")) and not list(dest.rglob("*.partial"))
    report = json.loads(report_path.read_text())
    assert report["files_copied"] == 0 and report["bytes_copied"] == 0
    assert report["files_total"] == 4 and report["bytes_total"] == total


def test_a_shard_that_cannot_be_stat_ed_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_process_env(monkeypatch)
    src = tmp_path / "ds"
    shards = write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=2))

    def fail() -> None:
        raise OSError(errno.EIO, "Input/output error")

    _patch_stat(monkeypatch, shards[1].name, fail)
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(tmp_path / "s"), "--jitter-max", "0", "--quiet"
    )
    assert result.returncode == EXIT_SOURCE, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert (
        len(failed) == 1
        and shards[1].name in failed[0]
        and "cannot stat it: Input/output error" in failed[0]
    )
    assert sorted(p.name for p in (tmp_path / "s" / "ds").glob("*.tar")) == [
        shards[0].name,
        shards[2].name,
    ]


# names a staged tree and a listing draw from: files, directories and symlinks collide on them
_NAMES = ["a.tar", "b.tar", "d", "d/a.tar", "d/e", "d/e/b.tar", "l", "l/a.tar"]


@settings(max_examples=200, deadline=None)
@given(
    staged=st.dictionaries(
        st.sampled_from(_NAMES), st.sampled_from(["file", "dir", "link-file", "link-dir"])
    ),
    listed=st.sets(st.sampled_from([n for n in _NAMES if n.endswith(".tar")])),
)
def test_which_shards_are_sized_while_copying_agrees_with_lexists(
    tmp_path_factory: pytest.TempPathFactory, staged: dict[str, str], listed: set[str]
) -> None:
    # The staged tree is walked once (StagedNames) instead of an lexists per shard; the verdict
    # must be the same for any tree of files, directories and symlinks, including names that
    # sit under a file or a symlinked directory.
    from stager.stagein.plan import sized_while_copying
    from stager.stagein.stagedtree import StagedNames
    from stager.storage.sources import SourceSet, SourceShard

    root = tmp_path_factory.mktemp("staged")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "a.tar").write_bytes(b"x")
    for name, kind in sorted(staged.items()):
        path = root / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "file":
                path.write_bytes(b"x")
            elif kind == "dir":
                path.mkdir()
            elif kind == "link-file":
                path.symlink_to(elsewhere / "a.tar")
            else:
                path.symlink_to(elsewhere, target_is_directory=True)
        except (FileExistsError, NotADirectoryError):
            continue  # a name already taken by another kind, or under a file
    shards = [SourceShard(f"/src/{r}", f"/src/{r}", r, None) for r in sorted(listed)]
    source = SourceSet("/src", "ds", tuple(shards), walked=True)
    undescribed = set(listed)
    walked = sized_while_copying(source, shards, undescribed, root, StagedNames.walk(str(root)))
    assert walked == sized_while_copying(source, shards, undescribed, root)


def test_probe_stats_fast_paths_in_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fast filesystem a probe thread stats many paths per take of the interpreter lock:
    far fewer runs than paths, and the same answers as one stat each."""
    import stager.stagein.sizing

    calls: list[int] = []

    def counted(paths: list[str], budget_s: float) -> tuple[list[StatRow | int], float]:
        results, spent_s = stat_many(paths, budget_s)
        calls.append(len(results))
        return results, spent_s

    monkeypatch.setattr(stager.stagein.sizing, "_stat_run", counted)
    paths = _files(tmp_path, [n % 7 for n in range(2000)])
    probe = SizeProbe(paths, 8).start()
    assert [probe.get(i) for i in range(len(paths))] == [n % 7 for n in range(2000)]
    probe.join()
    assert sum(calls) == len(paths) and len(calls) < len(paths) / 4


class _SlowStats:
    """``os.stat`` that sleeps ``delay_s`` first (for the paths in ``only``, else every path),
    counting the most slow stats in flight at once (``peak``)."""

    def __init__(self, delay_s: float, only: set[str] | None = None) -> None:
        self.delay_s, self.only = delay_s, only
        self.inside = self.peak = 0
        self._lock = threading.Lock()

    def __call__(self, path: str) -> os.stat_result:
        if self.only is None or path in self.only:
            with self._lock:
                self.inside += 1
                self.peak = max(self.peak, self.inside)
            time.sleep(self.delay_s)
            with self._lock:
                self.inside -= 1
        return os.stat(path)


def test_probe_keeps_slow_stats_in_flight_on_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a stat is a slow round trip (NFS), each thread claims one path at a time, so the
    round trips overlap instead of queueing behind one thread's run."""
    slow = _SlowStats(delay_s=0.02)
    claimed: list[int] = []

    import stager.stagein.sizing

    def stat_run(paths: list[str], budget_s: float) -> tuple[list[StatRow | int], float]:
        claimed.append(len(paths))
        return stat_many_python(paths, budget_s, stat=slow)

    monkeypatch.setattr(stager.stagein.sizing, "_stat_run", stat_run)
    paths = _files(tmp_path, [1] * 24)
    probe = SizeProbe(paths, 4).start()
    assert [probe.get(i) for i in range(len(paths))] == [1] * 24
    probe.join()
    assert claimed == [1] * 24 and slow.peak >= 2


def test_a_run_whose_stats_turn_slow_is_handed_back_path_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs grow long while stats are fast; when they turn slow (attributes cached by the
    listing, then not), the rest of a claimed run goes back one path at a time, so the round
    trips overlap on the threads instead of queueing on the one that claimed them."""
    import stager.stagein.sizing

    fast, slow_count = 300, 40
    paths = _files(tmp_path, [1] * (fast + slow_count))
    slow = set(paths[fast:])
    calls: list[list[str]] = []
    slow_stat = _SlowStats(delay_s=0.01, only=slow)

    def stat_run(run: list[str], budget_s: float) -> tuple[list[StatRow | int], float]:
        calls.append(run)
        return stat_many_python(run, budget_s, stat=slow_stat)

    monkeypatch.setattr(stager.stagein.sizing, "_stat_run", stat_run)
    threads = 4
    probe = SizeProbe(paths, threads).start()
    assert [probe.get(i) for i in range(len(paths))] == [1] * len(paths)
    probe.join()
    long_slow = [run for run in calls if run[0] in slow and len(run) > 1]
    assert len(long_slow) <= threads, "a slow remainder was statted by the thread that claimed it"
    assert slow_stat.peak >= 2
    assert max(map(len, calls)) > 1  # (the runs did grow while the stats were fast)


@settings(max_examples=40, deadline=None)
@given(
    slow=st.lists(st.booleans(), min_size=1, max_size=120),
    threads=st.integers(1, 8),
    batches=st.integers(1, 4),
)
def test_probe_answers_every_path_once_whatever_the_speeds(
    tmp_path_factory: pytest.TempPathFactory, slow: list[bool], threads: int, batches: int
) -> None:
    """Random fast and slow stats, a listing streamed in batches: every path gets its size,
    none is stat'ed twice, and the probe ends (no run left in flight or handed back)."""
    import stager.stagein.sizing

    root = tmp_path_factory.mktemp("probe")
    paths = _files(root, [i % 5 for i in range(len(slow))])
    delay = {p: 0.003 for p, s in zip(paths, slow, strict=True) if s}
    seen: list[str] = []

    def stat_(path: str) -> os.stat_result:
        seen.append(path)
        time.sleep(delay.get(path, 0.0))
        return os.stat(path)

    real = stager.stagein.sizing._stat_run
    stager.stagein.sizing._stat_run = lambda run, budget_s: stat_many_python(
        run, budget_s, stat=stat_
    )
    try:
        cut = [len(paths) * k // batches for k in range(batches + 1)]
        probe = SizeProbe(paths[: cut[1]], threads, more=True).start()
        for lo, hi in zip(cut[1:-1], cut[2:], strict=True):
            probe.add(paths[lo:hi])
        probe.close()
        assert [probe.get(i) for i in range(len(paths))] == [i % 5 for i in range(len(paths))]
        probe.join()
    finally:
        stager.stagein.sizing._stat_run = real
    assert sorted(seen) == sorted(paths)
