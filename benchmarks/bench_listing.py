"""Benchmark: listing a directory source behind per-operation latency, one thread against many.

Run: ``.venv/bin/python -m benchmarks.bench_listing [--dirs 200] [--files 5] [--delay-ms 10]
[--jobs 16] [--repeats 3]``

A tree of ``--dirs`` directories of ``--files`` tiny shards each, served through the latency
shim (:mod:`benchmarks.latencyfs`: every lookup, getattr, open and read sleeps ``--delay-ms``,
as an NFS round trip would). Each repeat times :func:`stager.storage.listing.walk_local` with
``jobs=1`` (one directory after another, as before issue 20) and with ``--jobs`` threads,
alternately; it prints the medians and their ratio. The same walk over a local tmpfs is timed
too, where directory reads are fast and the walk must stay on one thread.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.latencyfs import mounted
from stager.storage.listing import walk_local


def make_tree(root: Path, dirs: int, files: int) -> None:
    for d in range(dirs):
        directory = root / f"{d:05d}"
        directory.mkdir(parents=True)
        for i in range(files):
            (directory / f"s{i:05d}.tar").write_bytes(b"x" * 1024)


def timed(root: str, jobs: int, expected: int) -> float:
    started = time.perf_counter()
    found = walk_local(root, jobs)
    elapsed = time.perf_counter() - started
    if len(found) != expected:
        raise RuntimeError(f"walk found {len(found)} shards, expected {expected}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirs", type=int, default=200)
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="/dev/shm", help="a tmpfs for the tree")
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also time stage-in's first byte written through the shim, this code against "
        "another checkout (e.g. `git worktree add /tmp/old <commit>`), alternately",
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-listing-", dir=args.data))
    expected = args.dirs * args.files
    rows: dict[str, list[float]] = {}
    try:
        make_tree(work / "src", args.dirs, args.files)
        (work / "mnt").mkdir()
        with mounted(work / "src", work / "mnt", delay_s=args.delay_ms / 1000) as shim:
            for _ in range(args.repeats):
                for jobs in (1, args.jobs):
                    key = f"{args.delay_ms:g} ms per op ({shim['impl']} shim), jobs={jobs}"
                    rows.setdefault(key, []).append(timed(str(work / "mnt"), jobs, expected))
            if args.baseline:
                first_bytes = _first_bytes(work, args.baseline, args.repeats)
        for _ in range(args.repeats):
            for jobs in (1, args.jobs):
                key = f"local tmpfs, jobs={jobs}"
                rows.setdefault(key, []).append(timed(str(work / "src"), jobs, expected))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.dirs} directories x {args.files} shards; medians of {args.repeats}")
    print("| condition | walk s (median) | runs (s) | x jobs=1 |")
    print("|---|---|---|---|")
    medians = {key: statistics.median(times) for key, times in rows.items()}
    for key, times in rows.items():
        base = medians[key.rsplit("jobs=", 1)[0] + "jobs=1"]
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {key} | {medians[key]:.3f} | {runs} | {medians[key] / base:.2f}x |")
    if args.baseline:
        print(f"\nstage-in's first byte written, {args.delay_ms:g} ms per op, --jobs 64 (default)")
        print("| code | first byte s (median) | runs (s) | x baseline |")
        print("|---|---|---|---|")
        base = statistics.median(first_bytes["baseline"])
        for name, times in first_bytes.items():
            runs = ", ".join(f"{t:.2f}" for t in times)
            median = statistics.median(times)
            print(f"| {name} | {median:.2f} | {runs} | {median / base:.2f}x |")
    return 0


def _first_bytes(work: Path, baseline: str, repeats: int) -> dict[str, list[float]]:
    """stage-in from the shim's mount to a first byte written: this code and ``baseline``,
    alternately (a first run each time: the destination is removed before every run)."""
    import os

    from benchmarks.bench_manifest_start import first_byte_s

    times: dict[str, list[float]] = {"this code": [], "baseline": []}
    for _ in range(repeats):
        for name in times:
            if name == "baseline":
                os.environ["PYTHONPATH"] = str(Path(baseline).resolve())
            try:
                times[name].append(first_byte_s(work / "mnt", work / "dest"))
            finally:
                os.environ.pop("PYTHONPATH", None)
    return times


if __name__ == "__main__":
    sys.exit(main())
