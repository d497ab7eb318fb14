"""``stager index``: flags and the call into :mod:`stager.shards.build`."""

from __future__ import annotations

import argparse
import sys

from stager.cli.argtypes import count, default_of, positive_count, seconds
from stager.errors import UsageError
from stager.leftout import left_out_warnings, skipped_message
from stager.shards.build import IndexOptions
from stager.storage.hashing import ALGORITHMS, DEFAULT_ALGORITHM

HELP = "scan a dataset once and write its manifest (size, hash and sample count per shard)"

EPILOG = """The manifest goes beside the dataset by default (stager-manifest.json up to 10,000 \
shards,
stager-manifest.parquet beyond), where stage-in finds it and verifies every shard it copies.
exit codes: 0 ok; 2 usage error; 3 source error (shards unreadable after retries);
4 a shard is a corrupt or truncated tar. No manifest is written unless every shard was read."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "source",
        nargs="?",
        metavar="SRC",
        help="directory, glob, brace pattern or single shard; any fsspec URL (s3://bucket/prefix/)",
    )
    parser.add_argument(
        "--from-list",
        metavar="FILE",
        help="read shard URLs from FILE (one per line, # comments; - reads standard input)",
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="where to write the manifest, .json or .parquet, local or a URL (default: beside the "
        "dataset)",
    )
    parser.add_argument(
        "--hash",
        choices=ALGORITHMS,
        default=DEFAULT_ALGORITHM,
        help=f"content hash (default {DEFAULT_ALGORITHM}: fast; sha256 for strict sites)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_count,
        default=default_of(IndexOptions, "jobs"),
        metavar="N",
        help=f"shards read in parallel (default {default_of(IndexOptions, 'jobs')})",
    )
    parser.add_argument(
        "--retries",
        type=count,
        default=3,
        metavar="N",
        help="retries per shard on transient errors (default 3)",
    )
    parser.add_argument(
        "--retry-delay",
        type=seconds,
        default=0.5,
        metavar="S",
        help="first retry delay in s; doubles (default 0.5)",
    )
    parser.add_argument(
        "--no-count", action="store_true", help="do not count samples (hash and size only)"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stager.shards.build import index_source
    from stager.storage.retry import RetryPolicy
    from stager.storage.sources import resolve_source
    from stager.units import human_bytes

    if args.jobs < 1:
        raise UsageError("--jobs must be at least 1")
    if args.retries < 0:
        raise UsageError("--retries must be >= 0")
    source = resolve_source(args.source, from_list=args.from_list, jobs=args.jobs)
    warnings = [
        *map(skipped_message, source.skipped),
        *left_out_warnings(source.left_out, "indexed"),
    ]
    for warning in warnings:
        print(f"index: warning: {warning}", file=sys.stderr, flush=True)
    options = IndexOptions(
        algorithm=args.hash,
        jobs=args.jobs,
        retry=RetryPolicy(attempts=args.retries + 1, base_delay_s=args.retry_delay),
        count_samples=not args.no_count,
    )

    def on_retry(attempt: int, exc: BaseException) -> None:
        print(
            f"index: retry {attempt} after: {' '.join(str(exc).split())}",
            file=sys.stderr,
            flush=True,
        )

    manifest, where, seconds = index_source(source, args.out, options, on_retry=on_retry)
    samples = manifest.total_samples
    print(
        f"index: {len(manifest.entries)} shards, {human_bytes(manifest.total_bytes)}, "
        f"{'?' if samples is None else samples} samples in {seconds:.2f} s -> {where}",
        file=sys.stderr,
        flush=True,
    )
    return 0
