"""Benchmark: the least a Python copier can spend per shard, against ``cp -r`` and stage-in.

Run: ``.venv/bin/python -m benchmarks.bench_python_floor SRC SCRATCH [--threads 1,2,4]
[--repeats 3] [--syscalls]`` with ``SRC`` a directory of shards and ``SCRATCH`` a directory to
copy into (both on a tmpfs, to measure the copiers rather than the disk; it is emptied between
runs).

The "floor" copier does only what a verified, atomic copy of a whole small file needs: open,
``fstat``, one read, xxh3, create ``<name>.partial``, write, close, rename. No journal,
manifest, index, retries, progress or stream control. Where stage-in trails ``cp -r`` on tiny
shards, this tells the interpreter's share of the gap from stage-in's own bookkeeping
(docs/benchmarks.md, "What a Python copier can reach on tiny shards at all").

``--syscalls`` adds the system calls alone, from C (``benchmarks/syscall_floor.c``): stage-in's
per shard (``partial``), the same with ``O_TMPFILE`` and ``linkat`` (``tmpfile``), and ``cp``'s
(``plain``): what no copier making those calls can beat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import xxhash

from benchmarks.common import build_c

#: The system calls alone, from C (``--syscalls``).
SYSCALL_FLOOR = Path(__file__).with_name("syscall_floor.c")


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def floor_copy(
    files: list[str], src: str, dst: str, threads: int, processes: bool = False
) -> float:
    """Copy ``files`` (under ``src``) to ``dst`` on ``threads`` threads (forked processes
    where ``processes``); seconds taken."""
    _make_directories(files, src, dst)

    def work(part: list[str]) -> None:
        for path in part:
            out = dst + path[len(src) :]
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.read(fd, os.fstat(fd).st_size + 1)
            finally:
                os.close(fd)
            xxhash.xxh3_64_hexdigest(data)
            partial = out + ".partial"
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(partial, out)

    started = time.perf_counter()
    if processes:  # one interpreter each: what the work costs without a shared lock
        children = []
        for i in range(threads):
            pid = os.fork()
            if pid == 0:
                try:
                    work(files[i::threads])
                finally:
                    os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        return time.perf_counter() - started
    pool = [threading.Thread(target=work, args=(files[i::threads],)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return time.perf_counter() - started


def syscall_copy(binary: Path, files: list[str], src: str, dst: str, threads: int, mode: str):
    """Seconds ``syscall_floor`` took to copy ``files`` (under ``src``) to ``dst``."""
    _make_directories(files, src, dst)
    listing = "".join(p[len(src) + 1 :] + "\n" for p in files)
    done = subprocess.run(
        [binary, src, dst, str(threads), mode], input=listing, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"syscall_floor failed: {done.stderr.strip()}")
    return float(done.stdout)


def _tools(args, counts, files, src, out, stage_in, binary):
    """``(name, run)`` of each copier timed in one repeat, in the order they alternate."""
    tools = [("cp -r", lambda: _timed(["cp", "-r", src, out]))]
    for n in counts:
        tools.append((f"floor, {n} thread(s)", lambda n=n: floor_copy(files, src, out, n)))
    if binary is not None:
        modes = [(n, "partial") for n in counts] + [(max(counts), m) for m in ("tmpfile", "plain")]
        for n, mode in modes:
            tools.append(
                (
                    f"syscalls ({mode}), {n} thr.",
                    lambda n=n, mode=mode: syscall_copy(binary, files, src, out, n, mode),
                )
            )
    for n in (int(p) for p in args.processes.split(",") if p):
        tools.append((f"floor, {n} process(es)", lambda n=n: floor_copy(files, src, out, n, True)))
    tools.append(("stage-in (defaults)", lambda: _timed(stage_in)))
    return tools


def _make_directories(files: list[str], src: str, dst: str) -> None:
    """The directories under ``dst`` that ``files`` (under ``src``) are copied into."""
    for directory in {os.path.dirname(dst + p[len(src) :]) for p in files}:
        os.makedirs(directory, exist_ok=True)


def _timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("scratch")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--processes", default="", help="also the floor in this many forked processes, e.g. 16"
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="also the system calls alone, from C (benchmarks/syscall_floor.c, needs cc)",
    )
    args = parser.parse_args(argv)
    src = os.path.abspath(args.src).rstrip("/")
    out = os.path.join(os.path.abspath(args.scratch), "copy")
    os.makedirs(args.scratch, exist_ok=True)
    files = _files(src)
    stage_in = [sys.executable, "-m", "stager", "stage-in", src, "--dest", out]
    stage_in += ["--jitter-max", "0", "--quiet", "--no-cache"]
    runs: dict[str, list[float]] = {}
    counts = [int(t) for t in args.threads.split(",")]
    binary = build_c(SYSCALL_FLOOR, ["-pthread"]) if args.syscalls else None
    if args.syscalls and binary is None:
        print("note: syscall_floor.c could not be built; its rows are left out", file=sys.stderr)
    try:
        for _ in range(args.repeats):  # alternating, so drift touches every tool alike
            for name, run in _tools(args, counts, files, src, out, stage_in, binary):
                shutil.rmtree(out, ignore_errors=True)
                runs.setdefault(name, []).append(run())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = statistics.median(runs["cp -r"])
    print(f"{len(files)} files from {src}; median of {args.repeats}")
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        print(f"{name:28s} {median:7.3f} s  {base / median:5.2f}x cp -r")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
