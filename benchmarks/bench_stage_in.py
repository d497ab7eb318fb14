"""Benchmark: stage-in throughput against ``cp -r`` (and rsync, rclone when installed).

Run: ``.venv/bin/python -m benchmarks.bench_stage_in [--size small|large] [--repeats N]``.

Every figure is a ratio to ``cp -r`` measured in the same run. Runs alternate between tools
(A B A B ...) and the median of the repeats is reported, because this machine has 2 cores and
its disk throughput varies up to 2x between runs. The page cache is dropped before every run
when we are root (cold condition); otherwise the condition is reported as "warm-ish".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import compile_bytecode, in_workdir, report

BIN = Path(sys.executable).parent

# (label, shards, samples per shard, bytes per sample)
SIZES = {
    "small": [("150 x 2 MB", 150, 20, 100_000), ("6 x 50 MB", 6, 500, 100_000)],
    "large": [("400 x 2 MB", 400, 20, 100_000), ("16 x 64 MB", 16, 640, 100_000)],
}


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
        raise RuntimeError(
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode(errors='replace')[-1500:]}"
        )
    return time.perf_counter() - start


_run = run_tool
_drop_caches = drop_caches


def bench(size: str, repeats: int, jobs: int, workdir: Path) -> list[dict]:
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


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| dataset | tool | MB/s (median) | ratio vs cp -r | condition |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['tool']} | {r['mb_per_s']} | {r['ratio_vs_cp']}x | {r['condition']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument(
        "--workdir", type=Path, help="where to write data (default: a temp dir on /var/tmp)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    compile_bytecode()
    rows = in_workdir(
        args.workdir,
        "bench-stage-in-",
        lambda w: bench(args.size, args.repeats, args.jobs, w),
        parent="/var/tmp",
    )
    report(rows, to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
