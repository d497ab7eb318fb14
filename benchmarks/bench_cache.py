"""Benchmark: a repeated job's stage-in with the node cache, beside one without it.

Run: ``.venv/bin/python -m benchmarks.bench_cache [--shards 1000] [--delay-ms 10] [--repeats 3]``
(root: it mounts a FUSE filesystem and unmounts it on exit, even on error).

The source is served through :mod:`benchmarks.latencyfs`, which sleeps ``--delay-ms`` per
lookup, open and read, as a shared filesystem's round trips cost. Three stage-ins, each into a
fresh job directory as a new job would get, with the kernel's 1 s attribute cache waited out
before each: ``no cache`` (``--no-cache``: every byte from the source), ``cached`` (``--cache``
after a first job filled it: what a repeated job, a requeue or a sweep's next job pays), and
``fill`` (the first job with ``--cache``, against an empty cache each time). Every figure is the
median of the repeats: wall time of the whole command (interpreter start-up included) and the
report's ``seconds``; the ratio is to ``no cache`` in the same run.

With the cache the source is still listed and every shard stat'ed (its version decides whether
the cached bytes may be served); that is what a cached run pays the source.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import REPO
from .latencyfs import mounted

STAGE_IN = str(REPO / ".venv" / "bin" / "stage-in")


def _run(src: Path, dest: Path, report: Path, *flags: str) -> tuple[float, dict]:
    time.sleep(1.1)  # the kernel's entry and attribute cache (1 s) expires: a cold start
    argv = [STAGE_IN, str(src), "--dest", str(dest), "--quiet", "--report", str(report), *flags]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-1500:]}")
    return wall_s, json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        data = work / "data" / "ds"
        write_synthetic_dataset(
            data, SyntheticSpec(num_shards=args.shards, samples_per_shard=2, image_bytes=200)
        )
        runs: dict[str, list[tuple[float, float, int]]] = {"no cache": [], "fill": [], "cached": []}
        with mounted(data.parent, work / "nfs", delay_s=args.delay_ms / 1000) as fs:
            src = work / "nfs" / "ds"
            warm = work / "cache-warm"
            _run(src, work / "warmup", work / "r.json", "--cache", str(warm))
            for repeat in range(args.repeats):
                for label in runs:
                    dest = work / f"job-{label.replace(' ', '-')}-{repeat}"
                    if label == "no cache":
                        flags = ["--no-cache"]
                    elif label == "fill":
                        flags = ["--cache", str(work / f"cache-empty-{repeat}")]
                    else:
                        flags = ["--cache", str(warm)]
                    wall_s, report = _run(src, dest, work / "r.json", *flags)
                    runs[label].append((wall_s, report["seconds"], report["bytes_read_source"]))
        base = statistics.median(w for w, _, _ in runs["no cache"])
        total = sum(p.stat().st_size for p in data.glob("*.tar"))
        print(
            f"{args.shards} shards, {total} B; source latency {args.delay_ms:g} ms per operation "
            f"({fs['impl']} shim); median of {args.repeats}"
        )
        print(
            f"{'run':10s} {'wall s':>7s} {'stage-in s':>10s} {'source B':>10s} {'vs no cache':>11s}"
        )
        for label, rows in runs.items():
            wall = statistics.median(w for w, _, _ in rows)
            inner = statistics.median(s for _, s, _ in rows)
            read = int(statistics.median(b for _, _, b in rows))
            print(f"{label:10s} {wall:7.2f} {inner:10.2f} {read:10d} {wall / base:10.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
