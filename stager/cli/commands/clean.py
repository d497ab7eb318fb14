"""``stager clean``: flags and the calls into :mod:`stager.node.clean` and the cache's sweep."""

from __future__ import annotations

import argparse
import os
import sys
import time

from stager.cache.paths import resolve_cache_dir
from stager.cache.store import ShardCache
from stager.cache.sweep import sweep
from stager.cli.argtypes import duration
from stager.cli.commands.ls import add_node_arguments, scratch_of
from stager.errors import DestinationError, StagerError, UsageError, one_line
from stager.node.clean import choose_job_dirs, remove_tree
from stager.node.inventory import is_job_id, take_inventory
from stager.node.jobs import JobStates, query_job_states
from stager.slurm import SlurmEnv
from stager.units import human_bytes, human_duration

HELP = "remove ended jobs' scratch directories on this node (or, with --cache, unused cache data)"
EPILOG = """Never removes another user's data, a directory whose stager lock is held, or the data \
of a job that squeue lists as not ended (pending, running, completing...). A job may remove its \
own scratch at its end with --job $SLURM_JOB_ID (the templates do, after stage-out). When Slurm \
cannot be asked, nothing is removed unless --older-than says what has been unused long enough.
--cache: evict every cached dataset no stage-in is using and no running job staged, then files \
no dataset names (what a killed stage-in left).
exit codes: 0 done (kept directories are listed with the reason); 2 nothing removed because \
Slurm cannot be asked, or --job names a running job; 5 a directory could not be removed."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_node_arguments(parser)
    add = parser.add_argument
    add(
        "--older-than",
        type=duration,
        metavar="AGE",
        help="only what has not changed (or, in the cache, been used) for AGE: 90s, 30m, 12h, 2d",
    )
    add("--job", metavar="ID", help="only this job's scratch directory")
    add(
        "--cache",
        nargs="?",
        const="",
        metavar="DIR",
        help="clean the cache (DIR, default $STAGER_CACHE) instead of jobs' scratch directories",
    )
    add("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    parser.set_defaults(handler=run)


def _say(text: str) -> None:
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.cache is not None:
        return _clean_cache(args)
    if args.job is not None and not is_job_id(args.job):
        raise UsageError(f"--job {args.job!r} is not a Slurm job id (digits only)")
    slurm = SlurmEnv.from_environ()
    own_job = slurm.job_id if slurm.in_slurm else None
    root, there = scratch_of(args)
    if not there:
        return 0  # (said: nothing to clean)
    # A job cleaning its own scratch knows it runs, and needs no answer from Slurm.
    if own_job is not None and args.job == own_job:
        states = JobStates(frozenset({own_job}))
    else:
        states = query_job_states()
    if not states.known and args.older_than is None:
        raise UsageError(
            f"cannot tell which jobs still run ({states.error}): nothing removed. Run it where "
            "squeue works, or pass --older-than AGE to remove only what has not changed for AGE"
        )
    found = take_inventory(
        node=slurm.node_name, scratch=root, cache=None, states=states, job=args.job
    )
    choices = choose_job_dirs(
        found.jobs,
        states=states,
        uid=os.geteuid(),
        now=time.time(),
        older_than_s=args.older_than,
        only_job=args.job,
        own_job=own_job,
    )
    node = slurm.node_name
    if args.job is not None and not choices:
        _say(f"[{node}] nothing to clean: no scratch directory {root / args.job}")
        return 0
    failed = 0
    freed = 0
    for choice in choices:
        job = choice.job
        if not choice.remove:
            _say(f"[{node}] kept {job.path}: {choice.reason}")
            continue
        verb = "would remove" if args.dry_run else "removed"
        if not args.dry_run:
            try:
                remove_tree(job.path)
            except DestinationError as exc:
                print(f"[{node}] {one_line(exc)}", file=sys.stderr, flush=True)
                failed += 1
                continue
        freed += job.size_bytes
        _say(f"[{node}] {verb} {job.path} ({human_bytes(job.size_bytes)}): {choice.reason}")
    if args.job is not None and not choices[0].remove:
        raise UsageError(f"{choices[0].job.path} not removed: {choices[0].reason}")
    if failed:
        raise DestinationError(f"{failed} scratch director(ies) could not be removed (see above)")
    return 0


def _clean_cache(args: argparse.Namespace) -> int:
    if args.job is not None:
        raise UsageError("--cache cleans the cache, not a job's scratch: drop --job or --cache")
    root = resolve_cache_dir(args.cache or None)
    if root is None:
        raise UsageError("no cache to clean: pass --cache DIR or set STAGER_CACHE")
    node = SlurmEnv.from_environ().node_name
    if not (root / "CACHEDIR.TAG").is_file():
        _say(f"[{node}] nothing to clean: no cache at {root}")
        return 0
    try:
        cache = ShardCache.open(root, limit_bytes=0)
        swept = sweep(
            cache, states=query_job_states(), older_than_s=args.older_than, dry_run=args.dry_run
        )
    except OSError as exc:
        if isinstance(exc, StagerError):
            raise
        raise DestinationError(
            f"cannot clean the cache at {root}: {exc.strerror or exc}"
            + (f" ({exc.filename})" if exc.filename else "")
            + "; check its filesystem (read-only?) and its permissions"
        ) from exc
    verb = "would evict" if args.dry_run else "evicted"
    now = time.time()
    for record in swept.evicted:
        age = human_duration(now - record.last_used)
        _say(
            f"[{node}] {verb} {record.name or record.spec!r} from the cache "
            f"({human_bytes(record.total_bytes)}, last used {age} ago)"
        )
    for record, reason in swept.kept:
        _say(f"[{node}] kept {record.name or record.spec!r} in the cache: {reason}")
    if swept.objects_removed or swept.bytes_removed:
        verb = "would remove" if args.dry_run else "removed"
        _say(
            f"[{node}] {verb} {swept.objects_removed} cached shard(s) that no kept dataset "
            f"names ({human_bytes(swept.bytes_removed)} with their records)"
        )
    return 0
