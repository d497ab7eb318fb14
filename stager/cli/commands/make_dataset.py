"""``stager make-dataset``: write the deterministic synthetic dataset used by the demo."""

from __future__ import annotations

import argparse
import errno
import sys

from stager.cli.argtypes import count, path, positive_count
from stager.errors import DestinationError, ScratchFull, UsageError

HELP = "write a small synthetic WebDataset (for the demo, tests and benchmarks)"
#: What a synthetic dataset is for (a demo, a test, a benchmark) never needs more; past it a
#: typo ran out of memory with a traceback.
_MOST_SHARDS, _MOST_SHARD_BYTES = 1_000_000, 1 << 30


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=path, metavar="DIR", help="directory to write shards into")
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
    if args.shards > _MOST_SHARDS or args.samples * args.sample_bytes > _MOST_SHARD_BYTES:
        raise UsageError(
            f"at most {_MOST_SHARDS:,} shards of at most 1 GiB each (--samples x --sample-bytes)"
        )
    try:
        paths = write_synthetic_dataset(args.out, spec)
    except OSError as exc:  # one line naming the place, as stage-in says it
        reason = f"cannot write {exc.filename or args.out}: {exc.strerror or exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ScratchFull(reason, where=str(args.out)) from exc
        raise DestinationError(reason) from exc
    print(
        f"wrote {len(paths)} shards, {sum(spec.shard_sizes())} samples to {args.out}",
        file=sys.stderr,
    )
    return 0
