"""Runs of small shards copied by one compiled call (stager/storage/copyrun.py, _copyrun.c):
each copy is the source's bytes with xxhash's digest and the walk's index, left ``.partial``
until published; a job that fails ends the run with nothing of it left, and the jobs after it
are not started; no descriptor leaks."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.shards._tarwalk import TarWalker
from stager.shards.tarparse import TarSampleCounter
from stager.storage import bytepath, copyrun
from stager.storage.copyrun import RunJob, copy_run, publish_run

from .trees import tar_bytes

pytestmark = pytest.mark.skipif(
    not copyrun.available(), reason="the byte pump was not built (no C compiler)"
)

BLOCK = 1 << 18  # the run's buffer: a file of this size or more is not for a run


def _identity_version(path: Path) -> str:
    from stager.storage.identity import local_version

    return local_version(os.stat(path))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


_members = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c/d"]),
        st.sampled_from(["jpg", "cls"]),
        st.binary(max_size=3000),
    ),
    max_size=8,
)
_contents = st.one_of(
    st.binary(max_size=BLOCK - 1),
    _members.map(
        lambda ms: tar_bytes(
            [(f"{k}{i // 2}.{e}", d) for i, (k, e, d) in enumerate(ms)], tarfile.GNU_FORMAT
        )
    ),
)


def _jobs(tmp_path: Path, contents: list[bytes], walk: bool = True) -> list[RunJob]:
    jobs = []
    for i, data in enumerate(contents):
        src = tmp_path / f"src{i}.tar"
        src.write_bytes(data)
        counter = TarSampleCounter() if walk else None
        jobs.append(RunJob(str(src), str(tmp_path / f"out{i}.tar"), len(data), None, counter))
    return jobs


#: Modification times a source can carry, in nanoseconds: before 1970 (negative, with and
#: without nanoseconds past the second), around zero, and past 2262 (beyond 64 bits once made
#: one count of nanoseconds, as the version does).
_times_ns = st.one_of(
    st.integers(min_value=-(2**40) * 10**9, max_value=2**40 * 10**9),
    st.integers(min_value=-(10**9) - 1, max_value=10**9 + 1),
    st.integers(min_value=-10, max_value=10).map(lambda s: s * 10**9),
    st.integers(min_value=2**63, max_value=2**43 * 10**9),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(mtimes=st.lists(_times_ns, min_size=1, max_size=4))
def test_a_runs_version_is_the_one_the_python_path_writes_for_any_source_time(
    tmp_path_factory: pytest.TempPathFactory, mtimes: list[int]
) -> None:
    """The version string is made in C from the open's stat; it must equal
    ``identity.local_version`` of the source, which resume compares it with, for any time the
    file system keeps (a time it refuses is skipped)."""
    tmp_path = tmp_path_factory.mktemp("times")
    jobs = _jobs(tmp_path, [b"x" * (i + 1) for i in range(len(mtimes))], walk=False)
    for job, mtime in zip(jobs, mtimes, strict=True):
        try:
            os.utime(job.src_path, ns=(mtime, mtime))
        except (OSError, OverflowError):
            continue  # (a time this file system cannot keep)
    results = copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=60.0, publish=False)
    for job, result in zip(jobs, results, strict=True):
        assert result is not None
        assert result.version == _identity_version(Path(job.src_path))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    contents=st.lists(_contents, min_size=1, max_size=8),
    hashed=st.booleans(),
    publish=st.booleans(),
)
def test_a_run_copies_hashes_and_walks_each_file_as_the_python_pieces(
    tmp_path_factory: pytest.TempPathFactory, contents: list[bytes], hashed: bool, publish: bool
) -> None:
    tmp_path = tmp_path_factory.mktemp("run")
    jobs = _jobs(tmp_path, contents)
    if hashed:  # the manifest's hash, checked
        jobs = [
            RunJob(
                j.src_path,
                j.final,
                j.expected_size,
                f"xxh3_64:{xxhash.xxh3_64_hexdigest(d)}",
                j.inspect,
            )
            for j, d in zip(jobs, contents, strict=True)
        ]
    before = _open_fds()
    results = copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=60.0, publish=publish)
    assert len(results) == len(jobs) and all(r is not None for r in results)
    for job, data, result in zip(jobs, contents, results, strict=True):
        assert result is not None
        named, other = (job.final, job.partial) if publish else (job.partial, job.final)
        assert Path(named).read_bytes() == data and not Path(other).exists()
        assert (
            result.size == len(data) and result.hash == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"
        )
        assert result.version == _identity_version(Path(job.src_path))
        assert 0 <= result.first_byte_s <= result.seconds
        reference = TarWalker()
        reference.feed(data)
        walked = reference.finish()
        counter = job.inspect
        assert isinstance(counter, TarSampleCounter)
        assert counter.samples == (None if walked is None else int(walked["samples"]))
    if not publish:
        errors = publish_run([(job.partial, job.final) for job in jobs])
        assert errors == [None] * len(jobs)
    assert [Path(job.final).read_bytes() for job in jobs] == contents
    assert not list(tmp_path.glob("*.partial")) and _open_fds() == before


def _spoil(tmp_path: Path, jobs: list[RunJob], at: int, how: str) -> list[RunJob]:
    """Make ``jobs[at]`` fail the way ``how`` says."""
    job = jobs[at]
    src = Path(job.src_path)
    if how == "missing":
        src.unlink()
    elif how == "directory":
        src.unlink()
        src.mkdir()
    elif how == "fifo":
        src.unlink()
        os.mkfifo(src)
    elif how == "reads more than its size":  # (fails after its partial was created)
        src.unlink()
        src.symlink_to("/proc/self/status")  # regular, size 0, yet a read returns its text
    elif how == "larger than the buffer":
        src.write_bytes(b"x" * BLOCK)
    elif how == "no partial directory":
        job = RunJob(
            job.src_path, str(tmp_path / "gone" / "x.tar"), job.expected_size, None, job.inspect
        )
    elif how == "partial name is a directory":
        Path(job.partial).mkdir()
    elif how == "other size":
        job = RunJob(job.src_path, job.final, job.expected_size + 1, None, job.inspect)
    elif how == "other hash":
        job = RunJob(
            job.src_path, job.final, job.expected_size, "xxh3_64:0000000000000000", job.inspect
        )
    elif how == "other samples":  # (each shard holds one sample)
        job = RunJob(job.src_path, job.final, job.expected_size, None, job.inspect, 2)
    return [*jobs[:at], job, *jobs[at + 1 :]]


HOW = [
    "missing",
    "directory",
    "fifo",
    "reads more than its size",
    "larger than the buffer",
    "no partial directory",
    "partial name is a directory",
    "other size",
    "other hash",
    "other samples",
]


@pytest.mark.parametrize("publish", [False, True])
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("at", [0, 2, 4])
def test_a_failing_job_ends_the_run_with_nothing_of_it_left(
    tmp_path: Path, how: str, at: int, publish: bool
) -> None:
    """The caller copies it one by one (which says what is wrong) and starts a new run after it."""
    contents = [tar_bytes([(f"s{i}.jpg", bytes([i]) * 900)]) for i in range(5)]
    jobs = _spoil(tmp_path, _jobs(tmp_path, contents), at, how)
    before = _open_fds()
    results = copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=60.0, publish=publish)
    assert _open_fds() == before
    if how in ("other size", "other hash", "other samples"):  # checked after the copy: went on
        assert len(results) == 5 and results[at] is None
        assert all(r is not None for i, r in enumerate(results) if i != at)
    else:
        assert len(results) == at + 1 and results[at] is None  # the rest not started
        assert all(r is not None for r in results[:at])
        assert not any(Path(j.partial).is_file() for j in jobs[at + 1 :])
    assert not Path(jobs[at].partial).is_file() and not Path(jobs[at].final).exists()
    for job, data, result in zip(jobs, contents, results, strict=False):
        if result is not None:
            assert Path(job.final if publish else job.partial).read_bytes() == data


@pytest.mark.parametrize("publish", [False, True])
@pytest.mark.parametrize("expected", [None, 3, 4])
def test_a_tar_its_walk_does_not_vouch_for_is_counted_in_python_then_published(
    tmp_path: Path, publish: bool, expected: int | None
) -> None:
    """Such a copy is not renamed in C: its count comes from reading the copy back, and a count
    other than the one expected refuses it (nothing of it left), as the walk's would."""
    # (keys that are not ASCII: the compiled walk leaves them to the Python walk)
    data = tar_bytes([(f"clé{i}.jpg", bytes([65 + i]) * 700) for i in range(3)])
    walker = TarWalker()
    walker.feed(data)
    assert walker.finish() is None  # (the premise: the walk does not vouch)
    jobs = _jobs(tmp_path, [b"x" * 50, data, b"y" * 60])
    jobs[1] = RunJob(jobs[1].src_path, jobs[1].final, len(data), None, jobs[1].inspect, expected)
    results = copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=60.0, publish=publish)
    assert len(results) == 3 and results[0] is not None and results[2] is not None
    counter = jobs[1].inspect
    assert isinstance(counter, TarSampleCounter) and counter.samples == 3
    if expected == 4:
        assert results[1] is None
        assert not Path(jobs[1].partial).exists() and not Path(jobs[1].final).exists()
    else:
        assert results[1] is not None
        named = jobs[1].final if publish else jobs[1].partial
        assert Path(named).read_bytes() == data
    assert not Path(jobs[1].partial).exists() or not publish


def test_a_published_run_raises_the_rename_events_os_replace_raises(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, [b"a" * 10, b"b" * 10], walk=False)
    seen: list[tuple[str, bytes, bytes]] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "os.rename":
            seen.append((event, os.fsencode(args[0]), os.fsencode(args[1])))

    sys.addaudithook(hook)  # (cannot be removed: it stops recording below)
    try:
        copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=1.0, publish=True)
    finally:
        watching[0] = False
    for job in jobs:
        assert ("os.rename", os.fsencode(job.partial), os.fsencode(job.final)) in seen
        assert Path(job.final).exists() and not Path(job.partial).exists()


def test_the_budget_ends_a_run_after_its_first_copy_at_least(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, [b"a" * 100, b"b" * 100, b"c" * 100])
    results = copy_run(jobs, block_bytes=BLOCK, fsync=True, budget_s=0.0, publish=False)
    assert len(results) == 1 and results[0] is not None  # the rest: the caller's next run
    assert not Path(jobs[1].partial).exists() and not Path(jobs[2].partial).exists()


def test_a_walker_already_in_use_is_refused_with_nothing_copied(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, [b"a" * 100, b"b" * 100])
    walker = jobs[0].inspect.compiled_walk()  # type: ignore[union-attr]
    # the same walker twice in one run: the second claim finds it busy
    arguments = [(j.src_path, j.partial, j.final, j.expected_size, None, -1, walker) for j in jobs]
    with pytest.raises(RuntimeError):
        bytepath._pump.copy_run(arguments, bytepath._buffer(BLOCK), 1 << 20, False, 1.0, True)
    assert not list(tmp_path.glob("*.partial"))
    results = copy_run(
        jobs, block_bytes=BLOCK, fsync=False, budget_s=1.0, publish=False
    )  # released: usable
    assert [r is not None for r in results] == [True, True]


def test_an_inspector_without_a_compiled_walk_is_refused(tmp_path: Path) -> None:
    class Fed:
        def feed(self, chunk: memoryview) -> None: ...

        def finish(self, read_at: object) -> None: ...

    job = RunJob(str(tmp_path / "x"), str(tmp_path / "y"), 1, None, Fed())
    with pytest.raises(ValueError, match="compiled walk"):
        copy_run([job], block_bytes=BLOCK, fsync=False, budget_s=1.0, publish=False)


def test_renames_that_fail_say_why_and_leave_no_partial(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, [b"a" * 10, b"b" * 10, b"c" * 10], walk=False)
    copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=1.0, publish=False)
    Path(jobs[1].final).mkdir()
    (Path(jobs[1].final) / "inside").write_bytes(b"")  # a non-empty directory has its name
    errors = publish_run([(j.partial, j.final) for j in jobs])
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], OSError) and errors[1].errno in (21, 39)  # EISDIR, ENOTEMPTY
    assert not list(tmp_path.glob("*.partial"))
    assert Path(jobs[0].final).read_bytes() == b"a" * 10


def test_a_run_raises_the_audit_events_os_open_and_os_replace_raise(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, [b"a" * 10, b"b" * 10], walk=False)
    seen: list[tuple[str, bytes]] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event in ("open", "os.rename") and isinstance(args[0], (str, bytes)):
            seen.append((event, os.fsencode(args[0])))

    sys.addaudithook(hook)  # (cannot be removed: it stops recording below)
    try:
        copy_run(jobs, block_bytes=BLOCK, fsync=False, budget_s=1.0, publish=False)
        publish_run([(j.partial, j.final) for j in jobs])
    finally:
        watching[0] = False
    for job in jobs:
        assert ("open", os.fsencode(job.src_path)) in seen
        assert ("open", os.fsencode(job.partial)) in seen
        assert ("os.rename", os.fsencode(job.partial)) in seen


@pytest.mark.parametrize(
    ("size", "expected_hash", "fits"),
    [
        (None, None, False),
        (0, None, True),
        (BLOCK - 1, None, True),
        (BLOCK, None, False),
        (10, "xxh3_64:00", True),
        (10, "sha256:00", False),
    ],
)
def test_what_fits_a_run(size: int | None, expected_hash: str | None, fits: bool) -> None:
    assert copyrun.fits(size, expected_hash, BLOCK) is fits


def test_a_job_list_changed_while_it_is_read_is_copied_as_it_was(tmp_path: Path) -> None:
    """A path's __fspath__ that empties the list meanwhile: the run copies the jobs as they
    were when it was called (it read past the list's end and crashed before)."""
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    jobs: list[tuple[object, str, str, int, None, int, None]] = []

    class Emptying:
        def __fspath__(self) -> str:
            jobs.clear()
            return str(src)

    jobs += [
        (Emptying(), str(tmp_path / "a.partial"), str(tmp_path / "a"), 100, None, -1, None),
        (str(src), str(tmp_path / "b.partial"), str(tmp_path / "b"), 100, None, -1, None),
    ]
    copied, failed = bytepath._pump.copy_run(
        jobs, bytepath._buffer(BLOCK), 1 << 20, False, 1.0, False
    )
    assert len(copied) == 2 and not failed
    pairs: list[tuple[object, str]] = []

    class Emptying2:
        def __fspath__(self) -> str:
            pairs.clear()
            return str(tmp_path / "a.partial")

    pairs += [
        (Emptying2(), str(tmp_path / "a")),
        (str(tmp_path / "b.partial"), str(tmp_path / "b")),
    ]
    assert bytepath._pump.rename_run(pairs) == [0, 0]
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"x" * 100
