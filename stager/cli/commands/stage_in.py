"""``stage-in``: flags and the call into :func:`stager.stagein.run.stage_in` or a variant."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from stager.cache.paths import (
    check_cache_place,
    resolve_cache_dir,
    resolve_cache_limit,
    vet_cache,
)
from stager.cli.argtypes import (
    count,
    default_of,
    mbps,
    path,
    positive_count,
    positive_seconds,
    seconds,
    size,
)
from stager.cli.fanout_flags import add_fanout_arguments, fanout_options_from_args
from stager.cli.places import check_report_place, dataset_dir_of
from stager.cli.staging_flags import (
    add_background_arguments,
    background_dataset,
    background_spec,
    check_background_arguments,
    wait_for_background,
)
from stager.errors import (
    EXIT_CHECKPOINT,
    EXIT_NO_CHECKPOINT,
    EXIT_OK,
    StagerError,
    UsageError,
    exit_codes_text,
    one_line,
)
from stager.gcpause import collection_paused, freezing_after_pauses
from stager.interrupts import sigterm_interrupts
from stager.layout import is_remote_url, source_root
from stager.slurm import SlurmEnv
from stager.stagein.options import PROGRESS_STYLES, SUBSETS, StageInOptions
from stager.stagein.report import StageInReport
from stager.stagein.streamed import stage_in_foreground
from stager.storage.dest import resolve_dest_root
from stager.storage.retry import RetryPolicy
from stager.storage.sources import SourceSet, resolve_source

HELP = "copy dataset shards to node-local scratch (run once per node: srun --ntasks-per-node=1)"


def _d(name: str) -> object:
    return default_of(StageInOptions, name)


_RETRY = RetryPolicy()

EPILOG = f"""exit codes: {exit_codes_text()}.
with --checkpoint: {EXIT_OK} restored (its local path is the only line on stdout); \
{EXIT_NO_CHECKPOINT} no committed checkpoint at DEST yet (start from scratch); \
{EXIT_CHECKPOINT} checkpoints committed but none restorable whole.
sizes take units: 4096, 500M, 10G, 2GiB.
environment: STAGER_DEST (destination root), STAGER_CACHE and STAGER_CACHE_LIMIT (--cache and \
--cache-limit), SLURM_JOB_ID/SLURM_NODEID/... (job layout)."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add(
        "source",
        nargs="?",
        metavar="SOURCE",
        help="directory, glob, brace pattern (train-{000000..000099}.tar) or single shard; "
        "any fsspec URL",
    )
    add(
        "--checkpoint",
        type=path,
        metavar="DEST",
        help="restore the newest committed checkpoint from DEST (stage-out's destination) to "
        "--dest/<name>; prints its local path on stdout",
    )
    add(
        "--from-list",
        type=path,
        metavar="FILE",
        help="read shard URLs from FILE (one per line, # comments; - reads standard input)",
    )
    add(
        "--dest",
        type=path,
        metavar="DIR",
        help="destination root (default: $STAGER_DEST, else /scratch/$SLURM_JOB_ID, "
        "else $TMPDIR/stager-$USER/local)",
    )
    add(
        "--name",
        type=path,
        help="dataset name under the destination (default: the source directory's name)",
    )
    add(
        "--jobs",
        type=positive_count,
        default=_d("jobs"),
        metavar="N",
        help=f"most concurrent copy streams per node (default {_d('jobs')}); the count adapts "
        "to the source's latency",
    )
    add(
        "--min-jobs",
        type=positive_count,
        default=_d("min_jobs"),
        metavar="N",
        help=f"fewest concurrent streams (default {_d('min_jobs')}); shards small enough to "
        "arrive in one read may run on fewer, found by measuring (docs/tuning.md)",
    )
    add("--fixed-jobs", action="store_true", help="always run --jobs streams (no adaptation)")
    add("--bw-limit", type=mbps, metavar="MBPS", help="cap on source reads per node, in MB/s")
    add(
        "--retries",
        type=count,
        default=_RETRY.attempts - 1,
        metavar="N",
        help=f"retries per shard on transient errors (default {_RETRY.attempts - 1})",
    )
    add(
        "--retry-delay",
        type=seconds,
        default=_RETRY.base_delay_s,
        metavar="S",
        help=f"first retry delay in s; doubles (default {_RETRY.base_delay_s:g})",
    )
    add(
        "--manifest",
        type=path,
        metavar="PATH",
        help="manifest to verify against (default: stager-manifest.* beside the source)",
    )
    add("--report", type=path, metavar="PATH.json", help="write the run's summary as JSON")
    add("--quiet", action="store_true", help="no progress output (summary line still printed)")
    add(
        "--progress",
        choices=PROGRESS_STYLES,
        default=_d("progress"),
        help="progress style: bar on a TTY, periodic lines otherwise (default auto)",
    )
    add(
        "--progress-interval",
        type=positive_seconds,
        default=_d("progress_interval_s"),
        metavar="S",
        help=f"seconds between progress lines (default {_d('progress_interval_s'):g})",
    )
    add(
        "--jitter-max",
        type=seconds,
        default=_d("jitter_max_s"),
        metavar="S",
        help=f"max start delay spread over nodes (default {_d('jitter_max_s'):g})",
    )
    add("--no-count", action="store_true", help="do not count samples of copied shards")
    add("--fsync", action="store_true", help="fsync each shard before publishing it")
    add(
        "--min-free",
        type=size,
        default=_d("min_free_bytes"),
        metavar="SIZE",
        help="space to keep free on scratch, e.g. 10G (default 0)",
    )
    add(
        "--lock-timeout",
        type=positive_seconds,
        default=_d("lock_timeout_s"),
        metavar="S",
        help="max wait for another stage-in of this dataset on the node "
        f"(default {_d('lock_timeout_s'):g})",
    )
    add(
        "--cache",
        type=path,
        metavar="DIR",
        help="node-local cache that outlives the job (default: $STAGER_CACHE): shards are "
        "served from it by identity (hard link, reflink or copy) and copied into it once per "
        "node; private to you. See docs/cache.md",
    )
    add(
        "--cache-limit",
        type=size,
        metavar="SIZE",
        help="cap on the cache, e.g. 500G; least recently used datasets no running job uses are "
        "evicted (default: $STAGER_CACHE_LIMIT, else half the cache's filesystem)",
    )
    add("--no-cache", action="store_true", help="ignore $STAGER_CACHE: copy from the source")
    add_fanout_arguments(parser)
    add_background_arguments(parser)
    add(
        "--subset",
        choices=SUBSETS,
        default=_d("subset"),
        help="all: stage every shard (default); node: only this node's share, for the loader's "
        "node-local shuffle",
    )
    parser.set_defaults(handler=run)


def options_from_args(args: argparse.Namespace, slurm: SlurmEnv) -> StageInOptions:
    cache_dir = None if args.no_cache else resolve_cache_dir(args.cache)
    return StageInOptions(
        dest_root=resolve_dest_root(args.dest, slurm=slurm),
        name=args.name,
        jobs=args.jobs,
        min_jobs=args.min_jobs,
        adaptive=not args.fixed_jobs,
        bw_limit_mbps=args.bw_limit,
        retry=RetryPolicy(attempts=args.retries + 1, base_delay_s=args.retry_delay),
        manifest=args.manifest,
        progress="none" if args.quiet else args.progress,
        progress_interval_s=args.progress_interval,
        jitter_max_s=args.jitter_max,
        count_samples=not args.no_count,
        fsync=args.fsync,
        lock_timeout_s=args.lock_timeout,
        min_free_bytes=args.min_free,
        subset=args.subset,
        cache_dir=cache_dir,
        # (read only where a cache is used: a bad $STAGER_CACHE_LIMIT fails no --no-cache run)
        cache_limit_bytes=resolve_cache_limit(args.cache_limit) if cache_dir else None,
    )


def run(args: argparse.Namespace) -> int:
    with freezing_after_pauses():  # this command runs stage-in alone: see stager.gcpause
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        return _restore(args)
    check_background_arguments(args)
    if args.wait_staged is not None:
        return wait_for_background(args)
    if args.fanout and args.subset != "all":
        raise UsageError(
            "--fanout replicates the whole dataset on every node; it needs --subset all"
        )
    slurm = SlurmEnv.from_environ()
    # Sizes come after the manifest (fewer stats; --subset node's partition takes the sizes it
    # gives, stager.stagein.subset), unless --fanout, which plans its exchange by size
    defer_stats = not args.fanout

    def list_source() -> SourceSet:
        with collection_paused():  # a million shards: see stager.gcpause
            return resolve_source(
                args.source,
                from_list=args.from_list,
                name=args.name,
                jobs=args.jobs,
                stat_listed=not defer_stats,
            )

    options = options_from_args(args, slurm)
    dataset_dir = dataset_dir_of(args, options)
    if args.report:
        check_report_place(args.report, options.dest_root, dataset_dir)
    uncached_mode = "--fanout" if args.fanout else "--background" if args.background else None
    if uncached_mode and options.cache_dir is not None:
        if args.cache:
            raise UsageError(f"--cache does not combine with {uncached_mode} yet; drop one of them")
        print(
            f"stage-in: warning: {uncached_mode} ignores $STAGER_CACHE", file=sys.stderr, flush=True
        )
        options = dataclasses.replace(options, cache_dir=None)
    if options.cache_dir is not None:  # (before anything is written to the destination)
        local_source = args.source and not args.from_list and not is_remote_url(args.source)
        check_cache_place(
            options.cache_dir,
            options.dest_root,
            dataset_dir,
            source_root(args.source) if local_source else None,
        )
        vet_cache(options.cache_dir)
    select = None
    if args.subset == "node":
        from stager.plan.nodes import select_node_shards

        def select(src, weights):  # noqa: ANN001, ANN202 - the stage_in callback
            return select_node_shards(
                src, num_nodes=slurm.num_nodes, node=slurm.node, weights=weights
            )

    report: StageInReport | None
    try:
        if args.background:  # lists the source once it holds the node lock
            from stager.stagein.background import background_stage_in

            report = background_stage_in(
                list_source,
                background_dataset(args, options),
                options,
                spec=background_spec(args),
                copy_seed=args.copy_seed,
                slurm=slurm,
                select=select,
            )
        elif args.fanout:
            from stager.fanout.run import fanout_stage_in, told_to_peers  # (numpy, then torch)

            fanout = fanout_options_from_args(args)
            with told_to_peers(slurm, fanout, lambda: background_dataset(args, options).name):
                source = list_source()  # (a source missing on one node: every node stops)
            report = fanout_stage_in(source, options, fanout, slurm=slurm)
        else:  # a directory's first run copies while its walk goes on
            spec = None if args.from_list else args.source  # a list's shards are named
            with sigterm_interrupts():  # the copies in flight end without a .partial left
                report = stage_in_foreground(spec, options, slurm, list_source, select)
    except Exception as exc:
        report = getattr(exc, "report", None)
        if report is not None and (report.files_total or report.failures):
            _tell(report, args, failing=True)  # what was done before the error
        raise
    _tell(report, args)
    if not slurm.in_slurm and not args.dest and not os.environ.get("STAGER_DEST"):
        _outside_a_job(report)
    return 0


def _outside_a_job(report: StageInReport) -> None:
    """Say where a run outside any job staged, and how to stage inside one instead."""
    import shutil  # (only here: ~3 ms of every stage-in's start)

    hint = ""
    if shutil.which("srun") or shutil.which("sbatch"):
        hint = (
            "; this host has Slurm: inside an allocation (salloc or sbatch) run "
            "`srun --nodes=$SLURM_NNODES --ntasks=$SLURM_NNODES stage-in ...` to stage to "
            "/scratch/$SLURM_JOB_ID on every node"
        )
    print(
        f"stage-in: note: not inside a Slurm job (no SLURM_JOB_ID): staged to "
        f"{report.dataset_dir}, which outlives this run (rm -r it when done){hint}",
        file=sys.stderr,
        flush=True,
    )


def _tell(report: StageInReport, args: argparse.Namespace, *, failing: bool = False) -> None:
    """The summary line, and ``--report``; a report that cannot be written never hides the
    run's own error (it is a warning then), and otherwise fails the run with its own code."""
    if args.report:
        try:
            report.write(args.report)
        except StagerError as exc:
            if not failing:
                raise
            print(f"stage-in: warning: {one_line(exc)}", file=sys.stderr, flush=True)
    print(report.summary_line(), file=sys.stderr, flush=True)


def _restore(args: argparse.Namespace) -> int:
    """``--checkpoint DEST``: stdout carries only the restored path (``CKPT=$(stage-in ...)``)."""
    from stager.stageout.restore import restore_checkpoint

    if args.source or args.from_list:
        raise UsageError(
            "--checkpoint takes no SOURCE or --from-list; it restores from the DEST it names"
        )
    with sigterm_interrupts():  # (scancel, a requeue: one line, exit 130, nothing partial left)
        path = restore_checkpoint(args.checkpoint, resolve_dest_root(args.dest))
    print(os.path.abspath(path), flush=True)
    return 0
