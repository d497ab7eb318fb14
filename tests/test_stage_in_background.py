"""``stage-in --background`` as a process: what it refuses, what a signal leaves behind, that
it never lets a stale final name stand for a shard it will copy, one copier per node, and
``--wait-staged``."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from stager.errors import EXIT_LOCK, EXIT_STAGING_STOPPED, EXIT_USAGE
from stager.layout import StagedDataset
from stager.plan.staging import copy_order, copy_salt
from stager.shards.build import build_manifest, write_manifest
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.stagein.status import read_plan
from stager.storage.sources import resolve_source

from .background_util import SPEC, dataset, finished, job_env, start_copier, stop, wait_plan
from .conftest import BIN, clean_env, run_cli

FAST = ("--progress", "none", "--jitter-max", "0")


def test_needs_sample_counts_and_refuses_fanout(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    write_synthetic_dataset(bare, SyntheticSpec(num_shards=2, samples_per_shard=3))
    result = run_cli("stage-in", "--background", str(bare), "--dest", str(tmp_path / "s"), *FAST)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "stager index" in result.stderr and len(result.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "s" / "bare" / ".stager" / "staging.json").exists()
    fanout = run_cli("stage-in", "--background", "--fanout", str(bare), "--dest", str(tmp_path))
    assert fanout.returncode == EXIT_USAGE and "--fanout" in fanout.stderr


def test_sigterm_stops_between_blocks_leaves_no_partial_and_a_rerun_copies_the_rest(
    tmp_path: Path,
) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    copier = start_copier(src, dest, "--bw-limit", "0.3")
    wait_plan(dest, first_shards=1)
    code, err = stop(copier, signal.SIGTERM)
    assert code == EXIT_STAGING_STOPPED, err
    assert "stopped by a signal" in err and "no partial file left" in err
    staged = StagedDataset(dest, "ds")
    assert not list(staged.dir.rglob("*.partial"))
    published = sorted(p.name for p in staged.dir.glob("*.tar"))
    assert 1 <= len(published) < SPEC.num_shards
    for name in published:  # whole, with the source's bytes
        assert (staged.dir / name).read_bytes() == (src / name).read_bytes()
    result = json.loads(staged.result_path.read_text())
    assert result["error_class"] == "StagingStopped"

    report = tmp_path / "report.json"
    again = run_cli(
        "stage-in", "--background", str(src), "--dest", str(dest), "--report", str(report), *FAST
    )
    assert again.returncode == 0, again.stderr
    summary = json.loads(report.read_text())
    assert summary["files_skipped"] == len(published)
    assert summary["files_copied"] == SPEC.num_shards - len(published)
    manifest = Manifest.read(staged.manifest_path)
    assert [e.relpath for e in manifest.entries] == sorted(p.name for p in src.glob("*.tar"))


def test_a_stale_final_name_never_stands_for_a_shard_still_to_copy(tmp_path: Path) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    assert finished(start_copier(src, dest)) == 0
    staged = StagedDataset(dest, "ds")
    # The source changes (a shard rewritten, re-indexed); the copy of the old bytes is staged.
    changed = src / "train-000003.tar"
    old = changed.read_bytes()
    write_synthetic_dataset(src, SyntheticSpec(**{**SPEC.__dict__, "seed": 9}))
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    assert changed.read_bytes() != old
    # The job's next run (a requeue) stages again; far slower than the checks below.
    copier = start_copier(src, dest, "--bw-limit", "0.05", restart_count=1)
    try:
        wait_plan(dest, restart_count=1)
        final = staged.dir / changed.name
        # From the plan's publication on, the name holds the new bytes or does not exist.
        assert not final.exists() or final.read_bytes() == changed.read_bytes()
    finally:
        stop(copier)


def test_one_copier_per_node_whatever_the_tasks_per_node(tmp_path: Path) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    tasks = [
        start_copier(src, dest, "--bw-limit", "1", "--report", str(tmp_path / f"r{i}.json"))
        for i in range(3)
    ]
    codes = [finished(t) for t in tasks]
    assert codes == [0, 0, 0]
    roles = sorted(json.loads((tmp_path / f"r{i}.json").read_text())["role"] for i in range(3))
    assert roles == ["copier", "waiter", "waiter"]


def test_wait_staged_returns_once_the_first_shards_of_the_copy_order_are_published(
    tmp_path: Path,
) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    env = clean_env(**job_env(0))
    copier = start_copier(src, dest, "--bw-limit", "0.3")
    try:
        waited = run_cli("stage-in", "--wait-staged", "2", str(src), "--dest", str(dest), env=env)
        assert waited.returncode == 0, waited.stderr
        staged = StagedDataset(dest, "ds")
        loaded = read_plan(staged)
        assert loaded is not None
        columns, facts = loaded
        order = copy_order(len(columns.relpaths), seed=facts.copy_seed, salt=facts.salt)
        for shard in order[:2].tolist():
            assert (staged.dir / columns.relpaths[shard]).is_file()
    finally:
        stop(copier)


def test_wait_staged_without_a_copier_times_out_and_a_dead_one_is_said(tmp_path: Path) -> None:
    src, dest = dataset(tmp_path), tmp_path / "scratch"
    env = clean_env(**job_env(0))
    lonely = run_cli(
        "stage-in",
        "--wait-staged",
        "0",
        str(src),
        "--dest",
        str(dest),
        "--lock-timeout",
        "0.5",
        env=env,
    )
    assert lonely.returncode == EXIT_LOCK, lonely.stderr
    assert "stage-in --background" in lonely.stderr

    copier = start_copier(src, dest, "--bw-limit", "0.05")
    wait_plan(dest)
    copier.send_signal(signal.SIGKILL)
    stop(copier)
    started = time.monotonic()
    gone = run_cli("stage-in", "--wait-staged", "6", str(src), "--dest", str(dest), env=env)
    assert gone.returncode == EXIT_STAGING_STOPPED, gone.stderr
    assert "is gone" in gone.stderr and time.monotonic() - started < 60


def test_subset_node_plans_each_node_its_own_shards_in_its_own_order(tmp_path: Path) -> None:
    src = dataset(tmp_path)
    planned = {}
    for node in (0, 1):
        dest = tmp_path / f"node{node}"
        env = clean_env(
            SLURM_JOB_ID="7", SLURM_NODEID=str(node), SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2"
        )
        result = run_cli(
            "stage-in",
            "--background",
            "--subset",
            "node",
            str(src),
            "--dest",
            str(dest),
            *FAST,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        loaded = read_plan(StagedDataset(dest, "ds"))
        assert loaded is not None
        columns, facts = loaded
        assert facts.subset == "node" and facts.salt == copy_salt("node", node)
        planned[node] = set(columns.relpaths)
    assert planned[0] and planned[1] and not planned[0] & planned[1]
    assert planned[0] | planned[1] == {p.name for p in src.glob("*.tar")}


def test_a_waiter_reports_the_error_of_a_copier_that_failed_before_its_plan(
    tmp_path: Path,
) -> None:
    bare = tmp_path / "src" / "ds"  # no manifest: the copier refuses after taking the lock
    write_synthetic_dataset(bare, SyntheticSpec(num_shards=2, samples_per_shard=3))
    dest = tmp_path / "scratch"
    env = clean_env(**job_env(0))
    waiter = subprocess.Popen(
        [str(BIN / "stage-in"), "--wait-staged", "0", str(bare), "--dest", str(dest)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)  # the job script starts the waiter right after the copier step
        copier = start_copier(bare, dest)
        _, err = copier.communicate(timeout=120)
        assert copier.returncode == EXIT_USAGE, err
        _, waited = waiter.communicate(timeout=120)
    finally:
        stop(waiter)
    assert waiter.returncode == EXIT_USAGE, waited
    assert "stager index" in waited


def test_a_plan_rewritten_while_it_is_read_reads_as_no_plan_or_the_plan(tmp_path: Path) -> None:
    """A copier discards an earlier run's plan, then writes its own. A waiter that read in
    between and checked after found the plan there and failed its step with "manifest not
    found" (a two-node job on the test cluster, once). Read while a writer discards and
    rewrites it thousands of times, the plan is either absent or whole."""
    import os
    import threading

    from stager.stagein.status import discard_plan

    src = dataset(tmp_path)
    dest = tmp_path / "scratch"
    finished(start_copier(src, dest))
    staged = StagedDataset(dest, "ds")
    text = staged.staging_path.read_bytes()
    done = threading.Event()

    def rewrite() -> None:
        spare = staged.staging_path.with_name("plan.spare")
        while not done.is_set():
            discard_plan(staged)
            spare.write_bytes(text)
            os.replace(spare, staged.staging_path)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen = {read_plan(staged) is None for _ in range(3000)}
    finally:
        done.set()
        writer.join()
    assert False in seen  # (read whole at least once: the race was run)
