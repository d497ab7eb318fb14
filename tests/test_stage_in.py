"""stage-in end to end through its console script, on real tar shards."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import EXIT_FULL, EXIT_INTEGRITY, EXIT_SOURCE, EXIT_USAGE
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.shards.tarindex import count_samples
from stager.stagein.journal import Journal
from stager.storage.dest import resolve_dest_root

from .conftest import BIN, clean_env, run_cli


def _shards(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tar") if ".stager" not in p.parts)


def _assert_identical(src: Path, staged: Path) -> None:
    src_files = {p.relative_to(src) for p in _shards(src)}
    staged_files = {p.relative_to(staged) for p in _shards(staged)}
    assert staged_files == src_files
    for rel in src_files:
        assert filecmp.cmp(src / rel, staged / rel, shallow=False), rel


def test_directory_source_is_copied_byte_identical(small_dataset: Path, tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    result = run_cli(
        "stage-in",
        str(small_dataset),
        "--dest",
        str(tmp_path / "scratch"),
        "--report",
        str(report_path),
    )
    assert result.returncode == 0, result.stderr
    staged = tmp_path / "scratch" / "ds"
    _assert_identical(small_dataset, staged)
    assert stat.S_IMODE((tmp_path / "scratch").stat().st_mode) == 0o700
    report = json.loads(report_path.read_text())
    total = sum(p.stat().st_size for p in _shards(small_dataset))
    assert report["files_copied"] == 8 and report["files_failed"] == 0
    assert report["bytes_read_source"] == total and report["dataset_dir"] == str(staged)
    assert "[" in result.stderr and "8 copied" in result.stderr  # the one summary line
    manifest = Manifest.read(StagedDataset.of(staged).manifest_path)
    for entry in manifest.entries:
        assert entry.samples == count_samples(small_dataset / entry.relpath)
        assert entry.hash and entry.hash.startswith("xxh3_64:")


def test_rerun_copies_nothing(small_dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "scratch"
    assert run_cli("stage-in", str(small_dataset), "--dest", str(dest)).returncode == 0
    inodes = {p: p.stat().st_ino for p in _shards(dest)}
    result = run_cli(
        "stage-in", str(small_dataset), "--dest", str(dest), "--report", str(tmp_path / "r.json")
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["files_copied"], report["files_skipped"], report["bytes_read_source"]) == (
        0,
        8,
        0,
    )
    assert {p: p.stat().st_ino for p in _shards(dest)} == inodes


def test_brace_pattern_glob_and_list_sources(small_dataset: Path, tmp_path: Path) -> None:
    brace = f"{small_dataset}/train-{{000002..000004}}.tar"
    result = run_cli("stage-in", brace, "--dest", str(tmp_path / "a"), "--name", "b")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in _shards(tmp_path / "a" / "b")] == [
        "train-000002.tar",
        "train-000003.tar",
        "train-000004.tar",
    ]

    result = run_cli(
        "stage-in", f"{small_dataset}/train-00000[0-1].tar", "--dest", str(tmp_path / "g")
    )
    assert result.returncode == 0, result.stderr
    assert [p.name for p in _shards(tmp_path / "g" / "ds")] == [
        "train-000000.tar",
        "train-000001.tar",
    ]

    listing = tmp_path / "list.txt"
    listing.write_text(
        f"# two shards\nfile://{small_dataset}/train-000005.tar\n{small_dataset}/train-000006.tar\n"
    )
    result = run_cli(
        "stage-in", "--from-list", str(listing), "--dest", str(tmp_path / "l"), "--name", "x"
    )
    assert result.returncode == 0, result.stderr
    assert [p.name for p in _shards(tmp_path / "l" / "x")] == [
        "train-000005.tar",
        "train-000006.tar",
    ]


def test_nested_directories_keep_relative_paths(tmp_path: Path) -> None:
    src = tmp_path / "nested"
    write_synthetic_dataset(src / "train", SyntheticSpec(num_shards=2, samples_per_shard=3))
    write_synthetic_dataset(
        src / "val", SyntheticSpec(num_shards=1, samples_per_shard=3, prefix="val")
    )
    (src / "README.txt").write_text("not a shard")
    result = run_cli("stage-in", f"file://{src}", "--dest", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    _assert_identical(src, tmp_path / "s" / "nested")
    assert not (tmp_path / "s" / "nested" / "README.txt").exists()


@pytest.mark.parametrize("subset", ["all", "node"])
def test_directory_named_like_a_shard_is_not_a_shard(tmp_path: Path, subset: str) -> None:
    # "all" sizes the walked names after the manifest lookup; "node" stats them first (it splits
    # by size): either way the directory drops out, and nothing is reported as failed.
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=3))
    (src / "odd.tar").mkdir()
    result = run_cli(
        "stage-in", str(src), "--dest", str(tmp_path / "s"), "--subset", subset, "--jitter-max", "0"
    )
    assert result.returncode == 0, result.stderr
    staged = Manifest.read(StagedDataset.of(tmp_path / "s" / "ds").manifest_path)
    assert sorted(e.relpath for e in staged.entries) == ["train-000000.tar", "train-000001.tar"]
    assert "FAILED" not in result.stderr


def test_missing_source_is_one_clear_line_and_exit_3(tmp_path: Path) -> None:
    result = run_cli("stage-in", str(tmp_path / "nope"), "--dest", str(tmp_path / "s"))
    assert result.returncode == EXIT_SOURCE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "source not found" in lines[0] and str(tmp_path / "nope") in lines[0]


def test_missing_members_of_a_pattern_fail_alone(small_dataset: Path, tmp_path: Path) -> None:
    result = run_cli(
        "stage-in", f"{small_dataset}/train-{{000006..000009}}.tar", "--dest", str(tmp_path / "s")
    )
    assert result.returncode == EXIT_SOURCE
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and "train-000008.tar" in failed[0] and "not found" in failed[0]
    assert [p.name for p in _shards(tmp_path / "s" / "ds")] == [
        "train-000006.tar",
        "train-000007.tar",
    ]


def test_usage_errors_exit_2(small_dataset: Path, tmp_path: Path) -> None:
    result = run_cli("stage-in", str(small_dataset), "--jobs", "0", "--dest", str(tmp_path))
    assert result.returncode == EXIT_USAGE and "--jobs" in result.stderr
    assert run_cli("stage-in").returncode == EXIT_USAGE


@pytest.fixture()
def big_dataset(tmp_path: Path) -> Path:
    """4 shards of ~2 MB: slow enough under --bw-limit to be killed mid-copy."""
    src = tmp_path / "big"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=4, samples_per_shard=20, image_bytes=100_000)
    )
    return src


def _killed_mid_copy(dataset: Path, dest: Path, settle_s: float) -> Path:
    """Start stage-in of ``dataset`` at a capped rate, kill -9 it ``settle_s`` after its first
    ``.partial`` appears, and return the staged directory (holding that ``.partial``)."""
    proc = subprocess.Popen(
        [str(BIN / "stage-in"), str(dataset), "--dest", str(dest), "--bw-limit", "2"]
        + ["--jobs", "2", "--quiet"],
        env=clean_env(),
        stderr=subprocess.DEVNULL,
    )
    staged = dest / dataset.name
    deadline = time.monotonic() + 30
    while not list(staged.glob("*.partial")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(settle_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(staged.glob("*.partial")), "the copy should have been caught in flight"
    return staged


def test_kill_mid_copy_leaves_no_partial_visible_and_rerun_completes(
    big_dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "scratch"
    staged = _killed_mid_copy(big_dataset, dest, settle_s=0.5)
    for final in _shards(staged):  # anything with a final name is whole
        assert filecmp.cmp(final, big_dataset / final.name, shallow=False)
    # A shard is kept by the rerun when its source version was journaled after its rename (a
    # kill between the two costs that shard one more copy, never trust without a version).
    journaled = set(Journal(StagedDataset.of(staged).journal_path).read())
    survivors = {p.name: p.stat().st_ino for p in _shards(staged) if p.name in journaled}
    assert len(survivors) >= len(_shards(staged)) - 1

    result = run_cli(
        "stage-in", str(big_dataset), "--dest", str(dest), "--report", str(tmp_path / "r.json")
    )
    assert result.returncode == 0, result.stderr
    _assert_identical(big_dataset, staged)
    assert not list(staged.rglob("*.partial"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["files_skipped"] == len(survivors) and report["files_copied"] == 4 - len(
        survivors
    )
    assert all(staged.joinpath(name).stat().st_ino == ino for name, ino in survivors.items())


def test_a_partial_left_by_a_kill_goes_even_when_its_shard_left_the_source(
    big_dataset: Path, tmp_path: Path
) -> None:
    """The rerun deletes every ``.partial`` a killed run left, not only those it copies over:
    a shard whose copy was killed and that the source has dropped since is never copied
    again, so its ``.partial`` (a part of a shard, in scratch for the rest of the job) goes only
    because the rerun looks for leftovers."""
    dest = tmp_path / "scratch"
    staged = _killed_mid_copy(big_dataset, dest, settle_s=0.3)
    left = sorted(staged.glob("*.partial"))
    for partial in left:  # the source drops the shards whose copies were cut
        (big_dataset / partial.name.removesuffix(".partial")).unlink()

    result = run_cli("stage-in", str(big_dataset), "--dest", str(dest), "--quiet")
    assert result.returncode == 0, result.stderr
    assert not list(staged.rglob("*.partial")), "a killed run's .partial outlived the rerun"
    _assert_identical(big_dataset, staged)


def test_concurrent_stage_in_on_one_node_copies_each_shard_once(
    big_dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "scratch"
    procs = [
        subprocess.Popen(
            [
                str(BIN / "stage-in"),
                str(big_dataset),
                "--dest",
                str(dest),
                "--quiet",
                "--report",
                str(tmp_path / f"r{i}.json"),
            ],
            env=clean_env(),
            stderr=subprocess.PIPE,
        )
        for i in range(4)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(4)]
    copiers = [r for r in reports if r["role"] == "copier" and r["files_copied"]]
    assert len(copiers) == 1 and copiers[0]["files_copied"] == 4
    assert sum(r["bytes_read_source"] for r in reports if r["role"] == "copier") == sum(
        p.stat().st_size for p in _shards(big_dataset)
    )
    _assert_identical(big_dataset, dest / "big")


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {result.stderr.decode().strip()}")


def test_preflight_refuses_on_a_small_tmpfs_before_copying(
    big_dataset: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "tmpfs"
    _mount_tmpfs(scratch, "2M")
    try:
        result = run_cli("stage-in", str(big_dataset), "--dest", str(scratch))
        assert result.returncode == EXIT_FULL
        assert (
            "not enough space" in result.stderr
            and "need" in result.stderr
            and "free" in result.stderr
        )
        assert str(scratch) in result.stderr
        assert not _shards(scratch) and not list(scratch.rglob("*.partial"))
    finally:
        subprocess.run(["umount", str(scratch)], check=False)


def test_non_tty_progress_is_plain_lines(big_dataset: Path, tmp_path: Path) -> None:
    result = run_cli(
        "stage-in",
        str(big_dataset),
        "--dest",
        str(tmp_path / "s"),
        "--progress-interval",
        "0.2",
        "--bw-limit",
        "8",
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert any("MB/s" in line and "%" in line for line in result.stderr.splitlines()[:-1])


def test_python_m_and_umbrella_command_work(small_dataset: Path, tmp_path: Path) -> None:
    env = clean_env()
    by_module = subprocess.run(
        [
            sys.executable,
            "-m",
            "stager",
            "stage-in",
            str(small_dataset),
            "--dest",
            str(tmp_path / "m"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert by_module.returncode == 0, by_module.stderr
    umbrella = run_cli(
        "stager", "stage-in", str(small_dataset), "--dest", str(tmp_path / "u"), env=env
    )
    assert umbrella.returncode == 0, umbrella.stderr
    _assert_identical(small_dataset, tmp_path / "u" / "ds")


def test_import_stager_does_not_import_torch() -> None:
    code = "import sys, stager, stager.cli.main, stager.stagein.run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stage_in_start_does_not_import_numpy() -> None:
    """numpy's import (~60 ms warm, ~0.15 s with the page cache dropped) holds the interpreter
    lock: stage-in imports it after the copies (the loader index), never at start."""
    code = (
        "import sys, stager.cli.main, stager.cli.commands.stage_in, stager.stagein.run, "
        "stager.stagein.streamed, stager.stagein.copier, stager.stagein.plan; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy')[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_destination_resolution_order(tmp_path: Path) -> None:
    job = {"SLURM_JOB_ID": "77"}
    assert resolve_dest_root("/x", env={"STAGER_DEST": "/y", **job}) == Path("/x")
    assert resolve_dest_root(None, env={"STAGER_DEST": "/y", **job}) == Path("/y")
    assert resolve_dest_root(None, env=job) == Path("/scratch/77")
    assert resolve_dest_root(None, env={"TMPDIR": "/t", "USER": "ann"}) == Path(
        "/t/stager-ann/local"
    )
    assert resolve_dest_root(None, env={"USER": "ann"}) == Path("/tmp/stager-ann/local")


def test_runaway_brace_pattern_is_refused_without_expanding(tmp_path: Path) -> None:
    result = run_cli(
        "stage-in", "/nfs/x-{0..99999999999}-{0..99999}.tar", "--dest", str(tmp_path), timeout=20
    )
    assert result.returncode == EXIT_USAGE and "expands to more than" in result.stderr


def test_shards_missing_from_the_manifest_are_staged_with_a_warning(
    dataset_copy: Path, tmp_path: Path
) -> None:
    assert run_cli("stager", "index", str(dataset_copy)).returncode == 0
    write_synthetic_dataset(
        dataset_copy, SyntheticSpec(num_shards=1, samples_per_shard=3, prefix="extra")
    )
    result = run_cli("stage-in", str(dataset_copy), "--dest", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "not in the manifest" in line]
    assert len(warning) == 1 and "1 shard(s)" in warning[0] and "extra-000000.tar" in warning[0]
    assert (tmp_path / "s" / "ds" / "extra-000000.tar").is_file()


@pytest.mark.parametrize("order", ["as listed", "reversed", "one missing from the source"])
def test_a_manifest_in_any_order_is_checked_alike(
    dataset_copy: Path, tmp_path: Path, order: str
) -> None:
    # A manifest naming the listing one for one, in order, takes a fast path (no dict by name,
    # no set algebra); any other order or membership the general one. Both must stage the same
    # files and refuse the same corrupt shard.
    assert run_cli("stager", "index", str(dataset_copy)).returncode == 0
    path = dataset_copy / "stager-manifest.json"
    manifest = Manifest.read(path)
    entries = list(manifest.entries)
    bad = entries[2].relpath
    entries[2] = dataclasses.replace(entries[2], hash="xxh3_64:0000000000000000")
    if order == "reversed":
        entries.reverse()
    path.unlink()
    Manifest(tuple(entries), manifest.meta).write(path)
    if order == "one missing from the source":
        (dataset_copy / entries[-1].relpath).unlink()
    result = run_cli(
        "stage-in", str(dataset_copy), "--dest", str(tmp_path / "s"),
        "--report", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    failed = {f["url"].rsplit("/", 1)[-1]: f["reason"] for f in report["failures"]}
    assert bad in failed and "hash" in failed[bad]
    staged = tmp_path / "s" / "ds"
    on_source = {p.name for p in dataset_copy.glob("*.tar")}
    if order == "one missing from the source":
        assert "missing from the source" in failed[entries[-1].relpath]
    assert {p.name for p in staged.glob("*.tar")} == on_source - {bad}
    for name in on_source - {bad}:
        assert filecmp.cmp(dataset_copy / name, staged / name, shallow=False)
    assert not list(staged.rglob("*.partial"))


def test_space_check_on_sizes_found_while_copying_leaves_nothing_staged(tmp_path: Path) -> None:
    # A walked directory without a manifest is sized while it copies: the shards that fit may
    # already be copied when the last size is in, and must not be left staged by the refusal.
    src = tmp_path / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=6, samples_per_shard=10, image_bytes=100_000)
    )
    scratch = tmp_path / "tmpfs"
    _mount_tmpfs(scratch, "3M")  # two ~1 MB shards fit, six do not
    try:
        result = run_cli(
            "stage-in", str(src), "--dest", str(scratch), "--jobs", "2", "--min-jobs", "2"
        )
        assert result.returncode == EXIT_FULL, result.stderr
        assert "not enough space" in result.stderr and "nothing was copied" in result.stderr
        assert not _shards(scratch) and not list(scratch.rglob("*.partial"))
    finally:
        subprocess.run(["umount", str(scratch)], check=False)


def test_rerun_sizes_staged_shards_first_and_the_rest_while_copying(
    small_dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "s"
    first = run_cli("stage-in", str(small_dataset), "--dest", str(dest))
    assert first.returncode == 0, first.stderr
    for gone in sorted((dest / "ds").glob("*.tar"))[3:]:
        gone.unlink()  # as if the first run had been killed after three shards
    staged = dest / "ds" / "train-000001.tar"
    staged.write_bytes(staged.read_bytes()[:-512])  # a stale copy: its size no longer matches
    result = run_cli(
        "stage-in", str(small_dataset), "--dest", str(dest), "--report", str(tmp_path / "r.json")
    )
    assert result.returncode == 0, result.stderr
    _assert_identical(small_dataset, dest / "ds")
    report = json.loads((tmp_path / "r.json").read_text())
    total = len(list(small_dataset.glob("*.tar")))
    assert report["files_total"] == total and report["files_skipped"] == 2
    assert report["files_copied"] == total - 2
    assert report["bytes_total"] == sum(p.stat().st_size for p in small_dataset.glob("*.tar"))


def test_staged_files_take_their_mode_from_the_umask_like_cp(
    small_dataset: Path, tmp_path: Path
) -> None:
    # The directories stay private (0700); the files inside are created as open() would
    # (0666 & ~umask).
    old = os.umask(0o002)
    try:
        result = run_cli("stage-in", str(small_dataset), "--dest", str(tmp_path / "s"))
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr
    modes = {stat.S_IMODE(p.stat().st_mode) for p in _shards(tmp_path / "s" / "ds")}
    assert modes == {0o664}


@pytest.mark.parametrize("spelling", ["bare", "upper-case bare", "prefixed upper-case"])
def test_sha256sum_digests_in_a_manifest_verify_copies(
    dataset_copy: Path, tmp_path: Path, spelling: str
) -> None:
    # A manifest from another tool may carry sha256sum's bare hex (split_digest reads a bare
    # digest as sha256). It must verify the copies, not refuse every one for its spelling.
    import hashlib

    entries = []
    for shard in sorted(dataset_copy.glob("*.tar")):
        hexdigest = hashlib.sha256(shard.read_bytes()).hexdigest()
        digest = {
            "bare": hexdigest,
            "upper-case bare": hexdigest.upper(),
            "prefixed upper-case": "sha256:" + hexdigest.upper(),
        }[spelling]
        entries.append({"path": shard.name, "size": shard.stat().st_size, "hash": digest})
    manifest = {"format": "stager-manifest", "version": 1, "meta": {}, "shards": entries}
    (dataset_copy / "stager-manifest.json").write_text(json.dumps(manifest))
    result = run_cli("stage-in", str(dataset_copy), "--dest", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    rerun = run_cli("stage-in", str(dataset_copy), "--dest", str(tmp_path / "s"))
    assert rerun.returncode == 0 and " 0 copied, 8 skipped" in rerun.stderr, rerun.stderr
    entries[1]["hash"] = "0" * 64  # a wrong digest is still refused
    (dataset_copy / "stager-manifest.json").write_text(json.dumps(manifest))
    wrong = run_cli("stage-in", str(dataset_copy), "--dest", str(tmp_path / "t"))
    assert wrong.returncode == EXIT_INTEGRITY, wrong.stderr


def test_the_command_freezes_its_planning_objects_only_while_it_runs(
    small_dataset: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command line freezes (gc.freeze) what planning built, so the collector never walks a
    # million shards' objects again; run in a user's process, it must leave later pauses (a
    # loader's) as they were: pausing, not freezing.
    import gc

    from stager.gcpause import collection_paused

    from .inproc import clean_process_env, run_main

    clean_process_env(monkeypatch)
    try:
        result = run_main(capsys, "stage-in", str(small_dataset), "--dest", str(tmp_path / "s"))
        assert result.returncode == 0, result.stderr
        assert gc.get_freeze_count() > 0, "the command froze nothing"
        gc.unfreeze()
        with collection_paused():
            assert not gc.isenabled()
            _ = [[] for _ in range(100)]
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    finally:
        gc.unfreeze()


_ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    relpath=_ANY_TEXT,
    size=st.integers(0, 2**63),
    digest=_ANY_TEXT,
    samples=st.none() | st.integers(0, 2**70),
    version=st.none() | _ANY_TEXT,
)
def test_journal_lines_are_json_and_read_back_as_recorded(
    tmp_path_factory: pytest.TempPathFactory,
    relpath: str,
    size: int,
    digest: str,
    samples: int | None,
    version: str | None,
) -> None:
    """The journal writes its lines by hand (json.dumps was most of its cost per shard): they
    must be what json.dumps writes, for any text (quotes, control characters, surrogates of
    undecodable names) and any count, and read back as the entry recorded."""
    from stager.shards.manifest import ManifestEntry

    entry = ManifestEntry(relpath, size, digest, samples, version)
    path = tmp_path_factory.mktemp("journal") / "journal"
    journal = Journal(path)
    journal.record(entry)
    line = path.read_bytes()
    assert line == json.dumps([relpath, size, digest, samples, version]).encode() + b"\n"
    assert journal.read() == {relpath: entry}
    # a run's entries: one write, the same lines, read back with the last of a name winning
    other = ManifestEntry(relpath + "x", size + 1, digest, None, version)
    again = ManifestEntry(relpath, size + 2, digest, samples, None)
    journal.record_all([other, again])
    journal.record_all([])
    assert path.read_bytes().count(b"\n") == 3
    assert journal.read() == {relpath: again, relpath + "x": other}


def test_api_takes_a_path_as_the_command_line_does(small_dataset: Path, tmp_path: Path) -> None:
    """``stager.stage_in`` given a path string, a PathLike or a list of shard paths resolves it
    as ``stage-in SRC`` does (it raised AttributeError, 'str' object has no attribute 'name',
    from deep inside); anything else is refused in one line before scratch is touched."""
    from stager import StageInOptions, resolve_source, stage_in
    from stager.errors import UsageError

    def options(where: str) -> StageInOptions:
        return StageInOptions(dest_root=tmp_path / where, progress="none", jitter_max_s=0)

    with pytest.raises(UsageError, match=r"not int"):
        stage_in(42, options("refused"))  # type: ignore[arg-type]
    assert not (tmp_path / "refused").exists()
    given = stage_in(str(small_dataset), options("str"))
    assert given.files_failed == 0 and given.files_copied > 0
    resolved = stage_in(resolve_source(str(small_dataset)), options("set"))
    assert (given.dataset_dir, given.files_copied) == (
        resolved.dataset_dir.replace("/set/", "/str/"),
        resolved.files_copied,
    )
    assert stage_in(small_dataset, options("str")).files_skipped == given.files_copied
    shards = sorted(str(p) for p in small_dataset.glob("*.tar"))
    listed = stage_in(shards[:2], options("list"))
    assert listed.files_copied == 2
