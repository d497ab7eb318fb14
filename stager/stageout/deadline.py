"""How long stage-out may take: ``--deadline-s``, or the Slurm job's end time.

Inside a job the end time comes from ``squeue -h -j $SLURM_JOB_ID -o %e`` (one line such as
``2026-11-22T02:00:00``, in the controller's local time), falling back to the ``EndTime=`` field
of ``scontrol show job``. Either command may be missing (login node without Slurm client,
container) or say ``Unknown``/``N/A`` for a job without a limit: then there is no deadline.
The parsers are pure and tested on the documented formats; only :func:`slurm_job_end_epoch`
runs processes.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from stager.slurm import SlurmEnv

__all__ = [
    "Deadline",
    "parse_slurm_time",
    "parse_scontrol_end_time",
    "slurm_job_end_epoch",
    "resolve_deadline",
    "DEADLINE_MARGIN_S",
]

_NO_TIME = {"", "unknown", "n/a", "none", "invalid", "(null)"}

#: Seconds kept before the job's end time, for the commit itself to finish.
DEADLINE_MARGIN_S = 10.0


def parse_slurm_time(text: str) -> float | None:
    """``2026-11-22T02:00:00`` (local time) -> epoch seconds; None for Unknown/N/A/garbage."""
    text = text.strip()
    if text.lower() in _NO_TIME:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_scontrol_end_time(text: str) -> float | None:
    """The ``EndTime=`` field of ``scontrol show job`` output, as epoch seconds (or None)."""
    match = re.search(r"\bEndTime=(\S+)", text)
    return parse_slurm_time(match.group(1)) if match else None


Runner = Callable[[Sequence[str]], str]


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=True)
    return done.stdout


def slurm_job_end_epoch(job_id: str, *, run: Runner = _run) -> float | None:
    """The job's scheduled end from squeue, else scontrol; None when neither can tell."""
    for argv, parse in (
        (
            ["squeue", "-h", "-j", job_id, "-o", "%e"],
            lambda out: parse_slurm_time(out.strip().splitlines()[0] if out.strip() else ""),
        ),
        (["scontrol", "show", "job", job_id], parse_scontrol_end_time),
    ):
        try:
            end = parse(run(argv))
        except (OSError, subprocess.SubprocessError, IndexError):
            continue  # command missing, failing or hanging: try the next source
        if end is not None:
            return end
    return None


@dataclass(frozen=True)
class Deadline:
    """A point in (monotonic) time by which stage-out must be done, and where it came from."""

    at_monotonic: float
    source: str  # "--deadline-s" | "slurm end time"

    def left_s(self, now: float | None = None) -> float:
        return self.at_monotonic - (time.monotonic() if now is None else now)

    @classmethod
    def in_s(cls, seconds: float, source: str) -> Deadline:
        return cls(time.monotonic() + seconds, source)


def resolve_deadline(
    deadline_s: float | None,
    slurm: SlurmEnv,
    *,
    margin_s: float = DEADLINE_MARGIN_S,
    end_epoch: Callable[[str], float | None] = slurm_job_end_epoch,
) -> Deadline | None:
    """``--deadline-s`` when given, else the job's end minus ``margin_s`` inside Slurm, else None.

    The margin leaves time for the batch script's own exit after stage-out returns.
    """
    if deadline_s is not None:
        return Deadline.in_s(deadline_s, "--deadline-s")
    if not slurm.in_slurm:
        return None
    end = end_epoch(slurm.job_id)
    if end is None:
        return None
    return Deadline.in_s(end - time.time() - margin_s, "slurm end time")
