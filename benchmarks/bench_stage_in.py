"""Benchmark: stage-in against ``cp -r``, ``rsync -a`` and the read ceiling, warm and cold.

Run: ``.venv/bin/python -m benchmarks.bench_stage_in [--repeats N] [--jobs N] [--scale F]
[--conditions warm,cold] [--sweep] [--data DIR] [--rows large,small,tiny-samples,tiny-shards]``.

Rows (issue 22): few large shards, many small shards, shards of ~1 KB samples (50,000
members per shard: the case where indexing, not copying, used to cost), and 10,000 tiny
shards of 4 samples (where a copy's fixed cost per file is all there is). Conditions, as
docs/benchmarks.md and BENCHMARKING.md describe this machine:

- ``warm``: the source on a tmpfs (this machine evicts clean page-cache pages within ~2 s, so
  only a tmpfs stays warm), the destination on the ext4 disk;
- ``cold``: the source on the ext4 disk with the page cache dropped before every run, the
  destination on a tmpfs;
- ``memory``: source and destination on tmpfs: the copier's own cost, without the disk's
  writeback (which made the warm rows vary up to 2x from run to run) or reads.

Every tool runs in the same repeat, alternating (A B C D A B C D ...), and the median of the
repeats is reported as a ratio to ``cp -r`` of the same row and condition; absolute MB/s are
context only. stage-in runs with its defaults (hash verification, sample counting and the
loader index handed over) plus ``--jobs``, and once with no flags at all (``stage-in
(defaults)``: 64 adaptive streams), as users run it. ``cat`` (run by ``xargs``) reads every
shard to ``/dev/null``, one after the other: the ceiling a single sequential reader sees (a
``dd`` per shard until 2026-11-28: older tables say "read ceiling (dd)"). "CPU stolen" is the
hypervisor's share during each tool's runs (:func:`benchmarks.common.stolen_fraction`), and the
load average at the start of the row says how busy the 2 cores were with other work.

``--sample-sizes`` measures only issue 22's second goal head to head: stage-in (and ``cp -r``)
on the shards of ~100 KB samples and of ~1 KB samples, alternating.

``--baseline CHECKOUT`` adds stage-in with its defaults from another checkout (a ``git
worktree`` of an older commit), run in the same alternation: the ratio between the two is the
change's own effect.

``--sweep`` adds stage-in on one core (``taskset -c 0``) and with ``--jobs 1``; ``--cores
1,2,4,8,16`` adds stage-in with its defaults pinned to each count of CPUs (what
``--cpus-per-task`` gives a job) and ``xargs -P N cp`` on all of them: how it scales with the
cores a job gives it, on a machine that has them. :func:`bench` keeps the older
single-condition entry point for ``benchmarks.run_all``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import compile_bytecode, cpu_jiffies, in_workdir, report, stolen_fraction

BIN = Path(sys.executable).parent

# (label, shards, samples per shard, bytes per sample)
SIZES = {
    "small": [("150 x 2 MB", 150, 20, 100_000), ("6 x 50 MB", 6, 500, 100_000)],
    "large": [("400 x 2 MB", 400, 20, 100_000), ("16 x 64 MB", 16, 640, 100_000)],
}
#: The rows of issue 22's table; ``--scale`` shrinks the shard counts for a quick run.
#: Picked by key with ``--rows``.
ROWS = {
    "large": ("few large shards: 16 x 64 MB, ~100 KB samples", 16, 640, 100_000),
    "small": ("many small shards: 400 x 2.5 MB, ~100 KB samples", 400, 25, 100_000),
    "smaller": ("many smaller shards: 4,000 x 200 KB, ~100 KB samples", 4_000, 2, 100_000),
    "tiny-samples": ("~1 KB samples: 16 x 77 MB, 25,000 samples each", 16, 25_000, 1024),
    "tiny-shards": ("tiny shards: 10,000 x 20 KB, 4 ~1 KB samples each", 10_000, 4, 1024),
}
WARM_SRC = Path("/dev/shm")  # tmpfs
DISK = Path("/var/tmp")  # ext4 on the virtio disk


def drop_caches() -> bool:
    """Drop the page cache (cold condition); False when we may not (not root)."""
    if os.geteuid() != 0:
        return False
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def tool_commands(
    *, transfers: int = 8, stage_in_flags: tuple[str, ...] = ("--quiet",)
) -> dict[str, list[str]]:
    """Command templates of the tools that are installed; SRC and DST are substituted.

    stage-in copies SRC into DST/<basename of SRC>; the others copy SRC to DST, so callers pass
    DST/<basename> to them (see :func:`target_for`).
    """
    tools: dict[str, list[str]] = {
        "cp -r": ["cp", "-r", "SRC", "DST"],
        "stage-in": [str(BIN / "stage-in"), "SRC", "--dest", "DST", *stage_in_flags],
        "rsync -a": ["rsync", "-a", "SRC/", "DST/"],
        f"rclone --transfers {transfers}": [
            "rclone",
            "copy",
            "--transfers",
            str(transfers),
            "SRC",
            "DST",
        ],
    }
    return {
        name: cmd for name, cmd in tools.items() if shutil.which(cmd[0]) or cmd[0].startswith("/")
    }


def _tools(jobs: int) -> dict[str, list[str] | None]:
    return dict(
        tool_commands(transfers=jobs, stage_in_flags=("--quiet", "--jobs", str(jobs), "--no-count"))
    )


def target_for(tool: str, dst: Path, name: str) -> Path:
    """Where a tool is pointed so that every tool leaves the copy at ``dst / name``."""
    return dst if tool.startswith("stage-in") else dst / name


def run_tool(cmd: list[str], src: Path, dst: Path, timeout_s: float | None = None) -> float:
    """Run one copy and return its wall time in seconds (startup included, as a user sees it)."""
    argv = [a.replace("SRC", str(src)).replace("DST", str(dst)) for a in cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = time.perf_counter()
    done = subprocess.run(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout_s
    )
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace")[-1500:]
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {stderr}")
    return time.perf_counter() - start


_run = run_tool
_drop_caches = drop_caches


def bench(size: str, repeats: int, jobs: int, workdir: Path) -> list[dict]:
    """The older table (disk to disk, cold, stage-in with ``--no-count``), kept as it was for
    ``benchmarks.run_all``."""
    rows = []
    tools = {k: v for k, v in _tools(jobs).items() if v is not None}
    for label, shards, samples, sample_bytes in SIZES[size]:
        src = workdir / "src" / "ds"
        shutil.rmtree(workdir / "src", ignore_errors=True)
        write_synthetic_dataset(
            src,
            SyntheticSpec(num_shards=shards, samples_per_shard=samples, image_bytes=sample_bytes),
        )
        nbytes = sum(p.stat().st_size for p in src.iterdir())
        times: dict[str, list[float]] = {name: [] for name in tools}
        cold = True
        for _ in range(repeats):
            for name, cmd in tools.items():  # alternate tools within each repeat
                dst = workdir / "dst"
                shutil.rmtree(dst, ignore_errors=True)
                dst.mkdir()
                target = target_for(name, dst, "ds")
                cold = _drop_caches() and cold
                times[name].append(_run(cmd, src, target))
        base = statistics.median(times["cp -r"])
        for name, samples_s in times.items():
            median = statistics.median(samples_s)
            rows.append(
                {
                    "dataset": label,
                    "tool": name,
                    "bytes": nbytes,
                    "median_s": round(median, 3),
                    "mb_per_s": round(nbytes / median / 1e6, 1),
                    "ratio_vs_cp": round(base / median, 2),
                    "condition": "cold (page cache dropped)" if cold else "warm-ish",
                    "repeats": repeats,
                }
            )
        shutil.rmtree(workdir / "src", ignore_errors=True)
        shutil.rmtree(workdir / "dst", ignore_errors=True)
    return rows


def read_command(files: list[Path], list_file: Path) -> list[str]:
    """One shell command reading every file, in order, to ``/dev/null``: the sequential read
    ceiling. ``cat`` run by ``xargs`` (a few processes for any number of files); a ``dd`` per
    file, as before, timed 10,000 process starts on the tiny-shard row (~10 s, "0.02x").
    The names go through ``list_file``: 10,000 of them overflow an argument list."""
    list_file.write_text("".join(f"{f}\n" for f in files))
    return ["sh", "-c", 'xargs -d "\n" -a "$0" cat > /dev/null', str(list_file)]


def baseline_stage_in(checkout: Path) -> list[str]:
    """stage-in with its defaults from another checkout of this repository (a ``git worktree``
    of an older commit): the console script's entry as that checkout's pyproject.toml names it
    (the entry moved to stager.cli.entry in 79338f2, so this checkout's script cannot start an
    older tree), with that checkout first on the path, ahead of the working directory that
    ``-c`` puts there (this checkout, when the benchmark runs from it)."""
    found = re.search(
        r'^stage-in = "([\w.]+):(\w+)"', (checkout / "pyproject.toml").read_text(), re.M
    )
    if found is None:
        raise ValueError(f"{checkout}/pyproject.toml names no stage-in entry")
    root = str(checkout.resolve())
    entry = (
        f"import sys; sys.path.insert(0, {root!r}); "
        f"from {found[1]} import {found[2]} as main; sys.exit(main())"
    )
    return [sys.executable, "-c", entry, "SRC", "--dest", "DST", "--quiet"]


def parallel_cp(processes: int) -> list[str]:
    """``cp`` run by ``xargs -P``: what a user with many cores and no other tool would write
    (``find | xargs -P N cp --parents``), the fair baseline where ``cp -r``'s one process
    cannot use them."""
    loop = (
        'mkdir -p "$1" && cd "$0" && find . -type f -print0 '
        f'| xargs -0 -P {processes} -n 16 cp --parents -t "$1"'
    )
    return ["sh", "-c", loop, "SRC", "DST"]


def pinned(cores: int, argv: list[str]) -> list[str]:
    """``argv`` on the first ``cores`` CPUs (``taskset``): a job given ``--cpus-per-task``."""
    return ["taskset", "-c", f"0-{cores - 1}", *argv]


def matrix_tools(
    jobs: int, sweep: bool, baseline: Path | None = None, cores: tuple[int, ...] = ()
) -> dict[str, list[str]]:
    """Tool name -> argv template (SRC, DST substituted); the read ceiling is added per row.

    ``cores``: also stage-in with its defaults pinned to each count of CPUs, and ``cp`` in
    parallel on all of them (the scaling sweep of issue 22 on a machine with many cores).
    """
    stage_in = [str(BIN / "stage-in"), "SRC", "--dest", "DST", "--quiet"]
    tools = {
        "cp -r": ["cp", "-r", "SRC", "DST"],
        "rsync -a": ["rsync", "-a", "SRC/", "DST/"],
        f"stage-in --jobs {jobs}": [*stage_in, "--jobs", str(jobs)],
        "stage-in (defaults)": stage_in,
    }
    available = len(os.sched_getaffinity(0))
    for n in sorted({c for c in cores if 0 < c <= available}):
        tools[f"stage-in (defaults), {n} core{'s' if n > 1 else ''}"] = pinned(n, stage_in)
    if cores:
        tools[f"xargs -P {available} cp"] = parallel_cp(available)
    if baseline is not None:
        tools["stage-in (defaults), baseline"] = baseline_stage_in(baseline)
    if sweep:
        tools[f"stage-in --jobs {jobs}, 1 core"] = pinned(1, [*stage_in, "--jobs", str(jobs)])
        tools["stage-in --jobs 1"] = [*stage_in, "--jobs", "1", "--min-jobs", "1"]
    return {name: cmd for name, cmd in tools.items() if shutil.which(cmd[0]) or "/" in cmd[0]}


#: Conditions whose source is copied to a tmpfs (its page cache never dropped).
TMPFS_SOURCE = ("warm", "memory")


def _condition_roots(condition: str) -> tuple[Path | None, Path]:
    """Temporary source and destination folders for ``condition``: the source on a tmpfs for
    ``warm`` and ``memory`` (None for ``cold``: the stored copy on disk is read), the
    destination on the disk for ``warm`` only."""
    on_tmpfs = condition in TMPFS_SOURCE
    src_root = Path(tempfile.mkdtemp(prefix="bench-src-", dir=WARM_SRC)) if on_tmpfs else None
    dst_dir = DISK if condition == "warm" else WARM_SRC
    return src_root, Path(tempfile.mkdtemp(prefix="bench-dst-", dir=dst_dir))


def _dataset(
    data_dir: Path,
    label: str,
    shards: int,
    samples: int,
    sample_bytes: int,
    pool: Executor | None = None,
) -> Path:
    """The row's synthetic shards under ``data_dir`` (on disk), written once and reused;
    spread over ``pool``'s processes when one is given (a shard's bytes depend on its index
    alone, so the parts make the same files as one writer)."""
    out = data_dir / f"ds-{shards}x{samples}x{sample_bytes}"
    done = out / ".complete"
    if not done.exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"writing {label} to {out} ...", file=sys.stderr, flush=True)
        spec = SyntheticSpec(num_shards=shards, samples_per_shard=samples, image_bytes=sample_bytes)
        if pool is None:
            write_synthetic_dataset(out / "ds", spec)
        else:
            parts = [range(i, shards, _WRITERS) for i in range(min(shards, _WRITERS))]
            n = len(parts)
            list(pool.map(write_synthetic_dataset, [out / "ds"] * n, [spec] * n, parts))
        done.write_text("")
    return out / "ds"


#: Processes that write a row's shards (every CPU the benchmark may use).
_WRITERS = len(os.sched_getaffinity(0))


def bench_matrix(
    conditions: list[str],
    repeats: int,
    jobs: int,
    scale: float,
    data_dir: Path,
    sweep: bool,
    keys: list[str],
    baseline: Path | None = None,
    cores: tuple[int, ...] = (),
) -> list[dict]:
    rows: list[dict] = []
    cold_ok = os.geteuid() == 0
    specs = [(label, max(2, round(n * scale)), k, b) for label, n, k, b in map(ROWS.get, keys)]
    # Each row's shards are written by every CPU at once: minutes of Python tar writing on
    # one core (16 shards of 25,000 samples: ~80 s here) take seconds on a machine of many.
    with ProcessPoolExecutor(_WRITERS) as pool:
        written = [_dataset(data_dir, *spec, pool=pool) for spec in specs]
    for (label, *_), stored in zip(specs, written, strict=True):
        files = sorted(stored.iterdir())
        nbytes = sum(f.stat().st_size for f in files)
        for condition in conditions:
            if condition == "cold" and not cold_ok:
                print("skipping cold: dropping the page cache needs root", file=sys.stderr)
                continue
            rows += _bench_condition(
                *(label, condition, stored, files, nbytes, repeats, jobs, sweep),
                *(baseline, cores),
            )
    return rows


def _bench_condition(
    label: str,
    condition: str,
    stored: Path,
    files: list[Path],
    nbytes: int,
    repeats: int,
    jobs: int,
    sweep: bool,
    baseline: Path | None = None,
    cores: tuple[int, ...] = (),
) -> list[dict]:
    warm = condition in TMPFS_SOURCE  # no caches dropped
    src_root, dst_root = _condition_roots(condition)
    try:
        if src_root is not None:
            src = src_root / "ds"
            shutil.copytree(stored, src)
        else:
            src = stored
        tools = matrix_tools(jobs, sweep, baseline, cores)
        ceiling = read_command(sorted(src.iterdir()), dst_root / "read-files.txt")
        tools = {"read ceiling (cat)": ceiling, **tools}
        times: dict[str, list[float]] = {name: [] for name in tools}
        stolen: dict[str, list[float]] = {name: [] for name in tools}
        load = os.getloadavg()[0]
        for _ in range(repeats):
            for name, cmd in tools.items():  # A B C D A B C D: noise hits every tool alike
                dst = dst_root / "run"
                shutil.rmtree(dst, ignore_errors=True)
                dst.mkdir()
                subprocess.run(["sync"], check=True)  # earlier runs' writeback off this run
                if not warm:
                    drop_caches()
                before = cpu_jiffies()
                times[name].append(_run(cmd, src, target_for(name, dst, "ds")))
                share = stolen_fraction(before, cpu_jiffies())
                if share is not None:
                    stolen[name].append(share)
            shutil.rmtree(dst_root / "run", ignore_errors=True)
        base = statistics.median(times["cp -r"])
        out = []
        for name, seconds in times.items():
            median = statistics.median(seconds)
            out.append(
                {
                    "dataset": label,
                    "condition": condition,
                    "tool": name,
                    "bytes": nbytes,
                    "median_s": round(median, 3),
                    "mb_per_s": round(nbytes / median / 1e6, 1),
                    "ratio_vs_cp": round(base / median, 2),
                    "runs_s": [round(s, 3) for s in seconds],
                    "cpu_stolen": round(statistics.median(stolen[name]), 3)
                    if stolen[name]
                    else None,
                    "load_at_start": round(load, 2),
                    "repeats": repeats,
                }
            )
        return out
    finally:
        shutil.rmtree(dst_root, ignore_errors=True)
        if src_root is not None:
            shutil.rmtree(src_root, ignore_errors=True)


def bench_sample_sizes(
    conditions: list[str],
    repeats: int,
    jobs: int,
    scale: float,
    data_dir: Path,
    baseline: Path | None = None,
) -> list[dict]:
    """Issue 22's second goal, measured head to head: stage-in on the shards of ~100 KB samples
    and on those of ~1 KB samples, alternating within each repeat (with ``cp -r`` on both for
    reference), so that the MB/s ratio is not two rows measured minutes apart."""
    pair = [ROWS["large"], ROWS["tiny-samples"]]
    with ProcessPoolExecutor(_WRITERS) as pool:
        stored = [
            _dataset(data_dir, label, max(2, round(n * scale)), samples, sample_bytes, pool)
            for label, n, samples, sample_bytes in pair
        ]
    sizes = [sum(f.stat().st_size for f in ds.iterdir()) for ds in stored]
    tools = {"cp -r": ["cp", "-r", "SRC", "DST"]}
    tools[f"stage-in --jobs {jobs}"] = [
        *[str(BIN / "stage-in"), "SRC", "--dest", "DST", "--quiet"],
        *["--jobs", str(jobs)],
    ]
    tools["stage-in (defaults)"] = [str(BIN / "stage-in"), "SRC", "--dest", "DST", "--quiet"]
    if baseline is not None:
        tools["stage-in (defaults), baseline"] = baseline_stage_in(baseline)
    rows = []
    for condition in conditions:
        warm = condition in TMPFS_SOURCE  # no caches dropped
        if not warm and os.geteuid() != 0:
            continue
        src_root, dst_root = _condition_roots(condition)
        try:
            sources = []
            for i, ds in enumerate(stored):
                if src_root is None:
                    sources.append(ds)
                else:
                    shutil.copytree(ds, src_root / f"{i}" / "ds")
                    sources.append(src_root / f"{i}" / "ds")
            times = {(t, i): [] for t in tools for i in range(len(pair))}
            for _ in range(repeats):
                for name, cmd in tools.items():
                    for i, src in enumerate(sources):
                        dst = dst_root / "run"
                        shutil.rmtree(dst, ignore_errors=True)
                        dst.mkdir()
                        subprocess.run(["sync"], check=True)
                        if not warm:
                            drop_caches()
                        times[name, i].append(_run(cmd, src, target_for(name, dst, "ds")))
            for name in tools:
                rates = [sizes[i] / statistics.median(times[name, i]) / 1e6 for i in range(2)]
                rows.append(
                    {
                        "condition": condition,
                        "tool": name,
                        "large_samples_mb_per_s": round(rates[0], 1),
                        "small_samples_mb_per_s": round(rates[1], 1),
                        "ratio": round(rates[1] / rates[0], 2),
                        "runs_s": {pair[i][0]: times[name, i] for i in range(2)},
                    }
                )
        finally:
            shutil.rmtree(dst_root, ignore_errors=True)
            if src_root is not None:
                shutil.rmtree(src_root, ignore_errors=True)
    return rows


def sample_sizes_markdown(rows: list[dict]) -> str:
    lines = [
        "| condition | tool | MB/s, ~100 KB samples | MB/s, ~1 KB samples | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_CONDITION_TEXT[r['condition']]} | {r['tool']} | {r['large_samples_mb_per_s']} "
            f"| {r['small_samples_mb_per_s']} | {r['ratio']}x |"
        )
    return "\n".join(lines)


_CONDITION_TEXT = {
    "warm": "warm: source on tmpfs, destination ext4",
    "cold": "cold: source ext4, page cache dropped, destination tmpfs",
    "memory": "memory: source and destination on tmpfs",
    "cold (page cache dropped)": "cold (page cache dropped)",
    "warm-ish": "warm-ish",
}


def to_markdown(rows: list[dict]) -> str:
    if rows and "load_at_start" not in rows[0]:  # bench()'s rows
        lines = [
            "| dataset | tool | MB/s (median) | ratio vs cp -r | condition |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['dataset']} | {r['tool']} | {r['mb_per_s']} | {r['ratio_vs_cp']}x "
                f"| {r['condition']} |"
            )
        return "\n".join(lines)
    lines = [
        "| dataset | condition | tool | MB/s (median) | ratio vs cp -r | CPU stolen "
        "| load at start |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stolen = "" if r["cpu_stolen"] is None else f"{100 * r['cpu_stolen']:.0f}%"
        lines.append(
            f"| {r['dataset']} | {_CONDITION_TEXT[r['condition']]} | {r['tool']} "
            f"| {r['mb_per_s']} | {r['ratio_vs_cp']}x | {stolen} | {r['load_at_start']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--conditions", default="warm,cold")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each row's shards")
    parser.add_argument("--sweep", action="store_true", help="add 1-core and --jobs 1 runs")
    parser.add_argument(
        "--sample-sizes",
        action="store_true",
        help="only compare ~100 KB with ~1 KB samples, alternating (issue 22's second goal)",
    )
    parser.add_argument(
        "--data", type=Path, help="keep the generated shards here and reuse them (on disk)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also run stage-in (defaults) from this checkout (a git worktree of an older commit)",
    )
    parser.add_argument(
        "--cores",
        default="",
        metavar="N,N,...",
        help="also stage-in (defaults) pinned to each count of CPUs, and xargs -P cp on all",
    )
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"which datasets, of {', '.join(ROWS)}"
    )
    args = parser.parse_args(argv)
    keys = [k for k in args.rows.split(",") if k]
    unknown = sorted(set(keys) - set(ROWS))
    if unknown:
        parser.error(f"unknown --rows {unknown}; choose from {', '.join(ROWS)}")
    compile_bytecode()
    if args.baseline is not None:
        compile_bytecode(args.baseline)
    conditions = [c for c in args.conditions.split(",") if c]
    cores = tuple(int(c) for c in args.cores.split(",") if c)

    def run(workdir: Path) -> list[dict]:
        if args.sample_sizes:
            return bench_sample_sizes(
                conditions, args.repeats, args.jobs, args.scale, args.data or workdir, args.baseline
            )
        return bench_matrix(
            *(conditions, args.repeats, args.jobs, args.scale, args.data or workdir),
            *(args.sweep, keys, args.baseline, cores),
        )

    rows = in_workdir(None, "bench-stage-in-", run, parent=str(DISK))
    report(rows, sample_sizes_markdown if args.sample_sizes else to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
