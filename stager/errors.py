"""Every exception stager and its loader raise on purpose, and the exit code of each.

The tree (exit codes are fixed by the class, never set on an instance)::

    StagerError                        base of everything raised on purpose       exit 1
    ├── UsageError(ValueError)         bad arguments, environment or input file   exit 2
    │   └── ResumeMismatch             a saved loader state does not fit          exit 2
    ├── SourceError(OSError)           a source is missing or unreadable          exit 3
    │   └── ShardsFailed               shards failed after retries; rest staged   exit 3
    ├── IntegrityError                 bytes differ from what was promised        exit 4
    │   ├── SizeMismatch               the copy's size differs from the listing   exit 4
    │   ├── HashMismatch               the copy differs from the manifest         exit 4
    │   └── ShardsCorrupt              shards failed an integrity check           exit 4
    ├── DestinationError(OSError)      scratch or destination unusable            exit 5
    │   ├── ScratchFull                not enough free space                      exit 6
    │   ├── PathBlocked                something in the way of one shard's name   exit 5
    │   └── UnsafePath                 a path escapes its root / is not ours      exit 5
    ├── CheckpointError                stage-out or restore failed                exit 7
    │   ├── DeadlineTooShort           too little time left to commit one         exit 7
    │   └── NoCheckpoint               nothing committed at DEST yet              exit 9
    ├── LockTimeout(TimeoutError)      another copier held the node lock too long exit 8
    ├── FanoutError                    a peer failed after the node group formed  exit 10
    │   └── GroupUnavailable           the group never formed (plain copy follows)
    └── StagingStopped                 background staging stopped before the end  exit 11

Interrupted by Ctrl-C or SIGINT: exit 130. Anything else unexpected: a traceback and exit 1.

Low-level fsspec/OS errors are translated into these at one boundary each
(:mod:`stager.storage.copy` for bytes, :mod:`stager.storage.sources` for listing), so callers
catch one family. Each message names the thing (URL, shard, path) and ends with what to do.
:data:`EXIT_CODES` is the one table that ``--help``, the README and docs/cli.md are written from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_SOURCE",
    "EXIT_INTEGRITY",
    "EXIT_DEST",
    "EXIT_FULL",
    "EXIT_CHECKPOINT",
    "EXIT_LOCK",
    "EXIT_NO_CHECKPOINT",
    "EXIT_FANOUT",
    "EXIT_STAGING_STOPPED",
    "EXIT_INTERRUPTED",
    "EXIT_CODES",
    "StagerError",
    "UsageError",
    "ResumeMismatch",
    "SourceError",
    "ShardsFailed",
    "ShardFailure",
    "FAILURE_KINDS",
    "failure_kind",
    "one_line",
    "rebuild_error",
    "IntegrityError",
    "SizeMismatch",
    "HashMismatch",
    "ShardsCorrupt",
    "DestinationError",
    "ScratchFull",
    "PathBlocked",
    "UnsafePath",
    "CheckpointError",
    "DeadlineTooShort",
    "NoCheckpoint",
    "LockTimeout",
    "FanoutError",
    "GroupUnavailable",
    "StagingStopped",
    "exit_code_for",
    "error_class",
    "shard_failures",
    "exit_codes_text",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3
EXIT_INTEGRITY = 4
EXIT_DEST = 5
EXIT_FULL = 6
EXIT_CHECKPOINT = 7
EXIT_LOCK = 8
EXIT_NO_CHECKPOINT = 9
EXIT_FANOUT = 10
EXIT_STAGING_STOPPED = 11
EXIT_INTERRUPTED = 130

#: Exit code -> what it means; the README, ``--help`` and docs/cli.md are generated from this.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILURE: "unexpected error (a bug: the traceback says where)",
    EXIT_USAGE: "usage error: bad arguments, environment, manifest or loader state",
    EXIT_SOURCE: "source error: missing or unreadable source, shards failed after retries",
    EXIT_INTEGRITY: "integrity error: a copy differs from its manifest, or a shard is corrupt",
    EXIT_DEST: "destination error: scratch or destination unusable, read-only or unsafe",
    EXIT_FULL: "scratch full: not enough free space (nothing partial is left)",
    EXIT_CHECKPOINT: "checkpoint error: stage-out or restore failed",
    EXIT_LOCK: "lock timeout: another copier held the node's lock too long",
    EXIT_NO_CHECKPOINT: "no checkpoint committed at the destination yet (a first start)",
    EXIT_FANOUT: "--fanout: a peer node failed after the group formed (rerun to resume)",
    EXIT_STAGING_STOPPED: "--background: the copier stopped (signal, or died) before staging "
    "everything",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C; SIGTERM in a foreground stage-in or a one-shot "
    "stage-out; a --fanout stage-in dies by SIGTERM, 143); rerun to resume",
}


def exit_codes_text(codes: Iterable[int] | None = None) -> str:
    """``"0 success; 2 usage error: ...; ..."``: the table as one paragraph for ``--help``."""
    chosen = sorted(EXIT_CODES) if codes is None else list(codes)
    return "; ".join(f"{code} {EXIT_CODES[code]}" for code in chosen)


class StagerError(Exception):
    """Base class: anything stager raises on purpose derives from this."""

    exit_code = EXIT_FAILURE


class UsageError(StagerError, ValueError):
    """The command line, an argument, an environment variable or an input file is wrong."""

    exit_code = EXIT_USAGE


class ResumeMismatch(UsageError):
    """``load_state_dict`` got a state saved for another dataset, world or batch size."""

    def __init__(self, differences: Sequence[str] | str):
        self.differences = [differences] if isinstance(differences, str) else list(differences)
        super().__init__(
            "cannot resume the loader: "
            + "; ".join(self.differences)
            + ". Resume with the same dataset, world size and batch size, or start the epoch afresh"
        )


class SourceError(StagerError, OSError):
    """A source URL cannot be listed or read."""

    exit_code = EXIT_SOURCE


#: Why a shard failed: its source (missing, unreadable, flaky), its bytes (corrupt, changed),
#: or the destination (full, or read-only). The kinds decide the run's exit code
#: (:func:`shard_failures`, :mod:`stager.stagein.finish`).
FAILURE_KINDS = ("source", "corrupt", "full", "dest")


@dataclass(frozen=True)
class ShardFailure:
    """One shard that could not be staged, with the reason shown to the user."""

    url: str
    reason: str
    kind: str = "source"  # one of FAILURE_KINDS

    def __post_init__(self) -> None:
        # "FAILED url: url: ..." where the error's own text begins with the URL (an OSError's
        # filename, a fan-out owner's line passed on): the FAILED line names it already.
        object.__setattr__(self, "reason", self.reason.removeprefix(f"{self.url}: "))

    def __str__(self) -> str:
        return f"FAILED {one_line(self.url)}: {self.reason}"


def failure_kind(exc: BaseException) -> str:
    """The :data:`FAILURE_KINDS` entry of a shard whose copy raised ``exc``."""
    if isinstance(exc, ScratchFull):
        return "full"
    if isinstance(exc, DestinationError):
        return "dest"
    if isinstance(exc, IntegrityError) and not exc.transient:
        return "corrupt"
    return "source"


def one_line(value: object) -> str:
    """``str(value)`` on one line: whitespace runs (newlines in file names too) become one space.

    Every message stager prints is one line per event, so a log can be grepped and a name
    containing a newline cannot forge a second line.
    """
    text = str(value)
    if not text and isinstance(value, BaseException):
        text = type(value).__name__
    return " ".join(text.split())


class _Failures:
    """Mixed into the errors that carry one line per failed shard."""

    failures: list[ShardFailure]

    def detail_lines(self) -> list[str]:
        """One line per failed shard (URL and reason), printed before the summary error."""
        return [str(f) for f in self.failures]


class ShardsFailed(_Failures, SourceError):
    """Some shards failed after all retries; the others were staged and stay valid."""

    def __init__(self, failures: Iterable[ShardFailure] = (), message: str | None = None):
        self.failures = list(failures)
        super().__init__(
            message
            or f"{len(self.failures)} shard(s) failed after retries; "
            "any others are staged, rerun stage-in to retry only the failed ones"
        )


class IntegrityError(StagerError):
    """Bytes on disk differ from the size or hash recorded for them, or a shard is corrupt."""

    exit_code = EXIT_INTEGRITY
    #: Whether a retry may help (a file still being written) or not (the bytes are wrong).
    transient = False


class SizeMismatch(IntegrityError):
    """The copy's size differs from the listing's: the file may be changing; worth a retry."""

    transient = True


class HashMismatch(IntegrityError):
    """The copy differs from the manifest (its hash or size): the source changed or is corrupt."""


class ShardsCorrupt(_Failures, IntegrityError):
    """Some shards failed an integrity check (hash, size or tar); the others are staged."""

    def __init__(self, failures: Iterable[ShardFailure] = (), message: str | None = None):
        self.failures = list(failures)
        corrupt = sum(f.kind == "corrupt" for f in self.failures)
        others = len(self.failures) - corrupt
        also = f" and {others} other(s) failed after retries" if others else ""
        super().__init__(
            message
            or f"{corrupt} shard(s) differ from their manifest or are corrupt{also}; any "
            "others are staged. Fix the source (or re-run stager index if the change is "
            "intended) and rerun"
        )


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


class PathBlocked(DestinationError):
    """Something in scratch is in the way of one shard's name (a directory of that name): that
    shard fails, and the others go on, where a scratch that is unusable stops every copy."""


class UnsafePath(DestinationError):
    """A path would escape its root, or a directory is a symlink or owned by someone else."""


class CheckpointError(StagerError):
    """A checkpoint could not be staged out or restored."""

    exit_code = EXIT_CHECKPOINT


class DeadlineTooShort(CheckpointError):
    """Too little time is left before the job ends to commit a checkpoint; nothing partial left."""


class NoCheckpoint(CheckpointError):
    """The destination holds no committed checkpoint yet: a first start, not a failure to hide."""

    exit_code = EXIT_NO_CHECKPOINT


class LockTimeout(StagerError, TimeoutError):
    """Waited too long for another process holding the node-local lock."""

    exit_code = EXIT_LOCK


class FanoutError(StagerError):
    """The fan-out failed after the node group formed (a peer died, hung, or disagreed)."""

    exit_code = EXIT_FANOUT


class GroupUnavailable(FanoutError):
    """The node group could not form in time; nothing was exchanged, plain copying is safe."""


class StagingStopped(StagerError):
    """A background stage-in stopped (a signal, the job's end, or it died) before staging every
    shard: what it published stays valid, nothing partial is left, a rerun copies the rest."""

    exit_code = EXIT_STAGING_STOPPED


def shard_failures(
    failures: Iterable[ShardFailure], *, message: str | None = None
) -> ShardsFailed | ShardsCorrupt:
    """The error for a run that lost shards: integrity (exit 4) if any was corrupt, else source (3).

    A full destination is not decided here: the caller raises :class:`ScratchFull` first.
    """
    failures = list(failures)
    if any(f.kind == "corrupt" for f in failures):
        return ShardsCorrupt(failures, message)
    return ShardsFailed(failures, message)


def exit_code_for(exc: BaseException) -> int:
    """The documented process exit code for an exception (1 for anything unexpected)."""
    if isinstance(exc, StagerError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILURE


def error_class(name: str) -> type[StagerError]:
    """The class of this module called ``name`` (StagerError for an unknown name).

    A task that waited on another task's stage-in re-raises that task's failure as the same
    class, so its exit code and ``except`` clauses match what the copier saw.
    """
    found = globals().get(name)
    if isinstance(found, type) and issubclass(found, StagerError):
        return found
    return StagerError


def rebuild_error(class_name: str, message: str) -> StagerError:
    """An instance of ``class_name`` carrying ``message`` (see :func:`error_class`)."""
    cls = error_class(class_name)
    if issubclass(cls, (ShardsFailed, ShardsCorrupt)):
        return cls((), message)
    if issubclass(cls, ResumeMismatch):
        return cls(message)
    try:
        return cls(message)
    except TypeError:
        return StagerError(message)
