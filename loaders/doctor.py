"""``stager doctor``: is my job data-bound? Measure source, scratch and the loader; say what to
change.

Three probes, each short and bounded in bytes and seconds:

* the source: aggregate read MB/s over a sample of shards with several streams, and the time to
  first byte of a file (the per-file latency that NFS metadata round trips add);
* the scratch: write MB/s of a temporary file (fsync'd), and the free space;
* the loader: samples/s of ``ShardedLoader`` over the staged copy for a few worker counts.

The verdict compares them: what limits samples/s, how many workers (and so
``--cpus-per-task``) reach the plateau, and whether staging pays for itself.

The command is the loader's (it needs torch); ``stager doctor`` finds it through the
``stager.commands`` entry point, so the torch-free ``stager`` package never imports this one.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stager.errors import UsageError
from stager.layout import StagedDataset
from stager.slurm import SlurmEnv
from stager.stagein.streams import DEFAULT_JOBS
from stager.storage.dest import resolve_dest_root
from stager.storage.probe import ScratchProbe, SourceProbe, probe_scratch, probe_source
from stager.storage.sources import SourceSet, resolve_source
from stager.units import human_bytes

__all__ = ["LoaderProbe", "Diagnosis", "diagnose", "probe_loader", "add_parser", "configure"]


@dataclass(frozen=True)
class LoaderProbe:
    samples_per_s: dict[int, float]  # workers -> samples/s
    bytes_per_sample: float
    error: str = ""

    @property
    def best_workers(self) -> int | None:
        """The fewest workers within 10% of the best rate (more only cost CPUs and memory)."""
        if not self.samples_per_s:
            return None
        best = max(self.samples_per_s.values())
        return min(w for w, rate in self.samples_per_s.items() if rate >= 0.9 * best)


@dataclass
class Diagnosis:
    node: str
    dataset_bytes: int
    source: SourceProbe
    scratch: ScratchProbe
    loader: LoaderProbe | None
    verdict: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out["source"]["mb_per_s"] = round(self.source.mb_per_s, 2)
        out["scratch"]["mb_per_s"] = round(self.scratch.mb_per_s, 2)
        return out

    def render(self) -> str:
        s, d = self.source, self.scratch
        lines = [
            f"stager doctor on {self.node}: dataset {human_bytes(self.dataset_bytes)}",
            f"  source   {s.mb_per_s:8.1f} MB/s with {s.streams} streams; first byte "
            f"{s.first_byte_ms:.1f} ms/file "
            f"({s.files} files, {human_bytes(s.bytes_read)} read)",
            f"  scratch  {d.mb_per_s:8.1f} MB/s write (fsync'd) at {d.path}; "
            f"{human_bytes(d.free_bytes)} free",
        ]
        if self.loader is not None and self.loader.samples_per_s:
            rates = ", ".join(
                f"{w} workers {r:,.0f}/s" for w, r in sorted(self.loader.samples_per_s.items())
            )
            lines.append(
                f"  loader   {rates} (~{human_bytes(self.loader.bytes_per_sample)}/sample)"
            )
        elif self.loader is not None:
            lines.append(f"  loader   not measured: {self.loader.error}")
        lines.append("verdict:")
        lines.extend(f"  - {v}" for v in self.verdict)
        return "\n".join(lines)


def probe_loader(
    dataset: str, workers: Sequence[int], *, seconds: float = 3.0, batch_size: int = 64
) -> LoaderProbe:
    """samples/s of ShardedLoader for each worker count, nothing decoded."""
    try:
        from stager_loaders import ShardedLoader
    except ImportError as exc:
        return LoaderProbe({}, 0.0, error=f"loaders not importable ({exc})")
    rates: dict[int, float] = {}
    bytes_per_sample = 0.0
    for count in workers:
        loader = ShardedLoader(
            dataset,
            batch_size=batch_size,
            num_workers=count,
            shuffle=True,
            decode=None,
            to_tuple=None,
            persistent_workers=count > 0,
        )
        samples, nbytes, epoch = 0, 0, 0
        started = None  # the clock starts at the first batch: worker start-up is not throughput
        while started is None or time.perf_counter() - started < seconds:
            loader.set_epoch(epoch)
            for batch in loader:
                if started is None:
                    started = time.perf_counter()
                    continue
                keys = batch["__key__"]
                samples += len(keys)
                for name, value in batch.items():
                    if not name.startswith("__"):
                        nbytes += (
                            sum(len(v) for v in value)
                            if isinstance(value, list)
                            else int(value.numel())
                        )
                if time.perf_counter() - started > seconds:
                    break
            epoch += 1
        elapsed = time.perf_counter() - started
        rates[count] = samples / elapsed if elapsed > 0 else 0.0
        bytes_per_sample = nbytes / samples if samples else 0.0
        del loader
    return LoaderProbe(rates, bytes_per_sample)


def _verdict(diag: Diagnosis, epochs: int, ranks_per_node: int) -> list[str]:
    out = []
    src, scratch, loader = diag.source.mb_per_s, diag.scratch.mb_per_s, diag.loader
    if diag.source.first_byte_ms > 5:
        out.append(
            f"the source costs {diag.source.first_byte_ms:.0f} ms per file before any byte "
            "arrives: "
            f"keep stage-in's adaptive streams (up to --jobs, default {DEFAULT_JOBS}) and prefer "
            "fewer, larger shards "
            "(100 MB-1 GB)"
        )
    if loader is not None and loader.samples_per_s:
        best_w = loader.best_workers
        best_rate = loader.samples_per_s[best_w] if best_w is not None else 0.0
        loader_mbps = best_rate * loader.bytes_per_sample / 1e6
        out.append(
            f"num_workers={best_w} reaches {best_rate:,.0f} samples/s from scratch; "
            f"ask for --cpus-per-task={best_w + 1} per rank (workers + the training process), "
            "more if you decode images"
        )
        shared_mbps = src / max(1, ranks_per_node)
        if loader_mbps > 0 and shared_mbps < loader_mbps:
            out.append(
                f"bottleneck without staging: the source ({src:.0f} MB/s, ~{shared_mbps:.0f} MB/s "
                "per rank when "
                f"{ranks_per_node} ranks share it) is slower than the loader ({loader_mbps:.0f} "
                "MB/s): stage-in pays off"
            )
        else:
            out.append(
                "the loader, not the storage, limits samples/s: compare it with your training "
                "step's samples/s"
            )
    if src > 0 and diag.dataset_bytes:
        stage_s = diag.dataset_bytes / (src * 1e6)
        local_mbps = max(scratch, 1e-9)
        per_epoch_src = diag.dataset_bytes / (src * 1e6 / max(1, ranks_per_node))
        per_epoch_local = diag.dataset_bytes / (local_mbps * 1e6)
        saved = per_epoch_src - per_epoch_local
        if saved > 0:
            payoff = max(1, int(stage_s // saved) + 1)
            out.append(
                f"staging takes ~{stage_s:.1f} s once and saves ~{saved:.1f} s of reads per epoch: "
                f"pays off after {payoff} epoch(s) (you plan {epochs})"
            )
        else:
            out.append(
                f"staging takes ~{stage_s:.1f} s and saves no read time per epoch here: stage "
                "only to spare the shared filesystem"
            )
    if diag.scratch.free_bytes < diag.dataset_bytes:
        out.append(
            f"scratch has {human_bytes(diag.scratch.free_bytes)} free for a "
            f"{human_bytes(diag.dataset_bytes)} dataset: "
            "use stage-in --subset node, or a larger --dest"
        )
    return out


def diagnose(
    source: SourceSet,
    dest_root: Path,
    *,
    node: str,
    workers: Sequence[int] = (0, 1, 2),
    loader_dataset: str | None = None,
    epochs: int = 10,
    ranks_per_node: int = 1,
    max_source_bytes: int = 256 << 20,
    scratch_bytes: int = 128 << 20,
    loader_seconds: float = 3.0,
) -> Diagnosis:
    """Run the three probes and write the verdict."""
    diag = Diagnosis(
        node=node,
        dataset_bytes=source.total_bytes,
        source=probe_source(source, max_bytes=max_source_bytes),
        scratch=probe_scratch(dest_root, nbytes=scratch_bytes),
        loader=probe_loader(loader_dataset, workers, seconds=loader_seconds)
        if loader_dataset
        else None,
    )
    diag.verdict = _verdict(diag, epochs, ranks_per_node)
    return diag


HELP = "measure source read, scratch write and loader speed, and say what limits the job"


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="the dataset as given to stage-in (directory, pattern, URL)",
    )
    parser.add_argument(
        "--dest", metavar="DIR", help="scratch root to probe (default: as stage-in resolves it)"
    )
    parser.add_argument(
        "--name", help="dataset name under the destination (default: source basename)"
    )
    parser.add_argument(
        "--workers",
        default="0,1,2",
        metavar="LIST",
        help="loader worker counts to try (default 0,1,2)",
    )
    parser.add_argument(
        "--epochs", type=int, default=10, help="epochs you plan, for the staging pay-off estimate"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        metavar="N",
        help="ranks sharing the source per node",
    )
    parser.add_argument(
        "--max-source-mb", type=int, default=256, metavar="MB", help="bytes to read from the source"
    )
    parser.add_argument(
        "--scratch-mb", type=int, default=128, metavar="MB", help="bytes to write to scratch"
    )
    parser.add_argument(
        "--loader-seconds", type=float, default=3.0, metavar="S", help="seconds per worker count"
    )
    parser.add_argument("--no-loader", action="store_true", help="skip the loader probe")
    parser.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError as exc:
        raise UsageError(
            f"--workers must be a comma-separated list of integers, not {args.workers!r}"
        ) from exc
    slurm = SlurmEnv.from_environ()
    source = resolve_source(args.source, name=args.name)
    dest_root = resolve_dest_root(args.dest, slurm=slurm)
    staged = StagedDataset(dest_root, args.name or source.name).dir
    loader_dataset = None if args.no_loader else (str(staged) if staged.is_dir() else args.source)
    diag = diagnose(
        source,
        dest_root,
        node=slurm.node_name,
        workers=workers,
        loader_dataset=loader_dataset,
        epochs=args.epochs,
        ranks_per_node=args.ranks_per_node,
        max_source_bytes=args.max_source_mb << 20,
        scratch_bytes=args.scratch_mb << 20,
        loader_seconds=args.loader_seconds,
    )
    print(diag.render())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(diag.to_json(), handle, indent=1)
    return 0
