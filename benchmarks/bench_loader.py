"""Loader throughput on staged shards: ShardedLoader vs webdataset's WebLoader vs a raw tarfile
loop.

Run: ``.venv/bin/python -m benchmarks.bench_loader [--small-samples N] [--large-samples N]
[--reps R]``

Conditions: the same synthetic shards (``.npy`` + ``.cls`` per sample) written to a tmpfs
(``/dev/shm``) when there is one, so figures measure the loaders, not the virtio disk, whose
page cache is evicted ~2 s after use on this machine (see /work/shared/BENCHMARKING.md).
Batch 256, nothing decoded; 0/1/2 workers; ~1 KB and ~100 KB samples. Each configuration runs
``--reps`` times, alternating loaders (A B C A B C), and the median is printed with the ratio
of ShardedLoader to WebLoader. Time is a full epoch including worker start-up and, for
ShardedLoader, its construction
(reading the staged manifest and the cached index; the index itself is built once in a
warm-up, as a first epoch after stage-in would). ShardedLoader runs with its default seeded
global shuffle; the others read sequentially.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import scratch_root

BATCH = 256


def raw_tarfile(shards: list[Path], workers: int) -> int:
    """The floor any tar reader pays: parse every header, read every payload, group by key."""
    samples, last = 0, None
    for shard in shards:
        with tarfile.open(shard, "r|") as stream:
            for info in stream:
                member = stream.extractfile(info)
                if member is None:
                    continue
                member.read()
                key = info.name.split(".", 1)[0]
                if key != last:
                    samples, last = samples + 1, key
    return samples


def web_loader(shards: list[Path], workers: int) -> int:
    import webdataset as wds

    dataset = wds.WebDataset(
        [str(s) for s in shards], shardshuffle=False, empty_check=False
    ).batched(BATCH)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    return sum(len(batch["__key__"]) for batch in loader)


def sharded_loader(shards: list[Path], workers: int) -> int:
    from stager_loaders import ShardedLoader

    # ``shards`` are the staged copies: the loader is given the staged dataset directory.
    loader = ShardedLoader(shards[0].parent, batch_size=BATCH, num_workers=workers)
    return sum(len(batch["__key__"]) for batch in loader)


def stage(source_dir: Path, dest_root: Path) -> list[Path]:
    """stage-in (tmpfs to tmpfs) so every loader reads the same staged files."""
    from stager.slurm import SlurmEnv
    from stager.stagein.run import StageInOptions, stage_in
    from stager.storage.sources import resolve_source

    options = StageInOptions(dest_root=dest_root, progress="none", jitter_max_s=0)
    report = stage_in(resolve_source(str(source_dir)), options, slurm=SlurmEnv.from_environ({}))
    staged = sorted(Path(report.dataset_dir).glob("*.tar"))
    shutil.rmtree(source_dir)  # halve the tmpfs footprint; the staged copy is all we read
    return staged


LOADERS: dict[str, Callable[[list[Path], int], int]] = {
    "raw tarfile loop": raw_tarfile,
    "webdataset WebLoader": web_loader,
    "ShardedLoader": sharded_loader,
}


def measure(
    fn: Callable[[list[Path], int], int], shards: list[Path], workers: int, expected: int
) -> float:
    started = time.perf_counter()
    count = fn(shards, workers)
    elapsed = time.perf_counter() - started
    if count != expected:
        raise RuntimeError(f"{fn.__name__} delivered {count} samples, expected {expected}")
    return count / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-samples", type=int, default=20_000, help="number of ~1 KB samples")
    parser.add_argument(
        "--large-samples", type=int, default=1_000, help="number of ~100 KB samples"
    )
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", default="0,1,2")
    args = parser.parse_args(argv)
    root, condition = scratch_root("bench-loader-")
    worker_counts = [int(w) for w in args.workers.split(",")]
    print(
        f"condition: {condition}; batch {BATCH}; nothing decoded; {os.cpu_count()} CPUs (shared); "
        f"median of {args.reps} alternating runs",
        flush=True,
    )
    rows = []
    try:
        for label, total, image_bytes in (
            ("~1 KB", args.small_samples, 1024),
            ("~100 KB", args.large_samples, 100_000),
        ):
            spec = SyntheticSpec(
                num_shards=args.shards,
                samples_per_shard=max(1, total // args.shards),
                image_bytes=image_bytes,
                seed=0,
            )
            write_synthetic_dataset(root / f"src{image_bytes}" / "ds", spec)
            shards = stage(root / f"src{image_bytes}" / "ds", root / f"scratch{image_bytes}")
            expected = sum(spec.shard_sizes())
            sharded_loader(
                shards, 0
            )  # warm-up: builds the cached tar index, as the first epoch would
            for workers in worker_counts:
                names = [n for n in LOADERS if not (n == "raw tarfile loop" and workers > 0)]
                figures: dict[str, list[float]] = {n: [] for n in names}
                for _ in range(args.reps):
                    for name in names:
                        figures[name].append(measure(LOADERS[name], shards, workers, expected))
                medians = {n: statistics.median(v) for n, v in figures.items()}
                rows.append((label, workers, medians))
                print(
                    f"{label:>8} w={workers}: "
                    + ", ".join(f"{n} {v / 1e3:.1f}k/s" for n, v in medians.items()),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| samples | workers | raw tarfile (k/s) | WebLoader (k/s) | ShardedLoader (k/s) "
        "| Sharded / WebLoader | Sharded / raw |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, workers, medians in rows:
        raw = medians.get("raw tarfile loop")
        web, ours = medians["webdataset WebLoader"], medians["ShardedLoader"]
        print(
            f"| {label} | {workers} | {raw / 1e3:.1f} |" if raw else f"| {label} | {workers} | — |",
            end="",
        )
        print(
            f" {web / 1e3:.1f} | {ours / 1e3:.1f} | {ours / web:.2f}x | "
            + (f"{ours / raw:.2f}x |" if raw else "— |")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
