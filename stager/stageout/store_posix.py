"""Publishing by rename, for a DEST that is a POSIX path (local disk, NFS, Lustre, GPFS).

Files are copied into the attempt's staging directory with ``fsync``, the directories are
fsynced bottom-up, the checkpoint moves to ``DEST/NAME`` by one ``rename`` (same filesystem:
staging lives under ``DEST/.stager``), ``DEST`` is fsynced, and only then is the record written
(temp file, fsync, rename, fsync of ``commits/``). See :mod:`stager.stageout.store` for the layout.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from stager.errors import DestinationError, IntegrityError, ScratchFull
from stager.stageout.record import CommitRecord
from stager.stageout.store import (
    META_DIR,
    Attempt,
    CommitStore,
    dest_errors,
    fsync_dir,
    host_name,
    signals_deferred,
)
from stager.storage.copy import copy_file
from stager.storage.paths import PARTIAL_SUFFIX

__all__ = ["LocalCommitStore"]


class LocalCommitStore(CommitStore):
    """A POSIX path: publish by one rename, fsync files and directories for durability."""

    def local_root(self) -> str | None:
        return self.root

    def check_writable(self) -> None:
        with dest_errors(self.url, "creating .stager/"):
            os.makedirs(self.staging_dir, exist_ok=True)
            os.makedirs(self.commits_dir, exist_ok=True)
            probe = self.path(META_DIR, f".probe-{os.getpid()}-{secrets.token_hex(2)}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)

    def _write_small(self, path: str, payload: bytes) -> None:
        directory = posixpath.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{host_name()}__{os.getpid()}{PARTIAL_SUFFIX}"  # clean_stale reads it
        try:
            with open(tmp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(directory)

    def put_file(self, attempt, src, relpath, size, hash_, *, throttle, on_bytes) -> None:
        final = Path(attempt.staging, "data", relpath)
        with dest_errors(self.url, f"writing {relpath}"):
            try:
                copy_file(
                    LocalFileSystem(),
                    src,
                    final,
                    url=src,
                    expected_size=size,
                    expected_hash=hash_,
                    throttle=throttle,
                    on_bytes=on_bytes,
                    fsync=True,
                )
            except ScratchFull as exc:  # copy_file's message speaks of scratch
                raise DestinationError(
                    f"destination {self.url} is full while writing {relpath}; "
                    "free space or prune with --keep"
                ) from exc
            written = final.stat().st_size
        if written != size:
            raise IntegrityError(
                f"{self.display(relpath)}: {written} bytes on the destination, expected {size}"
            )

    def commit(self, attempt: Attempt, record: CommitRecord) -> bool:
        data_root = posixpath.join(attempt.staging, "data")
        target = self.path(record.name)
        with dest_errors(self.url, f"committing {record.name}"):
            staged = posixpath.join(data_root, record.name)
            if record.kind == "dir" and not os.path.isdir(staged):
                os.makedirs(staged)  # an empty checkpoint directory
            for directory, _, _ in sorted(os.walk(data_root), key=lambda w: -w[0].count("/")):
                fsync_dir(directory)  # bottom-up: file names are durable before the rename
            with self._committing():
                committed = self._publish(attempt, record, staged, target)
        return committed

    @contextlib.contextmanager
    def _committing(self) -> Iterator[None]:
        """One commit at a time at this DEST (``flock`` on ``.stager/commit.lock``: across
        processes, and across hosts where the filesystem's locks reach, as NFSv4's do). Two
        stage-outs of one name with different bytes, from two scratch directories (their
        node-local locks differ), could otherwise interleave the renames and leave a record
        describing the other one's bytes. The section is the renames and the record's write,
        not the copy: one lock for every name costs nothing, and leaves no file per name."""
        path = self.path(META_DIR, "commit.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:  # a filesystem without locks: as before, unlocked
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
            yield
        finally:
            os.close(fd)

    def _publish(self, attempt: Attempt, record: CommitRecord, staged: str, target: str) -> bool:
        """The commit proper, under :meth:`_committing`."""
        existing = self.record(record.name)
        if existing is not None and existing.content_id == record.content_id:
            self._finish(attempt)
            return False  # another copier committed the same bytes first
        with signals_deferred():
            if existing is not None:
                self._remove_record(record.name)
            if os.path.lexists(target):
                os.rename(target, posixpath.join(attempt.staging, "old"))  # old or orphan data
            os.rename(staged, target)
            fsync_dir(self.root)
            try:
                self._write_small(self.record_path(record.name), record.to_json().encode())
            except BaseException:  # (a full DEST): the data goes back to the attempt,
                with contextlib.suppress(OSError):  # which the caller abandons
                    os.rename(target, posixpath.join(attempt.staging, "unrecorded"))
                raise
            self._finish(attempt)
        return True

    def _remove_record(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.record_path(name))
            fsync_dir(self.commits_dir)

    def _remove_data(self, name: str) -> None:
        target = self.path(name)
        if not os.path.lexists(target):
            return
        # Move aside first: a kill during rmtree then leaves garbage in staging, not a torn NAME.
        trash = posixpath.join(
            self.staging_dir, f"{host_name()}__{os.getpid()}__{secrets.token_hex(4)}"
        )
        os.makedirs(trash, exist_ok=True)
        os.rename(target, posixpath.join(trash, "old"))
        shutil.rmtree(trash, ignore_errors=True)

    def _rm_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
