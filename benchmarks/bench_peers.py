"""Loader throughput against the peers: ShardedLoader vs WebLoader vs mosaicml-streaming vs litdata.

Run: ``.venv/bin/python -m benchmarks.bench_peers [--size small|large] [--reps R]``
``[--workers 0,1,2]``
(the peers come with the ``bench`` extra: ``pip install -e '.[bench]'``).

Conditions: the same synthetic samples (``.npy`` ~1 KB or ~100 KB + ``.cls``), staged by
stage-in as 8 WebDataset tar shards on a tmpfs (``/dev/shm``: page-cache warm, so figures
measure the loaders, not this machine's virtio disk; see /work/shared/BENCHMARKING.md). The
staged samples are converted with each peer's own converter into as many shards/chunks of about
the same size: mosaicml-streaming's ``MDSWriter`` (columns ``bytes``/``str``, no compression)
and litdata's ``optimize()`` (its chunk format, no compression), also on the tmpfs; conversion
time is shown for context. Conversions run in a forked child process, because litdata's
``optimize()`` switches the whole process to the ``spawn`` start method (left in this process,
every later DataLoader would re-import torch in each worker). Batch 256, nothing decoded
(every loader yields the members' bytes: ShardedLoader as uint8 tensor views, the others as
Python ``bytes``); no shuffle for the peers and WebLoader; ShardedLoader with its default seeded
global shuffle (on staged shards any order reads as fast as file order: docs/loader.md).
Workers 0, 1 and 2 (= all cores here). Peers are read through their own loaders:
``streaming.StreamingDataset(local=...)`` in a ``torch.utils.data.DataLoader``, and
``litdata.StreamingDataset`` in ``litdata.StreamingDataLoader``.

Time is one full epoch including the loader's construction and worker start-up, in the
benchmark's process (imports excluded, paid once). Loaders alternate within each repeat
(A B C D A B C D); the median of ``--reps`` is reported with ratios of ShardedLoader to each
loader in the same run. A peer that is not installed, or fails, is reported with its error and
the others still run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.bench_loader import BATCH, sharded_loader, stage, web_loader
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import report, scratch_root

SIZES = {  # (~1 KB samples, ~100 KB samples)
    "small": (20_000, 1_000),
    "large": (200_000, 10_000),
}
SHARDS = 8
LOADERS = ("ShardedLoader", "webdataset WebLoader", "mosaicml-streaming", "litdata")
# Peers without a num_workers=0 mode would be listed here; both peers run in-process at 0.
NO_ZERO_WORKERS: set[str] = set()


def tar_samples(shard: str | Path) -> Iterator[dict]:
    """The samples of one staged shard as ``{"__key__", "npy", "cls"}`` dicts of bytes."""
    sample: dict = {}
    with tarfile.open(shard, "r|") as stream:
        for info in stream:
            member = stream.extractfile(info)
            if member is None:
                continue
            key, ext = info.name.split(".", 1)
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample["__key__"] = key
            sample[ext] = member.read()
    if sample:
        yield sample


# ---- conversion with the peers' own writers ----------------------------------------------------


def convert_mds(shards: list[Path], out: Path, shard_bytes: int) -> None:
    from streaming import MDSWriter

    columns = {"__key__": "str", "npy": "bytes", "cls": "bytes"}
    with MDSWriter(
        out=str(out), columns=columns, compression=None, size_limit=shard_bytes
    ) as writer:
        for shard in shards:
            for sample in tar_samples(shard):
                writer.write(sample)


def convert_litdata(shards: list[Path], out: Path, shard_bytes: int) -> None:
    import litdata

    # optimize() calls tar_samples once per input shard in its own worker and writes chunks.
    litdata.optimize(
        fn=tar_samples,
        inputs=[str(s) for s in shards],
        output_dir=str(out),
        chunk_bytes=shard_bytes,
        num_workers=1,
        verbose=False,
        mode="overwrite",
    )


# ---- the peers' readers (same signature as bench_loader's: (location, workers) -> samples) -----


def mds_loader(local: Path, workers: int) -> int:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()  # streaming keeps per-dataset shared memory; start each run clean
    dataset = StreamingDataset(local=str(local), batch_size=BATCH, shuffle=False)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers)
    count = sum(len(batch["__key__"]) for batch in loader)
    del loader, dataset
    return count


def litdata_loader(input_dir: Path, workers: int) -> int:
    import litdata

    dataset = litdata.StreamingDataset(input_dir=str(input_dir))
    loader = litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)
    return sum(len(batch["__key__"]) for batch in loader)


def _sharded(staged: Path, workers: int) -> int:
    return sharded_loader(
        sorted(staged.glob("*.tar")), workers
    )  # bench_loader's helper takes shard paths


def _web(staged: Path, workers: int) -> int:
    return web_loader(sorted(staged.glob("*.tar")), workers)


READERS: dict[str, Callable[[Path, int], int]] = {
    "ShardedLoader": _sharded,
    "webdataset WebLoader": _web,
    "mosaicml-streaming": mds_loader,
    "litdata": litdata_loader,
}


def _timed(fn: Callable[[Path, int], int], location: Path, workers: int) -> tuple[int, float]:
    started = time.perf_counter()
    count = fn(location, workers)
    return count, time.perf_counter() - started


def _convert_and_report(convert: Callable, errors, *args) -> None:
    try:
        convert(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on
        errors.put(f"{type(exc).__name__}: {exc}")
        raise


def _in_child(convert: Callable, *args) -> str | None:
    """Run a converter in a forked child; its error text, or None.

    Why a child: litdata's ``optimize()`` calls ``multiprocessing.set_start_method("spawn",
    force=True)`` for the whole process. Left in the benchmark's process, every later DataLoader
    (ours and the peers') would spawn its workers, re-importing torch: ~3 s per epoch measured
    here, which swamps every worker figure.
    """
    context = multiprocessing.get_context("fork")
    errors = context.SimpleQueue()
    child = context.Process(target=_convert_and_report, args=(convert, errors, *args))
    child.start()
    child.join()
    if child.exitcode != 0:
        return errors.get() if not errors.empty() else f"converter exited {child.exitcode}"
    return None


def prepare(root: Path, samples: int, image_bytes: int) -> dict:
    """Stage the tar shards and convert them; returns locations, conversion times and errors."""
    spec = SyntheticSpec(
        num_shards=SHARDS,
        samples_per_shard=max(1, samples // SHARDS),
        image_bytes=image_bytes,
        seed=0,
    )
    write_synthetic_dataset(root / "src" / "ds", spec)
    shards = stage(root / "src" / "ds", root / "scratch")
    staged = shards[0].parent
    # The peers' size limits count payload bytes (no tar headers): aim for SHARDS files each.
    payload_bytes = sum(
        len(v)
        for s in shards
        for sample in tar_samples(s)
        for k, v in sample.items()
        if k != "__key__"
    )
    shard_bytes = max(1 << 16, payload_bytes // SHARDS + 4096)
    prepared = {
        "expected": sum(spec.shard_sizes()),
        "locations": {},
        "convert_s": {},
        "errors": {},
        "files": {},
    }
    prepared["locations"]["ShardedLoader"] = staged
    prepared["locations"]["webdataset WebLoader"] = staged
    for name, convert, out in (
        ("mosaicml-streaming", convert_mds, root / "mds"),
        ("litdata", convert_litdata, root / "litdata"),
    ):
        started = time.perf_counter()
        error = _in_child(convert, shards, out, shard_bytes)
        if error:
            prepared["errors"][name] = f"conversion failed: {error}"
            continue
        prepared["convert_s"][name] = time.perf_counter() - started
        prepared["files"][name] = len([p for p in out.iterdir() if p.suffix in (".mds", ".bin")])
        prepared["locations"][name] = out
    sharded_loader(shards, 0)  # warm-up: builds the cached tar index, as the first epoch would
    return prepared


def bench(
    size: str = "small",
    reps: int = 3,
    worker_counts: tuple[int, ...] = (0, 1, 2),
    root: Path | None = None,
) -> list[dict]:
    small, large = SIZES[size]
    own_root = root is None
    if root is None:
        root, condition = scratch_root("bench-peers-")
    else:
        condition = str(root)
    rows: list[dict] = []
    try:
        for label, total, image_bytes in (("~1 KB", small, 1024), ("~100 KB", large, 100_000)):
            sub = root / f"s{image_bytes}"
            prepared = prepare(sub, total, image_bytes)
            errors: dict[str, str] = dict(prepared["errors"])
            for workers in worker_counts:
                names = [
                    n
                    for n in LOADERS
                    if n in prepared["locations"] and not (workers == 0 and n in NO_ZERO_WORKERS)
                ]
                rates: dict[str, list[float]] = {n: [] for n in names}
                counts: dict[str, int] = {}
                for _ in range(reps):
                    for name in names:
                        if name in errors and name not in rates:
                            continue
                        try:
                            count, seconds = _timed(
                                READERS[name], prepared["locations"][name], workers
                            )
                        except Exception as exc:  # noqa: BLE001
                            errors[name] = f"w={workers}: {type(exc).__name__}: {str(exc)[:300]}"
                            rates.pop(name, None)
                            print(
                                f"{label} w={workers} {name}: FAILED {exc}",
                                file=sys.stderr,
                                flush=True,
                            )
                            continue
                        if name in rates:
                            rates[name].append(count / seconds)
                            counts[name] = count
                medians = {n: statistics.median(v) for n, v in rates.items() if v}
                ours = medians.get("ShardedLoader")
                for name, rate in medians.items():
                    rows.append(
                        {
                            "samples": label,
                            "workers": workers,
                            "loader": name,
                            "samples_per_s": rate,
                            "delivered": counts[name],
                            "expected": prepared["expected"],
                            "sharded_over_this": (ours / rate) if ours else None,
                            "runs": rates[name],
                            "convert_s": prepared["convert_s"].get(name),
                            "shard_files": prepared["files"].get(name, SHARDS),
                            "condition": condition,
                        }
                    )
                print(
                    f"{label:>8} w={workers}: "
                    + ", ".join(f"{n} {v / 1e3:.1f}k/s" for n, v in medians.items()),
                    file=sys.stderr,
                    flush=True,
                )
            for name, error in errors.items():
                rows.append(
                    {"samples": label, "loader": name, "error": error, "condition": condition}
                )
            shutil.rmtree(sub, ignore_errors=True)
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    """One row per (sample size, workers): k samples/s per loader and ShardedLoader's ratios."""
    ok = [r for r in rows if "error" not in r]
    lines = [
        "| samples | workers | "
        + " | ".join(f"{n} (k/s)" for n in LOADERS)
        + " | "
        + " | ".join(f"Sharded / {n.split()[-1]}" for n in LOADERS[1:])
        + " |",
        "|---|---|" + "---|" * (2 * len(LOADERS) - 1),
    ]
    for key in dict.fromkeys((r["samples"], r["workers"]) for r in ok):
        by = {r["loader"]: r for r in ok if (r["samples"], r["workers"]) == key}
        cells = [f"{by[n]['samples_per_s'] / 1e3:.1f}" if n in by else "—" for n in LOADERS]
        ratios = [
            f"{by[n]['sharded_over_this']:.2f}x" if n in by and by[n]["sharded_over_this"] else "—"
            for n in LOADERS[1:]
        ]
        lines.append(
            f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |"
        )
    short = [r for r in ok if r["delivered"] != r["expected"]]
    notes = [
        f"- {r['loader']} ({r['samples']}, w={r['workers']}) delivered {r['delivered']} of "
        f"{r['expected']} samples per epoch (rate computed on what it delivered)"
        for r in short
    ]
    notes += [f"- {r['loader']} ({r['samples']}): {r['error']}" for r in rows if "error" in r]
    converts = {(r["loader"], r["samples"]): r["convert_s"] for r in ok if r.get("convert_s")}
    files = {(r["loader"], r["samples"]): r["shard_files"] for r in ok if r.get("convert_s")}
    notes += [
        f"- conversion with {n}'s own writer, {s} samples: {t:.1f} s, {files[n, s]} shard files"
        for (n, s), t in converts.items()
    ]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: 20k x ~1 KB and 1k x ~100 KB samples (default); large: 10x that",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="alternating repeats per configuration (median)"
    )
    parser.add_argument(
        "--workers", default="0,1,2", help="DataLoader worker counts (default 0,1,2; 2 = all here)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    workers = tuple(int(w) for w in args.workers.split(","))
    rows = bench(args.size, args.reps, workers)
    condition = next((r["condition"] for r in rows), "")
    print(
        f"condition: {condition}; batch {BATCH}; nothing decoded; {SHARDS} shards per format; "
        f"{os.cpu_count()} CPUs (shared); median of {args.reps} alternating runs (A B C D)"
    )
    report(rows, to_markdown, args.json)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
