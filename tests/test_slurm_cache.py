"""The node cache and ``stager ls/clean`` on the real test cluster (private /scratch per node).

Source bytes are counted independently of stage-in's report, by the ``countfile://``
filesystem of test_fanout_procs.py loaded into the jobs through PYTHONPATH. Each test uses a
cache of its own under the node's /scratch (the same filesystem as the jobs' scratch, so
shards are hard-linked), and its own datasets.

The time a cached stage-in of 1,000 small shards takes is measured and printed (run with
``-s`` to see it; docs/cache.md quotes it), never asserted: it depends on the machine.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .test_fanout_procs import SITECUSTOMIZE, _assert_identical, _total

pytestmark = pytest.mark.slurm


def _counting(cluster, name: str) -> tuple[dict[str, str], Path]:
    """The environment that makes ``countfile://`` count into a fresh log, and the log."""
    base = cluster.shared_dir / name
    (base / "site").mkdir(parents=True, exist_ok=True)
    (base / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = base / "source-reads.log"
    log.write_text("")
    return {"PYTHONPATH": str(base / "site"), "FANOUT_TEST_COUNT_LOG": str(log)}, log


def _read(log: Path) -> int:
    return sum(int(n) for n in log.read_text().split())


def _on(cluster, node: str, script: str, *args: str, env=None, timeout: float = 180, check=True):
    """Run ``sh -c script args`` as a one-task job step on ``node``; returns the result."""
    return cluster.run(
        ["srun", "-w", node, "-N1", "-n1", "sh", "-c", script, *args],
        env=env,
        timeout=timeout,
        check=check,
    )


STAGE = (
    'stage-in "$0" --cache "$1" --quiet --jitter-max 0 --report "$2" && echo "job=$SLURM_JOB_ID"'
)


def _job_of(out) -> str:
    return next(w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("job="))


def test_a_second_job_reads_nothing_and_1000_shards_are_ready_at_once(slurm_cluster) -> None:
    cluster = slurm_cluster
    src = cluster.shared_dir / "cache-1000" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=1000, samples_per_shard=2, image_bytes=200, seed=11)
    )
    env, log = _counting(cluster, "cache-1000")
    reports = cluster.shared_dir / "cache-1000"
    total = _total(src)

    first = _on(
        cluster,
        "node1",
        STAGE,
        f"countfile://{src}",
        "/scratch/cache-1000",
        str(reports / "r1.json"),
        env=env,
    )
    assert _read(log) == total
    log.write_text("")
    second = _on(
        cluster,
        "node1",
        STAGE,
        f"countfile://{src}",
        "/scratch/cache-1000",
        str(reports / "r2.json"),
        env=env,
    )
    assert _read(log) == 0  # counted at the source
    r1, r2 = (json.loads((reports / f"r{i}.json").read_text()) for i in (1, 2))
    assert r1["bytes_read_source"] == total and r2["bytes_read_source"] == 0
    assert r2["files_from_cache"] == r2["files_copied"] == 1000
    for out in (first, second):
        _assert_identical(src, cluster.scratch("node1") / _job_of(out) / "ds")

    # The figure: a plain path, as a user writes it. Each stage-in is timed from the shell
    # around it (interpreter start-up included) and by its own report; a first (filling) run,
    # a cached run, and a run without the cache beside them on the other node.
    timed = (
        's=$(date +%s%N); stage-in "$0" $1 --quiet --jitter-max 0 --report "$2"; '
        'e=$(date +%s%N); echo "wall_ns=$((e - s))"'
    )
    figures = {}
    for label, node, flags in (
        ("fill", "node1", "--cache /scratch/cache-1000-plain"),
        ("cached", "node1", "--cache /scratch/cache-1000-plain"),
        ("cached again", "node1", "--cache /scratch/cache-1000-plain"),
        ("no cache", "node2", "--no-cache"),
    ):
        path = reports / f"timed-{label.replace(' ', '-')}.json"
        out = _on(cluster, node, timed, str(src), flags, str(path))
        wall_s = int(out.stdout.split("wall_ns=")[1].split()[0]) / 1e9
        figures[label] = (wall_s, json.loads(path.read_text()))
    assert figures["cached"][1]["files_from_cache"] == 1000
    assert figures["cached"][1]["bytes_read_source"] == 0
    print("\n1,000 shards of", f"{total / 1000:.0f} B average, {total} B in all:")
    for label, (wall_s, report) in figures.items():
        print(
            f"  {label:13s} wall {wall_s:.2f} s, stage-in {report['seconds']:.2f} s, "
            f"{report['bytes_read_source']} B read from the source, "
            f"{report['files_from_cache']} from the cache"
        )


def test_four_concurrent_jobs_of_one_user_copy_each_shard_once(slurm_cluster) -> None:
    cluster = slurm_cluster
    base = cluster.shared_dir / "cache-four"
    src = base / "data" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=8, samples_per_shard=6, image_bytes=4000, seed=12)
    )
    env, log = _counting(cluster, "cache-four")
    started = base / "started"
    started.mkdir()
    # All four wait until all four run, then stage at once; a bandwidth cap keeps their copies
    # in flight together, so they really contend for the same shards.
    script = base / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"touch {shlex.quote(str(started))}/$SLURM_JOB_ID\n"
        f"while [ $(ls {shlex.quote(str(started))} | wc -l) -lt 4 ]; do sleep 0.1; done\n"
        f'exec stage-in "countfile://{src}" --cache /scratch/cache-four --quiet --jitter-max 0 '
        f'--bw-limit 0.2 --jobs 2 --report "{base}/report-$SLURM_JOB_ID.json"\n'
    )
    jobs = [
        cluster.sbatch(script, "-w", "node1", f"--output={base}/job-%j.out", env=env)
        for _ in range(4)
    ]
    for job in jobs:
        record = cluster.wait_job(job, timeout_s=180, output=base / f"job-{job}.out")
        assert record["JobState"] == "COMPLETED", (record, (base / f"job-{job}.out").read_text())
    assert _read(log) == _total(src)  # every shard read once, for the four jobs together
    reports = [json.loads((base / f"report-{job}.json").read_text()) for job in jobs]
    assert sum(r["bytes_read_source"] for r in reports) == _total(src)
    assert sum(r["files_copied"] - r["files_from_cache"] for r in reports) == 8
    for job in jobs:
        _assert_identical(src, cluster.scratch("node1") / job / "ds")


def test_a_source_shard_changed_between_jobs_is_copied_again(slurm_cluster) -> None:
    cluster = slurm_cluster
    base = cluster.shared_dir / "cache-changed"
    src = base / "data" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=5, samples_per_shard=6, image_bytes=2000, seed=13)
    )
    env, log = _counting(cluster, "cache-changed")
    _on(
        cluster,
        "node2",
        STAGE,
        f"countfile://{src}",
        "/scratch/cache-changed",
        str(base / "r1.json"),
        env=env,
    )
    victim = src / "train-000003.tar"
    data = bytearray(victim.read_bytes())
    data[1000:1010] = b"0123456789"  # the same size, other bytes
    victim.write_bytes(bytes(data))
    log.write_text("")
    out = _on(
        cluster,
        "node2",
        STAGE,
        f"countfile://{src}",
        "/scratch/cache-changed",
        str(base / "r2.json"),
        env=env,
    )
    assert _read(log) == len(data)  # that shard only
    report = json.loads((base / "r2.json").read_text())
    assert report["files_from_cache"] == 4 and report["bytes_read_source"] == len(data)
    _assert_identical(src, cluster.scratch("node2") / _job_of(out) / "ds")


def _hold(cluster, base: Path, node: str, script_text: str, env=None) -> tuple[str, Path]:
    """Submit a job that runs ``script_text`` then waits for its release file; return (id, file)."""
    release = base / f"release-{time.monotonic_ns()}"
    script = base / f"hold-{time.monotonic_ns()}.sh"
    script.write_text(
        "#!/bin/sh\nset -e\n"
        + script_text
        + f"\ntouch {shlex.quote(str(release))}.ready\n"
        + f"while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.2; done\n"
    )
    job = cluster.sbatch(script, "-w", node, f"--output={base}/hold-%j.out", env=env)
    deadline = time.monotonic() + 120
    while not Path(f"{release}.ready").exists():
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING"), (state, (base / f"hold-{job}.out").read_text())
        assert time.monotonic() < deadline, "the holding job did not get ready"
        time.sleep(0.2)
    return job, release


def test_eviction_under_the_limit_keeps_the_dataset_a_running_job_uses(slurm_cluster) -> None:
    cluster = slurm_cluster
    base = cluster.shared_dir / "cache-evict"
    base.mkdir()
    data = {}
    for i, name in enumerate(("a", "b", "c")):
        data[name] = base / "data" / name
        write_synthetic_dataset(
            data[name], SyntheticSpec(num_shards=3, samples_per_shard=4, image_bytes=3000, seed=i)
        )
    limit = str(int(_total(data["a"]) * 2.5))  # room for two of the three
    flags = f"--cache /scratch/cache-evict --cache-limit {limit} --quiet --jitter-max 0"
    # Job A stages a and keeps running (training, say): a is in use though least recently used.
    job_a, release = _hold(
        cluster, base, "node1", f"stage-in {shlex.quote(str(data['a']))} {flags}"
    )
    try:
        _on(cluster, "node1", f'stage-in "$0" {flags}', str(data["b"]))
        out = _on(cluster, "node1", f'stage-in "$0" {flags}', str(data["c"]))
        assert "evicted 'b'" in out.stderr, out.stderr
        listing = _on(cluster, "node1", "stager ls --cache /scratch/cache-evict --json")
        rows = [json.loads(line) for line in listing.stdout.splitlines()]
        cached = {r["name"]: (r["state"], r["jobs"]) for r in rows if r["where"] == "cache"}
        assert cached == {"a": ("in use", [job_a]), "c": ("idle", [])}, listing.stdout
        for command in ("ls", "du"):  # as docs/cache.md shows them
            shown = _on(cluster, "node1", f"stager {command} --cache /scratch/cache-evict")
            print(f"\n$ stager {command} --cache /scratch/cache-evict\n{shown.stdout}")
        assert (cluster.scratch("node1") / job_a / "a").is_dir()
        _assert_identical(data["a"], cluster.scratch("node1") / job_a / "a")
    finally:
        release.touch()
    cluster.wait_job(job_a, timeout_s=60)


def test_clean_never_removes_a_running_jobs_data_and_ls_covers_the_allocation(
    slurm_cluster,
) -> None:
    cluster = slurm_cluster
    base = cluster.shared_dir / "clean"
    src = base / "data" / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=3, samples_per_shard=4, seed=14))
    # Jobs' scratch under a root of this test's own, so other tests' leftovers play no part.
    env = {"STAGER_SCRATCH_ROOT": "/scratch/clean-test"}
    # An ended job left its scratch on node1; a running one is staging and training there.
    ended = _job_of(
        _on(
            cluster, "node1", 'stage-in "$0" --quiet && echo "job=$SLURM_JOB_ID"', str(src), env=env
        )
    )
    running, release = _hold(
        cluster, base, "node1", f"stage-in {shlex.quote(str(src))} --quiet", env=env
    )
    scratch = cluster.scratch("node1") / "clean-test"
    try:
        assert (scratch / ended / "ds").is_dir() and (scratch / running / "ds").is_dir()
        out = _on(cluster, "node1", "stager clean", env=env)
        assert f"removed /scratch/clean-test/{ended} " in out.stdout, out.stdout
        assert f"kept /scratch/clean-test/{running}: job {running} is still running" in out.stdout
        assert not (scratch / ended).exists()
        _assert_identical(src, scratch / running / "ds")
        # Naming it does not help; only the job itself may (at its end, as the templates do).
        refused = _on(cluster, "node1", f"stager clean --job {running}", env=env, check=False)
        assert refused.returncode == 2 and "is still running" in refused.stderr
        assert (scratch / running / "ds").is_dir()
        # One line per dataset, prefixed by its node, over the whole allocation.
        ls = ["srun", "-N2", "--ntasks-per-node=1", "stager", "ls"]
        listing = cluster.run([*ls, "--json"], env=env)
        rows = [json.loads(line) for line in listing.stdout.splitlines()]
        assert [(r["node"], r["where"], r["state"], r["name"]) for r in rows] == [
            ("node1", running, "running", "ds")
        ]
        text = cluster.run(ls, env=env)
        assert all(line.startswith(("NODE", "node1")) for line in text.stdout.splitlines())
        print("\n$ srun -N2 --ntasks-per-node=1 stager ls\n" + text.stdout)
    finally:
        release.touch()
    cluster.wait_job(running, timeout_s=60)
    out = _on(cluster, "node1", f"stager clean --job {running}", env=env)
    assert "removed" in out.stdout and not (scratch / running).exists()
