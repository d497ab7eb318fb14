"""What a background stage-in tells the processes that read beside it, and how they check it.

``stage-in --background`` (:mod:`stager.stagein.background`) copies while training reads, so a
reader must know three things that a crash cannot falsify:

* **the plan**: ``.stager/staging.json`` (:attr:`stager.layout.StagedDataset.staging_path`), a
  manifest of every shard the run will publish (size, hash, samples, in source order) whose
  ``meta`` holds :class:`PlanFacts` (run id, start time, job, copy-order key). It is written
  atomically before the first copy and after the final name of every shard still to copy was
  deleted, so while it is the current plan a shard's final name exists only when the file is
  whole and holds the source's current bytes (published by rename after verification, or
  kept by the plan's identity check). :func:`published` is that test: a ``stat``.
* **the end**: the copier's result file (:mod:`stager.stagein.node`), written after the run
  ended, well or not, with ``finished_at`` no earlier than the plan's ``started_at``
  (:func:`read_outcome`).
* **life**: the copier holds the node lock (an ``flock``) for its whole run; the kernel frees it
  when the process dies, even by ``kill -9`` (:func:`lock_held`).

The plan's shard order is :func:`stager.plan.staging.copy_order` of its ``copy_seed`` and
``salt``; the loader reads epoch 0 in that order while shards land.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from stager.errors import StagerError, UsageError
from stager.layout import StagedDataset
from stager.shards.manifest import Manifest, ManifestColumns, ManifestEntry
from stager.shards.manifestcolumns import (
    PLAN_COLUMNS_NAME,
    cached_columns,
    columns_path,
    keep_columns,
)
from stager.slurm import SlurmEnv
from stager.storage.paths import discard

__all__ = [
    "PlanFacts",
    "Outcome",
    "write_plan",
    "read_plan",
    "discard_plan",
    "read_outcome",
    "lock_held",
    "CopierWatch",
    "GONE_AFTER_S",
    "published",
    "is_current",
]

#: Marks a manifest as a background stage-in's plan rather than a staged copy's record.
_KIND = "stage-in --background plan"


@dataclass(frozen=True)
class PlanFacts:
    """The run behind a plan: which one it is, when it started, and what keys its order."""

    run_id: str
    started_at: float  # time.time() on the node, when the plan was written
    job_id: str
    restart_count: int
    node: str
    copy_seed: int
    salt: int  # stager.plan.staging.copy_salt of the node
    subset: str
    source: str  # the absolute source root (a URL for remote sources)
    spec: str  # stager.layout.canonical_spec of what was asked for

    def meta(self) -> dict[str, str]:
        return {"kind": _KIND, **{k: str(v) for k, v in asdict(self).items()}}

    @classmethod
    def from_meta(cls, meta: dict[str, str], where: object) -> PlanFacts:
        if meta.get("kind") != _KIND:
            raise UsageError(f"{where} is not a stage-in --background plan; remove it and rerun")
        try:
            return cls(
                run_id=meta["run_id"],
                started_at=float(meta["started_at"]),
                job_id=meta["job_id"],
                restart_count=int(meta["restart_count"]),
                node=meta["node"],
                copy_seed=int(meta["copy_seed"]),
                salt=int(meta["salt"]),
                subset=meta["subset"],
                source=meta["source"],
                spec=meta["spec"],
            )
        except (KeyError, ValueError) as exc:
            raise UsageError(
                f"{where}: a stage-in --background plan without {exc}; rerun stage-in"
            ) from exc


@dataclass(frozen=True)
class Outcome:
    """How the run behind a plan ended (from the copier's result file)."""

    exit_code: int
    error: str = ""
    error_class: str = ""
    failures: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def write_plan(staged: StagedDataset, entries: Sequence[ManifestEntry], facts: PlanFacts) -> None:
    """Publish the plan atomically (see the module doc for what must happen first), and for a
    large one its columns, which every reader maps instead of parsing it (best effort)."""
    staged.meta_dir.mkdir(exist_ok=True)
    plan = Manifest(tuple(entries), facts.meta())
    plan.write(staged.staging_path)
    plan_columns = columns_path(staged.index_dir, PLAN_COLUMNS_NAME)
    keep_columns(plan, staged.staging_path, plan_columns, digests=True)


def read_plan(staged: StagedDataset) -> tuple[ManifestColumns, PlanFacts] | None:
    """The plan's shards as columns, and its facts; None when there is no plan."""
    path = staged.staging_path
    try:
        columns = cached_columns(path, staged.index_dir, PLAN_COLUMNS_NAME, digests=True)
    except UsageError as exc:
        # Not there when read: no plan now, even where one is there a moment later (a copier
        # discards an earlier run's plan, then writes its own: a waiter that read in between
        # and checked after failed the job step with "manifest not found")
        if isinstance(exc.__cause__, FileNotFoundError) or not path.exists():
            return None
        raise
    return columns, PlanFacts.from_meta(dict(columns.meta), path)


def discard_plan(staged: StagedDataset) -> None:
    """Void the plan of an earlier run: from now on its final names prove nothing.

    On a read-only scratch nothing can replace a final name either, so a plan that cannot be
    removed there still tells the truth; ``unlink`` of a missing file fails with EROFS there.
    """
    try:
        staged.staging_path.unlink()
    except OSError:
        pass
    # its columns too: kept, they stayed in the copy's index for good (and a --cache run kept
    # them in the node cache, and put them back into each later copy)
    discard(columns_path(staged.index_dir, PLAN_COLUMNS_NAME))


def read_outcome(staged: StagedDataset, facts: PlanFacts) -> Outcome | None:
    """How the plan's run ended, or None while it has not (or its result is unreadable)."""
    try:
        payload = json.loads(staged.result_path.read_text())
        if float(payload.get("finished_at", 0)) < facts.started_at:
            return None  # an earlier run's result
        report = payload.get("report") or {}
        failures = [f for f in report.get("failures", []) if isinstance(f, dict)]
        return Outcome(
            int(report.get("exit_code", 1)),
            str(payload.get("error", "")),
            str(payload.get("error_class", "")),
            failures,
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def lock_held(staged: StagedDataset) -> bool:
    """True while some process holds the node lock of ``staged`` (its copier is alive).

    Probed with a shared, non-blocking ``flock`` released at once: it never waits, and a
    copier that starts during the probe only retries its own (polling) acquisition.
    """
    try:
        fd = os.open(staged.lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise StagerError(f"cannot probe the copier's lock {staged.lock_path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


#: A copier counts as gone when its lock stays free this long without a result: a task
#: taking over from a dead one needs a moment to take the lock and publish its own plan.
GONE_AFTER_S = 5.0


class CopierWatch:
    """How long a background copier's lock has been seen free: the one rule for "the copier
    is gone" (free for :data:`GONE_AFTER_S`, with no result), which ``--wait-staged``, the
    loader's shard gate and its monitor all apply.

    Each :meth:`free_for` probes the lock. The time is kept between calls, from the first
    probe that found it free; a probe that finds it held starts over.
    """

    def __init__(self, staged: StagedDataset) -> None:
        self.staged = staged
        self._free_since: float | None = None

    def free_for(self, now: float) -> float | None:
        """Seconds the lock has been free (0 at the first probe that finds it free), or None
        while a copier holds it."""
        if lock_held(self.staged):
            self._free_since = None
            return None
        if self._free_since is None:
            self._free_since = now
        return now - self._free_since

    def gone(self, now: float, *, at_once: bool = False) -> bool:
        """Whether the lock has been free longer than :data:`GONE_AFTER_S` (``at_once``: at
        all, when there is no time left to wait, as at the end of an epoch)."""
        free = self.free_for(now)
        return free is not None and (at_once or free > GONE_AFTER_S)

    def forget(self) -> None:
        """Start the grace over (a new wait must not inherit an old sighting)."""
        self._free_since = None

    def quiet_for(self) -> float | None:
        """Seconds since the lock's holder last showed progress, or None while the lock is
        free (or its time cannot be read). The copier's heartbeat touches the lock file as its
        bytes arrive (:meth:`stager.storage.lock.NodeLock.heartbeat`, at most once a second):
        a copier stopped, or hung on a read of a dead server, holds the lock and touches it
        no more."""
        if not lock_held(self.staged):
            return None
        try:
            return max(0.0, time.time() - os.stat(self.staged.lock_path).st_mtime)
        except OSError:
            return None


def published(path: str, size: int) -> bool:
    """True when a shard of the current plan is published at ``path`` (whole, see module doc)."""
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def is_current(facts: PlanFacts, slurm: SlurmEnv) -> bool:
    """True when the plan was written by this job's current run (outside Slurm: any plan)."""
    if not slurm.in_slurm:
        return True
    return facts.job_id == slurm.job_id and facts.restart_count == slurm.restart_count
