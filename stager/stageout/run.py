"""stage-out: commit checkpoints from node-local scratch to persistent storage, atomically.

Per checkpoint, newest first:

1. take the checkpoint's node-local lock. All ranks of a job may call stage-out at once; one
   copies, the others wait here and then find the checkpoint committed with the same content
   (step 3) and return "already committed". ``flock`` dies with its holder, so a killed copier
   only hands the work to the next waiter;
2. snapshot: list and hash the files (cached by size+mtime, so waiters and watch passes only
   ``stat``);
3. skip when the destination already holds a record with the same content id;
4. check the deadline: if the estimated copy time exceeds the time left, say so in one line
   and copy nothing;
5. copy every file into a staging attempt, verifying size and hash
   (:mod:`stager.stageout.store`), re-check that the source did not change meanwhile, then commit
   (rename + record, or record last). Any failure or signal abandons the attempt, which leaves
   nothing visible.

Finally ``--keep N`` prunes all but the N newest committed checkpoints.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

from stager.errors import (
    CheckpointError,
    DeadlineTooShort,
    DestinationError,
    IntegrityError,
    ScratchFull,
    SourceError,
    UsageError,
)
from stager.slurm import SlurmEnv
from stager.stageout.deadline import Deadline
from stager.stageout.keep import newest_skipped, prune
from stager.stageout.outcome import (
    ALREADY,
    CHANGED,
    COMMITTED,
    FAILED,
    SKIPPED_DEADLINE,
    SKIPPED_KEEP,
    SKIPPED_UNSETTLED,
    Outcome,
    empty,
    unsettled,
)
from stager.stageout.record import KIND_DIR, CommitRecord, plan_keep
from stager.stageout.snapshot import (
    Snapshot,
    has_files,
    newest_mtime_ns,
    snapshot,
    state_dir,
)
from stager.stageout.store import CommitStore
from stager.stageout.stores import open_store
from stager.storage.hashing import hash_file
from stager.storage.lock import NodeLock
from stager.storage.throttle import Throttle
from stager.units import human_bytes

__all__ = ["StageOutOptions", "stage_out", "prune", "estimate_s", "check_outside_checkpoints"]


@dataclass(frozen=True)
class StageOutOptions:
    """Everything that tunes a stage-out run; the CLI builds this from its flags."""

    keep: int | None = None
    deadline: Deadline | None = None
    assume_mbps: float = 100.0  # copy-rate guess for the deadline check until one is measured
    bw_limit_mbps: float | None = None
    settle_s: float = 0.0  # skip checkpoints modified less than this long ago
    lock_timeout_s: float = 3600.0
    stale_s: float = 6 * 3600.0  # attempts from other nodes older than this are dead
    log: TextIO | None = None
    ckpt_dir: Path | None = None  # --all's directory: a DEST inside it is refused


@dataclass
class _Rate:
    """Bytes per second measured over this run's copies, for later deadline estimates."""

    nbytes: int = 0
    seconds: float = 0.0
    assumed_bps: float = 100e6

    def bps(self) -> float:
        if self.nbytes >= (8 << 20) and self.seconds > 0:
            return self.nbytes / self.seconds
        return self.assumed_bps


def estimate_s(nbytes: int, bytes_per_s: float) -> float:
    """Seconds to copy ``nbytes`` at ``bytes_per_s``, plus a fixed second for commit round trips."""
    return nbytes / max(bytes_per_s, 1.0) + 1.0


def _lock_path(ckpt: Path) -> Path:
    """Node-local lock of one checkpoint: beside it on scratch, else under the temp dir."""
    directory = state_dir(ckpt)
    try:
        directory.mkdir(exist_ok=True)
        return directory / f"{ckpt.name}.lock"
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"stager-stageout-{os.getuid()}"
        fallback.mkdir(mode=0o700, exist_ok=True)
        digest = hashlib.sha256(str(ckpt).encode()).hexdigest()[:16]  # stable across processes
        return fallback / f"{digest}-{ckpt.name}.lock"


def stage_out(
    ckpts: Sequence[str | os.PathLike[str]],
    dest_url: str,
    options: StageOutOptions | None = None,
    *,
    slurm: SlurmEnv | None = None,
    stop: threading.Event | None = None,
    say: Callable[[str, bool], None] | None = None,
) -> list[Outcome]:
    """Commit each checkpoint in ``ckpts`` under ``dest_url``, newest first; return the outcomes.

    ``stop`` (set by a signal in ``--watch``) is checked between checkpoints: the copy in flight
    always finishes or is abandoned atomically. Raises :class:`DestinationError` when the
    destination is unusable; per-checkpoint problems (deadline, source changing) are outcomes.
    ``say(line, news)`` prints each report line (default: to ``options.log``, else stderr);
    ``--watch`` passes one that drops a line its last pass said too, unless it is news (a
    commit, a cleanup, a prune: each an event, even in the same words as the last).
    """
    options = options or StageOutOptions()
    if options.keep is not None and options.keep < 1:
        raise UsageError("--keep must be at least 1: the newest checkpoint is never pruned")
    say = say or partial(_print_line, options.log or sys.stderr)
    slurm = slurm or SlurmEnv.from_environ()
    store = open_store(dest_url, stale_s=options.stale_s)
    check_outside_checkpoints(store, [Path(os.path.abspath(p)) for p in ckpts], options.ckpt_dir)
    store.check_writable()
    for name in store.clean_stale():
        say(f"stage-out: cleaned an interrupted stage-out of {name} at {store.url}", True)
    outcomes: list[Outcome] = []
    candidates = []
    for ckpt in (Path(os.path.abspath(p)) for p in ckpts):
        if has_files(ckpt):
            candidates.append(ckpt)
        else:  # before --keep ranks it
            outcomes.append(empty(ckpt.name, store.display(ckpt.name)))
            say(outcomes[-1].line(), False)
    mtimes = {p: newest_mtime_ns(p) for p in candidates}
    paths = sorted(mtimes, key=lambda p: (mtimes[p], p.name), reverse=True)
    if options.keep is not None:
        ranked, records = [(p.name, m) for p, m in mtimes.items()], store.records()
        wanted = set(plan_keep(ranked, records, options.keep))
        if paths and paths[0].name not in wanted:  # (the newest here: DEST's are dated later)
            say(newest_skipped(paths[0].name, mtimes[paths[0]], records, options.keep), False)
        dropped = [p for p in paths if p.name not in wanted]
        outcomes += [Outcome(p.name, SKIPPED_KEEP, url=store.display(p.name)) for p in dropped]
        paths = [p for p in paths if p.name in wanted]
    rate = _Rate(assumed_bps=options.assume_mbps * 1e6)
    throttle = Throttle(options.bw_limit_mbps * 1e6) if options.bw_limit_mbps else None
    full: DestinationError | None = None
    for ckpt in paths:
        if stop is not None and stop.is_set():
            break
        try:
            outcome = _stage_one(ckpt, mtimes[ckpt], store, options, slurm, rate, throttle, say)
        except (CheckpointError, DestinationError) as exc:  # this one only: the others go on
            if len(paths) == 1 or (isinstance(exc, DestinationError) and not dest_full(exc)):
                raise  # one line says it all; an unusable DEST fails every other one too
            if isinstance(exc, DestinationError):  # full: an older, smaller one may still fit
                full = full or exc
            outcome = Outcome(ckpt.name, FAILED, url=store.display(ckpt.name), message=str(exc))
        if outcome.status != SKIPPED_UNSETTLED or stop is None:  # (--watch: its next pass)
            say(outcome.line(), outcome.status == COMMITTED)
        outcomes.append(outcome)
    if options.keep is not None:
        for name in prune(store, options.keep):
            say(f"stage-out: pruned {name} (--keep {options.keep})", True)
    if full is not None:  # exit 5 as before, once what fits is committed
        raise full
    return outcomes


def dest_full(exc: BaseException) -> bool:
    """Whether ``exc`` (a :class:`DestinationError`) was DEST running out of space: its attempt
    is removed, so the space is back for the next, older checkpoint of ``--all``. Before, the
    first (newest, often largest) checkpoint that did not fit ended the run with nothing else
    committed, at the job's end too."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ScratchFull) or getattr(cause, "errno", None) in _FULL_ERRNOS:
            return True
        cause = cause.__cause__
    return False


#: errno values of a destination out of space (or of quota)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _print_line(log: TextIO, line: str, _news: bool) -> None:
    print(line, file=log, flush=True)


def check_outside_checkpoints(
    store: CommitStore, ckpts: Sequence[Path], ckpt_dir: Path | None = None
) -> None:
    """Refuse a local DEST that is a checkpoint or inside one, or inside ``--all``'s directory:
    each run would stage its own copies again (or commit a checkpoint onto itself)."""
    dest = store.local_root()
    if dest is None:
        return
    dest = os.path.realpath(dest)
    if any(dest == os.path.realpath(ckpt.parent) for ckpt in ckpts):  # DEST/NAME is itself
        raise UsageError(
            f"the destination {store.url} is the directory the checkpoints are in: each would "
            "be committed onto itself; pass a DEST outside it"
        )
    for where in map(os.path.realpath, [*ckpts, *([ckpt_dir] if ckpt_dir else [])]):
        if dest == where or dest.startswith(where.rstrip("/") + "/"):
            raise UsageError(
                f"the destination {store.url} is inside {where}, where the checkpoints are: "
                "each run would stage its own copies again; pass a DEST outside it"
            )


def _stage_one(
    ckpt: Path,
    mtime_ns: int,
    store: CommitStore,
    options: StageOutOptions,
    slurm: SlurmEnv,
    rate: _Rate,
    throttle: Throttle | None,
    say: Callable[[str, bool], None],
) -> Outcome:
    url = store.display(ckpt.name)
    if options.settle_s > 0 and time.time() - mtime_ns / 1e9 < options.settle_s:
        # from stats alone: a checkpoint still being written is not hashed (it would change)
        return unsettled(ckpt.name, url, options.settle_s)
    with NodeLock(_lock_path(ckpt), timeout_s=options.lock_timeout_s):
        snap = snapshot(ckpt)
        for rel in snap.skipped:
            say(
                f"stage-out: warning: skipped {rel!r} of {snap.name}: not a regular file (a "
                "FIFO, a socket or a symlink to nothing?)",
                False,
            )
        if snap.kind == KIND_DIR and not snap.files:  # emptied since it was listed
            return empty(snap.name, url)
        if options.settle_s > 0 and snap.age_s() < options.settle_s:
            return unsettled(snap.name, url, options.settle_s)
        existing = store.record(snap.name)
        if existing is not None and existing.content_id == snap.content_id:
            return Outcome(snap.name, ALREADY, snap.total_bytes, url=url)
        if options.deadline is not None:
            needed_s = estimate_s(snap.total_bytes, rate.bps())
            left_s = options.deadline.left_s()
            if needed_s > left_s:
                return Outcome(
                    snap.name,
                    SKIPPED_DEADLINE,
                    snap.total_bytes,
                    url=url,
                    message=(
                        f"not enough time to stage out {snap.name} "
                        f"({human_bytes(snap.total_bytes)}, ~{needed_s:.0f} s "
                        f"needed, {max(left_s, 0):.0f} s left by {options.deadline.source}); "
                        "skipped, nothing partial left"
                    ),
                )
        return _copy_and_commit(snap, store, options, slurm, rate, throttle, url)


def _copy_and_commit(
    snap: Snapshot,
    store: CommitStore,
    options: StageOutOptions,
    slurm: SlurmEnv,
    rate: _Rate,
    throttle: Throttle | None,
    url: str,
) -> Outcome:
    deadline = options.deadline

    def on_bytes(_n: int) -> None:
        if deadline is not None and deadline.left_s() <= 0:
            raise DeadlineTooShort(
                f"deadline ({deadline.source}) reached while copying {snap.name}; abandoned, "
                "nothing partial left"
            )

    started = time.monotonic()
    attempt = store.begin(snap.name)
    try:
        for f in snap.files:
            store.put_file(
                attempt,
                str(f.path),
                f.relpath,
                f.size,
                f.hash,
                throttle=throttle,
                on_bytes=on_bytes,
            )
        if snap.changed():
            raise IntegrityError(f"{snap.path} changed while it was copied")
        record = CommitRecord(
            name=snap.name,
            kind=snap.kind,
            entries=snap.entries,
            source_mtime_ns=snap.mtime_ns,
            committed_at=time.time(),
            host=slurm.node_name,
            job_id=slurm.job_id,
        )
        committed = store.commit(attempt, record)
    except (IntegrityError, SourceError):  # (a file of it gone, or no longer a file: changed)
        store.abandon(attempt)
        if _still_matches(snap):
            raise  # the bytes at the destination are wrong: a real integrity failure
        return Outcome(
            snap.name,
            CHANGED,
            url=url,
            message=(
                f"{snap.name} changed while it was copied; abandoned, nothing partial left; "
                "stage out again once the trainer has finished writing it"
            ),
        )
    except DeadlineTooShort as exc:
        store.abandon(attempt)
        return Outcome(snap.name, SKIPPED_DEADLINE, snap.total_bytes, url=url, message=str(exc))
    except BaseException:
        store.abandon(attempt)  # signal, kill of a thread, any error: leave nothing half visible
        raise
    seconds = time.monotonic() - started
    rate.nbytes += snap.total_bytes
    rate.seconds += seconds
    return Outcome(snap.name, COMMITTED if committed else ALREADY, snap.total_bytes, seconds, url)


def _still_matches(snap: Snapshot) -> bool:
    """True when the source still has exactly the snapshot's bytes (so it did not change)."""
    if snap.changed():
        return False
    try:
        return all(hash_file(f.path, f.hash.split(":", 1)[0]) == f.hash for f in snap.files)
    except OSError:
        return False
