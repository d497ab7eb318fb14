"""One rank's loader start over a staged copy of many shards: time and peak memory, with the
manifest's columns file against parsing the manifest, alternated in one run.

Run: ``.venv/bin/python -m benchmarks.bench_rank_start [--shards N] [--reps R] [--root DIR]``
(a ``--root`` is kept, and its copy reused by a later run; else a temporary one is removed)

Why: every rank of a job builds its loader from the staged copy's manifest. At 1e6 shards the
JSON is ~170 MB, and parsing it cost each rank seconds and a ~630 MB peak, whatever the world
size (docs/benchmarks.md, "Per-node and per-worker costs at scale"). Since stage-in leaves the
manifest's columns beside it (``stager/shards/manifestcolumns.py``), a start maps them instead.

The staged copy is written in the exact on-disk format stage-in leaves, cheaply: its shards are
hard links to 40 real tars of 2 samples, its manifest is written by ``Manifest.write``, its
loader index by ``save_dataset_index`` and its columns file by ``save_columns``, as stage-in's
finish writes them (staging a million real files would take this machine most of an hour).

Each start is a fresh Python process that imports torch and the loader, then builds
``ShardedLoader`` as rank 513 of 1,024 (no process group: the layout is given) and takes one
batch. Reported: construction seconds, and the peak RSS the construction added (``VmHWM``,
reset just before, less the RSS then: it counts the mapped index's pages, which the ranks of a
node share). Modes alternate within each repeat; medians, and the columns file's ratio to the
parse in the same run:

* columns file: what a start costs now;
* manifest parsed: the columns file passed by (as before it existed, and for a copy staged by
  an older stager until its first loader writes the file).

Conditions: the copy on this machine's disk (``--root``, default a directory under
``/var/tmp``), its inodes stat'ed just before each start as a stage-in leaves them (each start
stats every shard: the floor of a start, ~1.5 us a stat here). The loader is given the
source's path, as a job's script gives it, and finds the copy under ``--dest``.
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

from .common import in_workdir, report

MODES = ("columns file", "manifest parsed")
WORLD, RANK = 1024, 513
_BASES = 40


def prepare(root: Path, shards: int) -> Path:
    """A staged copy of ``shards`` shards under ``root`` (its dataset directory returned)."""
    from stager.layout import StagedDataset
    from stager.shards.loader_index import save_dataset_index
    from stager.shards.manifest import Manifest, ManifestEntry
    from stager.shards.manifestcolumns import columns_path, file_key, save_columns
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
    from stager.shards.tarindex import index_tar
    from stager.storage.hashing import hash_file

    name = f"rankstart{shards}"
    staged = StagedDataset(root / "scratch", name)
    if staged.manifest_path.is_file():
        return staged.dir
    shutil.rmtree(staged.dir, ignore_errors=True)
    bases = root / "bases"
    spec = SyntheticSpec(num_shards=_BASES, samples_per_shard=2, seed=3)
    base_files = write_synthetic_dataset(bases, spec)
    relpaths = [f"d{i // 1000:04d}/train-{i:07d}.tar" for i in range(shards)]
    for d in range((shards + 999) // 1000):
        (staged.dir / f"d{d:04d}").mkdir(parents=True)
    per_base = -(-shards // _BASES)
    for i, rel in enumerate(relpaths):
        os.link(base_files[i // per_base], staged.dir / rel)
    indexes = [index_tar(p) for p in base_files]
    digests = [hash_file(p) for p in base_files]
    sizes = [p.stat().st_size for p in base_files]
    entries = tuple(
        ManifestEntry(
            rel,
            sizes[i // per_base],
            digests[i // per_base],
            indexes[i // per_base].num_samples,
            f"{1000 + i}:1:1",
        )
        for i, rel in enumerate(relpaths)
    )
    source = str(root / name)
    meta = {"source": source, "spec": f"file://{source}", "subset": "all"}
    staged.meta_dir.mkdir(exist_ok=True)
    manifest = Manifest(entries, meta)
    manifest.write(staged.manifest_path)
    locations = [f"{staged.dir}/{r}" for r in relpaths]
    counts = [e.samples for e in entries]
    save_dataset_index(
        locations,
        relpaths,
        counts,
        [indexes[i // per_base] for i in range(shards)],
        staged.index_dir,
    )
    save_columns(
        file_key(staged.manifest_path),
        columns_path(staged.index_dir),
        relpaths,
        [e.size for e in entries],
        counts,
        meta,
    )
    return staged.dir


def _child(mode: str, dataset_dir: str) -> None:
    """One start, as a job's rank sees it; prints one JSON line."""
    import torch  # noqa: F401 - imported first, as a training script does

    from stager.shards import manifestcolumns
    from stager_loaders import LoaderOptions, ShardedLoader

    if mode == "manifest parsed":
        manifestcolumns.load_columns = lambda *args, **kwargs: None  # type: ignore[assignment]
        manifestcolumns.COLUMNS_FROM = sys.maxsize  # (nor written: each start parses)
    _reset_peak()
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    staged = Path(dataset_dir)
    source = staged.parent.parent / staged.name  # (as the job's script names it; never read)
    loader = ShardedLoader(
        str(source),
        batch_size=256,
        options=LoaderOptions(rank=RANK, world_size=WORLD, dest=str(Path(dataset_dir).parent)),
    )
    built = time.perf_counter() - started
    peak = _status_mb("VmHWM")
    next(iter(loader))
    assert loader.shards.from_source == 0, "the staged copy was not used"
    print(json.dumps({"construct_s": built, "peak_added_mb": peak - before}))


def _reset_peak() -> None:
    """Start the peak RSS (``VmHWM``) over from the current RSS: what torch's import peaked
    at is not the construction's."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _warm(dataset_dir: Path) -> None:
    """Stat every shard once, as the stage-in just before a job's start leaves them: this
    machine drops its caches within seconds, and a start behind an inode cache gone cold here
    (tens of seconds at 1e6 shards) measures the disk, not the loader."""
    for sub in os.scandir(dataset_dir):
        if sub.is_dir() and not sub.name.startswith("."):
            for entry in os.scandir(sub.path):
                entry.stat()


def _spawn(mode: str, dataset_dir: Path) -> dict:
    _warm(dataset_dir)
    argv = [sys.executable, "-m", "benchmarks.bench_rank_start", "--child", mode, str(dataset_dir)]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: child exited {done.returncode}: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(dataset_dir: Path, shards: int, reps: int) -> list[dict]:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(reps):
        for mode in MODES:
            runs[mode].append(_spawn(mode, dataset_dir))
    rows = []
    for mode in MODES:
        rows.append(
            {
                "shards": shards,
                "mode": mode,
                "construct_s": statistics.median(r["construct_s"] for r in runs[mode]),
                "peak_added_mb": statistics.median(r["peak_added_mb"] for r in runs[mode]),
                "reps": reps,
            }
        )
    return rows


def to_markdown(rows: list[dict]) -> str:
    base = {r["shards"]: r for r in rows if r["mode"] == "manifest parsed"}
    lines = [
        "| shards | start | construction | ratio | peak added | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r["shards"]]
        lines.append(
            f"| {r['shards']:,} | {r['mode']} | {r['construct_s']:.2f} s | "
            f"{r['construct_s'] / b['construct_s']:.2f}x | {r['peak_added_mb']:.0f} MB | "
            f"{r['peak_added_mb'] / b['peak_added_mb']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=float, default=2e5, help="shards in the staged copy")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--root", type=Path, help="where to write the copy (kept, reused)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    shards = int(args.shards)

    def run(root: Path) -> list[dict]:
        return bench(prepare(root, shards), shards, args.reps)

    rows = in_workdir(args.root, "bench-rank-start-", run, parent=_tmp_dir())
    report(rows, to_markdown, args.json)
    return 0


def _tmp_dir() -> str | None:
    return "/var/tmp" if os.path.isdir("/var/tmp") else None


if __name__ == "__main__":
    raise SystemExit(main())
