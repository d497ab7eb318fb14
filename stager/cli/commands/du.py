"""``stager du``: flags and the call into :mod:`stager.node` (space used on this node)."""

from __future__ import annotations

import argparse

from stager.cache.paths import resolve_cache_limit
from stager.cli.commands.ls import add_listing_arguments, emit, inventory
from stager.node.render import DU_COLUMNS, du_rows

HELP = "space used on this node by each job's scratch directory and by the cache, and in total"
EPILOG = """A shard hard-linked from the cache is counted under each job that has it and once in \
the total.
Each line starts with the node's name: srun --ntasks-per-node=1 stager du covers an allocation.
environment: STAGER_SCRATCH_ROOT (default /scratch), STAGER_CACHE, STAGER_CACHE_LIMIT."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_listing_arguments(parser, "count")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    rows = du_rows(inventory(args), limit_bytes=resolve_cache_limit(None))
    emit(rows, args, DU_COLUMNS)
    return 0
