"""Run every benchmark and write a Markdown table plus JSON, and ``docs/benchmarks.md``.

Run (root, for the FUSE, tmpfs and network-namespace benchmarks):
``.venv/bin/python -m benchmarks [--large] [--repeats N] [--only NAME ...] [--out DIR]
[--no-docs]``.

Default sizes finish in a few minutes on a 2-core machine; ``--large`` uses bigger datasets.
Our own benchmarks (local stage-in, per-operation latency, sshfs over a capped link) run in
this process and return rows; benchmarks other modules provide (``bench_loader``,
``bench_fanout``, ``bench_subset_bytes``) run as ``python -m benchmarks.NAME`` subprocesses when
the module exists and has a ``main``, and their text output is included as is. A benchmark that
fails or is missing
is reported with a note, and the others still run. Every figure is a ratio to a baseline
measured in the same run (cp -r, or the best baseline for the capped link).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import bench_latency, bench_sshfs, bench_stage_in
from .common import REPO, compile_bytecode, cpu_jiffies, stolen_fraction

EXTERNAL = (
    "bench_loader",
    "bench_fanout",
    "bench_subset_bytes",
    "bench_startup",
)  # by others: subprocesses, if present
EXTERNAL_TIMEOUT_S = 900


def machine() -> dict:
    """What the figures were measured on: they mean nothing without it."""
    meminfo = (
        Path("/proc/meminfo").read_text().split("\n") if Path("/proc/meminfo").exists() else []
    )
    mem_kb = next((int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:")), 0)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        ),
        "",
    )
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_avg_start": os.getloadavg(),
        "cpu_jiffies_start": cpu_jiffies(),
    }


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def _own(name: str, large: bool, repeats: int, workdir: Path) -> tuple[list[dict], str]:
    """Run one of our benchmarks in-process; returns (rows, markdown)."""
    size = "large" if large else "small"
    sub = workdir / name
    sub.mkdir(parents=True, exist_ok=True)
    if name == "stage_in_local":
        rows = bench_stage_in.bench(size, repeats, 8, sub)
        for r in rows:
            r["bench"] = "local"
        return rows, bench_stage_in.to_markdown(rows)
    if name == "latency":
        rows = bench_latency.bench(size, repeats, [2.0, 10.0], sub)
        return rows, bench_latency.to_markdown(rows)
    if name == "sshfs":
        rows = bench_sshfs.bench(size, repeats, 80.0, sub)
        return rows, bench_sshfs.to_markdown(rows)
    raise ValueError(name)


def _external(name: str, large: bool) -> dict:
    """Run benchmarks.NAME as a subprocess if it exists and has main(); its output, verbatim."""
    if importlib.util.find_spec(f"benchmarks.{name}") is None:
        return {
            "name": name,
            "status": "skipped",
            "note": f"benchmarks/{name}.py does not exist yet",
        }
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except Exception as exc:  # noqa: BLE001 - a broken module is a note, not a crash
        return {
            "name": name,
            "status": "skipped",
            "note": f"import failed: {type(exc).__name__}: {exc}",
        }
    if not callable(getattr(module, "main", None)):
        return {"name": name, "status": "skipped", "note": "module has no main(); cannot run it"}
    argv = [sys.executable, "-m", f"benchmarks.{name}"]
    if large and "--size" in (module.__doc__ or "") + _help(argv):
        argv += ["--size", "large"]
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=EXTERNAL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = (
            exc.stdout.decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        return {
            "name": name,
            "status": "timeout",
            "note": f"killed after {EXTERNAL_TIMEOUT_S} s",
            "output": out,
        }
    status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
    return {
        "name": name,
        "status": status,
        "seconds": round(time.monotonic() - started, 1),
        "output": done.stdout.strip(),
        "note": "" if done.returncode == 0 else done.stderr.strip()[-1500:],
    }


def _help(argv: list[str]) -> str:
    try:
        return subprocess.run(
            [*argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


SECTIONS = {
    "stage_in_local": (
        "Local source",
        "Ratios to `cp -r`; local disk (ext4 on virtio) to local disk, page cache dropped before "
        "every "
        "run (cold). stage-in here runs with `--jobs 8 --no-count` (bench_stage_in's setting).",
    ),
    "latency": (
        "Shared filesystem with per-operation latency (FUSE shim)",
        "Source on tmpfs behind `benchmarks/latencyfs.py`, which sleeps the given delay per "
        "lookup/getattr, "
        "open and read (parallel lookups enabled); destination on tmpfs. stage-in with default "
        "flags "
        '(adaptive streams, ceiling 64). "stage-in (brace list)" names the same files with a brace '
        "pattern, which stage-in stats in parallel instead of listing the directory serially; "
        '"stage-in (manifest)" is given a manifest made beforehand by `stager index` and takes '
        "the sizes "
        "from it instead of a stat per file. "
        '"copy phase s" is stage-in\'s own report (`seconds`): after startup and the directory '
        "read, so "
        "it includes the per-file stats that a manifest saves (without one they run on their own "
        "threads "
        "alongside the copies). "
        "The shim column says which build served the run: `c` (latencyfs.c, compiled on first "
        "use; a few "
        "microseconds of CPU per operation, as an NFS server's CPU is not the client's) or "
        "`python` (when no "
        "compiler or libfuse3-dev is present; ~0.7 ms of CPU per small file taken from the copier "
        "on these "
        "2 cores, topping out near 1,000-1,600 small files/s). "
        "Goal (issue 8): stage-in >= 25x `cp -r` on small files at 10 ms, by default.",
    ),
    "sshfs": (
        "Network filesystem behind a capped link (sshfs, tc tbf)",
        "sftp-only sshd in its own network namespace, veth capped with `tc tbf` on the server "
        "side; "
        "sshfs mounted on the host; export and destination on tmpfs. Ratios to the best of "
        "cp/rsync/rclone "
        "in the same run. The last column is stage-in's copy phase alone (its report's `seconds`, "
        "excluding its startup (~0.2 s) and the listing). Goal (issue 8): >= 0.9 of the cap and "
        ">= the "
        "best baseline.",
    ),
}


def _steal_sentence(stolen: float | None) -> str:
    if stolen is None:
        return ""
    return (
        f" CPU time stolen by the hypervisor during the run: {100 * stolen:.0f}% (other guests' "
        "share of "
        "these cores; CPU-bound figures slow down with it, latency-bound baselines do not)."
    )


def render(meta: dict, results: dict) -> str:
    """The Markdown document: machine, conditions, then one table per benchmark."""
    m = meta["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Latest run: {m['date_utc']}, `{meta['command']}` ({meta['total_s']:.0f} s).",
        "",
        f"Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), {m['memory_gib']} GiB memory, "
        f"kernel {m['kernel']}, {m['os']}, Python {m['python']}. Load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg_start'])}; at end "
        f"{', '.join(f'{x:.1f}' for x in meta['load_avg_end'])}."
        + _steal_sentence(meta.get("cpu_stolen")),
        "",
        "Every figure is a ratio to a baseline measured in the same run; tools alternate within "
        "each "
        f"repeat (A B A B) and the median of {meta['repeats']} repeats is reported. Absolute MB/s "
        "and "
        "files/s are shown for context only: this machine shares 2 cores with other work (a load "
        "average above 2 means other processes competed for the CPU during the run), so they vary "
        "from run to run; compare ratios. Times are wall-clock, process startup included, as a "
        "user "
        "sees them.",
        "",
    ]
    for name, result in results.items():
        title, conditions = SECTIONS.get(name, (name, ""))
        lines += [f"## {title}", ""]
        if conditions:
            lines += [conditions, ""]
        if result.get("markdown"):
            lines += [result["markdown"], ""]
        if result.get("output"):
            lines += ["```", result["output"], "```", ""]
        if result.get("status") not in (None, "ok"):
            lines += [f"_{result['status']}: {result.get('note', '')}_", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="bigger datasets (tens of minutes)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="repeats per tool; the median is reported (default 3)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["stage_in_local", "latency", "sshfs", *EXTERNAL],
        help="run only these benchmarks",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench-results",
        help="where results.{md,json} go (default bench-results/, git-ignored)",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=REPO / "docs" / "benchmarks.md",
        help="the Markdown page to rewrite",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs page")
    args = parser.parse_args(argv)
    compile_bytecode()
    if os.geteuid() != 0:
        print(
            "note: not root; the latency and sshfs benchmarks need root (mounts, namespaces) and "
            "will fail",
            file=sys.stderr,
        )

    started = time.monotonic()
    meta = {
        "machine": machine(),
        "repeats": args.repeats,
        "command": " ".join(["python -m benchmarks", *(argv or sys.argv[1:])]),
    }
    names = args.only or ["stage_in_local", "latency", "sshfs", *EXTERNAL]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-all-", dir="/var/tmp") as tmp:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            if name in EXTERNAL:
                results[name] = _external(name, args.large)
            else:
                try:
                    rows, markdown = _own(name, args.large, args.repeats, Path(tmp))
                    results[name] = {"status": "ok", "rows": rows, "markdown": markdown}
                except Exception as exc:  # noqa: BLE001 - one failing benchmark must not lose the others
                    traceback.print_exc()
                    results[name] = {"status": "failed", "note": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = round(time.monotonic() - t0, 1)
            print(
                f"== {name}: {results[name]['status']} in {results[name]['seconds']} s",
                file=sys.stderr,
                flush=True,
            )
    meta["total_s"] = time.monotonic() - started
    meta["load_avg_end"] = os.getloadavg()
    meta["cpu_stolen"] = stolen_fraction(meta["machine"].pop("cpu_jiffies_start"), cpu_jiffies())

    document = render(meta, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(document)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if not args.no_docs:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(document)
    print(document)
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
