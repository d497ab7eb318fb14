"""``stager doctor``: is my job data-bound? Measure the source, scratch and the loader as the
training script will use it, and say what to change.

Three probes, each short and bounded in bytes and seconds:

* the source: aggregate read MB/s over a sample of shards with several streams, and the time to
  first byte of a file (the per-file latency that NFS metadata round trips add);
* the scratch: write MB/s of a temporary file (fsync'd), and the free space;
* the loader: samples/s of ``ShardedLoader`` for a few worker counts, with the user's own
  ``decode`` and ``map`` (``--decode``/``--map``): decoding JPEGs costs ~50x reading them, so
  raw reads alone say nothing about how many workers a job needs.

The verdict follows from those figures alone: the fewest workers near the best rate, the CPUs
per rank that takes, the workers a target rate needs, and one statement about staging (it pays
off after k epochs, or it only spares the shared filesystem). The command is the loader's (it
needs torch); ``stager doctor`` finds it through the ``stager.commands`` entry point, so the
torch-free ``stager`` package never imports this one (the CLI half is :mod:`.doctor_cli`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import UsageError, one_line
from stager.shards import tarnative
from stager.slurm import usable_cpus
from stager.stagein.streams import DEFAULT_JOBS
from stager.storage import bytepath, statmany
from stager.storage.probe import ScratchProbe, SourceProbe, probe_scratch, probe_source
from stager.storage.sources import SourceSet
from stager.units import human_bytes

__all__ = ["LoaderProbe", "Diagnosis", "diagnose", "probe_loader", "usable_cpus"]


@dataclass(frozen=True)
class LoaderProbe:
    samples_per_s: dict[int, float]  # workers -> samples/s
    bytes_per_sample: float  # what a sample is in the batch (decoded)
    decode: str = "none (raw bytes)"  # what each sample went through
    num_samples: int = 0  # in the dataset, for the bytes a sample costs to read
    error: str = ""

    @property
    def best_workers(self) -> int | None:
        """The fewest workers within 10% of the best rate (more only cost CPUs and memory)."""
        if not self.samples_per_s:
            return None
        best = max(self.samples_per_s.values())
        return min(w for w, rate in self.samples_per_s.items() if rate >= 0.9 * best)

    @property
    def per_worker_rate(self) -> float:
        """Samples/s one process delivers (the main process alone, or one worker)."""
        rates = [self.samples_per_s.get(w, 0.0) for w in (0, 1)]
        return max(rates) if any(rates) else 0.0

    @property
    def ms_per_sample(self) -> float:
        """CPU cost of one sample through read + decode + map, in one process."""
        rate = self.per_worker_rate
        return 1000.0 / rate if rate > 0 else 0.0


@dataclass
class Diagnosis:
    node: str
    dataset_bytes: int
    source: SourceProbe
    scratch: ScratchProbe
    loader: LoaderProbe | None
    cpus: int
    #: whether stage-in indexes shards with the compiled tar walk (False: the numpy scanner,
    #: where the install found no C compiler)
    compiled_tar_walk: bool = True
    #: whether stage-in's size probe stats walked shards in runs without the interpreter lock
    #: (False: ``os.stat`` one at a time, where the install found no C compiler)
    compiled_stat_runs: bool = True
    #: whether stage-in copies local shards with the compiled byte pump (False: in Python,
    #: handing the interpreter lock over at every read, hash and write)
    compiled_byte_pump: bool = True
    verdict: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"]["mb_per_s"] = round(self.source.mb_per_s, 2)
        out["scratch"]["mb_per_s"] = round(self.scratch.mb_per_s, 2)
        if self.loader is not None:
            out["loader"]["ms_per_sample"] = round(self.loader.ms_per_sample, 4)
            out["loader"]["best_workers"] = self.loader.best_workers
        return out

    def render(self) -> str:
        s, d = self.source, self.scratch
        lines = [
            f"stager doctor on {self.node} ({self.cpus} CPUs usable): dataset "
            f"{human_bytes(self.dataset_bytes)}",
            f"  source   {s.mb_per_s:8.1f} MB/s with {s.streams} streams; first byte "
            f"{s.first_byte_ms:.1f} ms/file ({s.files} files, {human_bytes(s.bytes_read)} read)",
            f"  scratch  {d.mb_per_s:8.1f} MB/s write (fsync'd) at {d.path}; "
            f"{human_bytes(d.free_bytes)} free",
        ]
        loader = self.loader
        if loader is not None and loader.samples_per_s:
            rates = ", ".join(
                f"{w} worker{'s' if w != 1 else ''} {r:,.0f}/s"
                for w, r in sorted(loader.samples_per_s.items())
            )
            lines.append(
                f"  loader   decode {loader.decode}: {rates} "
                f"(~{human_bytes(loader.bytes_per_sample)}/sample decoded, "
                f"{loader.ms_per_sample:.2f} ms per sample in one process)"
            )
        elif loader is not None:
            lines.append(f"  loader   not measured: {loader.error}")
        walk = "compiled tar walk" if self.compiled_tar_walk else "numpy scanner (no compiled walk)"
        lines.append(f"  index    stage-in indexes shards with the {walk}")
        if not self.compiled_stat_runs:
            lines.append("  sizes    stage-in sizes walked shards with os.stat (no compiled runs)")
        if not self.compiled_byte_pump:
            lines.append("  copies   stage-in copies local shards in Python (no compiled pump)")
        lines.append("verdict:")
        lines.extend(f"  - {v}" for v in self.verdict)
        return "\n".join(lines)


class _Once(logging.Filter):
    """Lets each distinct message through once: one loader per worker count must not repeat
    the same warning (e.g. "no staged copy") for every count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


@contextmanager
def _warn_once() -> Iterator[None]:
    logger, once = logging.getLogger("stager_loaders"), _Once()
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


def _batch_bytes(batch: Any) -> tuple[int, int]:
    """(samples, payload bytes) of a batch, whatever shape the user's collate gave it."""
    import torch

    from .metrics import batch_length

    def size_of(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return int(value.numel() * value.element_size())
        if isinstance(value, (bytes, bytearray, memoryview)):
            return len(value)
        if hasattr(value, "nbytes"):  # numpy arrays
            return int(value.nbytes)
        if isinstance(value, (list, tuple)):
            return sum(size_of(v) for v in value)
        if isinstance(value, dict):
            return sum(size_of(v) for k, v in value.items() if not str(k).startswith("__"))
        return 0

    return batch_length(batch), size_of(batch)


def probe_loader(
    dataset: str,
    workers: Sequence[int],
    *,
    seconds: float = 3.0,
    batch_size: int = 64,
    decode: str | None = None,
    map_fn: Callable[[Any], Any] | None = None,
    to_tuple: Sequence[str] | None = None,
    dest: str | None = None,
    name: str | None = None,
) -> LoaderProbe:
    """samples/s of ShardedLoader for each worker count, through the user's decode and map."""
    from . import LoaderOptions, ShardedLoader

    rates: dict[int, float] = {}
    bytes_per_sample, num_samples = 0.0, 0
    label = decode or "none (raw bytes)"
    if map_fn is not None:
        label += f" + map {getattr(map_fn, '__qualname__', 'function')}"
    with _warn_once():
        for count in workers:
            loader = ShardedLoader(
                dataset,
                batch_size=batch_size,
                num_workers=count,
                shuffle=True,
                decode=decode,
                map=map_fn,
                to_tuple=tuple(to_tuple) if to_tuple else None,
                # a world of one: probed on one rank of a job, it must not wait in the loader's
                # collectives for ranks that build no loader
                options=LoaderOptions(
                    persistent_workers=count > 0, dest=dest, name=name, rank=0, world_size=1
                ),
            )
            num_samples = int(loader.shard_samples.sum())
            samples, nbytes, epoch = 0, 0, 0
            started = None  # the clock starts at the first batch: worker start is not throughput
            while started is None or time.perf_counter() - started < seconds:
                loader.set_epoch(epoch)
                with _options_misfit(decode, to_tuple):
                    for batch in loader:
                        if started is None:
                            started = time.perf_counter()
                            continue
                        got, size = _batch_bytes(batch)
                        samples, nbytes = samples + got, nbytes + size
                        if time.perf_counter() - started > seconds:
                            break
                epoch += 1
            elapsed = time.perf_counter() - started
            rates[count] = samples / elapsed if elapsed > 0 else 0.0
            bytes_per_sample = nbytes / samples if samples else 0.0
            del loader
    return LoaderProbe(rates, bytes_per_sample, label, num_samples)


@contextmanager
def _options_misfit(decode: str | None, to_tuple: Sequence[str] | None) -> Iterator[None]:
    """The samples do not fit --decode or --to-tuple (a member named that no sample has, bytes
    that are no image): one line, exit 2, where it was a traceback and exit 1 ("a bug")."""
    try:
        yield
    except (KeyError, ValueError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        asked = f"--decode {decode or 'none'}, --to-tuple {','.join(to_tuple or []) or 'none'}"
        raise UsageError(
            f"the loader cannot read these samples with {asked}: {one_line(reason)}"
        ) from exc


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _workers_advice(loader: LoaderProbe, cpus: int, target: float | None) -> list[str]:
    best = loader.best_workers
    if best is None:
        return []
    rate = loader.samples_per_s[best]
    out = [
        f"{_plural(best, 'worker')} reach{'es' if best == 1 else ''} {rate:,.0f} samples/s "
        f"here ({loader.ms_per_sample:.2f} ms per sample in one process); more measured no "
        f"faster on these {_plural(cpus, 'CPU')}: num_workers={best}, "
        f"--cpus-per-task={best + 1} per rank (the workers plus the training process)"
    ]
    enough = [w for w, measured in loader.samples_per_s.items() if target and measured >= target]
    if enough:  # (measured: num_workers=1 was advised where 0 workers reached the rate)
        fewest = min(enough)
        out.append(
            f"to feed {target:,.0f} samples/s per rank: num_workers={fewest} is enough "
            f"(measured {loader.samples_per_s[fewest]:,.0f}/s), --cpus-per-task={fewest + 1}"
        )
    elif target and loader.per_worker_rate > 0:
        need = max(1, math.ceil(target / loader.per_worker_rate))
        out.append(
            f"to feed {target:,.0f} samples/s per rank: num_workers={need}, "
            f"--cpus-per-task={need + 1} (each worker delivers ~{loader.per_worker_rate:,.0f}/s)"
        )
    elif not target:
        out.append(
            "pass --target SAMPLES_PER_S (what one rank's training step consumes) for the "
            "workers that rate needs"
        )
    return out


def _staging_advice(diag: Diagnosis, epochs: int, nodes: int, loader_mbps: float) -> str:
    """One statement about staging, from the read rates alone."""
    src = diag.source.mb_per_s * 1e6
    node_bytes = diag.dataset_bytes / max(1, nodes)  # what a node's ranks read per epoch
    stage_s = diag.dataset_bytes / src  # every node copies the whole dataset (--subset all)
    from_source_s = node_bytes / src
    local_rate = max(diag.scratch.mb_per_s * 1e6, loader_mbps * 1e6, 1.0)
    from_scratch_s = node_bytes / local_rate
    saved = from_source_s - from_scratch_s
    if saved <= 0 or (loader_mbps and diag.source.mb_per_s >= loader_mbps):
        return (
            f"the source ({diag.source.mb_per_s:,.0f} MB/s) keeps up with the loader here: "
            "staging does not speed an epoch, it spares the shared filesystem the reads of "
            "every rank of every node (stage-in ~"
            f"{stage_s:.1f} s)"
        )
    payoff = max(1, math.ceil(stage_s / saved))
    return (
        f"staging takes ~{stage_s:.1f} s once and saves ~{saved:.1f} s of source reads per "
        f"epoch per node: it pays off after {_plural(payoff, 'epoch')} (you plan {epochs})"
    )


def _verdict(diag: Diagnosis, *, epochs: int, nodes: int, target: float | None) -> list[str]:
    out = []
    if diag.source.first_byte_ms > 5:
        out.append(
            f"the source costs {diag.source.first_byte_ms:.0f} ms per file before any byte "
            f"arrives: keep stage-in's adaptive streams (up to --jobs, default {DEFAULT_JOBS}) "
            "and prefer fewer, larger shards (100 MB-1 GB)"
        )
    loader_mbps = 0.0  # what the loader would pull from storage, in shard bytes
    loader = diag.loader
    if loader is not None and loader.samples_per_s:
        out.extend(_workers_advice(loader, diag.cpus, target))
        best = loader.best_workers or 0
        if loader.num_samples:
            stored = diag.dataset_bytes / loader.num_samples
            loader_mbps = loader.samples_per_s[best] * stored / 1e6
    if diag.source.mb_per_s > 0 and diag.dataset_bytes:
        out.append(_staging_advice(diag, epochs, nodes, loader_mbps))
    if not diag.compiled_tar_walk:
        out.append(
            "stage-in indexes shards with the numpy scanner: the compiled tar walk was not built "
            "(no C compiler when the package was installed, or STAGER_NATIVE_TAR=0); on shards "
            "of ~1 KB samples indexing then costs ~4x the CPU: reinstall with a C compiler "
            "(docs/tuning.md)"
        )
    if not diag.compiled_stat_runs:
        out.append(
            "stage-in sizes walked shards with one os.stat per shard: the compiled stat runs "
            "were not built (no C compiler at install, or STAGER_NATIVE_STAT=0); on many small "
            "shards from a fast source the copies then wait on the stats: reinstall with a C "
            "compiler, or give the dataset a manifest (stager index)"
        )
    if not diag.compiled_byte_pump:
        out.append(
            "stage-in copies local shards in Python: the compiled byte pump was not built (no C "
            "compiler at install, or STAGER_NATIVE_COPY=0); on many small shards from a fast "
            "source its copy threads then take turns on the interpreter lock instead of the "
            "cores: reinstall with a C compiler"
        )
    if diag.scratch.free_bytes < diag.dataset_bytes:
        out.append(
            f"scratch has {human_bytes(diag.scratch.free_bytes)} free for a "
            f"{human_bytes(diag.dataset_bytes)} dataset: use stage-in --subset node, or a larger "
            "--dest"
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
    nodes: int = 1,
    target: float | None = None,
    max_source_bytes: int = 256 << 20,
    scratch_bytes: int = 128 << 20,
    loader_seconds: float = 3.0,
    decode: str | None = None,
    map_fn: Callable[[Any], Any] | None = None,
    to_tuple: Sequence[str] | None = None,
    dest: str | None = None,
    name: str | None = None,
) -> Diagnosis:
    """Run the three probes and write the verdict."""
    loader = None
    if loader_dataset:
        loader = probe_loader(
            loader_dataset,
            workers,
            seconds=loader_seconds,
            decode=decode,
            map_fn=map_fn,
            to_tuple=to_tuple,
            dest=dest,
            name=name,
        )
    diag = Diagnosis(
        node=node,
        dataset_bytes=source.total_bytes,
        source=probe_source(source, max_bytes=max_source_bytes),
        scratch=probe_scratch(dest_root, nbytes=scratch_bytes),
        loader=loader,
        cpus=usable_cpus(),
        compiled_tar_walk=tarnative.available(),
        compiled_stat_runs=statmany.available(),
        compiled_byte_pump=bytepath.available(),
    )
    diag.verdict = _verdict(diag, epochs=epochs, nodes=nodes, target=target)
    return diag
