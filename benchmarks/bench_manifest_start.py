"""Benchmark: seconds from ``stage-in`` starting to its first byte written, at 1M shards.

Run: ``.venv/bin/python -m benchmarks.bench_manifest_start [--shards 1000000] [--repeats 3]
[--baseline CHECKOUT]``

A source of N tiny shards (600 B each, 1,000 per directory) on a tmpfs, with a Parquet
manifest beside it as ``stager index`` writes it (sizes and hashes), and nothing staged yet.
Each run starts the ``stage-in`` command in a fresh process and polls the destination for the
first file to appear (a ``.partial`` or a published shard); then the run is stopped. What is
timed is what a user waits for: interpreter start-up, listing, reading the manifest, planning
and the first copy. The same run without the manifest is timed beside it ("no manifest" rows):
the shards listed, then stat'ed, or since the streamed first run, copied while the walk goes
on, each stat'ed as it copies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import compile_bytecode


def make_source(root: Path, shards: int) -> None:
    """``root/ds`` with ``shards`` files and a Parquet manifest (hashes as stager index writes)."""
    import xxhash

    from stager.shards.manifest import Manifest, ManifestEntry

    data = b"x" * 600
    digest = "xxh3_64:" + xxhash.xxh3_64(data).hexdigest()
    entries = []
    for i in range(shards):
        directory = root / "ds" / f"{i // 1000:04d}"
        if i % 1000 == 0:
            directory.mkdir(parents=True, exist_ok=True)
        relpath = f"{i // 1000:04d}/s{i:07d}.tar"
        (root / "ds" / relpath).write_bytes(data)
        entries.append(ManifestEntry(relpath, len(data), digest, None))
    Manifest(tuple(entries), {}).write(root / "ds" / "stager-manifest.parquet")


def first_byte_s(source: Path, dest: Path, *extra: str) -> float:
    """Seconds from starting stage-in to the first file under ``dest``'s dataset directory."""
    shutil.rmtree(dest, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
    bin_dir = Path(sys.executable).parent
    started = time.perf_counter()
    proc = subprocess.Popen(
        [str(bin_dir / "stage-in"), str(source), "--dest", str(dest), "--quiet",
         "--no-count", "--jitter-max", "0", *extra],
        env=env,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    dataset = dest / source.name
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"stage-in ended (exit {proc.returncode}) before any byte")
            try:
                with os.scandir(dataset) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False) and entry.name != ".stager":
                            with os.scandir(entry.path) as inner:
                                if any(True for _ in inner):
                                    return time.perf_counter() - started
            except FileNotFoundError:
                pass
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="/dev/shm", help="a tmpfs for the source and copies")
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="another checkout of this project (e.g. `git worktree add /tmp/old <commit>`): its "
        "stager runs the manifest row too, interleaved, for a ratio measured in the same run",
    )
    args = parser.parse_args(argv)
    compile_bytecode()
    work = Path(tempfile.mkdtemp(prefix="bench-manifest-", dir=args.data))
    try:
        made = time.perf_counter()
        make_source(work, args.shards)
        made_s = time.perf_counter() - made
        print(f"source: {args.shards:,} shards with a Parquet manifest ({made_s:.0f} s to make)")
        rows: dict[str, list[float]] = {"manifest": [], "no manifest": []}
        if args.baseline:
            rows["baseline, manifest"] = []
            rows["baseline, no manifest"] = []
        manifest = work / "ds" / "stager-manifest.parquet"
        hidden = work / "stager-manifest.parquet"

        def run(name: str, baseline: bool = False) -> None:
            if baseline:
                os.environ["PYTHONPATH"] = str(Path(args.baseline).resolve())
            try:
                rows[name].append(first_byte_s(work / "ds", work / "dest"))
            finally:
                os.environ.pop("PYTHONPATH", None)

        for _ in range(args.repeats):
            if args.baseline:
                run("baseline, manifest", baseline=True)
            run("manifest")
            manifest.rename(hidden)
            try:
                run("no manifest")
                if args.baseline:
                    run("baseline, no manifest", baseline=True)
            finally:
                hidden.rename(manifest)
        print("| run | first byte, median (s) | runs (s) | x manifest |")
        print("|---|---|---|---|")
        median = {name: sorted(times)[len(times) // 2] for name, times in rows.items()}
        for name, times in rows.items():
            runs = ", ".join(f"{t:.2f}" for t in times)
            ratio = median[name] / median["manifest"]
            print(f"| {name} | {median[name]:.2f} | {runs} | {ratio:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
