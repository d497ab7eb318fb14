"""Checkpoints on node-local scratch: finding them, and a hashed snapshot of one.

A snapshot lists every file with its size, mtime and content hash. Hashes are cached in
``<parent>/.stager-stageout/<name>.hashes.json`` keyed by the file's size and version (inode,
mtime_ns and ctime_ns: :mod:`stager.storage.identity`), so the ranks that
call ``stage-out`` after the copier, and every ``--watch`` pass, decide "already committed"
from a few ``stat`` calls instead of re-reading gigabytes. The same directory holds the
per-checkpoint lock (node-local, where ``flock`` is reliable). Size and mtime alone are not
a key: a file rewritten at the same size keeping its mtime (``cp -p``, ``rsync -a``, coarse
timestamps) would have been "already committed with the same content" while it was not.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from stager.errors import CheckpointError
from stager.layout import STAGEOUT_STATE_DIR
from stager.shards.manifest import ManifestEntry
from stager.stageout.record import KIND_DIR, KIND_FILE, check_new_checkpoint_name, content_id
from stager.storage.hashing import hash_file
from stager.storage.identity import local_version
from stager.storage.paths import PARTIAL_SUFFIX, not_utf8

__all__ = [
    "SourceFile",
    "Snapshot",
    "list_checkpoints",
    "snapshot",
    "state_dir",
    "newest_mtime_ns",
    "has_files",
    "SKIP_SUFFIXES",
]

#: Entries of a checkpoint directory that are still being written by common trainers.
SKIP_SUFFIXES = (PARTIAL_SUFFIX, ".tmp", ".lock")
STATE_DIR_NAME = STAGEOUT_STATE_DIR


@dataclass(frozen=True)
class SourceFile:
    path: Path  # absolute, on scratch
    relpath: str  # relative to the checkpoint's parent: "name" or "name/sub/file"
    size: int
    mtime_ns: int
    hash: str
    version: str = ""  # stager.storage.identity.local_version when hashed


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint as it was when hashed; :meth:`changed` tells whether it moved since."""

    name: str
    kind: str
    path: Path
    files: tuple[SourceFile, ...]
    skipped: tuple[str, ...] = ()  # not regular files (FIFOs, sockets, symlinks to nothing)

    @property
    def entries(self) -> tuple[ManifestEntry, ...]:
        return tuple(ManifestEntry(f.relpath, f.size, f.hash) for f in self.files)

    @property
    def content_id(self) -> str:
        return content_id(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def mtime_ns(self) -> int:
        """Newest modification among the files (the directory's own for an empty one)."""
        if self.files:
            return max(f.mtime_ns for f in self.files)
        return self.path.stat().st_mtime_ns

    def changed(self) -> bool:
        """True when any file's size or mtime differs from the snapshot, or the set changed."""
        try:
            current = _walk(self.path, self.name, self.kind)
        except OSError:
            return True
        if [rel for _, rel, _ in current] != [f.relpath for f in self.files]:
            return True
        for (_, _, st), f in zip(current, self.files, strict=True):
            if st.st_size != f.size or local_version(st) != f.version:
                return True
        return False

    def age_s(self) -> float:
        return time.time() - self.mtime_ns / 1e9


def state_dir(ckpt_path: Path) -> Path:
    """Where the lock and hash cache of a checkpoint live: beside it, on scratch."""
    return ckpt_path.parent / STATE_DIR_NAME


def _skipped(name: str) -> bool:
    return name.startswith(".") or name.endswith(SKIP_SUFFIXES)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Every checkpoint (file or directory) directly in ``ckpt_dir``; hidden and temp names not."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"checkpoint directory {ckpt_dir} does not exist; check the path"
        ) from exc
    except NotADirectoryError as exc:
        raise CheckpointError(
            f"{ckpt_dir} is not a directory; drop --all to stage out one checkpoint"
        ) from exc
    return [ckpt_dir / n for n in names if not _skipped(n)]


def _walk(
    path: Path, name: str, kind: str, skipped: list[str] | None = None
) -> list[tuple[Path, str, os.stat_result]]:
    """The checkpoint's regular files, with their ``stat``, by relative path.

    Symlinks are followed, to directories too (a checkpoint that links its optimizer state
    from elsewhere is staged whole, not without it; one linked twice is staged under both
    names, as ``cp -rL`` copies it); a link to a directory above it (a loop) is refused.
    What is not a regular file (a FIFO, a socket, a symlink to nothing) is never opened: its
    relative path goes to ``skipped``, for the caller's warning.
    """
    if kind == KIND_FILE:
        return [(path, _utf8(name), path.stat())]
    out = []
    chain: dict[str, tuple[tuple[int, int], ...]] = {}  # each directory's ancestors, itself last
    for root, dirs, files in os.walk(path, followlinks=True, onerror=_raise):
        here = os.stat(root)
        above = chain.pop(root, ())
        if (here.st_dev, here.st_ino) in above:  # its own ancestor: walking on never ends
            raise CheckpointError(f"{root}: a symlink loop (a link to a directory above it)")
        mine = (*above, (here.st_dev, here.st_ino))
        dirs[:] = sorted(d for d in dirs if not d.endswith(PARTIAL_SUFFIX))
        chain.update((os.path.join(root, d), mine) for d in dirs)
        for fname in sorted(files):
            if fname.endswith(PARTIAL_SUFFIX):
                continue
            full = Path(root) / fname
            rel = _utf8(full.relative_to(path.parent).as_posix())
            try:
                st = full.stat()
            except FileNotFoundError:
                st = None  # a symlink to nothing
            if st is None or not stat.S_ISREG(st.st_mode):
                if skipped is not None:
                    skipped.append(rel)
                continue
            out.append((full, rel, st))
    out.sort(key=lambda item: item[1])
    return out


def _raise(exc: OSError) -> None:
    raise exc


def _utf8(rel: str) -> str:
    """``rel``, refused when it is not UTF-8 (commit records are JSON in UTF-8)."""
    shown = not_utf8(rel)
    if shown is not None:
        raise CheckpointError(
            f"checkpoint file name is not valid UTF-8: '{shown}'; rename it (commit records "
            "name files in UTF-8)"
        )
    return rel


def has_files(ckpt_path: Path) -> bool:
    """Whether a checkpoint holds a file yet: a file does, an empty directory tree does not
    (the trainer has just made it: not a checkpoint to commit, nor to rank as the newest)."""
    if not ckpt_path.is_dir():
        return True
    try:  # the files a snapshot would stage: regular ones, FIFOs and dangling links not
        return bool(_walk(ckpt_path, ckpt_path.name, KIND_DIR))
    except (OSError, CheckpointError):
        return True  # staged, where the error is said on the checkpoint's own line


def newest_mtime_ns(ckpt_path: Path) -> int:
    """:attr:`Snapshot.mtime_ns` from ``stat`` alone (to order before hashing); 0 if gone."""
    try:
        kind = KIND_DIR if ckpt_path.is_dir() else KIND_FILE
        walked = _walk(ckpt_path, ckpt_path.name, kind)
        if walked:
            return max(st.st_mtime_ns for _, _, st in walked)
        return ckpt_path.stat().st_mtime_ns
    except (OSError, CheckpointError):  # said when it is staged, on its own line
        return 0


def _load_cache(cache_path: Path) -> dict[str, list]:
    try:
        payload = json.loads(cache_path.read_text())
        return payload if isinstance(payload, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache_path: Path, files: tuple[SourceFile, ...]) -> None:
    tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    try:
        tmp.write_text(json.dumps({f.relpath: [f.size, f.version, f.hash] for f in files}))
        os.replace(tmp, cache_path)
    except OSError:
        pass  # the cache only saves re-hashing; losing it is harmless


def snapshot(ckpt_path: Path) -> Snapshot:
    """Hash a checkpoint (re-using cached hashes of files whose size and mtime are unchanged)."""
    ckpt_path = Path(os.path.abspath(ckpt_path))
    name = check_new_checkpoint_name(ckpt_path.name)
    if ckpt_path.is_dir():
        kind = KIND_DIR
    elif ckpt_path.is_file():
        kind = KIND_FILE
    else:
        raise CheckpointError(
            f"checkpoint {ckpt_path} does not exist (or is not a file or directory); check the path"
        )
    skipped: list[str] = []
    try:
        walked = _walk(ckpt_path, name, kind, skipped)
    except OSError as exc:
        where = exc.filename or ckpt_path
        raise CheckpointError(
            f"cannot read checkpoint {ckpt_path} ({where}: {exc.strerror or exc}); is it "
            "being removed, or not readable?"
        ) from exc
    cache_dir = state_dir(ckpt_path)
    cache_path = cache_dir / f"{name}.hashes.json"
    cache = _load_cache(cache_path)
    files, rehashed = [], False
    for full, rel, st in walked:
        cached = cache.get(rel)
        version = local_version(st)
        if isinstance(cached, list) and cached[:2] == [st.st_size, version]:
            digest = str(cached[2])
        else:
            try:  # listed, then unreadable or gone: this checkpoint's line, not a traceback
                digest, rehashed = hash_file(full), True
                after = full.stat()
            except OSError as exc:
                raise CheckpointError(
                    f"cannot read checkpoint {ckpt_path} ({full}: {exc.strerror or exc}); is "
                    "it being removed, or not readable?"
                ) from exc
            if local_version(after) != version or after.st_size != st.st_size:
                raise CheckpointError(
                    f"checkpoint file {full} changed while it was hashed; it is still being "
                    "written: stage it out once the training script has finished saving it"
                )
        files.append(SourceFile(full, rel, st.st_size, st.st_mtime_ns, digest, version))
    snap = Snapshot(name, kind, ckpt_path, tuple(files), tuple(skipped))
    if rehashed or len(cache) != len(files):
        with contextlib.suppress(OSError):  # a read-only scratch only costs re-hashing
            cache_dir.mkdir(exist_ok=True)
            _save_cache(cache_path, snap.files)
    return snap
