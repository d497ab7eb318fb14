"""Planning cost of one rank's epoch: time and peak memory, new planner against the old one.

One configuration (prints one JSON object)::

    python -m benchmarks.bench_plan --samples 2e9 --shards 200000 --ranks 4096 --workers 8 --json

The process is fresh (as a rank starting a job is); ``import_s`` (numpy + the planner) is
reported apart and excluded from ``plan_s``. Building the per-shard sample counts (what the
manifest or the loader index hands the planner) is excluded too, and reported as ``counts_s``.
``plan_s`` covers what a rank does per epoch: its sample indices for the epoch, cut into batches,
and which of its ``--workers`` DataLoader workers reads each batch. ``first_chunk_s`` is what the
loader's sampler evaluates before its first batch (one chunk of positions). ``peak_rss_mb`` is the
process's peak resident set (``ru_maxrss``), imports and counts included; ``rss_before_mb`` is
the same figure just before planning, so the difference is the plan's own.

``--impl legacy`` runs the planner before issue 20 (:mod:`benchmarks.legacy_plan`: the whole
permutation, then a slice). ``--elastic-from R`` plans the rank's share of an epoch resumed
elastically from a world of ``R`` ranks that stopped halfway. ``--partition NODES`` times the
node-subset partition of ``--shards`` shards instead.

The suite (``--suite``, Markdown table) runs each configuration ``--reps`` times in fresh
processes, alternating configurations, and reports medians with ratios to the old planner at
1e8 samples in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _counts(samples: int, shards: int):  # noqa: ANN202 - numpy imported lazily
    import numpy as np

    counts = np.full(shards, samples // shards, dtype=np.int64)
    counts[: samples % shards] += 1
    return counts


def run_one(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    import numpy as np

    from stager.plan import ranks

    from . import legacy_plan

    t1 = time.perf_counter()
    samples, shards = int(float(args.samples)), int(float(args.shards))
    counts = _counts(samples, shards)
    t2 = time.perf_counter()
    rss_before = _rss_mb()
    doc: dict = {
        "impl": args.impl,
        "samples": samples,
        "shards": shards,
        "import_s": t1 - t0,
        "counts_s": t2 - t1,
    }
    if args.partition:
        weights = counts * 1000  # bytes as the weight, as stage-in uses
        started = time.perf_counter()
        if args.impl == "legacy":
            parts = legacy_plan.node_partition(weights, args.partition)
        else:
            parts = ranks.node_partition(weights, args.partition)
        doc.update(
            what="node_partition",
            nodes=args.partition,
            plan_s=time.perf_counter() - started,
            largest_node=max(len(p) for p in parts),
        )
    else:
        world = args.ranks
        rank = args.rank if args.rank is not None else world // 2 + 1
        layout = ranks.WorldLayout(1, world, rank, args.workers)
        options = ranks.PlanOptions(
            batch_size=args.batch_size, seed=args.seed, shuffle=args.shuffle, even=args.even
        )
        started = time.perf_counter()
        if args.impl == "legacy":
            indices = legacy_plan.rank_indices(counts, layout, epoch=args.epoch, options=options)
            first_chunk_s = time.perf_counter() - started  # the whole plan precedes any batch
        elif args.elastic_from:
            from stager.plan.elastic import elastic_indices, remaining_after

            old_per_rank = ranks.samples_per_rank(
                samples, ranks.WorldLayout(1, args.elastic_from), "pad"
            )
            consumed = old_per_rank // args.batch_size // 2
            remaining = remaining_after(
                counts,
                1,
                args.elastic_from,
                epoch=args.epoch,
                options=options,
                batches_consumed=consumed,
            )
            indices = elastic_indices(remaining, layout, args.even)
            first_chunk_s = float("nan")
        else:
            indices = ranks.rank_indices(counts, layout, epoch=args.epoch, options=options)
            chunk_start = time.perf_counter()
            ranks.rank_indices(counts, layout, epoch=args.epoch, options=options, stop=1 << 15)
            first_chunk_s = time.perf_counter() - chunk_start
            started += time.perf_counter() - chunk_start  # not part of the epoch's plan
        batches = ranks.rank_batches(indices, args.batch_size, args.even)
        workers = np.asarray(
            [ranks.worker_of_batch(i, args.workers) for i in range(len(batches))], dtype=np.int32
        )
        plan_s = time.perf_counter() - started
        doc.update(
            what="rank_plan" if not args.elastic_from else "elastic_rank_plan",
            ranks=world,
            rank=rank,
            workers=args.workers,
            shuffle=args.shuffle,
            batches=len(batches),
            per_rank=int(len(indices)),
            plan_s=plan_s,
            first_chunk_s=first_chunk_s,
            worker_batches=int((workers == 0).sum()),
        )
    doc.update(peak_rss_mb=_rss_mb(), rss_before_mb=rss_before)
    return doc


def _spawn(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_plan", *argv, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv}: exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: (label, argv): the issue's configurations, 4,096 ranks x 8 workers, batch 256.
SUITE = [
    ("old, global, 1e8 / 100k shards", ["--impl", "legacy", "--samples", "1e8", "--shards", "1e5"]),
    ("new, global, 1e8 / 100k shards", ["--samples", "1e8", "--shards", "1e5"]),
    ("new, global, 2e9 / 200k shards", ["--samples", "2e9", "--shards", "2e5"]),
    (
        "new, blocked, 2e9 / 1M shards",
        ["--samples", "2e9", "--shards", "1e6", "--shuffle", "blocked"],
    ),
    (
        "new, elastic 8,192 -> 4,096 ranks, 2e9",
        ["--samples", "2e9", "--shards", "2e5", "--elastic-from", "8192"],
    ),
    (
        "old, node partition, 1M shards x 4,096 nodes",
        ["--impl", "legacy", "--samples", "2e9", "--shards", "1e6", "--partition", "4096"],
    ),
    (
        "new, node partition, 1M shards x 4,096 nodes",
        ["--samples", "2e9", "--shards", "1e6", "--partition", "4096"],
    ),
]
COMMON = ["--ranks", "4096", "--workers", "8"]


def suite(reps: int) -> list[dict]:
    runs: dict[str, list[dict]] = {label: [] for label, _ in SUITE}
    for rep in range(reps):
        for label, argv in SUITE:
            if rep and "old, node partition" in label:
                continue  # ~minutes; once is enough to show the order of magnitude
            runs[label].append(_spawn(argv + COMMON))
            print(f"rep {rep}: {label}: {runs[label][-1]['plan_s']:.3f} s", file=sys.stderr)
    base = runs[SUITE[0][0]]
    base_s = statistics.median(r["plan_s"] for r in base)
    base_mb = statistics.median(r["peak_rss_mb"] for r in base)
    rows = []
    for label, _ in SUITE:
        mine = runs[label]
        plan_s = statistics.median(r["plan_s"] for r in mine)
        peak = statistics.median(r["peak_rss_mb"] for r in mine)
        rows.append(
            {
                **mine[0],
                "label": label,
                "plan_s": plan_s,
                "peak_rss_mb": peak,
                "rss_before_mb": statistics.median(r["rss_before_mb"] for r in mine),
                "first_chunk_s": statistics.median(
                    r.get("first_chunk_s", float("nan")) for r in mine
                ),
                "runs_s": [r["plan_s"] for r in mine],
                "time_ratio_to_old_1e8": plan_s / base_s,
                "rss_ratio_to_old_1e8": peak / base_mb,
            }
        )
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| configuration | plan s (median) | x old 1e8 | first chunk s | peak RSS MB "
        "| of which before planning | x old 1e8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunk = r.get("first_chunk_s", float("nan"))
        lines.append(
            f"| {r['label']} | {r['plan_s']:.3f} | {r['time_ratio_to_old_1e8']:.4f}x | "
            f"{'-' if chunk != chunk else f'{chunk:.4f}'} | {r['peak_rss_mb']:.0f} | "
            f"{r['rss_before_mb']:.0f} | {r['rss_ratio_to_old_1e8']:.3f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="1e8", help="samples in the dataset (1e8, 2e9, ...)")
    parser.add_argument("--shards", default="1e5")
    parser.add_argument("--ranks", type=int, default=4096, help="world size")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    parser.add_argument("--rank", type=int, help="which rank to plan (default: ranks/2 + 1)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shuffle", choices=("global", "blocked", "none"), default="global")
    parser.add_argument("--even", choices=("pad", "drop"), default="pad")
    parser.add_argument("--impl", choices=("new", "legacy"), default="new")
    parser.add_argument("--elastic-from", type=int, default=0, metavar="RANKS")
    parser.add_argument("--partition", type=int, default=0, metavar="NODES")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--suite", action="store_true", help="run the issue's table")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json-out", type=Path, help="with --suite: also write the rows here")
    args = parser.parse_args(argv)
    if args.suite:
        rows = suite(args.reps)
        print(
            f"4,096 ranks x 8 workers, batch 256, pad; median of {args.reps} fresh processes "
            "per configuration, alternating"
        )
        print(to_markdown(rows))
        if args.json_out:
            args.json_out.write_text(json.dumps(rows, indent=1))
        return 0
    doc = run_one(args)
    print(json.dumps(doc) if args.json else json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
