"""``stage-in --wait-staged N``: wait for this node's background copier to get training going.

A job script starts ``stage-in --background`` as a step of its own and then this, one task per
node, before the training step: it returns once the node's copier has published its plan for
this run of the job (:mod:`stager.stagein.status`) and the first ``N`` shards of its copy order,
which are the first shards the node's ranks read in a staging epoch
(:mod:`stager.plan.staging`). ``N = 0`` waits for the plan only, which is enough: the loader
waits for each shard itself. It copies nothing and never lists the source.

It fails rather than wait forever: with the copier's own error when the copier ended without
those shards, with :class:`StagingStopped` when the copier is gone (its lock is free, no
result), and with :class:`LockTimeout` when nothing happened for ``timeout_s``.
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from stager.errors import LockTimeout, StagerError, StagingStopped, one_line, rebuild_error
from stager.layout import StagedDataset
from stager.plan.staging import copy_order
from stager.slurm import SlurmEnv
from stager.stagein.status import (
    CopierWatch,
    PlanFacts,
    is_current,
    lock_held,
    published,
    read_outcome,
    read_plan,
)

__all__ = ["wait_staged", "STARTUP_GRACE_S"]

#: Before any plan of this run: how long the lock may stay free (the copier step starting:
#: an interpreter, the import, the lock) before the waiter says no copier runs.
STARTUP_GRACE_S = 60.0


def _failed_since(staged: StagedDataset, since: float) -> StagerError | None:
    """The error of a copier that ended after ``since`` without publishing a plan."""
    try:
        payload = json.loads(staged.result_path.read_text())
        if float(payload.get("finished_at", 0)) < since or not payload.get("error_class"):
            return None
        return rebuild_error(payload["error_class"], str(payload.get("error", "")))
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _copier_state(staged: StagedDataset, facts: PlanFacts) -> str:
    """How the copier stands once the shards waited for are there: what the one line says.
    Exit 0 either way (those shards are staged); a copier already stopped is said, since the
    loader will read past it (docs/loader.md, "A dead copier")."""
    outcome = read_outcome(staged, facts)
    if outcome is not None and outcome.ok:
        return "is complete"
    if outcome is not None:
        return f"stopped ({one_line(outcome.error or 'error')}) after these"
    return "is under way" if lock_held(staged) else "has stopped (its lock is free)"


def wait_staged(
    staged: StagedDataset,
    first_shards: int,
    *,
    slurm: SlurmEnv,
    timeout_s: float,
    log: TextIO,
    poll_s: float = 0.2,
) -> int:
    """Block until the plan and its first ``first_shards`` shards are published; return how
    many shards the plan has. ``timeout_s`` bounds the wait without progress."""
    progress_at = idle_since = time.monotonic()
    wait_started = time.time()
    copier = CopierWatch(staged)
    done = -1
    while True:
        loaded = read_plan(staged)
        if loaded is not None and is_current(loaded[1], slurm):
            columns, facts = loaded
            order = copy_order(len(columns.relpaths), seed=facts.copy_seed, salt=facts.salt)
            wanted = order[: min(first_shards, len(order))].tolist()
            prefix = str(staged.dir) + "/"
            ready = sum(published(prefix + columns.relpaths[i], columns.sizes[i]) for i in wanted)
            if ready == len(wanted):
                state = _copier_state(staged, facts)
                print(
                    f"[{slurm.node_name}] stage-in: the background copy of {staged.dir} "
                    f"{state} ({len(order)} shard(s) planned, the first {len(wanted)} "
                    "staged); training may start",
                    file=log,
                    flush=True,
                )
                return len(order)
            if ready > done:
                done, progress_at = ready, time.monotonic()
            outcome = read_outcome(staged, facts)
            if outcome is not None:
                if not outcome.ok:
                    raise rebuild_error(outcome.error_class or "StagerError", outcome.error)
                raise StagingStopped(
                    f"[{slurm.node_name}] the background stage-in of {staged.dir} ended with "
                    f"{ready} of the first {len(wanted)} shard(s) staged; see its log"
                )
            if copier.gone(time.monotonic()):
                raise StagingStopped(
                    f"[{slurm.node_name}] the background stage-in of {staged.dir} is gone "
                    f"(its lock is free, it left no result) with {ready} of the first "
                    f"{len(wanted)} shard(s) staged; see its log and rerun it"
                )
        else:
            # No plan of this run yet: a copier lists the source holding the node lock.
            failed = _failed_since(staged, wait_started)
            if failed is not None:
                raise failed
            if lock_held(staged):
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > STARTUP_GRACE_S:
                raise StagingStopped(
                    f"[{slurm.node_name}] no stage-in --background of {staged.dir} is running "
                    f"for this job (nothing holds its lock, no plan after {STARTUP_GRACE_S:.0f} "
                    "s); start it first, as a step of its own (see docs/jobs.md)"
                )
        if time.monotonic() - progress_at > timeout_s:
            raise LockTimeout(
                f"[{slurm.node_name}] waited {timeout_s:.0f} s without progress for the "
                f"background stage-in of {staged.dir}; start `stage-in --background` on every "
                "node first (see docs/jobs.md) or raise --lock-timeout"
            )
        time.sleep(poll_s)
