"""stage-in's ``--fanout*`` flags, and the :class:`FanoutOptions` they make.

Kept apart from :mod:`stager.cli.commands.stage_in`, which holds the plain flags: these only
matter to the replicated mode (:mod:`stager.fanout`).
"""

from __future__ import annotations

import argparse

from stager.cli.argtypes import positive_count, positive_seconds
from stager.errors import UsageError
from stager.fanout.group import FanoutOptions

__all__ = ["add_fanout_arguments", "fanout_options_from_args"]

_FANOUT = FanoutOptions()


def add_fanout_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--fanout*`` flags of ``stage-in``."""
    add = parser.add_argument
    add(
        "--fanout",
        action="store_true",
        help="replicated staging that reads the source once in total: the node tasks (srun "
        "--ntasks-per-node=1) form a gloo group, each reads its part and broadcasts it to the "
        "others",
    )
    add(
        "--fanout-host",
        metavar="HOST",
        help="rendezvous host (default: $STAGER_FANOUT_HOST, else the job's first node)",
    )
    add(
        "--fanout-port",
        type=positive_count,
        metavar="PORT",
        help="rendezvous TCP port (default: $STAGER_FANOUT_PORT, else derived from the job id)",
    )
    add(
        "--fanout-timeout",
        type=positive_seconds,
        default=_FANOUT.form_timeout_s,
        metavar="S",
        help="seconds to wait for all nodes to join; then fall back to plain copying with a "
        f"warning (default {_FANOUT.form_timeout_s:g})",
    )
    add(
        "--fanout-op-timeout",
        type=positive_seconds,
        default=_FANOUT.op_timeout_s,
        metavar="S",
        help="seconds one exchange step may wait for a peer (longer than one shard's source "
        f"read; default {_FANOUT.op_timeout_s:g})",
    )
    add(
        "--fanout-chunk-kib",
        type=positive_count,
        default=_FANOUT.chunk_bytes >> 10,
        metavar="KIB",
        help=f"size of one broadcast message in KiB (default {_FANOUT.chunk_bytes >> 10})",
    )


def fanout_options_from_args(args: argparse.Namespace) -> FanoutOptions:
    """The parsed ``--fanout*`` flags as :class:`FanoutOptions`; out-of-range values raise a
    one-line :class:`UsageError` here, before any node joins the group."""
    if not 1 <= args.fanout_chunk_kib <= 1 << 20:
        raise UsageError("--fanout-chunk-kib must be between 1 and 1048576")
    if args.fanout_port is not None and not 1 <= args.fanout_port <= 65535:
        raise UsageError("--fanout-port must be between 1 and 65535")
    return FanoutOptions(
        host=args.fanout_host,
        port=args.fanout_port,
        form_timeout_s=args.fanout_timeout,
        op_timeout_s=args.fanout_op_timeout,
        chunk_bytes=args.fanout_chunk_kib << 10,
    )
