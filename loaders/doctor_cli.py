"""``stager doctor``: flags and the call into :func:`stager_loaders.doctor.diagnose`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from stager.cli.argtypes import positive_count, positive_seconds, size
from stager.errors import DestinationError, UsageError
from stager.layout import StagedDataset
from stager.slurm import SlurmEnv
from stager.storage.dest import resolve_dest_root
from stager.storage.sources import resolve_source

__all__ = ["add_parser", "configure", "run", "default_workers"]

HELP = "measure the source, scratch and the loader (with your decode); say what limits the job"


def default_workers(cpus: int) -> list[int]:
    """0, 1, 2, 4, ... up to the CPUs left beside the training process."""
    counts, n = [0, 1], 2
    while n <= max(1, cpus - 1):
        counts.append(n)
        n *= 2
    return counts


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP))


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "source",
        metavar="SOURCE",
        help="the dataset as given to stage-in (directory, pattern, URL)",
    )
    add("--dest", metavar="DIR", help="scratch root to probe (default: as stage-in resolves it)")
    add("--name", help="dataset name under the destination (default: as stage-in names it)")
    add(
        "--decode",
        metavar="SPEC",
        help="decode each sample as the training script will (e.g. rgb8, torchrgb, pil); "
        "default: raw bytes",
    )
    add(
        "--map",
        metavar="MODULE:FUNCTION",
        help="a function the training script maps over each decoded sample, timed with it "
        "(imported from the current directory, as python -m would)",
    )
    add("--to-tuple", metavar="A,B", help="members to keep, as the loader's to_tuple")
    add(
        "--workers",
        metavar="LIST",
        help="loader worker counts to try (default 0, 1, 2, 4, ... up to the CPUs usable - 1)",
    )
    add(
        "--target",
        type=float,
        metavar="SAMPLES_PER_S",
        help="samples/s one rank's training step consumes: advice on the workers that needs",
    )
    add("--epochs", type=positive_count, default=10, help="epochs you plan (staging pay-off)")
    add(
        "--nodes",
        type=positive_count,
        metavar="N",
        help="nodes of the job (default: $SLURM_JOB_NUM_NODES, else 1)",
    )
    add(
        "--max-source",
        type=size,
        default=256 << 20,
        metavar="SIZE",
        help="bytes to read from the source (default 268M)",
    )
    add(
        "--scratch-bytes",
        type=size,
        default=128 << 20,
        metavar="SIZE",
        help="bytes to write to scratch (default 134M)",
    )
    add(
        "--loader-seconds",
        type=positive_seconds,
        default=3.0,
        metavar="S",
        help="seconds per worker count (default 3)",
    )
    add("--no-loader", action="store_true", help="skip the loader probe")
    add("--json", metavar="PATH", help="also write the measurements as JSON")
    parser.set_defaults(handler=run)


def _map_function(spec: str | None) -> Callable[[Any], Any] | None:
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's module beside them
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(
            f"--map {spec!r}: cannot import it ({exc}); write MODULE:FUNCTION"
        ) from exc


def run(args: argparse.Namespace) -> int:
    from .doctor import diagnose, usable_cpus

    if args.workers:
        try:
            workers = sorted({int(w) for w in args.workers.split(",") if w.strip()})
        except ValueError as exc:
            raise UsageError(f"--workers takes integers, not {args.workers!r}") from exc
        if not workers or workers[0] < 0:
            raise UsageError(f"--workers takes integers >= 0, not {args.workers!r}")
    else:
        workers = default_workers(usable_cpus())
    if args.json is not None and (not args.json.strip() or os.path.isdir(args.json)):
        raise UsageError(f"--json takes a file path, not {args.json!r}")
    if args.target is not None and not args.target > 0:
        raise UsageError("--target must be a positive number of samples/s")
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
        nodes=args.nodes or slurm.num_nodes,
        target=args.target,
        max_source_bytes=args.max_source,
        scratch_bytes=args.scratch_bytes,
        loader_seconds=args.loader_seconds,
        decode=args.decode,
        map_fn=_map_function(args.map),
        to_tuple=args.to_tuple.split(",") if args.to_tuple else None,
        dest=str(dest_root),
        name=args.name,
    )
    print(diag.render())
    if args.json:
        try:
            with open(args.json, "w") as handle:
                json.dump(diag.to_json(), handle, indent=1)
        except OSError as exc:  # (checked at the start; the place may have changed since)
            raise DestinationError(f"cannot write {args.json}: {exc.strerror or exc}") from exc
    return 0
