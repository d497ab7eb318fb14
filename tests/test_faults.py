"""Fault injection: flaky and failing sources, kill -9 at random moments, full scratch, changed
shards. Every test checks bytes against the source, not only exit codes.

Flaky/failing sources use ``faulty://`` (tests/faulty_fs.py) and run the stage-in CLI
in-process (``stage_in_main``), so the faults need no subprocess plumbing; kill -9 needs a real
process and uses the console script.
"""

from __future__ import annotations

import filecmp
import json
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stager.cli.main import stage_in_main
from stager.errors import EXIT_FULL, EXIT_INTEGRITY, EXIT_SOURCE
from stager.layout import StagedDataset
from stager.shards.build import IndexOptions, build_manifest, write_manifest
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.hashing import hash_file
from stager.storage.sources import resolve_source

from .conftest import BIN, clean_env, mount_tmpfs
from .faulty_fs import FaultyFileSystem
from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--retry-delay", "0.01", "--quiet"]
_FAULT_VARS = (
    "FAULTY_READ_FAIL_RATE",
    "FAULTY_SEED",
    "FAULTY_DENY",
    "FAULTY_FILL_ON",
    "FAULTY_FILL_PATH",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 shards of ~60 KB with a manifest beside them (as `stager index` writes it)."""
    root = tmp_path_factory.mktemp("faults") / "ds"
    write_synthetic_dataset(
        root, SyntheticSpec(num_shards=16, samples_per_shard=12, image_bytes=4000, seed=3)
    )
    write_manifest(build_manifest(resolve_source(str(root))), str(root / "stager-manifest.json"))
    return root


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)
    for name in _FAULT_VARS:
        monkeypatch.delenv(name, raising=False)
    FaultyFileSystem.reset()


def shards(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*.tar"))


def assert_staged_verified(
    src: Path, staged: Path, names: list[str], *, with_manifest: bool = True
) -> None:
    """Exactly ``names`` are staged, byte-identical, and the staged manifest's hashes match."""
    assert sorted(p.name for p in shards(staged)) == sorted(names)
    for name in names:
        assert filecmp.cmp(src / name, staged / name, shallow=False), name
    if with_manifest:
        manifest = Manifest.read(StagedDataset.of(staged).manifest_path).by_relpath()
        for name in names:
            assert manifest[name].hash == hash_file(src / name, manifest[name].hash.split(":")[0])
    assert not list(staged.rglob("*.partial"))


def test_transient_read_errors_are_retried_until_every_shard_is_staged(
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FAULTY_READ_FAIL_RATE", "0.1")
    monkeypatch.setenv(
        "FAULTY_SEED", "8"
    )  # a pattern that fails 8 of ~40 reads, some twice in a row
    report = tmp_path / "r.json"
    argv = [
        f"faulty://{dataset}",
        "--dest",
        str(tmp_path / "s"),
        "--retries",
        "6",
        "--report",
        str(report),
        *FAST,
    ]
    assert stage_in_main(argv) == 0, capsys.readouterr().err
    injected = FaultyFileSystem.counts()["injected"]
    assert injected >= 3, "the fault pattern should have failed some reads"
    assert json.loads(report.read_text())["retries"] == injected
    assert_staged_verified(dataset, tmp_path / "s" / "ds", [p.name for p in shards(dataset)])


def test_permanent_errors_fail_alone_with_one_line_each(
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = ["train-000002.tar", "train-000011.tar"]
    monkeypatch.setenv("FAULTY_DENY", ",".join(bad))
    dest = tmp_path / "s"
    assert stage_in_main([f"faulty://{dataset}", "--dest", str(dest), *FAST]) == EXIT_SOURCE
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if line.startswith("FAILED ")]
    assert sorted(failed) == sorted(
        f"FAILED faulty://{dataset}/{name}: source shard not readable (permission denied): faulty://{dataset}/{name}"
        for name in bad
    )
    assert "] retry " not in err  # a permanent error is not retried
    good = [p.name for p in shards(dataset) if p.name not in bad]
    assert_staged_verified(dataset, dest / "ds", good)

    monkeypatch.delenv("FAULTY_DENY")  # the source is fixed: a rerun copies only the two
    report = tmp_path / "r.json"
    assert (
        stage_in_main([f"faulty://{dataset}", "--dest", str(dest), "--report", str(report), *FAST])
        == 0
    )
    assert json.loads(report.read_text())["files_copied"] == 2
    assert_staged_verified(dataset, dest / "ds", [p.name for p in shards(dataset)])


def test_a_shard_changed_since_indexing_is_reported_not_staged(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src" / "ds"
    shutil.copytree(dataset, src)
    changed = src / "train-000007.tar"
    data = bytearray(changed.read_bytes())
    data[3000] ^= 0xFF  # same size, one byte of a payload differs: only the hash can tell
    changed.write_bytes(bytes(data))
    dest = tmp_path / "s"
    assert stage_in_main([str(src), "--dest", str(dest), *FAST]) == EXIT_INTEGRITY
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and failed[0].startswith(f"FAILED {changed}: ")
    assert "does not match the manifest" in failed[0]
    assert "] retry " not in err
    good = [p.name for p in shards(src) if p != changed]
    assert_staged_verified(src, dest / "ds", good)
    assert (
        "train-000007.tar"
        not in Manifest.read(StagedDataset.of(dest / "ds").manifest_path).by_relpath()
    )


def test_transient_faults_while_indexing_give_the_clean_manifest(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = build_manifest(resolve_source(str(dataset)))
    # The tar reader reads ~10 KB at a time, so a lower rate per read still fails ~1 in 5 scans.
    monkeypatch.setenv("FAULTY_READ_FAIL_RATE", "0.02")
    monkeypatch.setenv("FAULTY_SEED", "6")  # fails 7 reads
    from stager.storage.retry import RetryPolicy

    flaky = build_manifest(
        resolve_source(f"faulty://{dataset}"),
        IndexOptions(retry=RetryPolicy(attempts=8, base_delay_s=0.001)),
    )
    assert FaultyFileSystem.counts()["injected"] >= 3
    assert flaky.entries == clean.entries


# -- kill -9 at random moments -----------------------------------------------------------------
def _kill_trial(
    dataset: Path, tmp_path: Path, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Start stage-in, SIGKILL it at a random moment, check what it left, rerun, check again."""
    rng = random.Random(seed)
    dest = tmp_path / f"kill{seed}"
    staged = dest / "ds"
    proc = subprocess.Popen(
        [
            str(BIN / "stage-in"),
            str(dataset),
            "--dest",
            str(dest),
            "--bw-limit",
            "1.5",
            "--jobs",
            "3",
            *FAST,
        ],
        env=clean_env(),
        stderr=subprocess.DEVNULL,
    )
    time.sleep(rng.uniform(0.05, 1.5))  # startup, planning, copying or writing the manifest
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    survivors = {}
    for final in shards(staged) if staged.exists() else []:
        # The invariant: a file with its final name is always whole.
        assert filecmp.cmp(final, dataset / final.name, shallow=False), (
            f"seed {seed}: {final.name} is corrupt"
        )
        survivors[final.name] = final.stat().st_ino

    report = tmp_path / f"r{seed}.json"
    result = run_main(
        capsys, "stage-in", str(dataset), "--dest", str(dest), "--report", str(report), "--quiet"
    )
    assert result.returncode == 0, f"seed {seed}: {result.stderr}"
    assert_staged_verified(dataset, staged, [p.name for p in shards(dataset)])
    payload = json.loads(report.read_text())
    assert payload["files_skipped"] == len(survivors), f"seed {seed}"
    assert payload["files_copied"] == len(shards(dataset)) - len(survivors), f"seed {seed}"
    for name, inode in survivors.items():  # verified earlier: not copied again
        assert (staged / name).stat().st_ino == inode, f"seed {seed}: {name} was copied again"


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kill_9_at_a_random_moment_then_rerun(
    dataset: Path, tmp_path: Path, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    _kill_trial(dataset, tmp_path, seed, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 124))
def test_kill_9_at_a_random_moment_then_rerun_many(
    dataset: Path, tmp_path: Path, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    _kill_trial(dataset, tmp_path, seed, capsys)


# -- full scratch on a real tmpfs --------------------------------------------------------------
@pytest.fixture()
def small_tmpfs(tmp_path: Path):
    """A real 1.5 MiB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    with mount_tmpfs(tmp_path / "tmpfs", "1536k") as mount_point:
        yield mount_point


def test_preflight_refuses_with_the_numbers(
    tmp_path: Path, small_tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "big" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=4, samples_per_shard=10, image_bytes=60_000)
    )
    needed = sum(p.stat().st_size for p in shards(src))
    result = run_main(capsys, "stage-in", str(src), "--dest", str(small_tmpfs / "job"), *FAST)
    assert result.returncode == EXIT_FULL, result.stderr
    match = re.search(r"need .*?\((\d+) bytes\), free .*?\((\d+) bytes\)", result.stderr)
    assert match, result.stderr
    assert int(match.group(1)) == needed
    assert abs(int(match.group(2)) - shutil.disk_usage(small_tmpfs).free) <= 64 << 10
    assert str(small_tmpfs / "job" / "ds") in result.stderr
    assert not [
        p for p in small_tmpfs.rglob("*") if p.is_file() and p.suffix in (".tar", ".partial")
    ]


def test_scratch_filled_by_another_writer_mid_copy_fails_cleanly(
    dataset: Path,
    small_tmpfs: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Opening shard 5 first fills the tmpfs to the last byte, as another job's writer would.
    filler = small_tmpfs / "other-writer"
    monkeypatch.setenv("FAULTY_FILL_ON", "train-000005.tar")
    monkeypatch.setenv("FAULTY_FILL_PATH", str(filler))
    dest = small_tmpfs / "job"
    argv = [f"faulty://{dataset}", "--dest", str(dest), "--jobs", "1", "--min-jobs", "1", *FAST]
    assert stage_in_main(argv) == EXIT_FULL
    err = capsys.readouterr().err
    assert re.search(r"error: .*no space left on .* while writing train-000005\.tar", err), err
    assert not list(small_tmpfs.rglob("*.partial")), "no partial file may be left behind"
    # Scratch is still full, so the staged manifest could not be written; the rerun writes it.
    assert_staged_verified(
        dataset, dest / "ds", [f"train-{i:06d}.tar" for i in range(5)], with_manifest=False
    )

    filler.unlink()  # the other writer goes away: a rerun finishes the job
    monkeypatch.delenv("FAULTY_FILL_ON")
    assert stage_in_main([f"faulty://{dataset}", "--dest", str(dest), *FAST]) == 0
    assert_staged_verified(dataset, dest / "ds", [p.name for p in shards(dataset)])
