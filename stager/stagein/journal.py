"""A line per published shard, so a run killed before its manifest still leaves its identity.

A staged file is trusted only with the source version it was copied from (see
:mod:`stager.storage.identity`); the staged manifest records that at the end of a run. A run
killed with ``kill -9`` (a preemption, a time limit) never gets there, so each copy appends its
entry here right after its rename, and the next run reads the manifest and then this journal,
the newer facts winning. A kill between the rename and the append loses one line (a run of
small shards, :mod:`stager.stagein.smallruns`, appends its lines in one write after its renames:
up to a run's lines): those shards are copied again, never trusted without their version, or
removed where the source no longer lists them (:func:`stager.stagein.plan.remove_unlisted`). A
line cut by a kill is ignored. The journal is removed once the manifest holding its entries is
written.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from stager.shards.manifest import ManifestEntry
from stager.shards.manifest_entry import json_text

__all__ = ["Journal"]


class Journal:
    """Appends :class:`ManifestEntry` lines to ``path``; thread-safe, one ``write`` per line."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None

    def record(self, entry: ManifestEntry) -> None:
        """Append ``entry`` (best effort: without it the shard is only copied again)."""
        self.record_all([entry])

    def record_all(self, entries: list[ManifestEntry]) -> None:
        """Append ``entries`` in one ``write`` (a run's: :mod:`stager.stagein.smallruns`). A kill
        that cuts it loses the lines after the cut: those shards are copied again."""
        if not entries:
            return
        lines = b"".join(_line(entry) + b"\n" for entry in entries)
        with self._lock:
            try:
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                    self._fd = os.open(self.path, flags, 0o600)
                os.write(self._fd, lines)  # O_APPEND: whole lines from every thread
            except OSError:
                pass

    def read(self) -> dict[str, ManifestEntry]:
        """The entries recorded, by relpath, the last one of each winning."""
        out: dict[str, ManifestEntry] = {}
        try:
            text = self.path.read_bytes().decode("utf-8", "replace")
        except OSError:
            return out
        for line in text.splitlines():
            try:
                relpath, size, digest, samples, version = json.loads(line)
                out[relpath] = ManifestEntry(relpath, int(size), digest, samples, version)
            except (ValueError, TypeError):
                continue  # cut by a kill mid-write
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def remove(self) -> None:
        """Forget the journal: its entries are in the staged manifest now."""
        self.close()
        try:
            self.path.unlink()
        except OSError:
            pass


def _line(entry: ManifestEntry) -> bytes:
    """``json.dumps`` of the entry's fields as a list, written out: json.dumps costs ~7 us a
    call, most of the journal's share of a small shard's copy. Strings go through the json
    module's own C escaper, so :meth:`Journal.read` reads back exactly what was recorded."""
    fields = (
        json_text(entry.relpath),
        str(int(entry.size)),
        json_text(entry.hash),
        "null" if entry.samples is None else str(int(entry.samples)),
        json_text(entry.version),
    )
    return f"[{', '.join(fields)}]".encode()
