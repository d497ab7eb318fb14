"""When the record of a staged file was written, to tell a file changed after it.

A staged file is kept by a rerun when its record (the staged manifest, or the journal of a run
killed before one) says it holds the source's current version. The record names the source's
version, not the staged file's own: a staged file replaced since (a new inode under the same
name) or written in place (its mtime put back, as ``cp -p`` or ``rsync -a --inplace`` do) would
be trusted by its name and size. Every such change moves the file's ctime, which no call can set
back, and the kernel stamps ctime and the record's mtime from the same clock: a staged file
whose ctime is later than its record's mtime was changed after it was recorded. Its bytes are
then hashed against the manifest where there is a hash, and copied again where there is not.

A hard link moves the ctime too, and a ``--cache`` copy is a hard link that other jobs link
again: a staged file that is one (read-only, 0444, with other links:
:func:`stager.shards.indexkey.is_cache_link`) is not judged by its ctime; the cache's own
record (inode, size and mtime) vouches for its bytes. Any other file with a second link (a
user's ``ln``, a ``cp -al`` snapshot) is judged as every file is.

A kept file found changed, and every run that read a journal, rewrite the manifest (best
effort: a read-only scratch keeps its own), so that the next run compares with a record at
least as new as each file (else it would hash or copy the same files again on every run).

Not seen: a change within the clock tick of the record's write, and, for a killed run, a change
to a file after its own journal line but before the journal's last one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from stager.layout import StagedDataset
from stager.shards.indexkey import is_cache_link
from stager.stagein.journal import Journal

__all__ = ["RecordTimes"]


def _mtime_ns(path: os.PathLike[str] | str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@dataclass
class RecordTimes:
    """The mtimes of the staged manifest and of the journal, and which shards the journal
    recorded (it is read after the manifest, so its entries win); ``renewed``: the kept files
    found changed since (their bytes checked again), for :meth:`stale`."""

    manifest_ns: int | None
    journal_ns: int | None
    journaled: frozenset[str]
    renewed: list[str] = field(default_factory=list)

    @property
    def stale(self) -> bool:
        """Whether the manifest must be written even if its entries are the same."""
        return bool(self.renewed or self.journaled)

    @classmethod
    def of(cls, staged: StagedDataset) -> RecordTimes:
        journal_ns = _mtime_ns(staged.journal_path)
        journaled = frozenset(Journal(staged.journal_path).read()) if journal_ns else frozenset()
        return cls(_mtime_ns(staged.manifest_path), journal_ns, journaled)

    def changed_since_recorded(self, relpath: str, st: os.stat_result) -> bool:
        """Whether the staged file ``st`` of ``relpath`` changed after its record was written
        (False where there is no record to compare with: nothing is trusted by it then)."""
        if is_cache_link(st.st_mode, st.st_nlink):  # other jobs' links move its ctime
            return False
        recorded = self.journal_ns if relpath in self.journaled else self.manifest_ns
        return recorded is not None and st.st_ctime_ns > recorded
