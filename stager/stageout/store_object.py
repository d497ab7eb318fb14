"""Publishing by commit marker, for object stores (s3://, gs://, memory://...) that cannot rename.

Files are uploaded under the attempt's staging keys and their stored sizes checked; the commit
copies them to their final keys inside the store (no bytes through this node), then uploads
the record in one PUT, and that PUT is the commit. A checkpoint committed under the same name
stays committed while the new one uploads: uploaded straight to the final keys, a re-stage
had to un-commit it first, and an upload that then failed (a deadline, a source that changed,
the store gone) left no checkpoint of that name, and a requeued job started from scratch. An
attempt given up removes its staging keys, so only a kill -9 leaves keys behind, which the next
run removes (:meth:`clean_stale`).
"""

from __future__ import annotations

import contextlib
import posixpath

from stager.errors import DestinationError, IntegrityError, SourceError
from stager.stageout.record import CommitRecord
from stager.stageout.store import Attempt, CommitStore, dest_errors, signals_deferred
from stager.storage.hashing import new_hasher

__all__ = ["ObjectCommitStore"]

_BLOCK = 4 << 20
#: Object stores whose first path component is a bucket, which ``makedirs`` would create.
_BUCKET_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az", "abfss"}


class ObjectCommitStore(CommitStore):
    """An object store (s3://, gs://, memory://...): upload to staging keys, copy to the final
    keys at commit, record last."""

    def check_writable(self) -> None:
        with dest_errors(self.url, "checking the destination"):
            self.check_container()
            self.fs.makedirs(self.staging_dir, exist_ok=True)

    def check_container(self) -> None:
        """Refuse a bucket that does not exist: ``makedirs`` creates one (s3fs, gcsfs), so a
        typo in DEST made a new bucket and committed the job's checkpoints there, where the
        requeued job's restore would never look."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if not set(protocols) & _BUCKET_STORES:
            return
        bucket = self.staging_dir.lstrip("/").split("/", 1)[0]
        if not bucket or self.fs.exists(bucket):  # (s3fs probes it two ways, as makedirs does)
            return
        with dest_errors(self.url, "looking for its bucket"):
            try:  # why not: exists() also answers False for an endpoint it cannot reach
                self.fs.info(bucket)
            except FileNotFoundError:
                raise DestinationError(
                    f"destination {self.url}: bucket {bucket!r} does not exist (a typo?); "
                    "create it first, or pass another DEST"
                ) from None
            except PermissionError:
                return  # a bucket these credentials may not probe (a prefix's): as before

    def _write_small(self, path: str, payload: bytes) -> None:
        self.fs.pipe_file(path, payload)  # one PUT: atomic on object stores

    def _staged(self, attempt: Attempt, relpath: str) -> str:
        return posixpath.join(attempt.staging, "data", relpath)

    def put_file(self, attempt, src, relpath, size, hash_, *, throttle, on_bytes) -> None:
        remote = self._staged(attempt, relpath)
        algorithm = hash_.split(":", 1)[0]
        hasher = new_hasher(algorithm)
        copied = 0
        try:
            source_file = open(src, "rb")  # (the checkpoint's side: not the destination's)
        except OSError as exc:
            raise SourceError(f"checkpoint file {src} cannot be read: {exc.strerror}") from exc
        with dest_errors(self.url, f"uploading {relpath}"):
            with source_file as source:
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
                    # (closed, or collecting it "closes" the discarded buffer: a traceback
                    # printed after the run's one line)
                    with contextlib.suppress(Exception):
                        sink.closed = True
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
                if existing is not None:  # (NAME's keys change now: no reader pairs old and new)
                    self._remove_record(record.name)
                try:
                    self._place(attempt, record)
                except BaseException:
                    with contextlib.suppress(Exception):  # (neither the old nor the new)
                        self._remove_data(record.name)
                    raise
                self._write_small(self.record_path(record.name), record.to_json().encode())
                self._finish(attempt)
        return True

    def _place(self, attempt: Attempt, record: CommitRecord) -> None:
        """Copy the attempt's uploads to their final keys, inside the store; remove the keys of
        an older content of the same name that the new one does not have."""
        for entry in record.entries:
            final = self.path(entry.relpath)
            # cp_file, not copy: copy expands * ? [ in a name as a glob (a1b for a*b)
            self.fs.cp_file(self._staged(attempt, entry.relpath), final)
            if self.fs.size(final) != entry.size:
                raise IntegrityError(f"{self.display(entry.relpath)}: copied short in the store")
        if record.kind == "dir":
            wanted = {self.path(e.relpath) for e in record.entries}
            with contextlib.suppress(FileNotFoundError):
                for key in self.fs.find(self.path(record.name)):
                    if key.rstrip("/") not in wanted:
                        self.fs.rm_file(key)  # left from an older content of the same name

    def _remove_record(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.record_path(name))

    def _remove_data(self, name: str) -> None:
        """Delete NAME's keys, named one by one: ``rm`` expands * ? [ in a name as a glob, and
        a failed commit of ``a*b`` deleted the committed ``a1b`` under its record."""
        for key in self._keys_of(self.path(name)):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(key)

    def _rm_tree(self, path: str) -> None:
        for key in self._keys_of(path):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(key)
        self._abort_uploads(path)

    def _abort_uploads(self, path: str) -> None:
        """Abort the multipart uploads under ``path`` that a killed stage-out left: a listing
        shows none of their parts, which S3 keeps, and bills, until aborted (s3fs only)."""
        call = getattr(self.fs, "call_s3", None)
        if call is None or not hasattr(self.fs, "abort_mpu"):
            return
        bucket, _, prefix = path.partition("/")
        with contextlib.suppress(Exception):  # (best effort: a policy may not allow listing)
            listed = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
            for upload in listed.get("Uploads", []):
                self.fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])

    def _keys_of(self, path: str) -> list[str]:
        """The keys at ``path`` and below it, found without pattern matching (``find``)."""
        try:
            return list(self.fs.find(path))
        except FileNotFoundError:
            return []
