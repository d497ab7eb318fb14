"""Which Slurm jobs have not ended, asked of Slurm once (``squeue``), or "cannot tell".

``stager clean`` must never remove a running job's data, and the cache must never evict a
dataset a running job uses. Both ask here. A job Slurm no longer lists, or lists in a final
state, has ended; one it lists in any other state (pending after a requeue, completing,
suspended, or a state this code does not know) has not. When Slurm cannot be asked (no
``squeue``, no controller, a timeout), the answer is "cannot tell", and callers keep what
might be in use.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["JobStates", "ENDED_STATES", "query_job_states", "parse_squeue"]

#: Job states after which a job runs nothing more on any node.
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)


@dataclass(frozen=True)
class JobStates:
    """Job ids Slurm lists as not ended; ``alive is None`` when Slurm could not be asked."""

    alive: frozenset[str] | None
    error: str = ""

    @property
    def known(self) -> bool:
        return self.alive is not None

    def running(self, job_id: str) -> bool | None:
        """True (not ended), False (ended or unknown to Slurm), None (cannot tell)."""
        if self.alive is None:
            return None
        return job_id in self.alive

    def may_run(self, job_id: str) -> bool:
        """True unless Slurm said the job has ended: what keeps data when in doubt."""
        return self.running(job_id) is not False


def parse_squeue(text: str) -> frozenset[str]:
    """Job ids in ``squeue -h -o "%A %T"`` output whose state is not final."""
    alive = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].upper().rstrip("+") not in ENDED_STATES:
            alive.add(fields[0])
        elif len(fields) == 1:
            alive.add(fields[0])
    return frozenset(alive)


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def query_job_states(
    *, all_users: bool = False, timeout_s: float = 30, env: Mapping[str, str] | None = None
) -> JobStates:
    """Ask ``squeue`` which jobs (this user's, or everyone's) have not ended.

    ``%A`` is a job's own id (an array task's too, as its ``SLURM_JOB_ID`` is), ``-r`` lists
    array tasks one per line, ``-t all`` includes final states so they can be told apart.
    """
    env = dict(os.environ if env is None else env)
    squeue = shutil.which("squeue", path=env.get("PATH"))
    if squeue is None:
        return JobStates(None, "squeue is not on PATH")
    argv = [squeue, "-h", "-r", "-t", "all", "-o", "%A %T"]
    if not all_users:
        argv += ["-u", _user_name()]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return JobStates(None, f"squeue failed: {exc}")
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        detail = lines[-1][:160] if lines else "no message"  # the last line says why
        return JobStates(None, f"squeue exited {done.returncode}: {detail}")
    return JobStates(parse_squeue(done.stdout))
