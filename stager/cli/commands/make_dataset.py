"""``stager make-dataset``: write the deterministic synthetic dataset used by the demo."""

from __future__ import annotations

import argparse
import sys

from stager.cli.argtypes import count, positive_count

HELP = "write a small synthetic WebDataset (for the demo, tests and benchmarks)"


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="DIR", help="directory to write shards into")
    parser.add_argument(
        "--shards", type=positive_count, default=8, help="number of shards (default 8)"
    )
    parser.add_argument(
        "--samples", type=positive_count, default=100, help="samples per shard (default 100)"
    )
    parser.add_argument(
        "--sample-bytes",
        type=positive_count,
        default=1024,
        help="approximate image bytes per sample",
    )
    parser.add_argument("--seed", type=count, default=0, help="content seed (default 0)")
    parser.add_argument("--uneven", action="store_true", help="vary shard sizes around --samples")
    parser.add_argument("--compress", action="store_true", help="write .tar.gz shards")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    spec = SyntheticSpec(
        num_shards=args.shards,
        samples_per_shard=args.samples,
        image_bytes=args.sample_bytes,
        seed=args.seed,
        uneven=args.uneven,
        compress=args.compress,
    )
    paths = write_synthetic_dataset(args.out, spec)
    print(
        f"wrote {len(paths)} shards, {sum(spec.shard_sizes())} samples to {args.out}",
        file=sys.stderr,
    )
    return 0
