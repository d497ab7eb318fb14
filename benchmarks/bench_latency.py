"""Benchmark: stage-in vs cp -r, rsync -a and rclone on a source with NFS-like per-operation
latency.

Run: ``.venv/bin/python -m benchmarks.bench_latency [--size small|large] [--repeats N]
[--delays-ms 2,10]
[--tools "cp -r,stage-in"] [--shim auto|c|python]``
(root: it mounts a tmpfs and a FUSE filesystem, and unmounts both on exit, even on error).

The source is a tmpfs directory served through :mod:`benchmarks.latencyfs`, which sleeps a
fixed delay per lookup/getattr, open and read (with parallel lookups enabled), so per-file
latency rather than bandwidth is what the copiers face. The destination is a tmpfs too, so the
disk plays no part. Before every run we wait out the kernel's 1 s entry/attribute cache, so each
copier starts cold, and the FUSE page cache is not kept between opens, so every byte goes
through the shim each time. The shim's C build is used when it compiles (``--shim auto``): an NFS
server's CPU is not the client's, and the Python build's ~0.7 ms of CPU per small file on these
2 cores would be charged to whichever copier runs more files per second. Each row says which.

stage-in runs with default flags (adaptive streams, ceiling 64); its report's ``streams`` field
(peak stream count) and ``seconds`` (copy phase only, after listing) are recorded. A second
stage-in row, "stage-in (brace list)", names the same files with a brace pattern, which stage-in
stats in parallel instead of listing the directory: the difference between the two rows is the
cost of the directory listing. "stage-in (manifest)" is given a manifest made by ``stager index``
beforehand (as a dataset's owner would, once): it takes the sizes from it instead of a stat per
file. Every figure is a ratio to ``cp -r`` in the same run; tools
alternate within each repeat and the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .bench_stage_in import run_tool, target_for, tool_commands
from .common import (
    compile_bytecode,
    cpu_jiffies,
    in_workdir,
    raise_on_sigterm,
    report,
    stolen_fraction,
)
from .latencyfs import IMPLS, mounted

# (label, files, approximate bytes per file)
SIZES = {
    "small": [("300 x 64 KB", 300, 64 << 10), ("4 x 8 MB", 4, 8 << 20)],
    # 3000 small files: enough that stage-in's fixed ~0.4 s (startup, listing) stops hiding its
    # copy rate; cp -r alone takes ~100 s per run at 10 ms, so pick tools with --tools.
    "large": [("3000 x 64 KB", 3000, 64 << 10), ("8 x 64 MB", 8, 64 << 20)],
}
ENTRY_CACHE_S = 1.1  # libfuse's default entry/attr timeout is 1 s: wait it out before each run
RCLONE_TRANSFERS = 8
REPORT_NAME = ".stage-in-report.json"


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs at ``path`` for the ``with`` body (page-cache-warm by construction), unmounted
    after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)
        if Path(path).is_mount():
            subprocess.run(["umount", "-l", str(path)], check=False)


def make_dataset(src: Path, files: int, file_bytes: int) -> tuple[int, list[str]]:
    """``files`` real tar shards of about ``file_bytes`` each; returns (total bytes, names).

    One shard is synthesized and copied under the other names: content is irrelevant to a
    copier, and synthesizing hundreds of shards would take longer than the benchmark.
    """
    scratch = src.parent / ".synth"
    sample_bytes = 32 << 10
    samples = max(1, file_bytes // (sample_bytes + 2048))
    (one,) = write_synthetic_dataset(
        scratch, SyntheticSpec(num_shards=1, samples_per_shard=samples, image_bytes=sample_bytes)
    )
    src.mkdir(parents=True, exist_ok=True)
    names = [f"train-{i:06d}.tar" for i in range(files)]
    for name in names:
        shutil.copyfile(one, src / name)
    shutil.rmtree(scratch)
    return sum((src / n).stat().st_size for n in names), names


def _tools(names: list[str], manifest: Path) -> dict[str, list[str]]:
    report = ("--quiet", "--report", f"DST/{REPORT_NAME}")
    tools = tool_commands(transfers=RCLONE_TRANSFERS, stage_in_flags=report)
    brace = f"SRC/train-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"
    tools["stage-in (brace list)"] = [tools["stage-in"][0], brace, *tools["stage-in"][2:]]
    tools["stage-in (manifest)"] = [*tools["stage-in"], "--manifest", str(manifest)]
    return tools


def make_manifest(src: Path, out: Path) -> Path:
    """``stager index`` of the source, read directly (not through the shim), kept outside it."""
    stager = Path(sys.executable).with_name("stager")
    subprocess.run(
        [str(stager), "index", str(src), "--out", str(out)], check=True, capture_output=True
    )
    return out


def bench(
    size: str,
    repeats: int,
    delays_ms: list[float],
    workdir: Path,
    log=sys.stderr,
    only_tools: list[str] | None = None,
    shim: str = "auto",
) -> list[dict]:
    rows: list[dict] = []
    biggest = max(files * nbytes for _, files, nbytes in SIZES[size])
    with tmpfs(workdir, 3 * biggest + (256 << 20)):
        for label, files, file_bytes in SIZES[size]:
            src = workdir / "src" / "ds"
            shutil.rmtree(workdir / "src", ignore_errors=True)
            nbytes, names = make_dataset(src, files, file_bytes)
            tools = _tools(names, make_manifest(src, workdir / "manifest.json"))
            if only_tools:
                tools = {k: v for k, v in tools.items() if k in only_tools or k == "cp -r"}
            for delay_ms in delays_ms:
                mnt = workdir / "mnt" / "ds"  # basename "ds": every tool names its copy alike
                times: dict[str, list[float]] = {name: [] for name in tools}
                peaks: dict[str, list[int]] = {}
                copy_s: dict[str, list[float]] = {}
                stolen: dict[str, list[float]] = {name: [] for name in tools}
                with mounted(src, mnt, delay_s=delay_ms / 1000, impl=shim) as fs_info:
                    _warm_up(mnt, names)
                    for rep in range(repeats):
                        for name, cmd in tools.items():  # alternate tools within each repeat
                            dst = workdir / "dst"
                            shutil.rmtree(dst, ignore_errors=True)
                            dst.mkdir()
                            time.sleep(ENTRY_CACHE_S)
                            cpu_before = cpu_jiffies()
                            seconds = run_tool(cmd, mnt, target_for(name, dst, "ds"), timeout_s=900)
                            times[name].append(seconds)
                            steal = stolen_fraction(cpu_before, cpu_jiffies())
                            if steal is not None:
                                stolen[name].append(steal)
                            report = dst / REPORT_NAME
                            if report.is_file():
                                payload = json.loads(report.read_text())
                                peaks.setdefault(name, []).append(int(payload.get("streams", 0)))
                                copy_s.setdefault(name, []).append(
                                    float(payload.get("seconds", 0.0))
                                )
                            copied = sum(1 for p in (dst / "ds").rglob("*.tar"))
                            if copied != files:
                                raise RuntimeError(
                                    f"{name} copied {copied} of {files} files at {delay_ms} ms"
                                )
                            print(
                                f"  latency {label} {delay_ms} ms rep {rep + 1}: {name} "
                                f"{seconds:.2f} s",
                                file=log,
                                flush=True,
                            )
                rows.extend(
                    _rows(
                        label,
                        files,
                        nbytes,
                        delay_ms,
                        times,
                        peaks,
                        copy_s,
                        repeats,
                        fs_info,
                        stolen,
                    )
                )
            shutil.rmtree(workdir / "src", ignore_errors=True)
            shutil.rmtree(workdir / "dst", ignore_errors=True)
    return rows


def _warm_up(mnt: Path, names: list[str]) -> None:
    """Read every file once with 32 threads, untimed: the first pass after mounting is slow
    (libfuse starting its worker threads), and it must not be charged to whichever tool runs
    first."""
    from concurrent.futures import ThreadPoolExecutor

    def read(name: str) -> None:
        with open(mnt / name, "rb") as handle:
            while handle.read(1 << 20):
                pass

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(read, names))


def _rows(
    label, files, nbytes, delay_ms, times, peaks, copy_s, repeats, fs_info, stolen
) -> list[dict]:
    base = statistics.median(times["cp -r"])
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        row = {
            "bench": "latency",
            "dataset": label,
            "delay_ms": delay_ms,
            "tool": name,
            "files": files,
            "bytes": nbytes,
            "median_s": round(median, 3),
            "files_per_s": round(files / median, 1),
            "mb_per_s": round(nbytes / median / 1e6, 1),
            "ratio_vs_cp": round(base / median, 2),
            "repeats": repeats,
            "parallel_dirops": fs_info["parallel_dirops"],
            "shim": fs_info["impl"],
            # median share of the machine's CPU time taken by other guests during this tool's runs
            "cpu_stolen_pct": (
                round(100 * statistics.median(stolen[name]), 1) if stolen[name] else None
            ),
            "condition": "warm (tmpfs source behind the FUSE shim, tmpfs destination; shim's "
            "caches cold)",
        }
        if name in peaks:
            row["streams_peak"] = max(peaks[name])
            row["copy_phase_s"] = round(statistics.median(copy_s[name]), 3)
            # The copy phase alone (no startup, no listing) as a ratio to cp -r's whole run.
            row["copy_phase_ratio_vs_cp"] = (
                round(base / row["copy_phase_s"], 2) if row["copy_phase_s"] else None
            )
        rows.append(row)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| dataset | delay | shim | tool | files/s | MB/s | ratio vs cp -r | CPU stolen | "
        "stage-in peak streams "
        "| stage-in copy phase s (ratio vs cp -r) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['delay_ms']:g} ms | {r.get('shim', 'python')} | {r['tool']} | "
            f"{r['files_per_s']} | {r['mb_per_s']} | "
            f"{r['ratio_vs_cp']}x | {_pct(r.get('cpu_stolen_pct'))} | {r.get('streams_peak', '')} "
            "| "
            + (
                f"{r['copy_phase_s']} ({r['copy_phase_ratio_vs_cp']}x) |"
                if "copy_phase_s" in r
                else " |"
            )
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:g}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--delays-ms", default="2,10", help="comma-separated delays per operation (default 2,10)"
    )
    parser.add_argument(
        "--workdir", type=Path, help="where to mount the tmpfs (default: a new temp dir)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--tools",
        help='comma-separated subset of tools (cp -r, the baseline, always runs), e.g. "stage-in"',
    )
    parser.add_argument(
        "--shim",
        choices=IMPLS,
        default="auto",
        help="the latency shim's build (auto: C when it compiles)",
    )
    args = parser.parse_args(argv)
    delays = [float(d) for d in args.delays_ms.split(",") if d]
    raise_on_sigterm()  # a killed run must still unmount its tmpfs and FUSE shim
    only = [t.strip() for t in args.tools.split(",")] if args.tools else None
    compile_bytecode()
    rows = in_workdir(
        args.workdir,
        "bench-latency-",
        lambda w: bench(args.size, args.repeats, delays, w, only_tools=only, shim=args.shim),
    )
    report(rows, to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
