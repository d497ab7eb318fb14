"""Training beside staging: ``stage-in --background`` against staging first, under ``--bw-limit``.

Run: ``.venv/bin/python -m benchmarks.bench_background [--shards 32] [--bw-limit 16]``
``[--json out.json]``

One job on one node, two ways, each from an empty scratch:

* **staging first** (the baseline): ``stage-in SRC --bw-limit B`` runs to its end (``T``
  seconds), then the loader reads two epochs;
* **--background**: ``stage-in --background SRC --bw-limit B`` is started, the job waits for
  its plan (what ``stage-in --wait-staged 0`` does; here in-process, which saves an interpreter
  start), and the loader reads two epochs while the copier runs.

Both start their clock when the copier process is launched. The source is given as
``countfile:///...``: an fsspec protocol registered in this process and, through a
``sitecustomize.py``, in the copier's, that appends the size of every read to a log per process
(the trick of tests/test_fanout_procs.py), so the bytes each side read from the source are
counted by the filesystem, not by stager. An audit hook also logs every file this process or its
loader workers open under the source directory (a local read that bypassed fsspec).

Two scenarios: ``--step-s 0`` (no compute: the loader reads as fast as shards land, which shows
the time to first batch and epoch 0's rate against the staging rate), and a compute time per
batch chosen so that an epoch of compute takes about ``T`` (then staging plus two epochs takes
``T + 2E`` staging first, and ``max(T, E) + E = 2E`` in the background). Source and scratch
are on tmpfs; the bandwidth cap is the copier's own ``--bw-limit``, so the disk plays no part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from stager.shards.build import build_manifest, write_manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sources import resolve_source

from .common import compile_bytecode, report, scratch_root

BIN = Path(sys.executable).parent

COUNTING = """
import os
import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

_LOG = os.environ.get("BENCH_COUNT_LOG", "")


def _count(n):
    if n and _LOG:
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\\n" % n)
        finally:
            os.close(fd)


class CountingOpener(LocalFileOpener):
    def read(self, *args, **kwargs):
        data = super().read(*args, **kwargs)
        _count(len(data))
        return data

    def readinto(self, buf):
        n = self.f.readinto(buf)
        _count(n or 0)
        return n


class CountingFileSystem(LocalFileSystem):
    protocol = ("countfile",)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)


fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)
"""


def _counted(log: Path) -> int:
    return sum(int(n) for n in log.read_text().split()) if log.exists() else 0


def _watch_opens(root: str, log: Path) -> None:
    """Log every open under ``root`` by this process and its forked workers (audit hook)."""

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if path.startswith(root):
                with open(log, "a") as handle:
                    handle.write(path + "\n")

    sys.addaudithook(hook)


def _copier(argv: list[str], work: Path, tag: str) -> subprocess.Popen:
    env = dict(os.environ)
    site = work.parent / "site"  # the sitecustomize registering countfile://
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["BENCH_COUNT_LOG"] = str(work / f"copier-{tag}.log")
    return subprocess.Popen(
        [str(BIN / "stage-in"), *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def run(mode: str, spec: str, work: Path, args: argparse.Namespace, step_s: float) -> dict:
    """One job; returns its times and byte counts."""
    from stager.layout import StagedDataset
    from stager.slurm import SlurmEnv
    from stager.stagein.wait import wait_staged
    from stager_loaders import LoaderOptions, ShardedLoader

    tag = f"{mode}-{step_s:g}"
    work.mkdir(exist_ok=True)
    dest = work / f"scratch-{tag}"
    os.environ["BENCH_COUNT_LOG"] = str(work / f"loader-{tag}.log")
    common = [spec, "--dest", str(dest), "--bw-limit", str(args.bw_limit), "--quiet"]
    common += ["--jitter-max", "0", "--report", str(work / f"report-{tag}.json")]
    started = time.perf_counter()
    if mode == "background":
        copier = _copier(["--background", *common], work, tag)
        wait_staged(
            StagedDataset(dest, "ds"),
            0,
            slurm=SlurmEnv.from_environ({}),
            timeout_s=600,
            log=open(os.devnull, "w"),  # noqa: SIM115 - closed with the process
        )
    else:
        copier = _copier(common, work, tag)
        copier.wait()
    staged_s = time.perf_counter() - started if mode != "background" else None
    loader = ShardedLoader(
        spec,
        batch_size=args.batch_size,
        num_workers=args.workers,
        seed=1,
        options=LoaderOptions(dest=str(dest), rank=0, world_size=1),
    )
    epochs: list[tuple[float, float]] = []
    first_batch_s = None
    for epoch in range(2):
        loader.set_epoch(epoch)
        epoch_started = time.perf_counter()
        for _ in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            if step_s:
                time.sleep(step_s)
        epochs.append((epoch_started - started, time.perf_counter() - started))
    total_s = time.perf_counter() - started
    _, err = copier.communicate(timeout=600)
    if copier.returncode != 0:
        raise RuntimeError(f"{mode}: stage-in exited {copier.returncode}: {err.decode()[-800:]}")
    summary = json.loads((work / f"report-{tag}.json").read_text())
    metrics = loader.metrics.as_dict()
    return {
        "mode": mode,
        "step_s": step_s,
        "staging_s": summary["seconds"] if staged_s is None else staged_s,
        "first_batch_s": first_batch_s,
        "epoch0_s": epochs[0][1] - epochs[0][0],
        "epoch1_s": epochs[1][1] - epochs[1][0],
        "total_s": total_s,
        "samples": int(loader.shard_samples.sum()),
        "loader_source_bytes": _counted(work / f"loader-{tag}.log"),
        "copier_source_bytes": _counted(work / f"copier-{tag}.log"),
        "staging_wait_s": metrics["staging_wait_s"],
        "shards_waited": int(metrics["shards_waited"]),
    }


def _median(runs: list[dict]) -> dict:
    """One row per (mode, compute): the median of each figure over the repeats."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and key != "step_s":
            out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


def to_markdown(rows: list[dict], shard_copy_s: float, dataset_bytes: int) -> str:
    """The table, then per compute setting the ratios the issue asks for."""
    lines = [
        "| compute per batch | mode | staging T (s) | first batch (s) | epoch 0 (s) | "
        "epoch-0 samples/s | epoch 1 (s) | staging + 2 epochs (s) | loader bytes from source | "
        "copier bytes from source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step_s'] * 1000:.0f} ms | {r['mode']} | {r['staging_s']:.2f} | "
            f"{r['first_batch_s']:.2f} | {r['epoch0_s']:.2f} | {r['samples'] / r['epoch0_s']:.0f} "
            f"| {r['epoch1_s']:.2f} | {r['total_s']:.2f} | {int(r['loader_source_bytes'])} | "
            f"{int(r['copier_source_bytes'])} |"
        )
    lines.append("")
    by = {(r["mode"], r["step_s"]): r for r in rows}
    for step_s in sorted({r["step_s"] for r in rows}):
        base, bg = by.get(("staging first", step_s)), by.get(("background", step_s))
        if not base or not bg:
            continue
        staging_rate = base["samples"] / base["staging_s"]
        epoch0_rate = bg["samples"] / bg["epoch0_s"]
        training_s = base["epoch0_s"] + base["epoch1_s"]
        lines.append(
            f"- {step_s * 1000:.0f} ms of compute per batch: first batch after "
            f"{bg['first_batch_s']:.2f} s with --background against {base['first_batch_s']:.2f} s "
            f"staging first ({bg['first_batch_s'] / base['first_batch_s']:.2f}x; the bound is "
            f"2 s + one shard's copy, {2 + shard_copy_s:.2f} s); epoch 0 at {epoch0_rate:.0f} "
            f"samples/s against the staging rate {staging_rate:.0f} samples/s "
            f"({epoch0_rate / staging_rate:.2f}x); staging + 2 epochs {bg['total_s']:.2f} s "
            f"against {base['total_s']:.2f} s ({bg['total_s'] / base['total_s']:.2f}x), where "
            f"max(T, training) = {max(base['staging_s'], training_s):.2f} s and T + training = "
            f"{base['staging_s'] + training_s:.2f} s"
        )
    lines.append(
        f"- dataset {dataset_bytes / 1e6:.1f} MB; one shard's copy at the limit: "
        f"{shard_copy_s:.2f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--samples-per-shard", type=int, default=100)
    parser.add_argument("--image-bytes", type=int, default=40_000)
    parser.add_argument("--bw-limit", type=float, default=16.0, help="MB/s (default 16)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--step-s",
        type=float,
        nargs="*",
        help="compute per batch to simulate (default: 0, and an epoch of compute ~ T)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (median shown)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    compile_bytecode()
    work, where = scratch_root("bench-background-")
    try:
        return _bench(args, work, where)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bench(args: argparse.Namespace, work: Path, where: str) -> int:
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(COUNTING)
    exec(compile(COUNTING, "countfile", "exec"), {})  # the same protocol in this process
    src = work / "src" / "ds"
    spec_ = SyntheticSpec(
        num_shards=args.shards,
        samples_per_shard=args.samples_per_shard,
        image_bytes=args.image_bytes,
        seed=3,
    )
    write_synthetic_dataset(src, spec_)
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    dataset_bytes = sum(p.stat().st_size for p in src.glob("*.tar"))
    shard_copy_s = dataset_bytes / args.shards / (args.bw_limit * 1e6)
    staging_s = dataset_bytes / (args.bw_limit * 1e6)
    batches = -(-args.shards * args.samples_per_shard // args.batch_size)
    steps = args.step_s if args.step_s is not None else [0.0, round(staging_s / batches, 4)]
    _watch_opens(str(src), work / "opened.log")
    spec = f"countfile://{src}"
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for step_s in steps:
            for mode in ("staging first", "background"):  # alternating, A B A B
                runs.append(run(mode, spec, work / f"r{repeat}", args, step_s))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    rows = [
        _median([r for r in runs if (r["mode"], r["step_s"]) == key])
        for key in dict.fromkeys((r["mode"], r["step_s"]) for r in runs)
    ]
    opened = (work / "opened.log").read_text() if (work / "opened.log").exists() else ""
    print(f"{where}; {args.shards} shards, bw-limit {args.bw_limit} MB/s, {args.workers} workers")
    print(f"files the loader opened under the source: {len(opened.splitlines())}")
    report(rows, lambda r: to_markdown(r, shard_copy_s, dataset_bytes), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
