"""``--keep N``: prune all but the N newest committed checkpoints, and say when it skips the
newest one on scratch.

"Newest" is by the checkpoint's files' modification time (:mod:`stager.stageout.record`). A
checkpoint committed with files dated in the future (a node's clock ahead) ranks first until
that time has passed: every later checkpoint is older than it, and ``--keep 1`` skipped them
all without a line, under exit 0, while restore kept returning the old one.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from stager.errors import UsageError
from stager.stageout.record import CommitRecord, plan_prune
from stager.stageout.store import CommitStore

__all__ = ["prune", "newest_skipped"]


def prune(store: CommitStore, keep: int) -> list[str]:
    """Remove all but the ``keep`` newest committed checkpoints; never the newest."""
    if keep < 1:
        raise UsageError("--keep must be at least 1: the newest checkpoint is never pruned")
    names = plan_prune(store.records(), keep)
    for name in names:
        store.remove(name)
    return names


def newest_skipped(name: str, mtime_ns: int, records: Sequence[CommitRecord], keep: int) -> str:
    """The warning for the newest checkpoint on scratch, which ``--keep`` skips: ``keep``
    committed ones are dated later."""
    later = sorted(
        (r for r in records if r.source_mtime_ns > mtime_ns),
        key=CommitRecord.sort_key,
        reverse=True,
    )
    shown = ", ".join(f"{r.name} ({_when(r.source_mtime_ns)})" for r in later[:keep])
    return (
        f"stage-out: warning: {name} ({_when(mtime_ns)}), the newest here, is not staged: "
        f"--keep {keep} keeps what DEST holds dated later: {shown}; a checkpoint dated in "
        "the future (a clock ahead) ranks first until then"
    )


def _when(ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
