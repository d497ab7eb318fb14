"""Benchmark: replicated stage-in with and without ``--fanout`` over a tbf-capped shared link.

Run (root; Linux network namespaces and tc): ``.venv/bin/python -m benchmarks.bench_fanout``
``[--nodes 2 4] [--shards 30] [--rate-mbit 80] [--repeats 1]``.

The testbed, built fresh under unique names and removed at the end:

* one network namespace per simulated node and one for the file server, each with a veth to a
  bridge in a "switch" namespace (private addresses 10.<tag>.0.0/24);
* the server serves the dataset over HTTP (``python -m http.server``, read through fsspec's
  ``http://``) and its veth is capped by ``tc qdisc tbf`` (default 80 mbit, about 10 MB/s):
  the NFS stand-in of LOCAL-CLUSTER.md, a shared link every node's reads cross;
* node-to-node traffic (the fan-out's broadcasts) crosses the bridge uncapped, as a cluster's
  interconnect does; gloo is pinned to the namespace's ``eth0`` (``GLOO_SOCKET_IFNAME``).

HTTP instead of sshfs: the same capped link, without keys, sshd or per-node mount namespaces.
Each configuration runs every node as a ``stage-in`` process inside its namespace, each with
its own destination. Columns: ``wall s`` from launch until the last node exits (Python start,
torch import and group formation included: what a job's prologue sees); ``stage s`` the
slowest node's own stage-in time; ``data s`` the same minus the time spent forming the group
(``fanout_form_s`` in the report: torch import + rendezvous, a fixed cost of a few seconds that
a real dataset of many GB amortises); bytes read from the source and received from peers,
summed from the nodes' reports. Ratios are plain / fan-out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

BIN = Path(sys.executable).parent


class Testbed:
    """Namespaces, bridge, capped server link and an HTTP server; ``close()`` removes all."""

    def __init__(self, num_nodes: int, root: Path, rate_mbit: int):
        self.tag = f"fob{os.getpid() % 10000}"
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.num_nodes, self.root, self.rate_mbit = num_nodes, root, rate_mbit
        self.namespaces: list[str] = []
        self.server: subprocess.Popen | None = None

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def addr(self, name: str) -> str:
        return f"{self.subnet}.{1 if name == 'srv' else 10 + int(name[1:])}"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def nsenter(self, name: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns(name)}"]

    def open(self) -> Testbed:
        switch = self.ns("sw")
        self._ip("netns", "add", switch)
        self.namespaces.append(switch)
        self._ip("-n", switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", switch, "link", "set", "br0", "up")
        for name in ["srv", *(f"n{k}" for k in range(self.num_nodes))]:
            ns = self.ns(name)
            self._ip("netns", "add", ns)
            self.namespaces.append(ns)
            inner, outer = f"{self.tag}i{name}", f"{self.tag}o{name}"
            self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            self._ip("link", "set", inner, "netns", ns)
            self._ip("link", "set", outer, "netns", switch)
            self._ip("-n", ns, "link", "set", inner, "name", "eth0")
            self._ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", switch, "link", "set", outer, "master", "br0")
            self._ip("-n", switch, "link", "set", outer, "up")
        subprocess.run(
            [
                *self.nsenter("srv"),
                "tc",
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                f"{self.rate_mbit}mbit",
                "burst",
                "64kb",
                "latency",
                "50ms",
            ],
            check=True,
            capture_output=True,
        )
        self.server = subprocess.Popen(
            [
                *self.nsenter("srv"),
                sys.executable,
                "-m",
                "http.server",
                "8000",
                "--bind",
                self.addr("srv"),
                "--directory",
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            probe = subprocess.run(
                [
                    *self.nsenter("n0"),
                    sys.executable,
                    "-c",
                    "import urllib.request; "
                    f"urllib.request.urlopen('http://{self.addr('srv')}:8000/', timeout=1)",
                ],
                capture_output=True,
            )
            if probe.returncode == 0:
                return self
            time.sleep(0.2)
        raise RuntimeError("the benchmark's HTTP server did not answer")

    def close(self) -> None:
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def run_config(
    bed: Testbed, num_nodes: int, url: str, work: Path, fanout: bool, run_id: int
) -> dict:
    """Stage the dataset on ``num_nodes`` simulated nodes at once; wall time and source bytes."""
    procs = []
    reports = []
    started = time.monotonic()
    for rank in range(num_nodes):
        dest = work / f"run{run_id}-node{rank}"
        report = work / f"run{run_id}-node{rank}.json"
        reports.append(report)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STAGER_"))}
        env.update(
            SLURM_JOB_ID=f"9{run_id}",  # (a job number: stager refuses other ids)
            SLURM_NODEID=str(rank),
            SLURM_JOB_NUM_NODES=str(num_nodes),
            SLURM_JOB_NODELIST=",".join(f"n{k}" for k in range(num_nodes)),
            SLURMD_NODENAME=f"n{rank}",
            STAGER_FANOUT_HOST=bed.addr("n0"),
            STAGER_FANOUT_PORT="29411",
            GLOO_SOCKET_IFNAME="eth0",
        )
        argv = [
            str(BIN / "stage-in"),
            url,
            "--name",
            "ds",
            "--dest",
            str(dest),
            "--quiet",
            "--jitter-max",
            "0",
            "--no-count",
            "--report",
            str(report),
        ]
        if fanout:
            argv += ["--fanout", "--fanout-timeout", "120"]
        procs.append(
            subprocess.Popen(
                [*bed.nsenter(f"n{rank}"), *argv], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    errors = [p.communicate(timeout=1200)[1] for p in procs]
    wall_s = time.monotonic() - started
    for proc, err in zip(procs, errors, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a node failed ({proc.returncode}):\n{err}")
    payloads = [json.loads(r.read_text()) for r in reports]
    for rank in range(num_nodes):
        shutil.rmtree(work / f"run{run_id}-node{rank}", ignore_errors=True)
    return {
        "wall_s": wall_s,
        "stage_s": max(p["seconds"] for p in payloads),
        "data_s": max(p["seconds"] - p.get("fanout_form_s", 0.0) for p in payloads),
        "source_bytes": sum(p["bytes_read_source"] for p in payloads),
        "peer_bytes": sum(p["bytes_received_peers"] for p in payloads),
        "modes": sorted({p["fanout"] for p in payloads}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shards", type=int, default=30, help="shards of ~2 MB each (default 30)")
    parser.add_argument(
        "--rate-mbit", type=int, default=80, help="tbf cap of the server's link (default 80 mbit)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("nsenter") is None or shutil.which("tc") is None:
        print("bench_fanout needs root, nsenter and tc (network namespaces + tbf)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        root = Path(tmp)
        src = root / "www" / "ds"
        write_synthetic_dataset(
            src,
            SyntheticSpec(
                num_shards=args.shards, samples_per_shard=20, image_bytes=100_000, seed=1
            ),
        )
        total = sum(p.stat().st_size for p in src.glob("*.tar"))
        url = f"http://{{srv}}:8000/ds/train-{{{{000000..{args.shards - 1:06d}}}}}.tar"
        print(
            f"dataset: {args.shards} shards, {total / 1e6:.1f} MB; shared link: tbf "
            f"{args.rate_mbit} mbit "
            f"(~{args.rate_mbit / 8:.0f} MB/s); {os.cpu_count()} cores",
            flush=True,
        )
        print(
            f"{'nodes':>5} {'mode':>7} {'wall s':>7} {'stage s':>8} {'data s':>7} "
            f"{'source MB':>10} {'x dataset':>9} {'peer MB':>8}"
        )
        run_id = 0
        for num_nodes in args.nodes:
            bed = Testbed(num_nodes, root / "www", args.rate_mbit).open()
            try:
                shard_url = url.format(srv=bed.addr("srv"))
                results: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(args.repeats):
                    for fanout in (False, True):
                        run_id += 1
                        result = run_config(bed, num_nodes, shard_url, root, fanout, run_id)
                        results[fanout].append(result)
                        print(
                            f"{num_nodes:>5} {'fanout' if fanout else 'plain':>7} "
                            f"{result['wall_s']:>7.1f} "
                            f"{result['stage_s']:>8.1f} {result['data_s']:>7.1f} "
                            f"{result['source_bytes'] / 1e6:>10.1f} "
                            f"{result['source_bytes'] / total:>9.2f} "
                            f"{result['peer_bytes'] / 1e6:>8.1f}"
                            + (
                                ""
                                if result["modes"] in (["off"], ["on"])
                                else f"  (modes: {result['modes']})"
                            ),
                            flush=True,
                        )
                ratio_wall = min(r["wall_s"] for r in results[False]) / min(
                    r["wall_s"] for r in results[True]
                )
                ratio_data = min(r["data_s"] for r in results[False]) / min(
                    r["data_s"] for r in results[True]
                )
                print(
                    f"{num_nodes:>5} nodes: plain / fan-out = {ratio_wall:.2f}x wall time, "
                    f"{ratio_data:.2f}x data time (after the group formed)",
                    flush=True,
                )
            finally:
                bed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
