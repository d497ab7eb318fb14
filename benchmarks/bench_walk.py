"""Benchmark: the compiled tar walk, ns a member, with the shard in memory and in the CPU cache.

Run: ``.venv/bin/python -m benchmarks.bench_walk [--samples 25000] [--repeats 7]
[--baseline CHECKOUT]``

Why: a shard's headers form a chain (each one's place is known from the size in the one
before), a member apart, so a walk of a shard that is not in the CPU cache waits on memory once
a member unless it asks ahead (``_tarwalk.c``'s ``prefetch_ahead``). That is the loader's case
when it indexes staged shards of small members (``index_tar`` maps the shard and walks it) and
the case of any shard larger than the cache. stage-in's copies walk bytes they have just
hashed, mostly in the cache: the "in cache" row.

One shard of ~1 KB samples (two members each, as the synthetic datasets write them) is written
to a tmpfs. Each row is timed in a fresh process, trees alternating:

- walk from memory: the compiled walk over the whole shard, mapped (77 MB at 25,000 samples,
  more than a server's L3 cache);
- walk in cache: a 1 MiB prefix of it walked again and again;
- ``index_tar``: the loader's index of the shard from its path (map, walk, columns);
- read ceiling: the shard read into a 4 MiB buffer, in the same process: the walk from memory
  is reported as a fraction of its MB/s.

``--baseline CHECKOUT`` runs the same rows from an older checkout whose extensions are built
in place (``python setup.py build_ext --inplace`` in it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import scratch_root

REPO = Path(__file__).resolve().parent.parent

#: Run in a fresh interpreter with the tree to time first on the path: argv = tree, shard,
#: repeats. Prints one JSON object of medians.
_CHILD = r"""
import json, mmap, os, statistics, sys, time
tree, shard, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
from stager.shards import tarnative
from stager.shards.tarindex import index_tar
if not tarnative.available():
    raise SystemExit(f"the compiled walk is not built in {tree}")

def walk(data):
    walker = tarnative.native_walk()
    walker.feed(data)
    return walker.finish()

def timed(call):
    started = time.perf_counter()
    call()
    return time.perf_counter() - started

with open(shard, "rb") as handle:
    mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
import array
offsets = array.array("q", walk(mapped)["offsets"])  # each member's payload, after its header
members = len(offsets)
prefix = bytes(mapped[: 1 << 20])
prefix_members = sum(1 for offset in offsets if offset - 512 < len(prefix))  # headers walked
buffer = memoryview(bytearray(4 << 20))

def read_all():
    fd = os.open(shard, os.O_RDONLY)
    try:
        while os.readv(fd, [buffer]):
            pass
    finally:
        os.close(fd)

def hot():
    for _ in range(20):
        walk(prefix)

index_tar(shard)  # (its first call imports numpy: not what is timed)
rows = {"memory": [], "cache": [], "index_tar": [], "read": []}
for _ in range(repeats):
    rows["memory"].append(timed(lambda: walk(mapped)))
    rows["cache"].append(timed(hot) / 20)
    rows["index_tar"].append(timed(lambda: index_tar(shard)))
    rows["read"].append(timed(read_all))
result = {name: statistics.median(times) for name, times in rows.items()}
result.update(members=members, prefix_members=prefix_members, bytes=os.path.getsize(shard))
print(json.dumps(result))
"""


def write_shard(directory: Path, samples: int) -> Path:
    """One shard of ``samples`` ~1 KB samples."""
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    spec = SyntheticSpec(num_shards=1, samples_per_shard=samples, image_bytes=1024)
    return write_synthetic_dataset(directory, spec)[0]


def measure(tree: Path, shard: Path, repeats: int) -> dict[str, float]:
    """The child's medians for ``tree``."""
    argv = [sys.executable, "-c", _CHILD, str(tree), str(shard), str(repeats)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tree, check=False)
    if done.returncode:
        raise RuntimeError(f"the walk benchmark failed in {tree}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def rows_of(label: str, runs: list[dict[str, float]]) -> list[str]:
    """Markdown rows: medians over the runs of each child's medians."""

    def median(name: str) -> float:
        return statistics.median(run[name] for run in runs)

    first = runs[0]
    per_member = 1e9 / first["members"]
    mb = first["bytes"] / 1e6
    memory, read = median("memory"), median("read")
    return [
        f"| {label} | walk from memory | {median('memory') * per_member:.0f} ns | "
        f"{mb / memory:,.0f} MB/s ({read / memory:.2f}x the read ceiling) |",
        f"| {label} | walk in cache | {median('cache') * 1e9 / first['prefix_members']:.0f} ns | |",
        f"| {label} | index_tar | {median('index_tar') * per_member:.0f} ns | "
        f"{median('index_tar') * 1e3:.1f} ms a shard |",
        f"| {label} | read ceiling | {read * per_member:.0f} ns | {mb / read:,.0f} MB/s |",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=25_000, help="samples in the shard")
    parser.add_argument("--repeats", type=int, default=7, help="timings per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per tree")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT", help="an older checkout")
    args = parser.parse_args(argv)

    scratch, kind = scratch_root("bench-walk-")
    try:
        shard = write_shard(scratch, args.samples)
        trees = {"HEAD": REPO}
        if args.baseline is not None:
            trees["baseline"] = args.baseline.resolve()
        runs: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
        for _ in range(args.processes):
            for label, tree in trees.items():  # alternating
                runs[label].append(measure(tree, shard, args.repeats))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    first = runs["HEAD"][0]
    print(
        f"one shard of {args.samples:,} ~1 KB samples ({first['members']:,} members, "
        f"{first['bytes'] / 1e6:.0f} MB) on {kind}; medians of {args.processes} processes x "
        f"{args.repeats} timings; per member"
    )
    print("| tree | row | per member | |")
    print("|---|---|---|---|")
    for label, label_runs in runs.items():
        print("\n".join(rows_of(label, label_runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
