"""A first stage-in of a directory without a manifest copies while the walk goes on
(:mod:`stager.stagein.streamed`): its copies must start before the walk ends, a walk that fails
half way must leave nothing staged, and whatever the tree holds, the result must be the one
the list-first path gives (same files, same manifest, same exit code)."""

from __future__ import annotations

import filecmp
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stager.stagein.oneshard
from stager.errors import EXIT_SOURCE, EXIT_USAGE, StagerError
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.slurm import SlurmEnv
from stager.stagein.copier import Copier
from stager.stagein.feed import ItemFeed
from stager.stagein.journal import Journal
from stager.stagein.options import StageInOptions
from stager.stagein.run import stage_in
from stager.stagein.sizing import DeferredPreflight
from stager.storage import listing
from stager.storage.sources import resolve_source

from .inproc import clean_process_env, run_main
from .trees import build_tree


def _two_directories(root: Path) -> Path:
    src = root / "ds"
    for part, seed in (("a", 1), ("b", 2)):
        write_synthetic_dataset(
            src / part, SyntheticSpec(num_shards=3, samples_per_shard=4, seed=seed)
        )
    return src


def _gate_second_directory(monkeypatch: pytest.MonkeyPatch, before) -> list[object]:  # noqa: ANN001
    """Make the walk call ``before()`` when it comes to read the second of the two directories
    (in whatever order it reads them); returns what those calls returned."""
    real = listing._list_dir
    seen: list[object] = []
    subdirectories: list[str] = []

    def gated(directory: str, on_found=None):  # noqa: ANN001, ANN202 - the walk's reader
        if directory.rstrip("/").rsplit("/", 1)[-1] in ("a", "b"):
            subdirectories.append(directory)
            if len(subdirectories) == 2:
                seen.append(before())
        return real(directory, on_found=on_found)

    monkeypatch.setattr(listing, "_list_dir", gated)
    return seen


def _copies_signal(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Events set when the first copy starts, and when the first copy has ended."""
    started, ended = threading.Event(), threading.Event()
    real = stager.stagein.oneshard.copy_file

    def copy_file(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the copier's call
        started.set()
        try:
            return real(*args, **kwargs)
        finally:
            ended.set()

    monkeypatch.setattr(stager.stagein.oneshard, "copy_file", copy_file)
    return started, ended


def test_copies_start_while_the_walk_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_process_env(monkeypatch)
    src = _two_directories(tmp_path)
    started, _ = _copies_signal(monkeypatch)
    # the walk reads its second directory only once a shard of the first is being copied (or
    # gives up after 30 s)
    waited = _gate_second_directory(monkeypatch, lambda: started.wait(30))
    dest = tmp_path / "scratch"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--jitter-max", "0")
    assert result.returncode == 0, result.stderr
    assert waited == [True], "no copy started before the walk reached the second directory"
    shards = sorted(p.relative_to(src) for p in src.rglob("*.tar"))
    staged = sorted(p.relative_to(dest / "ds") for p in (dest / "ds").rglob("*.tar"))
    assert staged == shards and len(shards) == 6
    assert all(filecmp.cmp(src / p, dest / "ds" / p, shallow=False) for p in shards)
    manifest = Manifest.read(StagedDataset(dest, "ds").manifest_path)
    assert [e.relpath for e in manifest.entries] == [str(p) for p in shards]
    assert all(e.samples == 4 for e in manifest.entries)
    rerun = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--jitter-max", "0")
    assert rerun.returncode == 0 and "0 copied, 6 skipped" in rerun.stderr


def test_a_walk_that_fails_half_way_leaves_nothing_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_process_env(monkeypatch)
    src = _two_directories(tmp_path)
    _, ended = _copies_signal(monkeypatch)

    def fail_after_a_copy() -> None:
        ended.wait(30)  # a copy from the first directory has finished (held as .partial)
        raise PermissionError(13, "Permission denied", str(src / "b"))

    _gate_second_directory(monkeypatch, fail_after_a_copy)
    dest = tmp_path / "scratch"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--jitter-max", "0")
    assert ended.is_set()
    assert result.returncode == EXIT_SOURCE, result.stderr
    assert "permission denied" in result.stderr.lower() and str(src) in result.stderr
    left = [p for p in (dest / "ds").rglob("*") if p.is_file() and ".stager" not in p.parts]
    assert left == [], "a failed walk left files staged"


# ---- whatever the tree holds, streamed or listed first, the same outcome -------------------

_ENTRIES = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["a", "b", "c.tar"]), max_size=2),
        st.sampled_from(["s.tar", "t.tar", "u.tgz", "notes.txt", "bad.tar", "x.tar"]),
        st.sampled_from(["shard", "shard", "dir", "fifo", "garbage", "loop", "link", "bad name"]),
    ),
    max_size=10,
)


def _outcome(dest: Path, code: int) -> tuple[object, ...]:
    staged = dest / "ds"
    files = sorted(
        (str(p.relative_to(staged)), p.read_bytes())
        for p in staged.rglob("*")
        if p.is_file() and ".stager" not in p.parts
    )
    manifest_path = StagedDataset(dest, "ds").manifest_path
    entries = (
        [(e.relpath, e.size, e.hash, e.samples) for e in Manifest.read(manifest_path).entries]
        if manifest_path.is_file()
        else None
    )
    return code, files, entries


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(entries=_ENTRIES)
def test_streamed_and_listed_first_runs_agree(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    entries: list,
) -> None:
    clean_process_env(monkeypatch)
    root = tmp_path_factory.mktemp("tree")
    template_dir = root / "template"
    write_synthetic_dataset(template_dir, SyntheticSpec(num_shards=1, samples_per_shard=3))
    src = root / "ds"
    build_tree(src, entries, next(template_dir.glob("*.tar")))
    streamed_dest, listed_dest = root / "streamed", root / "listed"
    streamed = run_main(
        capsys, "stage-in", str(src), "--dest", str(streamed_dest), "--jitter-max", "0"
    )
    try:
        options = StageInOptions(dest_root=listed_dest, progress="none", jitter_max_s=0)
        stage_in(
            resolve_source(str(src), stat_listed=False), options, slurm=SlurmEnv.from_environ({})
        )
        listed_code = 0
    except StagerError as exc:
        listed_code = exc.exit_code
    assert _outcome(streamed_dest, streamed.returncode) == _outcome(listed_dest, listed_code), (
        streamed.stderr
    )


def test_a_list_beside_a_source_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_process_env(monkeypatch)
    src = _two_directories(tmp_path)
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(str(p) for p in sorted(src.rglob("*.tar"))[:2]))
    dest = tmp_path / "scratch"
    result = run_main(capsys, "stage-in", str(src), "--from-list", str(listed), "--dest", str(dest))
    assert result.returncode == EXIT_USAGE and "--from-list" in result.stderr
    assert not list(dest.rglob("*.tar"))


def test_copies_renamed_by_the_verdict_are_journaled_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The verdict renames the copies held during the walk while later copies still run: a
    kill then must not leave final files that a rerun does not know (and copies again)."""
    clean_process_env(monkeypatch)
    src = _two_directories(tmp_path)
    dest = tmp_path / "scratch"
    ended = threading.Event()
    copies = [0]
    real_book = Copier.book_run

    def book_run(self: Copier, copied: list, published: bool) -> None:  # one copy, or a run's
        real_book(self, copied, published)
        copies[0] += len(copied)
        if copies[0] >= 3:
            ended.set()

    monkeypatch.setattr(Copier, "book_run", book_run)
    # the first directory's three copies end (held) before the walk reads the second
    _gate_second_directory(monkeypatch, lambda: ended.wait(30))
    journaled: list[set[str]] = []
    real_done = DeferredPreflight._done

    def done(self: DeferredPreflight) -> None:
        real_done(self)
        if self.gate.passed:
            journaled.append(set(Journal(StagedDataset(dest, "ds").journal_path).read()))

    monkeypatch.setattr(DeferredPreflight, "_done", done)
    records: list[str] = []
    real_record = Journal.record_all

    def record_all(self: Journal, entries: list) -> None:  # (record() calls it too)
        records.extend(entry.relpath for entry in entries)
        real_record(self, entries)

    monkeypatch.setattr(Journal, "record_all", record_all)
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--jitter-max", "0")
    assert result.returncode == 0, result.stderr
    assert len(journaled) == 1
    held = journaled[0]
    assert len(held) >= 3, f"only {sorted(held)} journaled when the verdict renamed the copies"
    assert all((dest / "ds" / relpath).is_file() for relpath in held)
    staged = sorted(p.relative_to(dest / "ds").as_posix() for p in (dest / "ds").rglob("*.tar"))
    assert sorted(records) == staged  # each once: a line per shard, not two for the held ones


def test_a_feed_is_starved_while_open_with_everything_handed_out() -> None:
    """Copy threads ask before waiting for a stream slot: a slot held by a thread that then
    waits for the walk would hold up the copy of an item another thread has taken."""
    feed: ItemFeed[int] = ItemFeed([1, 2], closed=False)
    items = iter(feed)
    assert not feed.starved
    assert (next(items), next(items)) == (1, 2)
    assert feed.starved
    feed.add([3])
    assert not feed.starved
    assert next(items) == 3
    feed.close()
    assert not feed.starved  # closed: the next take ends at once
    assert list(items) == []


def test_an_open_feed_says_when_it_waits() -> None:
    """A copy thread about to wait for items that the walk has not found yet hears it first,
    so that it gives back the stream slot it kept (else the other items of a batch wait)."""
    waits: list[int] = []
    feed: ItemFeed[int] = ItemFeed(closed=False, on_wait=lambda: waits.append(len(feed)))
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(feed), daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while not waits and time.monotonic() < deadline:
        time.sleep(0.001)
    feed.add([1, 2])
    feed.close()
    reader.join(10)
    assert got == [1, 2] and waits[0] == 0


def test_feed_runs_hand_out_consecutive_items_and_wait_only_for_the_first() -> None:
    feed: ItemFeed[int] = ItemFeed(range(5), closed=False)
    sizes = iter([3, 3, 1, 4])
    runs = feed.runs(lambda: next(sizes))
    assert next(runs) == [0, 1, 2]
    assert next(runs) == [3, 4]  # fewer than asked: the rest are not added yet
    taken: list[list[int]] = []
    waiter = threading.Thread(target=lambda: taken.append(next(runs)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not taken  # the first of a run is waited for
    feed.add([5, 6])
    waiter.join(timeout=10)
    assert taken == [[5]]
    feed.close()
    assert list(runs) == [[6]]
