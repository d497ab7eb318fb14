"""Shared-filesystem bytes read by a multi-node job: naive copy vs stage-in --subset/--fanout.

Run: ``.venv/bin/python -m benchmarks.bench_subset_bytes [--nodes 2 4] [--size small|large]``
``[--no-fanout]``

Every simulated node is a separate ``stage-in`` process (launched together, as ``srun
--ntasks-per-node=1`` would) with its own ``--dest`` directory and the job layout in its
environment (``SLURM_JOB_ID``, ``SLURM_NODEID``, ``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_NODELIST``,
``SLURMD_NODENAME``). Bytes read from the source are each node's ``--report`` JSON
``bytes_read_source``, summed over nodes and divided by the dataset's bytes (the source shards'
sizes). Rows:

* naive: every node runs ``cp -r SOURCE DEST``; its bytes are the ``rchar`` of the shell that ran
  and reaped ``cp`` (``/proc/PID/io`` counts reaped children; ~15 KB of that is shared libraries);
* ``--subset all``: every node stages every shard (what a replicated job needs without fan-out);
* ``--subset node``: each node stages only its share (``stager.plan.nodes.select_node_shards``);
* ``--subset all --fanout``: replicated, but each shard is read from the source by one node and
  broadcast to the others over torch.distributed (gloo); here the nodes rendezvous on loopback
  (``--fanout-host 127.0.0.1``), so it counts bytes only. Its time over a capped shared link is
  ``benchmarks/bench_fanout.py``'s subject (network namespaces, ``tc tbf``).

Bytes do not depend on the storage, so source and destinations are on a tmpfs (``/dev/shm``) to
keep the run short. The synthetic shards are uneven (1/2 to 3/2 of the mean), so ``--subset node``
also shows how even the byte-balanced partition is (the largest node's source reads over
dataset bytes / nodes: 1.000 is a perfect split). "peer bytes" are what ``--fanout`` nodes
received from each other (``bytes_received_peers``), which cross the interconnect, not the
shared filesystem. Each configuration runs once: bytes are
deterministic, and wall times are shown for context only (2 shared cores; stage-in processes
import their own Python, fan-out processes import torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .common import report, scratch_root

BIN = Path(sys.executable).parent
SIZES = {  # (shards, samples per shard, bytes per sample image)
    "small": (48, 40, 20_000),  # ~40 MB
    "large": (400, 100, 50_000),  # ~2 GB
}
MODES = (
    "naive cp -r",
    "stage-in --subset all",
    "stage-in --subset node",
    "stage-in --subset all --fanout",
)


def node_env(job_id: str, node_id: int, num_nodes: int) -> dict[str, str]:
    """The environment srun gives task 0 of node ``node_id`` (one task per node)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k != "STAGER_DEST"}
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_NODEID=str(node_id),
        SLURM_JOB_NUM_NODES=str(num_nodes),
        SLURM_NNODES=str(num_nodes),
        SLURM_JOB_NODELIST=f"node[0-{num_nodes - 1}]" if num_nodes > 1 else "node0",
        SLURMD_NODENAME=f"node{node_id}",
        SLURM_PROCID=str(node_id),
        SLURM_LOCALID="0",
        SLURM_NTASKS=str(num_nodes),
        SLURM_NTASKS_PER_NODE="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    return env


def _dataset_bytes(source: Path) -> int:
    return sum(p.stat().st_size for p in source.glob("*.tar"))


def run_job(mode: str, source: Path, work: Path, num_nodes: int, port: int) -> dict:
    """One simulated job: ``num_nodes`` processes at once; returns bytes and times per node."""
    job_id = f"{os.getpid()}{num_nodes}{MODES.index(mode)}"  # (a number, as Slurm gives it)
    procs: list[tuple[subprocess.Popen, Path]] = []
    started = time.monotonic()
    for node in range(num_nodes):
        dest = work / f"node{node}"
        report = work / f"report{node}.json"
        dest.mkdir(parents=True)
        env = node_env(job_id, node, num_nodes)
        if mode == "naive cp -r":
            # $$ is the shell: after `wait`, its /proc/PID/io includes the reaped cp's reads.
            argv = [
                "sh",
                "-c",
                'cp -r "$1" "$2" && cat /proc/$$/io > "$3"',
                "sh",
                str(source),
                str(dest),
                str(report),
            ]
        else:
            argv = [
                str(BIN / "stage-in"),
                str(source),
                "--dest",
                str(dest),
                "--report",
                str(report),
                "--quiet",
                "--jitter-max",
                "0",
            ]
            argv += ["--subset", "node"] if mode.endswith("node") else ["--subset", "all"]
            if mode.endswith("--fanout"):
                argv += ["--fanout", "--fanout-host", "127.0.0.1", "--fanout-port", str(port)]
        procs.append(
            (
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                ),
                report,
            )
        )
    per_node = []
    for proc, report in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{mode}: a node exited {proc.returncode}: {err.strip()[-800:]}")
        if mode == "naive cp -r":
            io = dict(line.split(": ") for line in report.read_text().splitlines())
            per_node.append({"bytes_read_source": int(io["rchar"]), "bytes_from_peers": 0})
        else:
            doc = json.loads(report.read_text())
            per_node.append(
                {
                    "bytes_read_source": int(doc["bytes_read_source"]),
                    "bytes_from_peers": int(doc.get("bytes_received_peers", 0)),
                }
            )
    wall_s = time.monotonic() - started
    staged = [
        sum(p.stat().st_size for p in (work / f"node{n}").rglob("*.tar")) for n in range(num_nodes)
    ]
    return {"per_node": per_node, "staged_bytes": staged, "wall_s": wall_s}


def bench(
    size: str = "small",
    nodes: tuple[int, ...] = (2, 4),
    fanout: bool = True,
    root: Path | None = None,
) -> list[dict]:
    """Rows: one per (nodes, mode), with source bytes per dataset byte."""
    shards, per_shard, image_bytes = SIZES[size]
    own_root = root is None
    if root is None:
        root, condition = scratch_root("bench-subset-")
    else:
        condition = str(root)
    rows: list[dict] = []
    try:
        spec = SyntheticSpec(
            num_shards=shards,
            samples_per_shard=per_shard,
            image_bytes=image_bytes,
            seed=0,
            uneven=True,
        )
        source = root / "src" / "ds"
        write_synthetic_dataset(source, spec)
        dataset_bytes = _dataset_bytes(source)
        port = 29500 + os.getpid() % 2000
        for num_nodes in nodes:
            for mode in MODES:
                if mode.endswith("--fanout") and not fanout:
                    continue
                work = root / f"job-{num_nodes}-{MODES.index(mode)}"
                port += 1
                try:
                    result = run_job(mode, source, work, num_nodes, port)
                except Exception as exc:  # noqa: BLE001 - one failing mode is a row with its reason
                    rows.append(
                        {"nodes": num_nodes, "mode": mode, "error": f"{type(exc).__name__}: {exc}"}
                    )
                    print(f"nodes={num_nodes} {mode}: FAILED {exc}", file=sys.stderr, flush=True)
                    continue
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                read = sum(n["bytes_read_source"] for n in result["per_node"])
                share = max(n["bytes_read_source"] for n in result["per_node"]) / (
                    dataset_bytes / num_nodes
                )
                rows.append(
                    {
                        "nodes": num_nodes,
                        "mode": mode,
                        "condition": condition,
                        "dataset_bytes": dataset_bytes,
                        "bytes_read_source": read,
                        "source_bytes_per_dataset_byte": read / dataset_bytes,
                        "per_node_source_bytes": [
                            n["bytes_read_source"] for n in result["per_node"]
                        ],
                        "max_node_share": share,
                        "bytes_from_peers": sum(n["bytes_from_peers"] for n in result["per_node"]),
                        "staged_bytes_per_node": result["staged_bytes"],
                        "wall_s": result["wall_s"],
                    }
                )
                print(
                    f"nodes={num_nodes} {mode}: "
                    f"{read / dataset_bytes:.3f} source bytes per dataset byte",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| nodes | mode | source bytes / dataset byte | peer bytes / dataset byte "
        "| largest node's source "
        "reads / (dataset / nodes) | staged per node / dataset | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['nodes']} | {r['mode']} | failed: {r['error'][:120]} | | | | |")
            continue
        staged = [b / r["dataset_bytes"] for b in r["staged_bytes_per_node"]]
        lines.append(
            f"| {r['nodes']} | {r['mode']} | {r['source_bytes_per_dataset_byte']:.3f} | "
            f"{r['bytes_from_peers'] / r['dataset_bytes']:.3f} | {r['max_node_share']:.3f} | "
            f"{min(staged):.3f}-{max(staged):.3f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: 48 uneven shards, ~40 MB (default); large: 400 shards, ~2 GB",
    )
    parser.add_argument(
        "--nodes", type=int, nargs="+", default=[2, 4], help="job sizes to simulate (default 2 4)"
    )
    parser.add_argument(
        "--no-fanout",
        action="store_true",
        help="skip the --fanout rows (they import torch per node)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = bench(args.size, tuple(args.nodes), fanout=not args.no_fanout)
    ok = [r for r in rows if "error" not in r]
    if ok:
        r = ok[0]
        print(
            f"dataset: {r['dataset_bytes'] / 1e6:.1f} MB in {SIZES[args.size][0]} uneven shards; "
            f"condition: {r['condition']}; one run per configuration (bytes are deterministic)"
        )
    report(rows, to_markdown, args.json)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
