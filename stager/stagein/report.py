"""The end-of-run summary of a stage-in: one line for the log, the same facts as JSON."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stager.errors import DestinationError, ScratchFull, ShardFailure, one_line
from stager.layout import PARTIAL_SUFFIX
from stager.storage.paths import discard
from stager.units import human_bytes

__all__ = ["StageInReport"]


@dataclass
class StageInReport:
    """What one node's stage-in did. ``role`` is ``copier`` or ``waiter`` (adopted a result)."""

    node: str
    job_id: str
    dataset_dir: str
    source: str
    spec: str = ""  # stager.layout.canonical_spec: what was staged (waiters adopt only the same)
    files_total: int = 0
    files_copied: int = 0
    files_skipped: int = 0
    files_failed: int = 0
    bytes_total: int = 0
    bytes_copied: int = 0
    bytes_read_source: int = 0
    bytes_received_peers: int = 0
    cache_dir: str = ""  # the node cache used (--cache), else ""
    files_from_cache: int = 0  # of files_copied: placed from the node cache
    bytes_from_cache: int = 0
    seconds: float = 0.0
    retries: int = 0
    streams: int = 0
    subset: str = "all"
    role: str = "copier"
    fanout: str = "off"  # off | on (stage-in --fanout) | fallback (the group did not form)
    fanout_form_s: float = (
        0.0  # of ``seconds``: waiting for the node group to form (torch import included)
    )
    exit_code: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_copied / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def add_failure(self, failure: ShardFailure) -> None:
        self.failures.append({"url": failure.url, "reason": failure.reason, "kind": failure.kind})
        self.files_failed = len(self.failures)

    def summary_line(self) -> str:
        """One line, whatever the names hold (a newline in ``--name`` forged a second)."""
        return one_line(
            f"[{self.node}] stage-in: {self.files_total} files, {self.files_copied} copied, "
            f"{self.files_skipped} skipped, {self.files_failed} failed; "
            f"{human_bytes(self.bytes_copied)} in {self.seconds:.2f} s ({self.mb_per_s:.1f} MB/s)"
            + (
                f" [fan-out {self.fanout}: {human_bytes(self.bytes_read_source)} from the source, "
                f"{human_bytes(self.bytes_received_peers)} from peers]"
                if self.fanout != "off"
                else ""
            )
            + (
                f" [cache: {self.files_from_cache} from the cache, "
                f"{human_bytes(self.bytes_read_source)} read from the source]"
                if self.cache_dir
                else ""
            )
            + f" -> {self.dataset_dir}"
        )

    def to_json(self) -> dict:
        out = asdict(self)
        out["mb_per_s"] = round(self.mb_per_s, 3)
        return out

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write atomically so a reader never sees half a report; nothing is left on failure.

        A path that exists and is not a regular file (a FIFO, a device), or that names a
        stream (``/dev/stdout``, ``/proc/self/fd/1``, a link into ``/dev`` or ``/proc``), is
        appended to as it is: a rename over it replaced the device node, the link, or, where
        stdout was a job's log file, the whole log. A link to another regular file keeps its
        link: its target is replaced.
        Raises :class:`~stager.errors.ScratchFull` or :class:`~stager.errors.DestinationError`
        naming the path when it cannot be written.
        """
        path = Path(path)
        text = json.dumps(self.to_json(), indent=1) + "\n"
        tmp: Path | None = None
        try:
            if path.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            fd = _own_stream(path)
            if fd is not None:  # (its offset is the shell's: a reopened file wrote over lines)
                _write_all(fd, text.encode())
                return
            if path.exists() and (_names_a_stream(path) or not path.is_file()):
                with open(path, "a") as stream:
                    stream.write(text)
                return
            path = Path(os.path.realpath(path)) if path.is_symlink() else path
            tmp = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException as exc:
            if tmp is not None:
                discard(tmp)  # a Ctrl-C or SIGTERM mid-write too: no .partial left
            if not isinstance(exc, OSError):
                raise
            reason = exc.strerror or str(exc)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ScratchFull(
                    f"cannot write the report {path}: {reason}", where=str(path)
                ) from exc
            raise DestinationError(
                f"cannot write the report {path}: {reason}; pass --report a writable file path"
            ) from exc

    @classmethod
    def from_json(cls, payload: dict) -> StageInReport:
        payload = {k: v for k, v in payload.items() if k in cls.__dataclass_fields__}
        return cls(**payload)


def _names_a_stream(path: Path) -> bool:
    """Whether ``path`` names an open stream rather than a file to replace: a descriptor
    (``/dev/stdout``, ``/dev/fd/N``, anything under ``/proc``), or a link to one. A regular
    file elsewhere under ``/dev`` (``/dev/shm``, a node-local scratch) is a file: replaced."""

    def stream(text: str) -> bool:
        return text.startswith(("/proc/", "/dev/fd/")) or text in _STD_STREAMS

    text = os.path.abspath(path)
    if stream(text):
        return True
    return path.is_symlink() and stream(
        os.path.abspath(os.path.join(os.path.dirname(text), os.readlink(path)))
    )


_STD_STREAMS = ("/dev/stdin", "/dev/stdout", "/dev/stderr")


def _own_stream(path: Path) -> int | None:
    """The descriptor ``path`` names in this process (``/dev/stdout``, ``/dev/fd/1``,
    ``/proc/self/fd/1``), written through as it is; None for any other path."""
    text = os.path.abspath(path)
    named = {"/dev/stdout": 1, "/dev/stderr": 2}
    if text in named:
        return named[text]
    for prefix in ("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/"):
        number = text.removeprefix(prefix)
        if number != text and number.isdigit():
            return int(number)
    return None


def _write_all(fd: int, data: bytes) -> None:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    while data:
        data = data[os.write(fd, data) :]
