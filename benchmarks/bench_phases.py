"""Benchmark: where one stage-in's wall time goes, phase by phase, on N cores.

Run: ``.venv/bin/python -m benchmarks.bench_phases SRC [--cores 1,2,16] [--repeats 3]
[--scratch DIR] [--flags '--jobs 4'] [--baseline CHECKOUT]``.

Why: a whole run's time against ``cp -r`` (bench_stage_in) says how far stage-in is from the
plainest tool, not where the gap is. On many small shards the gap is made of a process's
fixed costs (the interpreter's start, imports, the finish's manifest and index) and of the
copies' Python, which one interpreter lock runs one thread at a time; which of them grows or
shrinks with the cores a job gives it decides what to build next. Each run here is a real
``stage-in`` process, pinned with ``taskset`` to the first N CPUs, with marks taken inside it:

- ``start``: from the parent's spawn to the first line of Python (the interpreter's start);
- ``imports``: the command line's modules;
- ``before copies``: the rest until the copier starts (the listing's start, the plan, the
  locks: on a directory the listing goes on beside the copies);
- ``copies``: the copier's run, from its start to the last shard booked;
- ``finish``: the staged manifest and the loader index;
- ``exit``: from the finish to the parent seeing the process end.

``cpu`` is the process's user and system time (every thread), so ``cpu / wall`` is how many
cores it kept busy. ``Python us/shard``: the copies phase less the time inside the runs'
compiled calls (``copy_run``, ``rename_run``), per shard booked. Read it with ``--cores 1
--flags '--jobs 1'``, where nothing overlaps: it is then the Python a shard holds the
interpreter lock for, which bounds a run of tiny shards on many cores however many copy
threads there are. Medians of ``--repeats`` runs per core count, the counts alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, compile_bytecode

#: Runs inside the timed process: marks the phases, then runs the command line as
#: ``stage-in`` does. The marks go to the file named by ``BENCH_PHASES_OUT``.
_CHILD = r"""
import time
marks = {"python": time.time()}
import atexit, json, os, sys
import stager.cli.main as cli
marks["imports"] = time.time()
import stager.stagein.copier as copier
import stager.stagein.run as run
import stager.stagein.streamed as streamed

def _marked(function, begin, end):
    def wrapper(*args, **kwargs):
        marks.setdefault(begin, time.time())
        try:
            return function(*args, **kwargs)
        finally:
            marks[end] = time.time()
    return wrapper

copier.Copier.run = _marked(copier.Copier.run, "copies", "copies_end")
run.finish = streamed.finish = _marked(streamed.finish, "finish", "finish_end")

# The compiled calls of the copies (a run's copy and renames), timed: the rest of the copies
# phase is Python, which one interpreter lock runs a thread at a time.
import stager.storage.bytepath as bytepath
marks["compiled_s"] = 0.0

class _TimedPump:
    def __init__(self, pump):
        self._pump = pump

    def __getattr__(self, name):
        found = getattr(self._pump, name)
        if name not in ("copy_run", "rename_run"):
            return found
        def timed(*args):
            started = time.perf_counter()
            try:
                return found(*args)
            finally:
                marks["compiled_s"] += time.perf_counter() - started
        return timed

if bytepath._pump is not None:
    bytepath._pump = _TimedPump(bytepath._pump)
_booked = copier.Copier.book_run
def _book_run(self, copies, published):
    marks["files"] = marks.get("files", 0) + len(copies)
    return _booked(self, copies, published)
copier.Copier.book_run = _book_run

def _save():
    with open(os.environ["BENCH_PHASES_OUT"], "w") as out:
        json.dump(marks, out)

atexit.register(_save)
sys.argv[0] = "stage-in"
sys.exit(cli.stage_in_main())
"""

PHASES = ("start", "imports", "before copies", "copies", "finish", "exit")


def run_once(
    src: Path, scratch: Path, cores: int, flags: list[str], checkout: Path = REPO
) -> dict[str, float]:
    """One pinned stage-in of ``src`` into a fresh ``scratch``, from ``checkout``'s stager (the
    child runs there, and ``-c`` puts its working directory first on the path): its phases
    and CPU, in seconds."""
    shutil.rmtree(scratch, ignore_errors=True)
    marks_file = scratch.with_name(scratch.name + ".marks.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["BENCH_PHASES_OUT"] = str(marks_file)
    argv = ["taskset", "-c", f"0-{cores - 1}", sys.executable, "-c", _CHILD]
    argv += [str(src), "--dest", str(scratch), "--quiet", *flags]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # (one child at a time: its own)
    spawned = time.time()
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stderr=subprocess.PIPE, cwd=checkout)
    wall = time.perf_counter() - started
    ended = spawned + wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace")[-1500:]
        raise RuntimeError(f"stage-in exited {done.returncode}: {stderr}")
    m = json.loads(marks_file.read_text())
    marks_file.unlink()
    return {
        "wall": wall,
        "cpu": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
        "start": m["python"] - spawned,
        "imports": m["imports"] - m["python"],
        "before copies": m["copies"] - m["imports"],
        "copies": m["copies_end"] - m["copies"],
        "finish": m["finish_end"] - m["finish"],
        "exit": ended - m["finish_end"],
        # the copies' Python per shard, outside the runs' compiled calls (on one core, with
        # --jobs 1, nothing else runs meanwhile: what a shard holds the interpreter lock for)
        "python_us": (m["copies_end"] - m["copies"] - m["compiled_s"])
        / max(1, m.get("files", 0))
        * 1e6,
    }


def to_markdown(rows: list[dict]) -> str:
    head = ["cores", "wall", *PHASES, "cpu", "cores busy", "Python us/shard"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cores = f"{r['cores']}, {r['tree']}" if r["tree"] else str(r["cores"])
        cells = [cores, *(f"{r[k]:.3f}" for k in ("wall", *PHASES, "cpu"))]
        cells.append(f"{r['cpu'] / r['wall']:.2f}")
        # (copy threads overlapping count their compiled time more than once: only --jobs 1)
        cells.append(f"{r['python_us']:.1f}" if r["python_us"] >= 0 else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a directory of shards (copy it to a tmpfs first)")
    parser.add_argument("--cores", default="1,2", help="CPU counts to pin stage-in to")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", type=Path, help="default: a fresh folder in /dev/shm")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also each count from this checkout (a git worktree of an older commit), alternating",
    )
    parser.add_argument("--flags", default="", help="stage-in flags, one string ('--jobs 1')")
    args = parser.parse_args(argv)
    flags = shlex.split(args.flags)
    compile_bytecode()
    trees = {"": REPO}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
        compile_bytecode(trees["baseline"])
    available = len(os.sched_getaffinity(0))
    counts = [c for c in (int(c) for c in args.cores.split(",") if c) if 0 < c <= available]
    work = args.scratch or Path(tempfile.mkdtemp(prefix="bench-phases-", dir="/dev/shm"))
    runs: dict[tuple[int, str], list[dict[str, float]]] = {
        (c, t): [] for c in counts for t in trees
    }
    try:
        for _ in range(args.repeats):
            for cores, tree in runs:  # alternating, so that drift hits every one alike
                measured = run_once(args.src, work / "scratch", cores, flags, trees[tree])
                runs[cores, tree].append(measured)
    finally:
        if args.scratch is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = []
    for (cores, tree), measured in runs.items():
        row: dict = {"cores": cores, "tree": tree, "repeats": len(measured)}
        for key in ("wall", "cpu", "python_us", *PHASES):
            row[key] = statistics.median(m[key] for m in measured)
        rows.append(row)
    print(f"stage-in {args.src} {' '.join(flags)}: medians of {args.repeats}, seconds")
    print(to_markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
