"""stage-in flags for background staging: ``--background``, ``--copy-seed``, ``--wait-staged``.

Kept apart from :mod:`stager.cli.commands.stage_in` (which holds the plain flags) because the
two modes of a background job share them: the copier step (``--background``) and the step
that waits for it before training starts (``--wait-staged N``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stager.cli.argtypes import count
from stager.errors import UsageError
from stager.layout import StagedDataset, canonical_spec, dataset_name
from stager.slurm import SlurmEnv
from stager.stagein.options import StageInOptions
from stager.storage.dest import resolve_dest_root

__all__ = [
    "add_background_arguments",
    "check_background_arguments",
    "background_dataset",
    "background_spec",
    "wait_for_background",
]


def add_background_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--background",
        action="store_true",
        help="stage beside training: copy in the order the loader reads epoch 0 and publish "
        "each shard as it lands, so training starts at once (needs sample counts: stager "
        "index). Run it as its own step for the whole job: srun --overlap --nodes=N --ntasks=N "
        "stage-in --background ... &",
    )
    add(
        "--copy-seed",
        type=int,
        default=0,
        metavar="N",
        help="key of the --background copy order (default 0); the loader reads its first epoch "
        "in this order whatever its own seed",
    )
    add(
        "--wait-staged",
        type=count,
        metavar="N",
        help="copy nothing: wait until this node's stage-in --background of SOURCE has "
        "published its plan and the first N shards its ranks read (0: the plan only), then "
        "exit 0; exit with the copier's error if it failed, 11 if it is gone",
    )


def check_background_arguments(args: argparse.Namespace) -> None:
    """Refuse the combinations background staging does not support, in one line each."""
    if args.background and args.fanout:
        raise UsageError(
            "--background cannot be combined with --fanout (the exchange needs every node in "
            "lockstep, the background copy follows each node's loader); drop one of them"
        )
    if args.wait_staged is not None and args.background:
        raise UsageError(
            "--wait-staged waits for a --background copier started separately; pass only one"
        )


def _dataset_of(args: argparse.Namespace, dest_root: Path) -> StagedDataset:
    """Where SOURCE (or --from-list) is staged, from its spec alone: no listing."""
    if args.name:
        return StagedDataset(dest_root, args.name)
    if args.from_list:
        from stager.storage.listing import read_list

        return StagedDataset(dest_root, dataset_name(read_list(args.from_list)))
    if not args.source:
        raise UsageError("give SOURCE (or --from-list, or --name)")
    return StagedDataset(dest_root, dataset_name(args.source))


def background_dataset(args: argparse.Namespace, options: StageInOptions) -> StagedDataset:
    """The dataset ``--background`` stages: known before the source is listed, so that the
    copier holds the node lock while it lists (``--wait-staged`` sees it working)."""
    return _dataset_of(args, options.dest_root)


def background_spec(args: argparse.Namespace) -> str:
    """What SOURCE asks for, spelled as the listing will spell it (tasks adopt only the same)."""
    if args.from_list:
        return canonical_spec(args.from_list, listed=True)
    return canonical_spec(args.source) if args.source else ""


def wait_for_background(args: argparse.Namespace) -> int:
    """``--wait-staged N``: see :mod:`stager.stagein.wait`."""
    from stager.stagein.wait import wait_staged

    slurm = SlurmEnv.from_environ()
    staged = _dataset_of(args, resolve_dest_root(args.dest, slurm=slurm))
    wait_staged(staged, args.wait_staged, slurm=slurm, timeout_s=args.lock_timeout, log=sys.stderr)
    return 0
