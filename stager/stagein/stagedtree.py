"""What a staged dataset directory holds before a run changes it, read in one walk.

Planning asks two questions of every shard at a million shards: is anything under its name
(then its bytes are checked, else it is copied without a metadata call), and is it there at all
(else its size can wait until it is copied). One walk answers both for every shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["StagedNames"]


@dataclass
class StagedNames:
    """What a staged tree holds, from one walk: names (files, symlinks and the like) and
    directories, relative to its root, and whether any symlink is among them."""

    files: set[str] = field(default_factory=set)
    dirs: set[str] = field(default_factory=set)
    linked: bool = False

    @classmethod
    def walk(cls, root: str) -> StagedNames:
        """Walk ``root``; symlinked directories are not followed, an unreadable directory
        counts as a symlink (every name then takes the per-shard checks)."""
        found = cls()
        pending = [("", root)]
        while pending:
            prefix, directory = pending.pop()
            try:
                with os.scandir(directory) as listing:
                    for entry in listing:
                        # Where readdir gives no file type these stat the entry, and may fail.
                        if entry.is_symlink():
                            found.linked = True
                        elif entry.is_dir(follow_symlinks=False):
                            found.dirs.add(prefix + entry.name)
                            pending.append((prefix + entry.name + "/", entry.path))
                            continue
                        found.files.add(prefix + entry.name)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:
                found.linked = True
                return found
        return found
