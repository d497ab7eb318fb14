"""Process plumbing for the test cluster: free ports, liveness, namespaces, kill by PID.

Everything here identifies processes by PID and checks what they are (command line, mount
namespace) before signalling, so a reused PID or another engineer's cluster is never hit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "ROOT_PREFIX",
    "alive",
    "cmdline",
    "free_ports",
    "kill_all",
    "mnt_ns",
    "pids_in_namespaces",
    "reap_stale",
]

#: Every cluster root is a fresh ``tempfile.mkdtemp(prefix=ROOT_PREFIX)``.
ROOT_PREFIX = "stager-slurm-"


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports free right now (the kernel picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def alive(pid: int) -> bool:
    """True for a running process; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def pids_in_namespaces(namespaces: Iterable[str]) -> list[int]:
    wanted = set(namespaces)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and mnt_ns(int(entry.name)) in wanted:
            out.append(int(entry.name))
    return out


def kill_all(pids: Iterable[int], *, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL what is left (zombies count as gone)."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def reap_stale(base: Path | None = None) -> list[Path]:
    """Kill daemons of earlier test clusters whose owning process is gone; remove their roots."""
    base = Path(base or tempfile.gettempdir())
    reaped = []
    for root in base.glob(f"{ROOT_PREFIX}*"):
        owner_file = root / "owner.json"
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue
        if alive(int(owner.get("pid", 0))):
            continue  # another live test run (maybe another engineer's): not ours to touch
        marker = str(root)
        victims = [int(p) for p in owner.get("pids", []) if marker in cmdline(int(p))]
        victims += pids_in_namespaces(owner.get("mnt_ns", []))
        kill_all(sorted(set(victims)), grace_s=3)
        shutil.rmtree(root, ignore_errors=True)
        reaped.append(root)
    return reaped
