"""Time to first batch with 10k small shards, and worker memory (RSS/PSS) over 5 epochs.

Run: ``.venv/bin/python -m benchmarks.bench_startup [--size small|large|100k] [--reps R]
[--epochs E] [--dataset DIR] [--skip-uncached]``

``--size 100k`` is 100k shards of 4 samples (issue 20's worker-PSS and first-batch figures);
preparing it (writing and staging 2 GB of tiny shards on tmpfs) takes a few minutes, so
``--dataset DIR`` reuses a staged copy left by an earlier run (``--keep`` keeps one), and
``--skip-uncached`` leaves out the first start that walks every tar header (~a minute there).

Conditions: synthetic shards (``.npy`` + ``.cls`` per sample, ~1 KB images), staged by stage-in
from a tmpfs to a tmpfs (``/dev/shm``, page-cache warm; see /work/shared/BENCHMARKING.md for
why not ext4 here); batch 256, nothing decoded, 2 DataLoader workers (this machine's cores).

Time to first batch: each measurement is a fresh Python process (as a job starting sees it) that
imports torch and the loader, then times construction + ``next(iter(loader))``; the import time
is reported apart. Loaders alternate within each repeat (A B C A B C) and medians are reported
with ratios to WebLoader in the same run:

* ShardedLoader, no cached index: the first epoch after stage-in; it walks every shard's tar
  headers (in the main process) and writes ``<dataset>/.stager/index``; the cache is deleted
  before each such run;
* ShardedLoader, cached index: any later start (a rerun, a requeue, another rank on the node);
* webdataset WebLoader (``WebDataset(urls).batched(256)``, no shard shuffle): it opens shards
  lazily, so its first batch needs only the first shard per worker, and it has no epoch length.

Memory: one process runs ``--epochs`` epochs with each loader; at the last batch of every epoch
(workers still alive) it reads ``/proc/PID/smaps_rollup`` of itself and of its DataLoader worker
processes (its child processes). RSS counts shared pages in full in every process; PSS divides
them among the sharers, so PSS summed over processes is the real footprint. ShardedLoader runs
with ``persistent_workers=True`` (the same workers for all epochs: the case where a leak would
accumulate) and with the default (fresh workers each epoch). "growth" is last epoch minus first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_loader import BATCH, stage
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import report, scratch_root

SIZES = {  # (shards, samples per shard)
    "small": (10_000, 4),  # 40k samples of ~1 KB: the 10k shards, minimal payload
    "large": (10_000, 40),  # 400k samples
    "100k": (100_000, 4),  # 400k samples in 100k shards: per-shard costs dominate
}
WORKERS = 2
STARTUP_LOADERS = (
    "ShardedLoader, no cached index",
    "ShardedLoader, cached index",
    "webdataset WebLoader",
)
MEMORY_LOADERS = ("ShardedLoader persistent workers", "ShardedLoader", "webdataset WebLoader")


# ---- child side: runs in a fresh process -------------------------------------------------------


def _make_loader(name: str, dataset_dir: Path, workers: int):
    if name.startswith("ShardedLoader"):
        from stager_loaders import LoaderOptions, ShardedLoader

        return ShardedLoader(
            dataset_dir,
            batch_size=BATCH,
            num_workers=workers,
            options=LoaderOptions(persistent_workers="persistent" in name),
        )
    import webdataset as wds

    urls = [str(p) for p in sorted(dataset_dir.glob("*.tar"))]
    return wds.WebLoader(
        wds.WebDataset(urls, shardshuffle=False, empty_check=False).batched(BATCH),
        batch_size=None,
        num_workers=workers,
    )


def _child_first_batch(name: str, dataset_dir: Path, workers: int) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401 - the import cost every loader pays, reported apart
    import webdataset  # noqa: F401

    # the package imports its modules lazily: import the loader's own modules here
    from stager_loaders import ShardedLoader  # noqa: F401

    t1 = time.perf_counter()
    loader = _make_loader(name, dataset_dir, workers)
    t2 = time.perf_counter()
    batch = next(iter(loader))
    t3 = time.perf_counter()
    assert len(batch["__key__"]) == BATCH
    return {"import_s": t1 - t0, "construct_s": t2 - t1, "first_batch_s": t3 - t1}


def smaps_rollup(pid: int) -> dict[str, int]:
    """RSS and PSS of one process in bytes, from ``/proc/PID/smaps_rollup``."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            fields[key.lower()] = int(rest.split()[0]) * 1024
    return fields


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the DataLoader workers here), from /proc/PID/task/*/children."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def _child_memory(name: str, dataset_dir: Path, workers: int, epochs: int) -> dict:
    import torch  # noqa: F401

    loader = _make_loader(name, dataset_dir, workers)
    me = os.getpid()
    per_epoch = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        it = iter(loader)
        batch = next(it)
        samples = len(batch["__key__"])
        seen: dict[int, dict[str, int]] = {}
        for batch in it:
            samples += len(batch["__key__"])
            # Sample the workers near the end of the epoch: they exit when the iterator ends.
            for pid in child_pids(me):
                try:
                    seen[pid] = smaps_rollup(pid)
                except OSError:
                    pass
        per_epoch.append(
            {
                "epoch": epoch,
                "samples": samples,
                "main": smaps_rollup(me),
                "workers": {str(p): v for p, v in seen.items()},
            }
        )
    return {"epochs": per_epoch}


# ---- parent side -------------------------------------------------------------------------------


def _spawn(mode: str, name: str, dataset_dir: Path, workers: int, epochs: int = 0) -> dict:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.bench_startup",
        "--child",
        mode,
        name,
        str(dataset_dir),
        str(workers),
        str(epochs),
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: child exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare(root: Path, shards: int, per_shard: int) -> Path:
    spec = SyntheticSpec(num_shards=shards, samples_per_shard=per_shard, image_bytes=1024, seed=0)
    write_synthetic_dataset(root / "src" / "ds", spec)
    staged = stage(root / "src" / "ds", root / "scratch")
    return staged[0].parent


def bench_first_batch(
    dataset_dir: Path, reps: int, workers: int = WORKERS, skip_uncached: bool = False
) -> list[dict]:
    names = [n for n in STARTUP_LOADERS if not (skip_uncached and n.endswith("no cached index"))]
    figures: dict[str, list[dict]] = {n: [] for n in names}
    index_dir = dataset_dir / ".stager" / "index"
    for _ in range(reps):
        for name in names:
            if name.endswith("no cached index"):
                shutil.rmtree(index_dir, ignore_errors=True)
            elif name.endswith("cached index") and not index_dir.is_dir():
                _spawn("first", STARTUP_LOADERS[0], dataset_dir, workers)  # builds it
            figures[name].append(_spawn("first", name, dataset_dir, workers))
    web = statistics.median(f["first_batch_s"] for f in figures["webdataset WebLoader"])
    rows = []
    for name, runs in figures.items():
        first = statistics.median(f["first_batch_s"] for f in runs)
        rows.append(
            {
                "bench": "first_batch",
                "loader": name,
                "workers": workers,
                "first_batch_s": first,
                "construct_s": statistics.median(f["construct_s"] for f in runs),
                "import_s": statistics.median(f["import_s"] for f in runs),
                "ratio_to_webloader": first / web,
                "runs": [f["first_batch_s"] for f in runs],
            }
        )
    return rows


def bench_memory(dataset_dir: Path, epochs: int, workers: int = WORKERS) -> list[dict]:
    rows = []
    for name in MEMORY_LOADERS:
        doc = _spawn("memory", name, dataset_dir, workers, epochs)
        for e in doc["epochs"]:
            workers_mem = list(e["workers"].values())
            rows.append(
                {
                    "bench": "memory",
                    "loader": name,
                    "epoch": e["epoch"],
                    "samples": e["samples"],
                    "main_rss": e["main"]["rss"],
                    "main_pss": e["main"]["pss"],
                    "worker_pids": list(e["workers"]),
                    "worker_rss": [w["rss"] for w in workers_mem],
                    "worker_pss": [w["pss"] for w in workers_mem],
                }
            )
    return rows


def bench(
    size: str = "small",
    reps: int = 3,
    epochs: int = 5,
    root: Path | None = None,
    dataset: Path | None = None,
    skip_uncached: bool = False,
    keep: bool = False,
) -> list[dict]:
    shards, per_shard = SIZES[size]
    own_root = root is None and dataset is None
    if dataset is not None:
        root, condition = dataset, f"{dataset} (reused)"
    elif root is None:
        root, condition = scratch_root("bench-startup-")
    else:
        condition = str(root)
    try:
        t0 = time.perf_counter()
        dataset_dir = dataset if dataset is not None else prepare(root, shards, per_shard)
        print(
            f"dataset ready in {time.perf_counter() - t0:.0f} s: {dataset_dir}",
            file=sys.stderr,
            flush=True,
        )
        rows = bench_first_batch(dataset_dir, reps, skip_uncached=skip_uncached)
        rows += bench_memory(dataset_dir, epochs)
    finally:
        if own_root and not keep:
            shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        r.update(condition=condition, shards=shards, samples=shards * per_shard)
    return rows


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _growth(epochs: list[dict], key: str) -> str:
    """Last epoch minus epoch 0, and minus epoch 1 (after warm-up), in MiB; max over workers."""

    def delta(a: dict, b: dict) -> float:
        if key.startswith("main"):
            return (b[key] - a[key]) / 2**20
        pairs = zip(
            a[key], b[key], strict=False
        )  # same worker slots; fresh workers each epoch without persistence
        return max((y - x for x, y in pairs), default=0) / 2**20

    figures = [delta(epochs[0], epochs[-1])] + (
        [delta(epochs[1], epochs[-1])] if len(epochs) > 2 else []
    )
    return " / ".join(f"{g:+.1f}" for g in figures)


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| loader | first batch s (median) | of which construction s | x WebLoader "
        "| torch+loader import s |",
        "|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["bench"] == "first_batch"):
        lines.append(
            f"| {r['loader']} | {r['first_batch_s']:.2f} | {r['construct_s']:.2f} | "
            f"{r['ratio_to_webloader']:.2f}x | {r['import_s']:.2f} |"
        )
    lines += [
        "",
        "| loader | epoch | main RSS MiB | main PSS MiB | worker RSS MiB | worker PSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    memory = [r for r in rows if r["bench"] == "memory"]
    for r in memory:
        lines.append(
            f"| {r['loader']} | {r['epoch']} | {_mb(r['main_rss'])} | {_mb(r['main_pss'])} | "
            f"{' / '.join(_mb(x) for x in r['worker_rss'])} | "
            f"{' / '.join(_mb(x) for x in r['worker_pss'])} |"
        )
    lines += [
        "",
        "Growth in MiB from epoch 0 to the last / from epoch 1 to the last "
        "(workers: max over workers):",
        "",
        "| loader | main RSS | main PSS | worker RSS | worker PSS |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["loader"] for r in memory):
        mine = [r for r in memory if r["loader"] == name]
        cells = [_growth(mine, key) for key in ("main_rss", "main_pss", "worker_rss", "worker_pss")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    web = [r for r in memory if r["loader"] == "webdataset WebLoader"]
    if web and web[-1]["worker_pss"]:
        web_pss = max(web[-1]["worker_pss"])
        lines += [
            "",
            "Worker PSS at the end of the last epoch (max over workers), against WebLoader's:",
            "",
            "| loader | worker PSS MiB | x WebLoader |",
            "|---|---|---|",
        ]
        for name in dict.fromkeys(r["loader"] for r in memory):
            last = [r for r in memory if r["loader"] == name][-1]
            if last["worker_pss"]:
                pss = max(last["worker_pss"])
                lines.append(f"| {name} | {_mb(pss)} | {pss / web_pss:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        mode, name, dataset_dir, workers, epochs = argv[1:6]
        if mode == "first":
            doc = _child_first_batch(name, Path(dataset_dir), int(workers))
        else:
            doc = _child_memory(name, Path(dataset_dir), int(workers), int(epochs))
        print(json.dumps(doc))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: 10k shards x 4 samples (default); large: 10k shards x 40 samples; "
        "100k: 100k shards x 4 samples",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="fresh-process repeats per loader (median)"
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--dataset", type=Path, help="a staged dataset directory to reuse")
    parser.add_argument("--skip-uncached", action="store_true", help="no header-walking start")
    parser.add_argument("--keep", action="store_true", help="keep the prepared dataset")
    args = parser.parse_args(argv)
    rows = bench(
        args.size,
        args.reps,
        args.epochs,
        dataset=args.dataset,
        skip_uncached=args.skip_uncached,
        keep=args.keep,
    )
    r = rows[0]
    print(
        f"{r['shards']} shards, {r['samples']} samples of ~1 KB; condition: {r['condition']}; "
        f"batch {BATCH}, nothing decoded, {WORKERS} workers; {os.cpu_count()} CPUs (shared); "
        f"median of {args.reps} alternating "
        f"fresh-process runs"
    )
    report(rows, to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
