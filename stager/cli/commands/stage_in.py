"""``stage-in``: flags and the call into :func:`stager.stagein.run.stage_in`."""

from __future__ import annotations

import argparse
import os
import sys

from stager.errors import UsageError
from stager.fanout.group import FanoutOptions
from stager.slurm import SlurmEnv
from stager.stagein.run import StageInOptions, stage_in
from stager.stagein.streams import DEFAULT_JOBS
from stager.storage.dest import resolve_dest_root
from stager.storage.retry import RetryPolicy
from stager.storage.sources import resolve_source

HELP = "copy dataset shards to node-local scratch (run once per node: srun --ntasks-per-node=1)"

EPILOG = """exit codes: 0 ok; 2 usage error; 3 source error (missing source, shards failed after retries);
4 integrity error (hash mismatch); 5 destination error; 6 scratch full; 8 lock timeout;
10 --fanout: a peer node failed after the group formed (rerun to resume).
with --checkpoint: 0 restored (its local path is the only line on stdout); 9 no committed
checkpoint at DEST yet (start from scratch); 7 checkpoints committed but none restorable whole.
environment: STAGER_DEST (destination root), SLURM_JOB_ID/SLURM_NODEID/... (job layout)."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "source",
        nargs="?",
        metavar="SOURCE",
        help="directory, glob, brace pattern (train-{000000..000099}.tar) or single shard; any fsspec URL",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DEST",
        help="restore the newest committed checkpoint from DEST (stage-out's destination) to --dest/<name>; "
        "prints its local path on stdout",
    )
    parser.add_argument(
        "--from-list", metavar="FILE", help="read shard URLs from FILE (one per line, # comments)"
    )
    parser.add_argument(
        "--dest",
        metavar="DIR",
        help="destination root (default: $STAGER_DEST, else /scratch/$SLURM_JOB_ID, else $TMPDIR/stager-$USER/local)",
    )
    parser.add_argument(
        "--name", help="dataset name under the destination (default: source directory's basename)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        metavar="N",
        help=f"most concurrent copy streams per node (default {DEFAULT_JOBS}); the count adapts to the source's latency",
    )
    parser.add_argument(
        "--min-jobs", type=int, default=4, metavar="N", help="fewest concurrent streams (default 4)"
    )
    parser.add_argument(
        "--fixed-jobs", action="store_true", help="always run --jobs streams (no adaptation)"
    )
    parser.add_argument(
        "--bw-limit", type=float, metavar="MBPS", help="cap on source reads per node, in MB/s"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=3,
        metavar="N",
        help="retries per shard on transient errors (default 3)",
    )
    parser.add_argument(
        "--retry-delay",
        type=float,
        default=0.5,
        metavar="S",
        help="first retry delay in s; doubles (default 0.5)",
    )
    parser.add_argument(
        "--manifest",
        metavar="PATH",
        help="manifest to verify against (default: stager-manifest.* beside the source)",
    )
    parser.add_argument("--report", metavar="PATH.json", help="write the run's summary as JSON")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress output (summary line still printed)"
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="progress style: bar on a TTY, periodic lines otherwise (default auto)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between progress lines",
    )
    parser.add_argument(
        "--jitter-max",
        type=float,
        default=2.0,
        metavar="S",
        help="max start delay spread over nodes (default 2)",
    )
    parser.add_argument(
        "--no-count", action="store_true", help="do not count samples of copied shards"
    )
    parser.add_argument(
        "--fsync", action="store_true", help="fsync each shard before publishing it"
    )
    parser.add_argument(
        "--min-free", type=int, default=0, metavar="BYTES", help="bytes to keep free on scratch"
    )
    add_fanout_arguments(parser)
    parser.add_argument(
        "--subset",
        choices=("all", "node"),
        default="all",
        help="all: stage every shard (default); node: only this node's share, for the loader's node-local shuffle",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is not None:
        return _restore(args)
    if args.jobs < 1 or args.min_jobs < 1:
        raise UsageError("--jobs and --min-jobs must be at least 1")
    if args.retries < 0:
        raise UsageError("--retries must be >= 0")
    if args.bw_limit is not None and args.bw_limit <= 0:
        raise UsageError("--bw-limit must be a positive number of MB/s")
    slurm = SlurmEnv.from_environ()
    # Sizes of a walked directory are looked up after the manifest (fewer stats), except where
    # shard selection needs them first: --subset node partitions by size, --fanout plans by it.
    defer_stats = args.subset == "all" and not args.fanout
    source = resolve_source(
        args.source,
        from_list=args.from_list,
        name=args.name,
        jobs=args.jobs,
        stat_listed=not defer_stats,
    )
    options = StageInOptions(
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
        min_free_bytes=args.min_free,
        subset=args.subset,
    )
    select = None
    if args.subset == "node":
        from stager.plan.nodes import select_node_shards  # torch-free

        def select(src):  # noqa: ANN001, ANN202 - the stage_in callback
            return select_node_shards(src, num_nodes=slurm.num_nodes, node_id=slurm.node_id)

    if args.fanout and args.subset != "all":
        raise UsageError(
            "--fanout replicates the whole dataset on every node; it needs --subset all"
        )
    try:
        if args.fanout:
            from stager.fanout.run import (
                fanout_stage_in,
            )  # numpy and, later, torch: only when asked for

            report = fanout_stage_in(source, options, fanout_options_from_args(args), slurm=slurm)
        else:
            report = stage_in(source, options, slurm=slurm, select=select)
    except Exception as exc:
        report = getattr(exc, "report", None)
        if report is not None:
            if args.report:
                report.write(args.report)
            print(report.summary_line(), file=sys.stderr, flush=True)
        raise
    if args.report:
        report.write(args.report)
    print(report.summary_line(), file=sys.stderr, flush=True)
    return 0


def _restore(args: argparse.Namespace) -> int:
    """``--checkpoint DEST``: stdout carries only the restored path, for ``CKPT=$(stage-in ...)``."""
    from stager.stageout.restore import restore_checkpoint

    if args.source or args.from_list:
        raise UsageError(
            "--checkpoint takes no SOURCE or --from-list; it restores from the DEST it names"
        )
    path = restore_checkpoint(args.checkpoint, resolve_dest_root(args.dest))
    print(os.path.abspath(path), flush=True)
    return 0


def add_fanout_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--fanout*`` flags of ``stage-in``."""
    parser.add_argument(
        "--fanout",
        action="store_true",
        help="replicated staging that reads the source once in total: the node tasks (srun --ntasks-per-node=1) "
        "form a gloo group, each reads its part and broadcasts it to the others",
    )
    parser.add_argument(
        "--fanout-host",
        metavar="HOST",
        help="rendezvous host (default: $STAGER_FANOUT_HOST, else the job's first node)",
    )
    parser.add_argument(
        "--fanout-port",
        type=int,
        metavar="PORT",
        help="rendezvous TCP port (default: $STAGER_FANOUT_PORT, else derived from the job id)",
    )
    parser.add_argument(
        "--fanout-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds to wait for all nodes to join; then fall back to plain copying with a warning (default 120)",
    )
    parser.add_argument(
        "--fanout-op-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds one exchange step may wait for a peer (longer than one shard's source read; default 900)",
    )
    parser.add_argument(
        "--fanout-chunk-kib",
        type=int,
        default=FanoutOptions.chunk_bytes >> 10,
        metavar="KIB",
        help=f"size of one broadcast message in KiB (default {FanoutOptions.chunk_bytes >> 10})",
    )


def fanout_options_from_args(args: argparse.Namespace) -> FanoutOptions:
    if args.fanout_timeout <= 0 or args.fanout_op_timeout <= 0:
        raise UsageError("--fanout-timeout and --fanout-op-timeout must be positive seconds")
    if not 1 <= args.fanout_chunk_kib <= 1 << 20:
        raise UsageError("--fanout-chunk-kib must be between 1 and 1048576")
    return FanoutOptions(
        host=args.fanout_host,
        port=args.fanout_port,
        form_timeout_s=args.fanout_timeout,
        op_timeout_s=args.fanout_op_timeout,
        chunk_bytes=args.fanout_chunk_kib << 10,
    )
