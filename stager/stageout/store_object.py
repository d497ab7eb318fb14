"""Publishing by commit marker, for object stores (s3://, gs://, memory://...) that cannot rename.

Files are uploaded straight to their final keys and their stored sizes checked; the record is
uploaded last in one PUT, and that PUT is the commit. An attempt given up removes its uploads,
so only a kill -9 leaves keys behind, which the next run removes (:meth:`clean_stale`).
"""

from __future__ import annotations

import contextlib

from stager.errors import IntegrityError, StagerError
from stager.stageout.record import CommitRecord
from stager.stageout.store import Attempt, CommitStore, dest_errors, signals_deferred
from stager.storage.hashing import new_hasher

__all__ = ["ObjectCommitStore"]

_BLOCK = 4 << 20


class ObjectCommitStore(CommitStore):
    """An object store (s3://, gs://, memory://...): upload to final keys, record last."""

    def check_writable(self) -> None:
        with dest_errors(self.url, "checking the destination"):
            self.fs.makedirs(self.staging_dir, exist_ok=True)

    def _write_small(self, path: str, payload: bytes) -> None:
        self.fs.pipe_file(path, payload)  # one PUT: atomic on object stores

    def begin(self, name: str) -> Attempt:
        attempt = super().begin(name)
        existing = self.record(name)
        if existing is not None:
            # Uploads overwrite NAME's keys in place: un-commit first so no reader pairs the
            # old record with new bytes.
            with dest_errors(self.url, f"replacing {name}"):
                self._remove_record(name)
        return attempt

    def put_file(self, attempt, src, relpath, size, hash_, *, throttle, on_bytes) -> None:
        remote = self.path(relpath)
        algorithm = hash_.split(":", 1)[0]
        hasher = new_hasher(algorithm)
        copied = 0
        with dest_errors(self.url, f"uploading {relpath}"):
            with open(src, "rb") as source:
                sink = self.fs.open(remote, "wb")
                try:
                    while block := source.read(_BLOCK):
                        hasher.update(block)
                        sink.write(block)
                        copied += len(block)
                        if throttle is not None:
                            throttle.consume(len(block))
                        if on_bytes is not None:
                            on_bytes(len(block))
                except BaseException:
                    # Closing would publish the bytes so far (s3fs completes the multipart
                    # upload); discard aborts it instead.
                    getattr(sink, "discard", lambda: None)()
                    raise
                sink.close()
            remote_size = self.fs.size(remote)
        if f"{algorithm}:{hasher.hexdigest()}" != hash_ or copied != size:
            raise IntegrityError(
                f"{src} changed while it was uploaded to {self.display(relpath)}; stage out again"
            )
        if remote_size != size:
            raise IntegrityError(
                f"{self.display(relpath)}: {remote_size} bytes stored, expected {size}"
            )

    def commit(self, attempt: Attempt, record: CommitRecord) -> bool:
        with dest_errors(self.url, f"committing {record.name}"):
            existing = self.record(record.name)
            if existing is not None and existing.content_id == record.content_id:
                self._finish(attempt)
                return False  # another copier committed the same bytes first
            with signals_deferred():
                if record.kind == "dir":
                    wanted = {self.path(e.relpath) for e in record.entries}
                    with contextlib.suppress(FileNotFoundError):
                        for key in self.fs.find(self.path(record.name)):
                            if key.rstrip("/") not in wanted:
                                self.fs.rm_file(key)  # left from an older content of the same name
                self._write_small(self.record_path(record.name), record.to_json().encode())
                self._finish(attempt)
        return True

    def abandon(self, attempt: Attempt) -> None:
        """Uploads went to NAME's final keys: remove them too, unless NAME is committed (by a
        concurrent copier) or another live attempt is uploading it."""
        with contextlib.suppress(OSError, StagerError):
            others = [
                a
                for a in self._attempts()
                if a[0] != attempt.token and a[2].get("name") == attempt.name
            ]
            if self.record(attempt.name) is None and not any(
                self._is_live(t, i, s) for t, s, i in others
            ):
                self._remove_data(attempt.name)
        super().abandon(attempt)

    def _remove_record(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.record_path(name))

    def _remove_data(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=True)
