"""A FUSE passthrough that sleeps a fixed delay per lookup/getattr, open and read.

It stands in for a shared filesystem with NFS-like per-operation latency (the kernel here has
no NFS). Every metadata round trip a copier makes costs ``delay_s``, so serial copiers are
latency-bound (~1 / (3 x delay) files/s) and only concurrent streams go faster.

Two settings matter, and both are set here because Debian 12's libfuse 3.14 does not:

- ``FUSE_CAP_PARALLEL_DIROPS`` (``1 << 18``): without it the kernel serializes lookups in one
  directory, so parallel copiers stall near 1 / delay lookups/s. It is requested in
  ``init_with_config`` when the kernel offers it; ``--check`` prints whether it was granted.
- ``max_threads``: libfuse's multithreaded loop defaults to 10 worker threads, so at most 10
  operations sleep at once, which would cap the filesystem rather than the copier.

Two builds of the same filesystem: ``latencyfs.c`` (compiled on first use when ``cc`` and
libfuse3's headers are present: ``apt-get install gcc libfuse3-dev pkg-config``) and the
Python one below. The shim stands in for an NFS server, whose CPU is on another machine; the
Python daemon costs ~0.7 ms of CPU per small file on these 2 cores (it tops out near
1,000-1,600 small files/s), taken from the copier under test, so ``mounted`` prefers the C
build and says which one ran (``impl`` in what it yields).

Run: ``.venv/bin/python -m benchmarks.latencyfs SOURCE MOUNTPOINT --delay-ms 10 [--impl c]``
(foreground), or from Python ``with mounted(source, mountpoint, delay_s=0.01): ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import build_c

__all__ = ["FUSE_CAP_PARALLEL_DIROPS", "IMPLS", "c_shim", "mounted", "unmount"]

FUSE_CAP_PARALLEL_DIROPS = 1 << 18
MAX_THREADS = 64  # worker threads in libfuse's loop (its default is 10)
MAX_BACKGROUND = 64  # kernel's limit on in-flight async requests (readahead); default 12
IMPLS = ("auto", "c", "python")
C_SOURCE = Path(__file__).with_name("latencyfs.c")


def c_shim() -> Path | None:
    """The compiled C build, compiling it if its source changed; None when it cannot be built."""
    if not shutil.which("pkg-config"):
        return None
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True, check=False
    )
    if flags.returncode != 0:
        return None
    binary = build_c(C_SOURCE, flags.stdout.split())
    if binary is None:
        print("latencyfs: using the Python build", file=sys.stderr)
    return binary


def _command(
    source: str, mountpoint: str, delay_s: float, status: str, impl: str
) -> tuple[list[str], str]:
    """The daemon's command line and which build it is."""
    binary = c_shim() if impl in ("auto", "c") else None
    if binary is not None:
        options = (
            f"ro,fsname=latencyfs-{int(delay_s * 1000)}ms,"
            f"max_threads={MAX_THREADS},max_idle_threads={MAX_THREADS}"
        )
        delay_us = str(round(delay_s * 1e6))
        return [str(binary), source, delay_us, status, mountpoint, "-f", "-o", options], "c"
    if impl == "c":
        raise RuntimeError(
            "latencyfs: the C build is unavailable (needs cc, pkg-config and libfuse3-dev)"
        )
    argv = [sys.executable, "-m", "benchmarks.latencyfs", source, mountpoint, "--impl", "python"]
    return [*argv, "--delay-ms", str(delay_s * 1000), "--status", status], "python"


def _operations(root: str, delay_s: float, status_path: str | None):
    """Build the Operations object; mfusepy is imported here so the module imports without it."""
    import mfusepy

    class LatencyFS(mfusepy.Operations):
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(root)
            self.delay_s = delay_s

        def _real(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _sleep(self) -> None:
            if self.delay_s > 0:
                time.sleep(self.delay_s)  # releases the GIL: concurrent operations overlap

        def init_with_config(self, conn_info, config) -> None:
            granted = False
            if conn_info is not None:
                if conn_info.capable & FUSE_CAP_PARALLEL_DIROPS:
                    conn_info.want |= FUSE_CAP_PARALLEL_DIROPS
                    granted = bool(conn_info.want & FUSE_CAP_PARALLEL_DIROPS)
                conn_info.max_background = MAX_BACKGROUND
                conn_info.congestion_threshold = MAX_BACKGROUND * 3 // 4
            if status_path:
                Path(status_path).write_text(f"parallel_dirops={int(granted)}\n")

        def getattr(self, path: str, fh=None) -> dict:  # every kernel lookup lands here too
            self._sleep()
            try:
                st = os.lstat(self._real(path))
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno) from None
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino")
            attrs = {k: getattr(st, k) for k in keys}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def readdir(self, path: str, fh: int):
            self._sleep()
            return [".", "..", *os.listdir(self._real(path))]

        def open(self, path: str, flags: int) -> int:
            self._sleep()
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise mfusepy.FuseOSError(errno.EROFS)
            return os.open(self._real(path), os.O_RDONLY)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            self._sleep()
            return os.pread(fh, size, offset)

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        def statfs(self, path: str) -> dict:
            st = os.statvfs(self.root)
            keys = (
                "f_bavail",
                "f_bfree",
                "f_blocks",
                "f_bsize",
                "f_favail",
                "f_ffree",
                "f_files",
                "f_frsize",
                "f_namemax",
            )
            return {k: getattr(st, k) for k in keys}

    return LatencyFS()


def serve(root: str, mountpoint: str, delay_s: float, status_path: str | None = None) -> None:
    """Mount in the foreground until unmounted (fusermount3 -u) or SIGTERM."""
    import mfusepy

    mfusepy.FUSE(
        _operations(root, delay_s, status_path),
        mountpoint,
        foreground=True,
        ro=True,
        fsname=f"latencyfs-{int(delay_s * 1000)}ms",
        max_threads=MAX_THREADS,
        max_idle_threads=MAX_THREADS,
    )


def unmount(mountpoint: str | Path) -> None:
    """Unmount, lazily if busy; never raises (cleanup must not hide the original error)."""
    for cmd in (
        ["fusermount3", "-u", str(mountpoint)],
        ["fusermount3", "-uz", str(mountpoint)],
        ["umount", "-l", str(mountpoint)],
    ):
        if not os.path.ismount(mountpoint):
            return
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


@contextlib.contextmanager
def mounted(
    source: str | Path,
    mountpoint: str | Path,
    *,
    delay_s: float,
    timeout_s: float = 20.0,
    impl: str = "auto",
) -> Iterator[dict]:
    """Serve ``source`` at ``mountpoint`` in a child process for the ``with`` body.

    Yields ``{"parallel_dirops": bool, "impl": "c" | "python"}``. ``impl="auto"`` takes the C
    build when it can be compiled. The child is a separate process (the Python build's threads
    must not compete for the benchmark's GIL); it is unmounted and reaped even on error.
    """
    Path(mountpoint).mkdir(parents=True, exist_ok=True)
    status = Path(mountpoint).parent / f".{Path(mountpoint).name}.latencyfs-status"
    status.unlink(missing_ok=True)
    cmd, built = _command(str(source), str(mountpoint), delay_s, str(status), impl)
    child = subprocess.Popen(
        cmd, cwd=Path(__file__).resolve().parent.parent, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not os.path.ismount(mountpoint):
            if child.poll() is not None:
                raise RuntimeError(
                    f"latencyfs exited ({child.returncode}) before mounting {mountpoint}: "
                    f"{child.stderr.read()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"latencyfs did not mount {mountpoint} within {timeout_s} s")
            time.sleep(0.05)
        os.listdir(mountpoint)  # the first request triggers init, which writes the status
        granted = status.is_file() and "parallel_dirops=1" in status.read_text()
        info = {"parallel_dirops": granted, "impl": built}
        yield info
    finally:
        unmount(mountpoint)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        status.unlink(missing_ok=True)


def _check(source: str, delay_ms: float, files: int, impl: str) -> int:
    """Quick self-test: is parallel lookup on, and do 32 threads beat one by the expected factor?"""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(os.listdir(source))[:files]
    mnt = tempfile.mkdtemp(prefix="latencyfs-check-")
    try:
        with mounted(source, mnt, delay_s=delay_ms / 1000, impl=impl) as info:
            print(f"{info['impl']} build; parallel_dirops granted: {info['parallel_dirops']}")
            for threads in (1, 8, 32):
                time.sleep(1.2)  # let the kernel's 1 s entry/attr cache expire
                start = time.perf_counter()

                def read(name: str) -> None:
                    with open(os.path.join(mnt, name), "rb") as fh:
                        while fh.read(1 << 20):
                            pass

                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(read, names))
                rate = len(names) / (time.perf_counter() - start)
                print(f"{threads:>2} threads: {rate:7.0f} files/s at {delay_ms} ms")
    finally:
        shutil.rmtree(mnt, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mountpoint", nargs="?")
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--status", help="write 'parallel_dirops=0|1' here once mounted")
    parser.add_argument(
        "--impl", choices=IMPLS, default="auto", help="C or Python build (auto: C if it builds)"
    )
    parser.add_argument(
        "--check",
        type=int,
        metavar="FILES",
        help="self-test on FILES files of SOURCE instead of serving",
    )
    args = parser.parse_args(argv)
    if args.check:
        return _check(args.source, args.delay_ms, args.check, args.impl)
    if not args.mountpoint:
        parser.error("MOUNTPOINT is required unless --check")
    if args.impl != "python":
        delay_s, status = args.delay_ms / 1000, args.status or "-"
        cmd, built = _command(args.source, args.mountpoint, delay_s, status, args.impl)
        if built == "c":
            os.execv(cmd[0], cmd)  # the C build in this process's place
    # No Python SIGTERM handler: libfuse installs its own (exit the loop) only while the
    # handler is SIG_DFL, and a Python handler would never run while fuse_main blocks in C.
    serve(args.source, args.mountpoint, args.delay_ms / 1000, args.status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
