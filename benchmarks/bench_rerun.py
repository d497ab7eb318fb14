"""Benchmark: a rerun of a fully staged dataset with its manifest, behind per-operation latency.

Run: ``.venv/bin/python -m benchmarks.bench_rerun [--shards 1000] [--delay-ms 10] [--repeats 3]
[--baseline CHECKOUT]`` as root (it mounts the FUSE latency shim, :mod:`benchmarks.latencyfs`).

A rerun keeps a staged shard only while its source's modification time is the one it was
copied from, with a manifest too, so it stats each staged shard's source once (on ``--jobs``
threads). This measures what that costs: the rerun's wall time, and the metadata calls under
the mount (counted with ``strace`` where it is installed), against ``--baseline`` (a git
worktree of an older commit, extensions built in place) in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.latencyfs import mounted
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

REPO = Path(__file__).resolve().parent.parent
ENV = {"STAGER_NATIVE_TAR": "1", "STAGER_NATIVE_STAT": "1", "STAGER_NATIVE_COPY": "1"}


def _stage_in(checkout: Path, source: Path, dest: Path, trace: Path | None = None) -> float:
    env = {**os.environ, **ENV, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-m", "stager", "stage-in", str(source), "--dest", str(dest)]
    argv += ["--quiet", "--jitter-max", "0"]
    if trace is not None:
        argv = ["strace", "-f", "-e", "trace=newfstatat,statx,stat,lstat", "-o", str(trace), *argv]
    started = time.perf_counter()
    # (run from the checkout: ``-m`` puts the working directory ahead of PYTHONPATH)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=checkout)
    if done.returncode != 0:
        raise SystemExit(f"stage-in failed ({done.returncode}): {done.stderr.strip()}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a git worktree of an older commit")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-rerun-", dir="/var/tmp"))
    try:
        src = root / "src" / "ds"
        spec = SyntheticSpec(num_shards=args.shards, samples_per_shard=2, image_bytes=256)
        write_synthetic_dataset(src, spec)
        index = [sys.executable, "-m", "stager", "index", str(src)]
        subprocess.run(index, check=True, capture_output=True, env={**os.environ, **ENV})
        mnt = root / "mnt"
        mnt.mkdir()
        checkouts = {"HEAD": REPO, **({"baseline": args.baseline} if args.baseline else {})}
        print(f"| checkout | stats under the mount | rerun wall time, median of {args.repeats} |")
        print("|---|---|---|")
        with mounted(src, mnt, delay_s=args.delay_ms / 1000) as info:
            for label, checkout in checkouts.items():
                dest = root / f"dest-{label}"
                _stage_in(checkout, mnt, dest)  # (the first run stages everything)
                times = [_stage_in(checkout, mnt, dest) for _ in range(args.repeats)]
                stats = "(no strace)"
                if shutil.which("strace"):
                    trace = root / f"trace-{label}.txt"
                    _stage_in(checkout, mnt, dest, trace)
                    stats = str(sum(str(mnt) in line for line in trace.open()))
                print(f"| {label} | {stats} | {statistics.median(times):.2f} s |")
        print(f"({args.shards} shards, {args.delay_ms:g} ms per operation, shim {info['impl']})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
