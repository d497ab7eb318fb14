"""``stage-out``: flags and the calls into :mod:`stager.stageout.run` and
:mod:`stager.stageout.watch`."""

from __future__ import annotations

import argparse
from pathlib import Path

from stager.cli.argtypes import default_of, mbps, path, positive_seconds, seconds
from stager.errors import NoCheckpoint, UsageError
from stager.signalevent import SignalSafeEvent
from stager.slurm import SlurmEnv
from stager.stageout.deadline import DEADLINE_MARGIN_S, resolve_deadline
from stager.stageout.outcome import check_outcomes
from stager.stageout.run import StageOutOptions, stage_out
from stager.stageout.snapshot import has_files, list_checkpoints
from stager.stageout.watch import WATCH_INTERVAL_S, stop_on_signals, watch


def _d(name: str) -> object:
    return default_of(StageOutOptions, name)


HELP = "commit checkpoints from node-local scratch to persistent storage, atomically"

EPILOG = """exit codes: 0 all requested checkpoints committed (or already were; --watch: \
stopped cleanly);
2 usage error; 4 integrity error (bytes at DEST differ after copy); 5 destination error (not
writable, full, unreachable); 7 checkpoint error: a checkpoint was not committed (not enough time
before the deadline, or it changed while copied), earlier committed ones are intact;
8 lock timeout; 9 (--all, one shot) no checkpoint in CKPT: nothing to stage out;
130 interrupted (the copy in flight was abandoned, nothing partial is visible).
layout at DEST: DEST/<name> plus DEST/.stager/commits/<name>.json (the commit record, written last).
environment: SLURM_JOB_ID (deadline from the job's end time via squeue/scontrol)."""


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP, epilog=EPILOG))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = parser.description or HELP
    parser.epilog = parser.epilog or EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "ckpt",
        type=path,
        metavar="CKPT",
        help="checkpoint file or directory on scratch (with --all: the directory holding them)",
    )
    parser.add_argument(
        "dest",
        type=path,
        metavar="DEST",
        help="persistent destination directory: a path or any fsspec URL (s3://bucket/run)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="stage out every checkpoint in the directory CKPT, newest first",
    )
    parser.add_argument(
        "--keep",
        type=int,  # checked in _validate: the message says why 0 is refused
        metavar="N",
        help="after staging, prune all but the N newest committed checkpoints at DEST",
    )
    parser.add_argument(
        "--watch",
        action="store_true",
        help="keep running; stage out new or changed checkpoints every --interval",
    )
    parser.add_argument(
        "--interval",
        type=positive_seconds,
        default=WATCH_INTERVAL_S,
        metavar="S",
        help=f"seconds between --watch passes (default {WATCH_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--settle",
        type=seconds,
        metavar="S",
        help="skip checkpoints modified less than S seconds ago (default 2 with --watch, else 0)",
    )
    parser.add_argument(
        "--deadline-s",
        type=seconds,
        metavar="S",
        help="seconds left to finish (default inside Slurm: the job's end time minus "
        "--deadline-margin-s)",
    )
    parser.add_argument(
        "--deadline-margin-s",
        type=seconds,
        default=DEADLINE_MARGIN_S,
        metavar="S",
        help=f"margin before the Slurm end time (default {DEADLINE_MARGIN_S:g})",
    )
    parser.add_argument(
        "--assume-mbps",
        type=mbps,
        default=_d("assume_mbps"),
        metavar="MBPS",
        help="copy rate assumed for deadline estimates until one is measured "
        f"(default {_d('assume_mbps'):g})",
    )
    parser.add_argument(
        "--bw-limit", type=mbps, metavar="MBPS", help="cap on the copy rate, in MB/s"
    )
    parser.add_argument(
        "--lock-timeout",
        type=positive_seconds,
        default=_d("lock_timeout_s"),
        metavar="S",
        help="max wait for another process copying the same checkpoint "
        f"(default {_d('lock_timeout_s'):g})",
    )
    parser.set_defaults(handler=run)


def _validate(args: argparse.Namespace) -> None:
    if args.keep is not None and args.keep < 1:
        raise UsageError("--keep must be at least 1: the newest checkpoint is never pruned")
    if args.interval <= 0:
        raise UsageError("--interval must be a positive number of seconds")
    for flag, value in (("--bw-limit", args.bw_limit), ("--assume-mbps", args.assume_mbps)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag} must be a positive number of MB/s")
    if args.settle is not None and args.settle < 0:
        raise UsageError("--settle must be >= 0")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    slurm = SlurmEnv.from_environ()
    options = StageOutOptions(
        keep=args.keep,
        deadline=resolve_deadline(args.deadline_s, slurm, margin_s=args.deadline_margin_s),
        assume_mbps=args.assume_mbps,
        bw_limit_mbps=args.bw_limit,
        settle_s=args.settle if args.settle is not None else (2.0 if args.watch else 0.0),
        lock_timeout_s=args.lock_timeout,
        ckpt_dir=Path(args.ckpt) if args.all else None,
    )
    ckpt = Path(args.ckpt)

    def list_ckpts() -> list[Path]:
        # --all: an empty step directory is not a checkpoint yet (the trainer has just made it)
        return [p for p in list_checkpoints(ckpt) if has_files(p)] if args.all else [ckpt]

    stop = SignalSafeEvent()  # set by a signal handler: see stager.signalevent
    if args.watch:
        with stop_on_signals(stop):
            watch(list_ckpts, args.dest, options, interval_s=args.interval, stop=stop)
        return 0
    ckpts = list_ckpts()
    if not ckpts:
        # Said, not passed over: a job script reads 9 as "the trainer saved nothing here".
        raise NoCheckpoint(
            f"no checkpoint in {ckpt} to stage out (names starting with '.' or ending in "
            f".partial, .tmp or .lock, and empty directories, are skipped); nothing committed "
            f"to {args.dest}"
        )
    # One shot (job end, signal trap): a signal abandons the copy in flight atomically.
    with stop_on_signals(stop, graceful=False):
        outcomes = stage_out(ckpts, args.dest, options, slurm=slurm, stop=None)
    check_outcomes(outcomes)
    return 0
