"""Defects a hostile review of the command-line contract found (2026-11-29), each as reported:
a ``--report`` renamed over a staged shard or a device, a one-shot stage-out that committed
nothing with exit 0, empty paths taken for the working directory, a glob that staged a
non-shard the loader then failed on, a ``--manifest`` that was a FIFO or ``/dev/zero``, names
past the file-name limit once ``.partial`` was added, a ``SLURM_JOB_ID`` that climbed out of
the scratch root, a summary forged onto two lines, a cache inside the source or the
destination, tracebacks from ``make-dataset``, ``doctor`` and a chained URL, and ``stager index``
calling a full output place a source error."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stager.errors import (
    EXIT_CHECKPOINT,
    EXIT_DEST,
    EXIT_FULL,
    EXIT_SOURCE,
    EXIT_USAGE,
)
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.paths import NAME_MAX, partial_of
from stager_loaders import LoaderOptions, ShardedLoader

from .conftest import BIN, clean_env, mount_tmpfs, run_cli
from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--quiet"]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_process_env(monkeypatch)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    data = tmp_path / "src" / "ds"
    write_synthetic_dataset(data, SyntheticSpec(num_shards=3, samples_per_shard=5))
    return data


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".partial")]


def test_a_report_never_replaces_a_staged_file_a_device_or_a_link(
    src: Path, tmp_path: Path, capsys
) -> None:
    dest = tmp_path / "scratch"
    assert run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST).returncode == 0
    shard = dest / "ds" / "train-000001.tar"
    before = shard.read_bytes()
    link = tmp_path / "report-link.json"
    link.symlink_to(shard)
    for report in (shard, link):  # (the link: the rename replaced its target's staged bytes)
        result = run_main(
            capsys, "stage-in", str(src), "--dest", str(dest), *FAST, "--report", str(report)
        )
        assert result.returncode == EXIT_USAGE and "--report" in _one_line_error(result.stderr)
    assert shard.read_bytes() == before
    # /dev/stdout where stdout is a job's log file: the report was renamed over the log
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        out.write("earlier line\n")
        out.flush()
        argv = [str(BIN / "stage-in"), str(src), "--dest", str(dest), *FAST]
        subprocess.run([*argv, "--report", "/dev/stdout"], stdout=out, env=clean_env(), check=True)
        out.write("later line\n")
    text = log.read_text()
    assert text.startswith("earlier line\n{") and text.endswith("}\nlater line\n"), text
    logs = dest / "logs" / "stage-in.json"  # (beside the datasets, in a directory of its own)
    argv = ["stage-in", str(src), "--dest", str(dest), *FAST, "--report", str(logs)]
    assert run_main(capsys, *argv).returncode == 0 and logs.is_file()
    # A FIFO stays a FIFO and its reader gets the report (the rename replaced the node).
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(dest), *FAST, "--report", str(fifo)
    )
    assert result.returncode == 0, result.stderr
    assert b'"files_total": 3' in reader.communicate(timeout=30)[0]
    assert fifo.is_fifo()
    # A link to a regular file keeps its link; its target holds the report.
    target = tmp_path / "reports" / "last.json"
    target.parent.mkdir()
    target.write_text("old")
    kept = tmp_path / "latest.json"
    kept.symlink_to(target)
    result = run_main(
        capsys, "stage-in", str(src), "--dest", str(dest), *FAST, "--report", str(kept)
    )
    assert result.returncode == 0 and kept.is_symlink() and '"files_total": 3' in target.read_text()
    assert not _leftovers(tmp_path)
    # A regular file under /dev (/dev/shm: node-local scratch) is a file: replaced, not added to.
    if os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            report = Path(shm) / "report.json"
            for _ in range(2):
                argv = ["stage-in", str(src), "--dest", str(dest), *FAST, "--report", str(report)]
                assert run_main(capsys, *argv).returncode == 0
            assert json.loads(report.read_text())["files_total"] == 3  # (one document)


@pytest.mark.parametrize(
    "argv",
    [
        ["stage-in", "{src}", "--report", ""],
        ["stage-in", "{src}", "--manifest", ""],
        ["stage-in", "{src}", "--dest", ""],
        ["stage-in", "{src}", "--name", ""],
        ["stage-in", "--checkpoint", ""],
        ["stage-out", "{ckpt}", ""],
        ["stage-out", "", "{out}"],
        ["stager", "make-dataset", ""],
    ],
)
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(
    argv: list[str], src: Path, tmp_path: Path
) -> None:
    """``stage-out CKPT ""`` committed into the working directory; ``--checkpoint ""`` (an
    unset $CKPT_DEST) said "no checkpoint yet" (exit 9), which a template reads as a first
    start, so training restarted from scratch."""
    ckpt = tmp_path / "ckpt" / "step-1"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"w" * 100)
    work = tmp_path / "cwd"
    work.mkdir()
    filled = [a.format(src=src, ckpt=ckpt, out=tmp_path / "out") for a in argv]
    result = run_cli(*filled, cwd=work)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "empty path" in _one_line_error(result.stderr)
    assert not any(work.iterdir()) and not (tmp_path / "out").exists()


def test_a_one_shot_stage_out_that_commits_nothing_says_so_with_exit_7(tmp_path: Path) -> None:
    """A checkpoint still being written (--settle) and an empty directory were passed over with
    exit 0 and, for the first, no line: a job's trap took that for a commit."""
    ckpt = tmp_path / "ckpt" / "step-9"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(os.urandom(1000))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    unsettled = run_cli("stage-out", str(ckpt), str(out), "--settle", "600")
    assert unsettled.returncode == EXIT_CHECKPOINT
    assert "step-9: still being written" in unsettled.stderr
    assert "not committed: step-9" in unsettled.stderr
    empty = run_cli("stage-out", str(tmp_path / "empty"), str(out))
    assert empty.returncode == EXIT_CHECKPOINT and "an empty directory" in empty.stderr
    assert not list((out / ".stager" / "commits").glob("*.json"))
    settled = run_cli("stage-out", str(ckpt), str(out))
    assert settled.returncode == 0 and "committed step-9" in settled.stderr


def test_a_glob_stages_the_shards_it_matches_and_names_the_rest(
    src: Path, tmp_path: Path, capsys
) -> None:
    """`ds/*` matched the stager-manifest.json that `stager index` writes beside the shards:
    staged with exit 0, and the loader then failed on it as a corrupt tar."""
    assert run_main(capsys, "stager", "index", str(src)).returncode == 0
    (src / "notes.txt").write_text("not a shard")
    dest = tmp_path / "scratch"
    result = run_main(capsys, "stage-in", f"{src}/*", "--dest", str(dest), "--jitter-max", "0")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (dest / "ds").glob("*") if p.is_file()) == [
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
    ]
    assert "not staged: " in result.stderr and "not shards" in result.stderr
    loader = ShardedLoader(
        f"{src}/*", batch_size=5, options=LoaderOptions(dest=str(dest), world_size=1)
    )
    assert loader.shards.from_source == 0
    assert sum(len(batch["__key__"]) for batch in loader) == 15
    only = run_main(capsys, "stage-in", f"{src}/*.json", "--dest", str(dest), *FAST)
    assert only.returncode == EXIT_SOURCE and "no shards" in _one_line_error(only.stderr)


def test_a_manifest_that_is_not_a_regular_file_is_refused_unread(src: Path, tmp_path: Path) -> None:
    """/dev/zero was read until the kernel killed the node's largest process; a FIFO hung."""
    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    for manifest in (fifo, Path("/dev/zero")):
        result = run_cli(
            "stage-in",
            str(src),
            "--dest",
            str(tmp_path / "s"),
            *FAST,
            "--manifest",
            str(manifest),
            timeout=60,
        )
        assert result.returncode == EXIT_USAGE
        assert "not a regular file" in _one_line_error(result.stderr)


@given(
    st.text(
        st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=300,
    )
)
def test_a_partial_name_fits_the_file_name_limit_and_ends_in_partial(name: str) -> None:
    final = f"/scratch/ds/{name}"
    partial = partial_of(final)
    assert partial.endswith(".partial") and os.path.dirname(partial) == "/scratch/ds"
    base = os.path.basename(partial)
    if len(name.encode()) + len(".partial") <= NAME_MAX:
        assert partial == final + ".partial"
    else:
        assert len(base.encode()) <= NAME_MAX and partial != partial_of(final + "x")


def test_a_shard_name_near_the_limit_is_staged(tmp_path: Path, capsys) -> None:
    """A 248-byte name is legal; with ".partial" it was not: ENAMETOOLONG, three retries and
    exit 3, as if the source had failed."""
    data = tmp_path / "src" / "long"
    write_synthetic_dataset(data, SyntheticSpec(num_shards=2, samples_per_shard=3))
    names = ["L" * 244 + ".tar", "é" * 123 + "x.tar"]  # 248 and 251 bytes
    for old, new in zip(sorted(data.iterdir()), names, strict=True):
        old.rename(data / new)
    dest = tmp_path / "scratch"
    for extra in ([], ["--jobs", "1", "--fixed-jobs"]):
        result = run_main(capsys, "stage-in", str(data), "--dest", str(dest), *FAST, *extra)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in (dest / "long").glob("*.tar")) == sorted(names)
        assert not _leftovers(dest)


@pytest.mark.parametrize("job_id", ["../../escape", "12/../..", "abc", "١٢"])
def test_a_job_id_that_is_not_a_number_is_refused(src: Path, tmp_path: Path, job_id: str) -> None:
    root = tmp_path / "scratch-root"
    env = clean_env(SLURM_JOB_ID=job_id, STAGER_SCRATCH_ROOT=str(root))
    result = run_cli("stage-in", str(src), *FAST, env=env)
    assert result.returncode == EXIT_USAGE and "SLURM_JOB_ID" in _one_line_error(result.stderr)
    assert not root.exists() and not (tmp_path / "escape").exists()


def test_a_name_never_forges_a_second_line_and_a_long_one_is_a_usage_error(
    src: Path, tmp_path: Path, capsys
) -> None:
    dest = tmp_path / "scratch"
    argv = ["stage-in", str(src), "--dest", str(dest), "--jitter-max", "0"]
    forged = run_main(capsys, *argv, "--name", "a\nFAKE: 0 failed")
    assert forged.returncode == 0
    assert not any(line.startswith("FAKE") for line in forged.stderr.splitlines())
    long = run_main(capsys, "stage-in", str(src), "--dest", str(dest), *FAST, "--name", "n" * 300)
    assert long.returncode == EXIT_USAGE and "255" in _one_line_error(long.stderr)


def test_a_cache_overlapping_the_destination_or_inside_the_source_is_refused_first(
    src: Path, tmp_path: Path, capsys
) -> None:
    """--cache X --dest X made the destination, then refused X as "not empty"; a cache inside
    the source wrote its objects into the dataset on the shared filesystem."""
    before = sorted(p.name for p in src.iterdir())
    for cache, dest in (
        (tmp_path / "x", tmp_path / "x"),
        (tmp_path / "d" / "ds", tmp_path / "d"),
        (tmp_path / "d2", tmp_path / "d2" / "job"),
        (src / "cache", tmp_path / "s"),
    ):
        result = run_main(
            capsys, "stage-in", str(src), "--dest", str(dest), *FAST, "--cache", str(cache)
        )
        assert result.returncode == EXIT_USAGE and "--cache" in _one_line_error(result.stderr)
        assert not dest.exists() or not any(dest.iterdir())
    assert sorted(p.name for p in src.iterdir()) == before
    # a directory of its own under a destination root that jobs share (docs/jobs.md) is fine
    shared = tmp_path / "shared"
    argv = ["stage-in", str(src), "--dest", str(shared), *FAST, "--cache", str(shared / "cache")]
    assert run_main(capsys, *argv).returncode == 0


def test_make_dataset_and_index_say_what_failed_in_one_line(tmp_path: Path, src: Path) -> None:
    with mount_tmpfs(tmp_path / "small", "512k") as small:
        full = run_cli("stager", "make-dataset", str(small / "mk"), "--shards", "20")
        assert full.returncode == EXIT_FULL and "No space left" in _one_line_error(full.stderr)
        assert not _leftovers(small)
        filler = small / "filler"
        filler.write_bytes(b"")
        with open(filler, "ab") as handle:  # (fill the rest: index has nowhere to write)
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        index = run_cli("stager", "index", str(src), "--out", str(small / "m.json"))
        assert index.returncode == EXIT_FULL, index.stderr
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        ro = run_cli("stager", "make-dataset", str(small / "ro"))
        assert ro.returncode == EXIT_DEST and "Read-only" in _one_line_error(ro.stderr)
        index = run_cli("stager", "index", str(src), "--out", str(small / "m.json"))
        assert index.returncode == EXIT_DEST and "Read-only" in _one_line_error(index.stderr)
    huge = run_cli("stager", "make-dataset", str(tmp_path / "h"), "--sample-bytes", str(10**11))
    assert huge.returncode == EXIT_USAGE and not (tmp_path / "h").exists()


def test_doctor_on_an_unwritable_scratch_or_json_path_says_so_in_one_line(
    src: Path, tmp_path: Path
) -> None:
    with mount_tmpfs(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        result = run_cli("stager", "doctor", str(src), "--no-loader", "--dest", str(ro))
        assert result.returncode == EXIT_DEST and "probe file" in result.stderr.splitlines()[-1]
        assert "Traceback" not in result.stderr
    result = run_cli("stager", "doctor", str(src), "--no-loader", "--json", str(tmp_path))
    assert result.returncode == EXIT_USAGE and "--json" in _one_line_error(result.stderr)


def test_a_chained_url_to_a_missing_file_is_a_source_error(tmp_path: Path) -> None:
    result = run_cli(
        "stage-in", f"zip://x.tar::file://{tmp_path}/missing.zip", "--dest", str(tmp_path / "s")
    )
    assert result.returncode == EXIT_SOURCE and "not found" in _one_line_error(result.stderr)


def test_a_shard_named_with_its_suffix_in_upper_case_is_refused(
    src: Path, tmp_path: Path, capsys
) -> None:
    """``X.TAR`` named on its own (or in a list) was staged "as it is": samples neither counted
    nor checked (a split one passed), a dataset name of its own, and the loader then refused the
    copy as another dataset's. A walk and a glob leave such a file out; named, it is refused."""
    cased = tmp_path / "up" / "X.TAR"
    cased.parent.mkdir()
    cased.write_bytes((src / "train-000000.tar").read_bytes())
    listed = tmp_path / "list.txt"
    listed.write_text(f"{cased}\n")
    for argv in ((str(cased),), ("--from-list", str(listed))):
        result = run_main(capsys, "stage-in", *argv, "--dest", str(tmp_path / "s"), *FAST)
        assert result.returncode == EXIT_SOURCE and "rename it to lower case" in result.stderr
        assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.TAR"))
