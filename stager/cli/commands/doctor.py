"""``stager doctor``: is my job data-bound? Measures source, scratch and loader; prints a verdict."""

from __future__ import annotations

import argparse
import json

from stager.errors import UsageError
from stager.slurm import SlurmEnv
from stager.storage.dest import resolve_dest_root
from stager.storage.sources import resolve_source

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
    from stager.cli.doctor import diagnose

    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError as exc:
        raise UsageError(
            f"--workers must be a comma-separated list of integers, not {args.workers!r}"
        ) from exc
    slurm = SlurmEnv.from_environ()
    source = resolve_source(args.source, name=args.name)
    dest_root = resolve_dest_root(args.dest, slurm=slurm)
    staged = dest_root / (args.name or source.name)
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
