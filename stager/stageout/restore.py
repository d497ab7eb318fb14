"""Restore: bring the newest committed checkpoint back to node-local scratch.

Only checkpoints with a commit record are candidates (:mod:`stager.stageout.store`), newest first.
Every file is copied into a private staging directory and verified against the record's size
and hash before one rename publishes ``<root>/<name>``; a checkpoint that fails verification
(bit rot, a file deleted by hand) is reported on stderr and the next newest is tried, so a
requeued job resumes from the best checkpoint that is actually whole.

All ranks of a node may call it at once: one copies under the node lock, the others find the
restored copy (``<root>/.stager-restored/<name>.json`` holds its content id) and return its path.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import TextIO

from stager.errors import (
    CheckpointError,
    DestinationError,
    IntegrityError,
    NoCheckpoint,
    SourceError,
    StagerError,
    one_line,
)
from stager.layout import RESTORE_LOCK, RESTORE_STAGING_PREFIX, RESTORED_DIR
from stager.stageout.record import CommitRecord, newest_first
from stager.stageout.store import CommitStore, signals_deferred
from stager.stageout.stores import open_store
from stager.storage.copy import copy_file
from stager.storage.dest import ensure_private_dir
from stager.storage.identity import local_version
from stager.storage.lock import NodeLock
from stager.storage.paths import PARTIAL_SUFFIX, safe_join

__all__ = ["restore_checkpoint", "RESTORED_DIR"]

_STAGING_PREFIX = RESTORE_STAGING_PREFIX


def _restored_marker(root: Path, name: str) -> Path:
    return root / RESTORED_DIR / f"{name}.json"


def _already_restored(root: Path, record: CommitRecord) -> bool:
    """The local copy was restored from this exact content and no file of it has changed since
    (each file's size and version, ``inode:mtime:ctime``, as restored: a file changed in place
    at the same size was trusted by its size, and a requeued job loaded the damaged copy)."""
    try:
        payload = json.loads(_restored_marker(root, record.name).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(payload, dict) or payload.get("content_id") != record.content_id:
        return False
    versions = payload.get("versions")
    try:
        found = {e.relpath: _version(root, e.relpath, e.size) for e in record.entries}
    except OSError:
        return False
    return isinstance(versions, dict) and found == versions


def _version(root: Path, relpath: str, size: int) -> str | None:
    """The restored file's version, or None where its size is not the record's."""
    st = safe_join(root, relpath).stat()
    return local_version(st) if st.st_size == size else None


def _copy_record(store: CommitStore, record: CommitRecord, staging: Path) -> None:
    if record.kind == "dir":
        (staging / record.name).mkdir(parents=True, exist_ok=True)
    for entry in record.entries:
        copy_file(
            store.fs,
            store.path(entry.relpath),
            safe_join(staging, entry.relpath),
            url=store.display(entry.relpath),
            expected_size=entry.size,
            expected_hash=entry.hash,
        )


def _publish(root: Path, staging: Path, record: CommitRecord) -> Path:
    target = root / record.name
    marker = _restored_marker(root, record.name)
    marker.unlink(missing_ok=True)  # the old local copy is no longer known to match anything
    if os.path.lexists(target):
        os.rename(target, staging / "old")
    os.rename(staging / record.name, target)
    marker.parent.mkdir(exist_ok=True)
    tmp = marker.with_name(marker.name + PARTIAL_SUFFIX)
    versions = {e.relpath: _version(root, e.relpath, e.size) for e in record.entries}
    payload = {"content_id": record.content_id, "source": record.name, "versions": versions}
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, marker)
    return target


def _restore_error(exc: Exception, name: str, root: Path, dest_url: str) -> DestinationError:
    """One line for a restore that failed on the local side (``root``: full, read-only) or on
    the store's (unreachable, throttling: a store's client raises its own errors, and an
    OSError of the store's was blamed on the local directory). Exit 5 either way."""
    filename = getattr(exc, "filename", None)
    local = isinstance(filename, str) and filename.startswith(str(root))
    if isinstance(exc, OSError) and (local or exc.errno in _LOCAL_ERRNOS):
        return DestinationError(
            f"cannot restore {name} into {root}: {exc.strerror or exc}; free space or pass "
            "--dest to a usable directory"
        )
    return DestinationError(
        f"cannot read {name} from {dest_url}: {one_line(exc)}; check the store (reachable? "
        "credentials?) and rerun"
    )


#: What the local side of a restore fails with (the store's failures are other errors).
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def restore_checkpoint(
    dest_url: str, local_root: str | os.PathLike[str], *, log: TextIO | None = None
) -> Path:
    """Copy the newest committed checkpoint at ``dest_url`` to ``local_root/<name>``; return it.

    Raises :class:`NoCheckpoint` when nothing is committed yet (a first start), and
    :class:`CheckpointError` when checkpoints are committed but none could be restored whole.
    """
    log = log or sys.stderr
    store = open_store(dest_url)

    bad: list[CheckpointError] = []

    def on_bad(exc: CheckpointError) -> None:
        bad.append(exc)
        print(f"stage-in: warning: {' '.join(str(exc).split())}", file=log, flush=True)

    records = newest_first(store.records(on_bad=on_bad))
    if not records and bad:  # something was committed: starting from scratch would lose it
        raise CheckpointError(
            f"{len(bad)} commit record(s) at {dest_url} but none is readable (see the warnings "
            "above); not starting from scratch over them"
        )
    unrecorded = [] if records else store.unrecorded()
    if unrecorded:  # a stage-out killed while committing: its previous version is gone
        raise CheckpointError(
            f"{store.display(unrecorded[0])} has no commit record: a stage-out was killed while "
            "committing it (after its previous version was removed); not starting from scratch "
            "over it. Commit it again with stage-out from the scratch that holds it, or remove it "
            "to start afresh"
        )
    if not records:
        store.check_container()  # (a bucket that does not exist is a typo: exit 5, not 9)
        raise NoCheckpoint(
            f"no committed checkpoint at {dest_url} yet; start from scratch (exit code 9 means "
            "this)"
        )
    root = ensure_private_dir(local_root)
    with NodeLock(root / RESTORE_LOCK):
        # Holding the lock, no one on this node is restoring: leftovers are from killed runs.
        for leftover in root.glob(f"{_STAGING_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        damaged = []
        for record in records:
            if _already_restored(root, record):
                return root / record.name
            staging = root / f"{_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                staging.mkdir()
                _copy_record(store, record, staging)
                with signals_deferred():  # (a SIGTERM between its renames: the old copy lost)
                    return _publish(root, staging, record)
            except (IntegrityError, SourceError, FileNotFoundError) as exc:
                damaged.append(record.name)
                print(
                    f"stage-in: warning: committed checkpoint {record.name} at {dest_url} cannot "
                    "be restored "
                    f"({' '.join(str(exc).split())}); trying the next newest",
                    file=log,
                    flush=True,
                )
            except StagerError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store's own (botocore's), or the disk's
                raise _restore_error(exc, record.name, root, dest_url) from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    raise CheckpointError(
        f"{len(damaged)} committed checkpoint(s) at {dest_url} but none could be restored whole "
        f"({', '.join(damaged)}); see the warnings above"
    )
