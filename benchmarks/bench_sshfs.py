"""Benchmark: stage-in vs cp -r, rsync -a and rclone from an sshfs mount behind a capped link.

Run (root): ``.venv/bin/python -m benchmarks.bench_sshfs [--size small|large] [--rate-mbit 80]
[--repeats N]``.

The file server is an sftp-only ``sshd`` in its own network namespace, reached over a veth pair
with private addresses (10.231.N.0/30) that this script creates; ``tc qdisc ... tbf`` on the
server's end caps what it sends. The host mounts the source with ``sshfs`` (one SSH connection,
sshfs's default) and each tool copies from that mount to a tmpfs, so the link is the
bottleneck. Figures: MB/s, that as a fraction of the cap, and the ratio to the best baseline
(cp, rsync, rclone) measured in the same run; tools alternate within each repeat and the median
of the repeats is reported. Goal from the issue: >= 0.9 of the cap and >= the best baseline.

Everything is torn down afterwards, even on error or SIGTERM: sshfs unmounted, sshd killed, the
veth and the namespace deleted. Traffic goes only to addresses inside our own namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .bench_latency import make_dataset, tmpfs
from .bench_stage_in import run_tool, target_for, tool_commands
from .common import compile_bytecode, in_workdir, raise_on_sigterm, report
from .latencyfs import unmount

# (label, files, approximate bytes per file); about 25 MB each so a run takes ~3 s at 80 mbit
SIZES = {
    "small": [("100 x 256 KB", 100, 256 << 10), ("2 x 12 MB", 2, 12 << 20)],
    "large": [("400 x 256 KB", 400, 256 << 10), ("4 x 64 MB", 4, 64 << 20)],
}
RCLONE_TRANSFERS = 8


@dataclass(frozen=True)
class FileServer:
    netns: str
    host_if: str
    server_if: str
    host_addr: str
    server_addr: str


def _sh(*argv: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ["nsenter", f"--net=/run/netns/{netns}"] if netns else []
    done = subprocess.run([*prefix, *argv], check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-1000:]}"
        )
    return done


def _wait_port(addr: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd did not listen on {addr}:{port} within {timeout_s} s"
                ) from None
            time.sleep(0.1)


@contextlib.contextmanager
def file_server(
    workdir: Path, export_dir: Path, rate_mbit: float
) -> Iterator[tuple[FileServer, Path]]:
    """Start the namespace, veth, tbf cap and sshd; yield the server and the sshfs mountpoint.

    Each resource registers its teardown as soon as it exists (ExitStack), so a failure half-way
    removes exactly what was created, in reverse order.
    """
    tag = os.getpid() % 250 + 1
    server = FileServer(
        netns=f"stgbench{os.getpid()}",
        host_if=f"stbh{os.getpid() % 100000}",
        server_if=f"stbs{os.getpid() % 100000}",
        host_addr=f"10.231.{tag}.1",
        server_addr=f"10.231.{tag}.2",
    )
    keys = workdir / "ssh"
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        _sh("ip", "netns", "add", server.netns)
        stack.callback(_sh, "ip", "netns", "del", server.netns, check=False)
        _sh("ip", "link", "add", server.host_if, "type", "veth", "peer", "name", server.server_if)
        stack.callback(_sh, "ip", "link", "del", server.host_if, check=False)
        _sh("ip", "link", "set", server.server_if, "netns", server.netns)
        _sh("ip", "addr", "add", f"{server.host_addr}/30", "dev", server.host_if)
        _sh("ip", "link", "set", server.host_if, "up")
        _sh("ip", "link", "set", "lo", "up", netns=server.netns)
        _sh(
            "ip",
            "addr",
            "add",
            f"{server.server_addr}/30",
            "dev",
            server.server_if,
            netns=server.netns,
        )
        _sh("ip", "link", "set", server.server_if, "up", netns=server.netns)
        # The cap is on what the server sends: file data flows server -> host.
        _sh(
            "tc",
            "qdisc",
            "add",
            "dev",
            server.server_if,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit:g}mbit",
            "burst",
            "64kb",
            "latency",
            "50ms",
            netns=server.netns,
        )

        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host_key"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "client_key"))
        shutil.copyfile(keys / "client_key.pub", keys / "authorized_keys")
        config = keys / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {server.server_addr}",
                    "Port 22",
                    f"HostKey {keys / 'host_key'}",
                    f"PidFile {keys / 'sshd.pid'}",
                    f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "Subsystem sftp internal-sftp",
                    "ForceCommand internal-sftp",
                    "AllowTcpForwarding no",
                    "X11Forwarding no",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        sshd = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{server.netns}",
                "/usr/sbin/sshd",
                "-D",
                "-e",
                "-f",
                str(config),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(keys / "sshd.log", "wb"),  # noqa: SIM115 - closed with the process
        )
        stack.callback(_stop, sshd)
        _wait_port(server.server_addr, 22, timeout_s=15)

        mnt = workdir / "mnt"
        mnt.mkdir(parents=True, exist_ok=True)
        _sh(
            "sshfs",
            f"root@{server.server_addr}:{export_dir}",
            str(mnt),
            "-o",
            f"IdentityFile={keys / 'client_key'},StrictHostKeyChecking=no,"
            "UserKnownHostsFile=/dev/null,"
            "BatchMode=yes,ro",
        )
        stack.callback(unmount, mnt)
        yield server, mnt


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(size: str, repeats: int, rate_mbit: float, workdir: Path, log=sys.stderr) -> list[dict]:
    rows: list[dict] = []
    cap_bytes_s = rate_mbit * 1e6 / 8
    biggest = max(files * nbytes for _, files, nbytes in SIZES[size])
    tools = tool_commands(
        transfers=RCLONE_TRANSFERS,
        stage_in_flags=("--quiet", "--report", "DST/.stage-in-report.json"),
    )
    with tmpfs(workdir, 3 * biggest + (256 << 20)):
        export = workdir / "export"
        export.mkdir(parents=True)
        with file_server(workdir, export, rate_mbit) as (_, mnt):
            for index, (label, files, file_bytes) in enumerate(SIZES[size]):
                # A fresh directory per dataset: sshfs caches listings for 20 s.
                nbytes, _ = make_dataset(export / str(index) / "ds", files, file_bytes)
                src = mnt / str(index) / "ds"
                times: dict[str, list[float]] = {name: [] for name in tools}
                peaks: list[int] = []
                copy_s: list[float] = []
                for rep in range(repeats):
                    for name, cmd in tools.items():
                        dst = workdir / "dst"
                        shutil.rmtree(dst, ignore_errors=True)
                        dst.mkdir()
                        times[name].append(
                            run_tool(cmd, src, target_for(name, dst, "ds"), timeout_s=900)
                        )
                        report = dst / ".stage-in-report.json"
                        if report.is_file():
                            payload = json.loads(report.read_text())
                            peaks.append(int(payload.get("streams", 0)))
                            copy_s.append(float(payload.get("seconds", 0.0)))
                        copied = sum(1 for _ in (dst / "ds").rglob("*.tar"))
                        if copied != files:
                            raise RuntimeError(
                                f"{name} copied {copied} of {files} files over sshfs"
                            )
                        print(
                            f"  sshfs {label} rep {rep + 1}: {name} {times[name][-1]:.2f} s",
                            file=log,
                            flush=True,
                        )
                rows.extend(
                    _rows(
                        label, files, nbytes, times, peaks, copy_s, cap_bytes_s, rate_mbit, repeats
                    )
                )
    return rows


def _rows(
    label, files, nbytes, times, peaks, copy_s, cap_bytes_s, rate_mbit, repeats
) -> list[dict]:
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    baselines = {name: s for name, s in medians.items() if not name.startswith("stage-in")}
    best_name = min(baselines, key=baselines.get)
    rows = []
    for name, median in medians.items():
        rows.append(
            {
                "bench": "sshfs",
                "dataset": label,
                "tool": name,
                "files": files,
                "bytes": nbytes,
                "cap_mbit": rate_mbit,
                "median_s": round(median, 3),
                "mb_per_s": round(nbytes / median / 1e6, 2),
                "fraction_of_cap": round(nbytes / median / cap_bytes_s, 2),
                "ratio_vs_cp": round(medians["cp -r"] / median, 2),
                "ratio_vs_best_baseline": round(baselines[best_name] / median, 2),
                "best_baseline": best_name,
                "repeats": repeats,
                "condition": "tmpfs export and destination; sshfs over a tbf-capped veth",
                **(
                    _stage_in_extras(peaks, copy_s, nbytes, cap_bytes_s)
                    if name == "stage-in" and peaks
                    else {}
                ),
            }
        )
    return rows


def _stage_in_extras(
    peaks: list[int], copy_s: list[float], nbytes: int, cap_bytes_s: float
) -> dict:
    """Peak streams, and the copy phase alone (stage-in's report; excludes startup and listing)."""
    phase_s = statistics.median(copy_s)
    return {
        "streams_peak": max(peaks),
        "copy_phase_s": round(phase_s, 3),
        "copy_phase_fraction_of_cap": round(nbytes / phase_s / cap_bytes_s, 2) if phase_s else None,
    }


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| dataset | cap | tool | MB/s | fraction of cap | ratio vs best baseline | ratio vs cp "
        "-r | stage-in copy phase: fraction of cap, peak streams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['cap_mbit']:g} mbit | {r['tool']} | {r['mb_per_s']} | "
            f"{r['fraction_of_cap']} | "
            f"{r['ratio_vs_best_baseline']}x ({r['best_baseline']}) | {r['ratio_vs_cp']}x | "
            + (
                f"{r['copy_phase_fraction_of_cap']}, {r['streams_peak']} |"
                if "streams_peak" in r
                else " |"
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rate-mbit", type=float, default=80.0, help="tbf cap on the server's link (default 80)"
    )
    parser.add_argument(
        "--workdir", type=Path, help="where to mount the tmpfs (default: a new temp dir)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_sshfs needs root (network namespaces, tc, mounts)", file=sys.stderr)
        return 2
    raise_on_sigterm()
    compile_bytecode()
    rows = in_workdir(
        args.workdir, "bench-sshfs-", lambda w: bench(args.size, args.repeats, args.rate_mbit, w)
    )
    report(rows, to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
