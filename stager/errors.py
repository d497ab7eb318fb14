"""The exceptions stager raises, and the exit code each one maps to.

The tree::

    StagerError                      base of everything raised on purpose
    ├── UsageError(ValueError)       bad arguments or environment        exit 2
    ├── SourceError(OSError)         a source is missing or unreadable   exit 3
    │   └── ShardsFailed             some shards failed after retries    exit 3
    ├── IntegrityError               bytes differ from what was promised exit 4
    ├── DestinationError(OSError)    scratch/destination unusable        exit 5
    │   ├── ScratchFull              not enough free space               exit 6
    │   └── UnsafePath               path escapes the root / not ours    exit 5
    ├── CheckpointError              stage-out / restore problems        exit 7
    │   ├── DeadlineTooShort         not enough time left to commit one  exit 7
    │   └── NoCheckpoint             nothing committed at DEST yet       exit 9
    ├── LockTimeout(TimeoutError)    another copier never finished       exit 8
    └── AdoptedFailure               another task's failure, re-raised   its code

Low-level fsspec/OS errors are translated into these at one boundary (``stager.storage.copy`` for
bytes, ``stager.storage.sources`` for listing) so callers can catch one family. Each message names the
thing (URL, shard, path) and ends with what to do next.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_SOURCE",
    "EXIT_INTEGRITY",
    "EXIT_DEST",
    "EXIT_FULL",
    "EXIT_CHECKPOINT",
    "EXIT_LOCK",
    "EXIT_NO_CHECKPOINT",
    "StagerError",
    "UsageError",
    "SourceError",
    "ShardsFailed",
    "ShardFailure",
    "IntegrityError",
    "DestinationError",
    "ScratchFull",
    "UnsafePath",
    "CheckpointError",
    "DeadlineTooShort",
    "NoCheckpoint",
    "LockTimeout",
    "AdoptedFailure",
    "exit_code_for",
]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SOURCE = 3
EXIT_INTEGRITY = 4
EXIT_DEST = 5
EXIT_FULL = 6
EXIT_CHECKPOINT = 7
EXIT_LOCK = 8
EXIT_NO_CHECKPOINT = 9


class StagerError(Exception):
    """Base class: anything stager raises on purpose derives from this."""

    exit_code = 1


class UsageError(StagerError, ValueError):
    """The command line, an argument or an environment variable is wrong."""

    exit_code = EXIT_USAGE


class SourceError(StagerError, OSError):
    """A source URL cannot be listed or read."""

    exit_code = EXIT_SOURCE


@dataclass(frozen=True)
class ShardFailure:
    """One shard that could not be staged, with the reason shown to the user."""

    url: str
    reason: str

    def __str__(self) -> str:
        return f"FAILED {self.url}: {self.reason}"


class ShardsFailed(SourceError):
    """Some shards failed after all retries; the others were staged and stay valid."""

    def __init__(self, failures: list[ShardFailure]):
        self.failures = list(failures)
        super().__init__(
            f"{len(self.failures)} shard(s) failed after retries; "
            "the rest are staged, rerun stage-in to retry only the failed ones"
        )

    def detail_lines(self) -> list[str]:
        """One line per failed shard (URL and reason), printed before the summary error."""
        return [str(f) for f in self.failures]


class IntegrityError(StagerError):
    """Bytes on disk differ from the size or hash recorded for them."""

    exit_code = EXIT_INTEGRITY


class DestinationError(StagerError, OSError):
    """The destination (usually node-local scratch) cannot be used."""

    exit_code = EXIT_DEST


class ScratchFull(DestinationError):
    """Not enough free space at the destination; nothing was copied or the copy was undone."""

    exit_code = EXIT_FULL

    def __init__(
        self, message: str, *, needed_bytes: int = 0, free_bytes: int = 0, where: str = ""
    ):
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.where = where
        super().__init__(message)


class UnsafePath(DestinationError):
    """A path would escape its root, or a directory is a symlink or owned by someone else."""


class CheckpointError(StagerError):
    """A checkpoint could not be staged out or restored."""

    exit_code = EXIT_CHECKPOINT


class DeadlineTooShort(CheckpointError):
    """The time left before the job ends is too short to commit a checkpoint; nothing partial was left."""


class NoCheckpoint(CheckpointError):
    """The destination holds no committed checkpoint yet: a first start, not a failure to hide."""

    exit_code = EXIT_NO_CHECKPOINT


class LockTimeout(StagerError, TimeoutError):
    """Waited too long for another process holding the node-local lock."""

    exit_code = EXIT_LOCK


class AdoptedFailure(StagerError):
    """The copier on this node failed; a waiting task exits with the same code and message."""

    def __init__(self, message: str, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)


def exit_code_for(exc: BaseException) -> int:
    """The documented process exit code for an exception (1 for anything unexpected)."""
    if isinstance(exc, StagerError):
        return exc.exit_code
    return 1
