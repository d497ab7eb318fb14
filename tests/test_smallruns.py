"""Small shards copied in runs (stager/stagein/smallruns.py) stage exactly what the one-by-one
path stages: the same files, manifest, failures and exit code, over random trees with random
faults; and the run length follows the shards' copy time."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import EXIT_FULL
from stager.layout import META_DIR
from stager.stagein import smallruns
from stager.stagein.smallruns import MAX_RUN, RUN_BUDGET_S, RunLength
from stager.storage import copyrun

from .conftest import mount_tmpfs
from .inproc import clean_process_env, run_main
from .trees import tar_bytes

FAST = ["--jitter-max", "0", "--quiet", "--retry-delay", "0.01", "--retries", "1"]


def test_the_run_length_doubles_while_shards_are_quick_and_drops_to_what_fits() -> None:
    length = RunLength()
    assert length() == 1  # the first take: one shard, timed
    seen = []
    for _ in range(10):
        length.timed(1e-5)
        seen.append(length())
    assert seen[:7] == [2, 4, 8, 16, 32, 64, 64] and max(seen) == MAX_RUN
    length.timed(RUN_BUDGET_S / 5)  # slower: what fits the budget
    assert length() == 5
    length.timed(0.03)  # a round trip per shard (NFS): one at a time, the one-by-one path
    assert length() == 1
    length.timed(0.0)
    assert length() == 2  # (an untimed copy grows it as a quick one)
    assert RunLength(most=1).timed(1e-6) is None and RunLength(most=1)() == 1


FAULTS = ["none", "none", "none", "hash", "size", "samples", "missing", "rewritten", "grown"]


def _tree(root: Path, count: int) -> dict[str, bytes]:
    files = {}
    for i in range(count):
        members = [(f"k{i}-{j}.jpg", bytes([i % 256, j]) * (50 + 37 * j)) for j in range(1 + i % 4)]
        files[f"d{i % 3}/s{i:03d}.tar"] = tar_bytes(members)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _spoil(root: Path, faults: dict[str, str]) -> None:
    """Make the source and its manifest disagree as ``faults`` says, per shard."""
    manifest_path = root / "stager-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]:
        fault, path = faults.get(entry["path"], "none"), root / entry["path"]
        if fault == "hash":
            entry["hash"] = "xxh3_64:0123456789abcdef"
        elif fault == "size":
            entry["size"] += 512
        elif fault == "samples":
            entry["samples"] += 1
        elif fault == "missing":
            path.unlink()
        elif fault == "rewritten":  # same size, other bytes
            data = bytearray(path.read_bytes())
            data[600] ^= 0xFF
            path.write_bytes(bytes(data))
        elif fault == "grown":
            path.write_bytes(path.read_bytes() + bytes(512))
    manifest_path.write_text(json.dumps(manifest))


def _outcome(dest: Path, report: Path) -> tuple[dict[str, bytes], list[tuple[str, str]], str]:
    dataset = dest / "src"
    files = {
        p.relative_to(dataset).as_posix(): p.read_bytes()
        for p in dataset.rglob("*")
        if p.is_file() and META_DIR not in p.parts
    }
    failures = sorted((f["url"], f["reason"]) for f in json.loads(report.read_text())["failures"])
    manifest = dataset / META_DIR / "manifest.json"
    return files, failures, manifest.read_text() if manifest.exists() else ""


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(2, 40),
    faults=st.lists(st.sampled_from(FAULTS), min_size=40, max_size=40),
    run=st.integers(2, MAX_RUN),
    manifest=st.booleans(),
)
def test_runs_stage_what_one_by_one_stages(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    count: int,
    faults: list[str],
    run: int,
    manifest: bool,
) -> None:
    clean_process_env(monkeypatch)
    root = tmp_path_factory.mktemp("t")
    src = root / "src"
    names = sorted(_tree(src, count))
    if manifest:
        assert run_main(capsys, "stager", "index", str(src)).returncode == 0
        _spoil(src, dict(zip(names, faults, strict=False)))
    shutil.copytree(src, root / "copy")  # (each run reads the same source)
    outcomes = []
    jobs_per_run: list[int] = []
    real_copy_run = copyrun.copy_run

    def spy(jobs, **kwargs):  # type: ignore[no-untyped-def]
        jobs_per_run.append(len(jobs))
        return real_copy_run(jobs, **kwargs)

    for runs in (True, False):
        with monkeypatch.context() as patch:
            if runs:  # takes of ``run`` shards from the start, whatever their time
                patch.setattr(smallruns.copyrun, "copy_run", spy)
                patch.setattr(RunLength, "__call__", lambda self: run)
            else:
                patch.setattr(smallruns.SmallRuns, "of", classmethod(lambda cls, copier: None))
            dest, report = root / f"dest-{runs}", root / f"report-{runs}.json"
            result = run_main(
                capsys, "stage-in", str(src), "--dest", str(dest), "--report", str(report), *FAST
            )
            outcomes.append((result.returncode, *_outcome(dest, report)))
            assert not list(dest.rglob("*.partial"))
    assert outcomes[0] == outcomes[1]
    missing = sum(1 for f in faults[:count] if manifest and f == "missing")  # (never planned)
    if count - missing >= 2:
        assert max(jobs_per_run, default=0) > 1  # runs were copied (not all one by one)
    code, files, failures, _ = outcomes[0]
    assert (code == 0) == (not failures)
    spoilt = {n for n, f in zip(names, faults, strict=False) if manifest and f != "none"}
    assert {url.rsplit("/src/", 1)[1] for url, _ in failures} == spoilt
    assert set(files) == set(names) - spoilt
    for name in files:
        assert files[name] == (root / "copy" / name).read_bytes()


def test_a_remote_or_cached_or_throttled_copier_has_no_runs(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Runs are for plain local copies; the others keep the one-by-one path (its pacing, its
    cache claims, its object-store reads)."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src"
    _tree(src, 6)
    made: list[object] = []
    real_of = smallruns.SmallRuns.of.__func__  # type: ignore[attr-defined]

    def spy(cls, copier):  # type: ignore[no-untyped-def]
        made.append(real_of(cls, copier))
        return made[-1]

    monkeypatch.setattr(smallruns.SmallRuns, "of", classmethod(spy))
    for extra in (["--bw-limit", "1000"], ["--cache", str(tmp_path / "cache")], []):
        dest = tmp_path / f"d{len(made)}"
        assert (
            run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST, *extra).returncode
            == 0
        )
    assert [r is not None for r in made] == [False, False, copyrun.available()]


def test_scratch_filled_by_another_writer_during_a_run_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer fills scratch as a run starts: the run's copy fails, the one-by-one path
    says "no space left" (exit 6), the shards after it are not attempted, no partial is left,
    and each file staged is whole."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src"
    files = _tree(src, 30)
    fill_at = sorted(files)[12]
    with mount_tmpfs(tmp_path / "tmpfs", "1536k") as scratch:
        filler = scratch / "other-writer"
        filling = [True]

        def hook(event: str, args: tuple) -> None:
            name = args[0] if event == "open" and args else None
            if (
                filling[0]
                and isinstance(name, (str, bytes))
                and os.fsdecode(name).endswith(fill_at)
            ):
                filling[0] = False  # (once; and the filler's own open is not this shard's)
                with open(filler, "wb") as out, contextlib.suppress(OSError):
                    while out.write(bytes(64 << 10)):
                        out.flush()

        sys.addaudithook(hook)  # (cannot be removed: it fires once)
        monkeypatch.setattr(RunLength, "__call__", lambda self: 8)
        dest = scratch / "job"
        result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST)
        assert result.returncode == EXIT_FULL, result.stderr
        assert "no space left" in result.stderr
        assert not filling[0] and not list(scratch.rglob("*.partial"))
        staged = {
            p.relative_to(dest / "src").as_posix(): p.read_bytes()
            for p in (dest / "src").rglob("*.tar")
        }
        assert fill_at not in staged and len(staged) < len(files)
        assert all(files[name] == data for name, data in staged.items())


def _staged_with(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    src: Path,
    dest: Path,
    *extra: str,
    runs: bool = True,
) -> tuple[int, list[tuple[str, str]], list[int]]:
    """Stage ``src`` with takes of 8 (or without runs): exit code, failures, and how many
    shards each run copied."""
    copied: list[int] = []
    real_copy_run = copyrun.copy_run

    def spy(jobs, **kwargs):  # type: ignore[no-untyped-def]
        results = real_copy_run(jobs, **kwargs)
        copied.append(sum(1 for r in results if r is not None))
        return results

    report = dest.with_suffix(".json")
    with monkeypatch.context() as patch:
        if runs:
            patch.setattr(smallruns.copyrun, "copy_run", spy)
            patch.setattr(RunLength, "__call__", lambda self: 8)
        else:
            patch.setattr(smallruns.SmallRuns, "of", classmethod(lambda cls, copier: None))
        argv = ("stage-in", str(src), "--dest", str(dest), "--report", str(report), *FAST, *extra)
        code = run_main(capsys, *argv).returncode
    failures = sorted((f["url"], f["reason"]) for f in json.loads(report.read_text())["failures"])
    return code, failures, copied


def test_one_shard_per_directory_is_still_copied_in_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scratch directories are made before a run: a run no longer ends at the first shard of
    each new directory (with one shard per directory, every run ended before copying any)."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src"
    for i in range(24):
        (src / f"dir{i:02d}").mkdir(parents=True)
        (src / f"dir{i:02d}" / "s.tar").write_bytes(tar_bytes([(f"k{i}.jpg", bytes([i]) * 300)]))
    code, failures, copied = _staged_with(capsys, monkeypatch, src, tmp_path / "dest")
    assert code == 0 and not failures
    assert sum(copied) >= 12, copied  # most of them by runs, not one by one
    for i in range(24):
        staged = tmp_path / "dest" / "src" / f"dir{i:02d}" / "s.tar"
        assert staged.read_bytes() == (src / f"dir{i:02d}" / "s.tar").read_bytes()


def test_samples_are_counted_one_by_one_where_the_compiled_walk_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """STAGER_NATIVE_TAR=0, or a file system encoding other than UTF-8, turns the tar walk off:
    shards whose samples are counted then go one by one (a run feeds the compiled walk), and
    stage-in stages them all, counted, where it used to stop with a traceback."""
    import stager.shards.tarnative as tarnative

    clean_process_env(monkeypatch)
    src = tmp_path / "src"
    files = _tree(src, 20)
    monkeypatch.setattr(tarnative, "_module", None)
    code, failures, copied = _staged_with(capsys, monkeypatch, src, tmp_path / "dest")
    assert (code, failures, copied) == (0, [], [])  # no run: every shard counted one by one
    manifest = json.loads((tmp_path / "dest" / "src" / META_DIR / "manifest.json").read_text())
    assert sorted(e["path"] for e in manifest["shards"]) == sorted(files)
    assert all(e["samples"] == 1 + int(e["path"][-7:-4]) % 4 for e in manifest["shards"])
    code, failures, copied = _staged_with(
        capsys, monkeypatch, src, tmp_path / "uncounted", "--no-count"
    )
    assert code == 0 and not failures and sum(copied) > 0  # not counting: runs again


def test_a_shard_an_audit_hook_refuses_fails_alone_as_one_by_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site's audit hook may refuse an open: the run it was in is copied one by one, where
    the refusal fails that shard alone (one FAILED line), as without runs."""
    clean_process_env(monkeypatch)
    src = tmp_path / "src"
    files = _tree(src, 20)
    refused = sorted(files)[9]
    refusing = [True]

    def hook(event: str, args: tuple) -> None:
        name = args[0] if event == "open" and args else None
        if refusing[0] and isinstance(name, (str, bytes)) and os.fsdecode(name).endswith(refused):
            raise PermissionError(f"refused by the site's audit hook: {os.fsdecode(name)}")

    sys.addaudithook(hook)  # (cannot be removed: turned off below)
    try:
        with_runs = _staged_with(capsys, monkeypatch, src, tmp_path / "runs")
        without = _staged_with(capsys, monkeypatch, src, tmp_path / "one", runs=False)
    finally:
        refusing[0] = False
    assert with_runs[:2] == without[:2]
    code, failures, _ = with_runs
    assert code != 0 and len(failures) == 1 and failures[0][0].endswith(refused)
    staged = {
        p.relative_to(tmp_path / "runs" / "src").as_posix()
        for p in (tmp_path / "runs" / "src").rglob("*.tar")
    }
    assert staged == set(files) - {refused}
