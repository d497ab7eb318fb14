"""``stager ls``: flags and the call into :mod:`stager.node` (what is on this node)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stager.cache.paths import resolve_cache_dir
from stager.errors import UsageError
from stager.node.inventory import NodeInventory, take_inventory
from stager.node.jobs import query_job_states
from stager.node.render import LS_COLUMNS, format_table, ls_rows
from stager.slurm import SlurmEnv
from stager.storage.dest import scratch_root

HELP = "list what is staged or cached on this node: per job and dataset, size, age, state"
EPILOG = """Each line starts with the node's name: srun --ntasks-per-node=1 stager ls lists a \
whole allocation.
STATE of a job's directory: running, ended (as squeue says), ? (Slurm could not be asked) or \
in use (a stager lock in it is held); of a cached dataset: in use (a stage-in holds it or a job \
that staged it runs) or idle (the cache may evict it).
environment: STAGER_SCRATCH_ROOT (default /scratch), STAGER_CACHE (the cache)."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``ls``, ``du`` and ``clean`` share: where scratch and the cache are."""
    parser.add_argument(
        "--scratch-root",
        metavar="DIR",
        help="where jobs' scratch directories (DIR/<job id>) are "
        "(default: $STAGER_SCRATCH_ROOT, else /scratch)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_listing_arguments(parser, "list")
    parser.set_defaults(handler=run)


def add_listing_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """The flags ``stager ls`` and ``stager du`` share: where to look and how to print."""
    add_node_arguments(parser)
    parser.add_argument(
        "--cache", metavar="DIR", help=f"the cache to {verb} (default: $STAGER_CACHE)"
    )
    parser.add_argument("--job", metavar="ID", help="only this job's scratch directory")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per line (bytes, seconds)"
    )
    parser.add_argument("--no-header", action="store_true", help="no column titles")


def scratch_of(args: argparse.Namespace) -> tuple[Path, bool]:
    """The scratch root ``args`` name, and whether it is there; one line on stderr where it is
    not (a mistyped ``--scratch-root`` listed nothing, silently, with exit 0). A file there
    is refused."""
    root = scratch_root() if args.scratch_root is None else Path(args.scratch_root)
    if root.is_dir():
        return root, True
    if root.exists():
        raise UsageError(f"scratch root {root} is not a directory; check --scratch-root")
    print(
        f"stager: no scratch root at {root}: nothing is staged there "
        "(--scratch-root, $STAGER_SCRATCH_ROOT)",
        file=sys.stderr,
        flush=True,
    )
    return root, False


def inventory(args: argparse.Namespace) -> NodeInventory:
    """Scan this node as ``args`` say (also used by ``stager du``)."""
    return take_inventory(
        node=SlurmEnv.from_environ().node_name,
        scratch=scratch_of(args)[0],
        cache=resolve_cache_dir(args.cache),
        states=query_job_states(all_users=True),
        job=args.job,
    )


def emit(
    rows: list[dict[str, Any]], args: argparse.Namespace, columns: Sequence[tuple[str, str]]
) -> None:
    """Print ``rows`` as a table, or as JSON lines with ``--json``."""
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        sys.stdout.write(format_table(rows, columns, header=not args.no_header))
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    emit(ls_rows(inventory(args)), args, LS_COLUMNS)
    return 0
