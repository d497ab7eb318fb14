"""``stager doctor``: measure where a job's data path is slow, and say what to change.

Three probes, each short and bounded in bytes and seconds:

* the source: aggregate read MB/s over a sample of shards with several streams, and the time to
  first byte of a file (the per-file latency that NFS metadata round trips add);
* the scratch: write MB/s of a temporary file (fsync'd), and the free space;
* the loader: samples/s of ``ShardedLoader`` over the staged copy for a few worker counts,
  nothing decoded (decode cost is the model's business, not the filesystem's).

The verdict compares them: what limits samples/s, how many workers (and so
``--cpus-per-task``) reach the plateau, and after how many epochs staging pays for itself.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stager.stagein.progress import human_bytes
from stager.stagein.streams import DEFAULT_JOBS
from stager.storage.dest import ensure_private_dir
from stager.storage.sources import SourceSet

__all__ = [
    "SourceProbe",
    "ScratchProbe",
    "LoaderProbe",
    "Diagnosis",
    "diagnose",
    "probe_source",
    "probe_scratch",
]

_BLOCK = 4 << 20


@dataclass(frozen=True)
class SourceProbe:
    files: int
    bytes_read: int
    seconds: float
    streams: int
    first_byte_ms: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ScratchProbe:
    path: str
    bytes_written: int
    seconds: float
    free_bytes: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e6 if self.seconds > 0 else 0.0


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
            f"  source   {s.mb_per_s:8.1f} MB/s with {s.streams} streams; first byte {s.first_byte_ms:.1f} ms/file "
            f"({s.files} files, {human_bytes(s.bytes_read)} read)",
            f"  scratch  {d.mb_per_s:8.1f} MB/s write (fsync'd) at {d.path}; {human_bytes(d.free_bytes)} free",
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


def _sample(shards: Sequence, max_files: int) -> list:
    if len(shards) <= max_files:
        return list(shards)
    step = len(shards) / max_files
    return [shards[int(i * step)] for i in range(max_files)]


def probe_source(
    source: SourceSet, *, max_files: int = 16, max_bytes: int = 256 << 20, streams: int = 8
) -> SourceProbe:
    """Read a spread-out sample of shards (bounded by count and bytes) and time it."""
    picked, total = [], 0
    for shard in _sample(source.shards, max_files):
        if picked and total + (shard.size or 0) > max_bytes:
            break
        picked.append(shard)
        total += shard.size or 0
    first_bytes: list[float] = []

    def read(shard) -> int:
        started = time.perf_counter()
        nbytes = 0
        with source.fs.open(shard.path, "rb", block_size=_BLOCK) as handle:
            while block := handle.read(_BLOCK):
                if not nbytes:
                    first_bytes.append(time.perf_counter() - started)
                nbytes += len(block)
        return nbytes

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(streams, len(picked)))) as pool:
        nbytes = sum(pool.map(read, picked))
    seconds = time.perf_counter() - started
    return SourceProbe(
        files=len(picked),
        bytes_read=nbytes,
        seconds=seconds,
        streams=max(1, min(streams, len(picked))),
        first_byte_ms=1000 * statistics.median(first_bytes) if first_bytes else 0.0,
    )


def probe_scratch(dest_root: Path, *, nbytes: int = 128 << 20) -> ScratchProbe:
    """Write (and fsync) a temporary file of ``nbytes`` under ``dest_root``, then delete it."""
    root = ensure_private_dir(dest_root)
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    nbytes = max(_BLOCK, min(nbytes, free // 4))
    path = root / f".stager-doctor-{os.getpid()}.partial"
    block = os.urandom(_BLOCK)
    started = time.perf_counter()
    try:
        with open(path, "wb", buffering=0) as handle:
            written = 0
            while written < nbytes:
                written += handle.write(block)
            os.fsync(handle.fileno())
        seconds = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    return ScratchProbe(path=str(root), bytes_written=written, seconds=seconds, free_bytes=free)


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
            f"the source costs {diag.source.first_byte_ms:.0f} ms per file before any byte arrives: "
            f"keep stage-in's adaptive streams (up to --jobs, default {DEFAULT_JOBS}) and prefer fewer, larger shards "
            "(100 MB-1 GB)"
        )
    if loader is not None and loader.samples_per_s:
        best_w = loader.best_workers
        best_rate = loader.samples_per_s[best_w] if best_w is not None else 0.0
        loader_mbps = best_rate * loader.bytes_per_sample / 1e6
        out.append(
            f"num_workers={best_w} reaches {best_rate:,.0f} samples/s from scratch; "
            f"ask for --cpus-per-task={best_w + 1} per rank (workers + the training process), more if you decode images"
        )
        shared_mbps = src / max(1, ranks_per_node)
        if loader_mbps > 0 and shared_mbps < loader_mbps:
            out.append(
                f"bottleneck without staging: the source ({src:.0f} MB/s, ~{shared_mbps:.0f} MB/s per rank when "
                f"{ranks_per_node} ranks share it) is slower than the loader ({loader_mbps:.0f} MB/s): stage-in pays off"
            )
        else:
            out.append(
                "the loader, not the storage, limits samples/s: compare it with your training step's samples/s"
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
                f"staging takes ~{stage_s:.1f} s and saves no read time per epoch here: stage only to spare the shared filesystem"
            )
    if diag.scratch.free_bytes < diag.dataset_bytes:
        out.append(
            f"scratch has {human_bytes(diag.scratch.free_bytes)} free for a {human_bytes(diag.dataset_bytes)} dataset: "
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
