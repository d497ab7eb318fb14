"""What became of each checkpoint a stage-out was asked for, and the run's verdict on them.

Each checkpoint gets an :class:`Outcome` (a status and its line); a one-shot run then fails
(exit 7, or :class:`~stager.errors.DeadlineTooShort`) when any asked-for checkpoint was not
committed: :func:`check_outcomes`. ``--watch`` passes keep the outcomes to themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stager.errors import CheckpointError, DeadlineTooShort
from stager.units import human_bytes

__all__ = [
    "Outcome",
    "COMMITTED",
    "ALREADY",
    "SKIPPED_DEADLINE",
    "SKIPPED_UNSETTLED",
    "SKIPPED_KEEP",
    "CHANGED",
    "FAILED",
    "SKIPPED_EMPTY",
    "unsettled",
    "empty",
    "check_outcomes",
]

COMMITTED = "committed"  # this process copied and committed it
ALREADY = "already"  # committed earlier (or by a concurrent copier) with the same content
SKIPPED_DEADLINE = "skipped-deadline"  # not enough time left: nothing copied
SKIPPED_UNSETTLED = "skipped-unsettled"  # modified too recently (--watch): next pass
SKIPPED_KEEP = "skipped-keep"  # older than what --keep retains: copying it would be pruned at once
CHANGED = "changed"  # the source changed during the copy: abandoned, nothing visible
FAILED = "failed"  # could not be read or hashed (gone, changing, unreadable): the others go on
SKIPPED_EMPTY = "skipped-empty"  # a directory with no file yet: just created, not a checkpoint


@dataclass
class Outcome:
    """What happened to one checkpoint."""

    name: str
    status: str
    nbytes: int = 0
    seconds: float = 0.0
    url: str = ""
    message: str = ""

    def line(self) -> str:
        if self.status == COMMITTED:
            rate = self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
            return (
                f"stage-out: committed {self.name} ({human_bytes(self.nbytes)} in "
                f"{self.seconds:.1f} s, "
                f"{rate:.0f} MB/s) -> {self.url}"
            )
        if self.status == ALREADY:
            return f"stage-out: {self.name} already committed with the same content at {self.url}"
        return f"stage-out: {self.message}"


def unsettled(name: str, url: str, settle_s: float) -> Outcome:
    message = f"skipped {name}: still being written (changed within --settle {settle_s:g} s)"
    return Outcome(name, SKIPPED_UNSETTLED, url=url, message=message)


def empty(name: str, url: str) -> Outcome:
    message = f"skipped {name}: an empty directory (its files not written yet?)"
    return Outcome(name, SKIPPED_EMPTY, url=url, message=message)


#: What a one-shot stage-out did not commit of what it was asked for (exit 7): a checkpoint
#: still being written (``--settle``) or an empty directory is not committed either, and a job's
#: trap that took exit 0 for a commit lost it.
_MISSED = (SKIPPED_DEADLINE, CHANGED, FAILED, SKIPPED_UNSETTLED, SKIPPED_EMPTY)


def check_outcomes(outcomes: Sequence[Outcome]) -> None:
    """Raise when some requested checkpoint was not committed (deadline, source changing, still
    being written, empty)."""
    missed = [o for o in outcomes if o.status in _MISSED]
    if not missed:
        return
    names = ", ".join(o.name for o in missed)
    if all(o.status == SKIPPED_DEADLINE for o in missed):
        raise DeadlineTooShort(
            f"not committed for lack of time: {names}; earlier committed checkpoints are intact"
        )
    raise CheckpointError(
        f"not committed: {names} (see the lines above); earlier committed checkpoints are intact"
    )
