"""``stager clean``: which jobs' scratch directories to remove, decided by a pure function.

A job's directory is removed only when all of these hold:

* it is the caller's own (owned by the same user); another user's is never touched;
* no stager lock inside it is held (a stage-in, stage-out or restore is running there now);
* the job has ended, as Slurm says (:mod:`stager.node.jobs`), or it is the job the caller runs
  in and was named with ``--job`` (a job cleaning its own scratch at its end, after stage-out
  has committed);
* with ``--older-than``: nothing in it changed for that long.

When Slurm cannot be asked, whether a job runs is unknown, and only ``--older-than`` (the
user's word that what was unused that long is not in use) lets anything go.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stager.errors import DestinationError, UnsafePath
from stager.node.inventory import JobDir
from stager.node.jobs import JobStates
from stager.units import human_duration

__all__ = ["CleanChoice", "choose_job_dirs", "remove_tree"]


@dataclass(frozen=True)
class CleanChoice:
    """One job directory, and whether (and why) ``stager clean`` removes it."""

    job: JobDir
    remove: bool
    reason: str


def choose_job_dirs(
    jobs: Sequence[JobDir],
    *,
    states: JobStates,
    uid: int,
    now: float,
    older_than_s: float | None = None,
    only_job: str | None = None,
    own_job: str | None = None,
) -> list[CleanChoice]:
    """Decide for each job directory (those of ``only_job``, when given); see the module doc.

    ``own_job``: the job id the caller runs in (``$SLURM_JOB_ID``), which it may clean by
    naming it with ``only_job``.
    """
    out = []
    for job in jobs:
        if only_job is not None and job.job_id != only_job:
            continue
        out.append(
            CleanChoice(job, *_decide(job, states, uid, now, older_than_s, only_job, own_job))
        )
    return out


def _decide(
    job: JobDir,
    states: JobStates,
    uid: int,
    now: float,
    older_than_s: float | None,
    only_job: str | None,
    own_job: str | None,
) -> tuple[bool, str]:
    job_id = job.job_id
    if job.owner_uid != uid:
        return False, f"owned by uid {job.owner_uid}, not by you"
    if job.locks_held:
        return False, f"in use: {job.locks_held[0].name} is locked by a running process"
    if only_job is not None and job_id == own_job:
        return True, f"the scratch of this job ({job_id}), removed at its own request"
    age = job.age_s(now)
    young = older_than_s is not None and age < older_than_s
    running = states.running(job_id)
    if running:
        return False, f"job {job_id} is still running (or pending, suspended, completing)"
    if running is None:
        if older_than_s is None:
            return False, (
                f"cannot ask Slurm whether job {job_id} still runs ({states.error}); pass "
                "--older-than to remove what has not been used that long"
            )
        if young:
            return False, f"used {human_duration(age)} ago, and Slurm cannot be asked"
        return True, f"unused for {human_duration(age)} (Slurm cannot be asked: {states.error})"
    if young:
        return False, f"job {job_id} ended, but its data changed {human_duration(age)} ago"
    return True, f"job {job_id} has ended"


def remove_tree(path: Path) -> None:
    """Remove a job's directory; never through a symlink, whatever is read-only inside.

    Staged shards hard-linked from the cache are read-only; that does not stop their removal
    (a directory's write bit does), but a directory made read-only would: it is made writable
    first. Raises :class:`DestinationError` naming what could not be removed.
    """
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise UnsafePath(f"{path} is a symlink; not removed")

    def retry(func, failed: str, exc: BaseException) -> None:  # noqa: ANN001 - shutil's hook
        parent = os.path.dirname(failed)
        if isinstance(exc, PermissionError) and parent:
            os.chmod(parent, 0o700)
            func(failed)
            return
        raise exc

    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=retry)
        else:
            shutil.rmtree(path, onerror=lambda func, failed, info: retry(func, failed, info[1]))
    except OSError as exc:
        raise DestinationError(
            f"could not remove all of {path}: {exc.strerror or exc}; check its permissions"
        ) from exc
