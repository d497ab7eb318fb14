"""The destination of stage-out: committed checkpoints on persistent storage, any fsspec URL.

Layout under ``DEST``::

    NAME/ or NAME                  the checkpoint, exactly as on scratch
    .stager/commits/NAME.json      its commit record (stager.stageout.record), written last
    .stager/staging/TOKEN/         one stage-out attempt: intent.json (+ data/ on a local DEST)

TOKEN is ``<host>__<pid>__<random>``, so a later run can tell a dead attempt (its pid is gone
on this host, or it is older than ``stale_s``) from a live one on another node.

Two ways to publish, one per kind of storage, one module each:

* **rename** (:mod:`stager.stageout.store_posix`, a local or network-mounted path): files are copied
  and fsynced under the staging directory, verified, moved to ``NAME`` by one ``rename``, then
  the record is written (temp file, fsync, rename, fsync of the directory). A kill leaves at
  most a staging directory, or ``NAME`` without a record for a moment; readers ignore both.
* **marker** (:mod:`stager.stageout.store_object`, object stores, which cannot rename): files are
  uploaded under the attempt's staging keys and checked by size; the commit copies them to
  their final keys inside the store, and the record, uploaded last, is the commit marker.

Re-staging a name whose committed content differs (``last.pt`` saved again) removes the old
record before the new content takes its place (the rename, or the copy inside the store), so
readers never pair an old record with new bytes; until the new record lands they fall back to
the next newest checkpoint. :func:`dest_errors` is the single boundary where
fsspec/OS errors at the destination become :class:`DestinationError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec

from stager.errors import CheckpointError, DestinationError, StagerError, one_line
from stager.layout import META_DIR
from stager.stageout.record import CommitRecord, check_checkpoint_name
from stager.storage.throttle import Throttle

__all__ = [
    "CommitStore",
    "Attempt",
    "META_DIR",
    "fsync_dir",
    "dest_errors",
    "signals_deferred",
    "host_name",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``path`` durable (the entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _valid_name(name: str) -> bool:
    """A name read back from an intent file is input: never let it point outside DEST."""
    try:
        check_checkpoint_name(name)
    except StagerError:
        return False
    return True


def host_name() -> str:
    return socket.gethostname().split(".")[0].replace("__", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGTERM/SIGUSR1/SIGINT while publishing: a signal handler that abandons the attempt
    must not run between the rename and the record (kill -9 still can; clean_stale covers it)."""
    held = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def dest_errors(url: str, doing: str) -> Iterator[None]:
    """Translate OS/fsspec errors at the destination into one-line :class:`DestinationError`s."""
    try:
        yield
    except StagerError:
        raise
    except PermissionError as exc:
        raise DestinationError(
            f"destination {url} is not writable ({doing}: permission denied); pass a writable DEST"
        ) from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DestinationError(
                f"destination {url} is full ({doing}); free space or prune with --keep"
            ) from exc
        if exc.errno == errno.EROFS:
            raise DestinationError(
                f"destination {url} is on a read-only filesystem ({doing}); pass a writable DEST"
            ) from exc
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise DestinationError(
            f"destination {url} is not usable ({doing}: {reason}); check the path or pass another "
            "DEST"
        ) from exc
    except Exception as exc:
        # A store's client raises its own (botocore's EndpointConnectionError is no OSError): a
        # traceback and exit 1, and the end of a --watch, where a pass is to be retried.
        if type(exc).__module__.split(".")[0] not in _STORE_CLIENTS:
            raise
        raise DestinationError(
            f"destination {url} is not reachable ({doing}: {one_line(exc)}); check the endpoint, "
            "the credentials and the network"
        ) from exc


#: Packages whose exceptions are a store's failures (object-store clients and their transport).
_STORE_CLIENTS = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs", "azure", "urllib3"}
)


@dataclass
class Attempt:
    """One in-progress stage-out of checkpoint ``name``; ``token`` names its staging directory."""

    name: str
    token: str
    staging: str  # path on the store's filesystem


class CommitStore:
    """Committed checkpoints under one destination URL (shared reading logic; see subclasses)."""

    def __init__(
        self, url: str, fs: fsspec.AbstractFileSystem, root: str, *, stale_s: float = 6 * 3600
    ):
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.stale_s = stale_s

    # -- layout ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def commits_dir(self) -> str:
        return self.path(META_DIR, "commits")

    @property
    def staging_dir(self) -> str:
        return self.path(META_DIR, "staging")

    def record_path(self, name: str) -> str:
        return posixpath.join(self.commits_dir, f"{name}.json")

    def display(self, relpath: str) -> str:
        return f"{self.url.rstrip('/')}/{relpath}"

    def local_root(self) -> str | None:
        """The destination as a local path, or None for an object store."""
        return None

    # -- reading --------------------------------------------------------------------------
    def record(self, name: str) -> CommitRecord | None:
        """The committed record of ``name``, or None when it is not committed."""
        try:
            with dest_errors(self.url, f"reading the commit record of {name}"):
                text = self.fs.cat_file(self.record_path(name))
        except DestinationError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        return CommitRecord.from_json(text, where=self.display(f"{META_DIR}/commits/{name}.json"))

    def records(
        self, *, on_bad: Callable[[CheckpointError], None] | None = None
    ) -> list[CommitRecord]:
        """Every committed checkpoint; unreadable records are reported to ``on_bad`` and skipped."""
        try:
            with dest_errors(self.url, "listing commit records"):
                self.fs.invalidate_cache(self.commits_dir)  # other processes commit too
                names = [posixpath.basename(p) for p in self.fs.ls(self.commits_dir, detail=False)]
        except DestinationError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return []
            raise
        out = []
        for fname in sorted(names):
            if not fname.endswith(".json") or fname.startswith("."):
                continue
            try:
                record = self.record(fname[: -len(".json")])
            except CheckpointError as exc:
                if on_bad is not None:
                    on_bad(exc)
                continue
            except DestinationError as exc:  # a directory where a record should be: junk
                if not isinstance(exc.__cause__, IsADirectoryError):
                    raise
                if on_bad is not None:
                    where = self.display(f"{META_DIR}/commits/{fname}")
                    on_bad(CheckpointError(f"{where} is a directory, not a commit record"))
                continue
            if record is not None:
                out.append(record)
        return out

    # -- attempts ---------------------------------------------------------------------------
    def begin(self, name: str) -> Attempt:
        token = f"{host_name()}__{os.getpid()}__{secrets.token_hex(4)}"
        attempt = Attempt(name, token, posixpath.join(self.staging_dir, token))
        intent = json.dumps(
            {"name": name, "host": host_name(), "pid": os.getpid(), "started_at": time.time()}
        )
        with dest_errors(self.url, "creating a staging directory"):
            self._write_small(posixpath.join(attempt.staging, "intent.json"), intent.encode())
        return attempt

    def _attempts(self) -> list[tuple[str, str, dict]]:
        """(token, staging path, intent) for every attempt directory at the destination."""
        self.fs.invalidate_cache(self.staging_dir)
        try:
            entries = self.fs.ls(self.staging_dir, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for staging in entries:
            token = posixpath.basename(staging.rstrip("/"))
            try:
                intent = json.loads(self.fs.cat_file(posixpath.join(staging, "intent.json")))
            except (OSError, ValueError):
                intent = {}
            out.append((token, staging, intent if isinstance(intent, dict) else {}))
        return out

    def _is_live(self, token: str, intent: dict, staging: str) -> bool:
        """Alive: its pid runs on this host, or (another host's) it is younger than stale_s."""
        started = intent.get("started_at")
        if not isinstance(started, (int, float)):
            try:
                started = self.fs.modified(staging).timestamp()
            except (OSError, NotImplementedError, ValueError):
                started = time.time()  # cannot tell: count it as just started
        if time.time() - started >= self.stale_s:
            return False  # also covers a pid reused on this host since
        host, _, rest = token.partition("__")
        pid_text = rest.partition("__")[0]
        if host == host_name() and pid_text.isdigit():
            return _pid_alive(int(pid_text))
        return True

    def clean_stale(self) -> list[str]:
        """Remove what dead attempts left (staging, uncommitted data); return the names touched.

        Uncommitted data at ``NAME`` is removed only when no live attempt for NAME exists, so a
        copy in flight on another node is never pulled from under it.
        """
        with dest_errors(self.url, "cleaning interrupted stage-outs"):
            attempts = self._attempts()
            live_names = {i.get("name") for t, s, i in attempts if self._is_live(t, i, s)}
            cleaned = []
            for token, staging, intent in attempts:
                if self._is_live(token, intent, staging):
                    continue
                name = intent.get("name")
                if (
                    isinstance(name, str)
                    and name not in live_names
                    and _valid_name(name)
                    and self.record(name) is None
                ):
                    self._remove_data(name)
                self._rm_tree(staging)
                cleaned.append(str(name or token))
            self._clean_record_temps()
            return cleaned

    def unrecorded(self) -> list[str]:
        """Names an attempt (killed, or still running) was committing that have data at
        ``DEST/NAME`` but no record: the commit's window between moving the data in (after the
        old record went) and writing the new record. Restore must not read that as "nothing
        committed yet" (see :func:`stager.stageout.restore.restore_checkpoint`)."""
        with dest_errors(self.url, "looking for interrupted commits"):
            names = {intent.get("name") for _, _, intent in self._attempts()}
            return sorted(
                name
                for name in names
                if isinstance(name, str)
                and _valid_name(name)
                and self.fs.exists(self.path(name))
                and self.record(name) is None
            )

    def _clean_record_temps(self) -> None:
        """Delete the temp files of records whose writer died on this host (a kill between
        the write and the rename): ``<name>.json.<host>__<pid>.partial``."""
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(self.commits_dir, detail=False)]
        except FileNotFoundError:
            return
        mine = f".json.{host_name()}__"  # host names may hold dots: matched whole
        for fname in names:
            if not fname.endswith(".partial") or mine not in fname:
                continue
            pid_text = fname[: -len(".partial")].rpartition("__")[2]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(posixpath.join(self.commits_dir, fname))

    def abandon(self, attempt: Attempt) -> None:
        """Give up an attempt: nothing of it stays (committed checkpoints are untouched). Best
        effort, whatever the store raises (a lost connection is botocore's, no OSError): its
        failure replaced the error that made the attempt fail, and ended ``--watch`` for good;
        what it leaves, the next run's :meth:`clean_stale` removes."""
        with contextlib.suppress(Exception):
            self._rm_tree(attempt.staging)

    def _finish(self, attempt: Attempt) -> None:
        """Drop a committed (or superseded) attempt's staging directory (best effort, as
        :meth:`abandon`)."""
        with contextlib.suppress(Exception):
            self._rm_tree(attempt.staging)

    def remove(self, name: str) -> None:
        """Un-commit ``name`` (record first, so it is never half visible), then delete its data."""
        with dest_errors(self.url, f"pruning {name}"):
            self._remove_record(name)
            self._remove_data(name)

    # -- per-storage operations ---------------------------------------------------------------
    def check_writable(self) -> None:
        raise NotImplementedError

    def check_container(self) -> None:
        """Raise :class:`DestinationError` where DEST's container (an object store's bucket)
        does not exist: nothing committed there is a typo, not a first start."""

    def put_file(
        self,
        attempt: Attempt,
        src: str,
        relpath: str,
        size: int,
        hash_: str,
        *,
        throttle: Throttle | None,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        raise NotImplementedError

    def commit(self, attempt: Attempt, record: CommitRecord) -> bool:
        raise NotImplementedError

    def _write_small(self, path: str, payload: bytes) -> None:
        raise NotImplementedError

    def _remove_record(self, name: str) -> None:
        raise NotImplementedError

    def _remove_data(self, name: str) -> None:
        raise NotImplementedError

    def _rm_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
