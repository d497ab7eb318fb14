"""Helpers the benchmark scripts share."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "scratch_root",
    "in_workdir",
    "report",
    "cpu_jiffies",
    "stolen_fraction",
    "raise_on_sigterm",
    "compile_bytecode",
    "build_c",
    "REPO",
]

#: The checkout the benchmarks run from.
REPO = Path(__file__).resolve().parent.parent
_STEAL_FIELD = 7  # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ...


def cpu_jiffies() -> list[int]:
    """The machine's cumulative CPU time per state (``/proc/stat``), or [] where there is none."""
    try:
        with open("/proc/stat") as handle:
            return [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def stolen_fraction(before: list[int], after: list[int]) -> float | None:
    """The share of CPU time the hypervisor gave to other guests between two snapshots.

    A virtual machine's cores are not always its own: while "steal" is high, every CPU-bound
    figure is slower while latency-bound ones (a serial ``cp -r`` on NFS) are not, so ratios
    between them move. Reported beside the figures so a reader can tell machine noise from code.
    """
    if len(before) <= _STEAL_FIELD or len(after) <= _STEAL_FIELD:
        return None
    fields = slice(0, _STEAL_FIELD + 1)
    deltas = [b - a for a, b in zip(before[fields], after[fields], strict=True)]
    total = sum(deltas)
    return deltas[_STEAL_FIELD] / total if total > 0 else None


def scratch_root(prefix: str) -> tuple[Path, str]:
    """A fresh work directory on tmpfs when there is one, and the condition to report with it.

    This machine evicts clean page-cache pages within seconds, so only tmpfs gives a
    reproducible warm condition; elsewhere the figures include disk reads, and say so.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=prefix, dir=shm)), "tmpfs (/dev/shm, page-cache warm)"
    return Path(
        tempfile.mkdtemp(prefix=prefix)
    ), "local disk (NOT tmpfs: figures include disk reads)"


def in_workdir(
    workdir: Path | None,
    prefix: str,
    run: Callable[[Path], list[dict]],
    *,
    parent: str | None = None,
) -> list[dict]:
    """``run(dir)`` in ``workdir``, or in a fresh temporary directory that is removed afterwards."""
    work = workdir or Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        return run(work)
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def report(
    rows: list[dict], to_markdown: Callable[[list[dict]], str], json_path: Path | None
) -> None:
    """Print the Markdown table, and write the rows as JSON when asked."""
    print(to_markdown(rows))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))


def raise_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so every ``finally`` runs (unmounts, namespace teardown).

    Python's default for SIGTERM ends the process without unwinding: a benchmark killed that
    way left its tmpfs and FUSE mounts behind.
    """

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def compile_bytecode(tree: Path = REPO) -> None:
    """Compile the modules of the project at ``tree`` (this checkout, or a baseline's) to
    bytecode before the stage-in CLI is timed.

    An installed package ships its ``.pyc`` files, and an editable checkout writes them on the
    first import, unless ``PYTHONDONTWRITEBYTECODE`` is set, as it is on the machine these
    benchmarks were written on: there every stage-in run compiled ~25 modules from source again,
    ~70 ms that no user pays, on runs of 0.3-3 s. ``compileall`` writes the files whatever that
    variable says; the interpreter reads them either way.
    """
    import compileall

    for package in ("stager", "loaders"):
        if not compileall.compile_dir(str(tree / package), quiet=1):
            print(
                f"note: some modules under {package}/ did not compile; they are compiled on import",
                file=sys.stderr,
            )


def build_c(source: Path, flags: list[str] | tuple[str, ...] = ()) -> Path | None:
    """``source`` (a benchmark's C program) compiled with ``cc -O2 -Wall`` and ``flags``,
    once per version of the source and flags (kept under ``build/<name>/``); None where no
    compiler is found or the build fails (its errors printed)."""
    digest = hashlib.sha256(source.read_bytes() + "\0".join(flags).encode()).hexdigest()[:12]
    build_dir = REPO / "build" / source.stem
    binary = build_dir / f"{source.stem}-{digest}"
    if binary.is_file():
        return binary
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(binary.name + ".tmp")
    built = subprocess.run(
        [cc, "-O2", "-Wall", "-o", str(tmp), str(source), *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    if built.returncode != 0:
        print(f"{source.name}: the C build failed:\n{built.stderr[-2000:]}", file=sys.stderr)
        return None
    os.replace(tmp, binary)
    return binary
