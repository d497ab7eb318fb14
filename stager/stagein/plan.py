"""What this node must copy: the shards not already staged whole, and whether they fit.

A staged file is kept only when it matches what the source promises: the manifest's size and
hash when there is a manifest, else the listing's size. Leftover ``.partial`` files of a killed
run are deleted first, and the bytes still to copy are checked against the free space before
any copy starts (:func:`stager.stagein.guards.preflight`), so a full scratch is refused up
front.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from pathlib import Path

from stager.errors import IntegrityError, StagerError, UsageError
from stager.layout import (
    PARTIAL_SUFFIX,
    StagedDataset,
    has_hidden_part,
    is_remote_url,
    is_shard_name,
)
from stager.shards import tarindex
from stager.shards.manifest import Manifest, ManifestEntry
from stager.shards.tarparse import TarSampleCounter
from stager.stagein.journal import Journal
from stager.stagein.options import StageInOptions
from stager.stagein.recorded import RecordTimes
from stager.stagein.stagedtree import StagedNames
from stager.storage.hashing import hash_file
from stager.storage.identity import node_neutral
from stager.storage.paths import SafeJoiner, all_canonical, discard, safe_relpath
from stager.storage.sources import SourceSet, SourceShard

__all__ = [
    "CopyItem",
    "CopyOutcome",
    "LocalPlan",
    "read_previous",
    "clean_partials",
    "sized_while_copying",
    "plan_local",
    "remove_unlisted",
    "count_samples_of",
]


@dataclass(slots=True)
class CopyItem:
    """One shard to copy: where it lands, and what its bytes must be.

    Treated as immutable (changed copies come from ``dataclasses.replace``) but not declared
    frozen: a frozen dataclass's ``__init__`` costs three times as much, over a second of the
    wait for the first copy at a million shards.
    """

    shard: SourceShard
    target: str  # where it lands; a string: a million Path objects cost seconds up front
    size: int | None  # the manifest's size, else the listing's; None: sized while copying
    want_hash: str | None  # the manifest's hash, if any
    from_manifest: bool  # size and hash come from the manifest: a difference is corruption
    want_samples: int | None = None  # the manifest's sample count, if any

    @property
    def final(self) -> Path:
        return Path(self.target)

    def sized(self, size: int, version: str | None) -> CopyItem:
        """This item with the size and version a stat found while it waited to copy.

        Built field by field: ``dataclasses.replace`` costs ~4 us, twice per shard (~5% of a
        20 KB shard's copy). A field added to either class must be added here.
        """
        was = self.shard
        shard = SourceShard(
            url=was.url, path=was.path, relpath=was.relpath, size=was.size, version=version
        )
        return CopyItem(
            shard=shard,
            target=self.target,
            size=size,
            want_hash=self.want_hash,
            from_manifest=self.from_manifest,
            want_samples=self.want_samples,
        )


@dataclass
class CopyOutcome:
    """What the copies produced: entries for the staged manifest, and indexes parsed in flight."""

    entries: dict[str, ManifestEntry] = field(default_factory=dict)
    parsed: dict[str, TarSampleCounter] = field(default_factory=dict)


@dataclass
class LocalPlan:
    """The shards to copy and the staged ones kept, with the free space seen before copying."""

    to_copy: list[CopyItem]
    kept: dict[str, ManifestEntry]
    sized_later: set[str] = field(default_factory=set)  # relpaths sized while they copy
    free_bytes: int = 0

    @property
    def bytes_to_copy(self) -> int:
        return sum(filter(None, map(attrgetter("size"), self.to_copy)))  # C loops: 1M in ~20 ms


def read_previous(staged: StagedDataset) -> dict[str, ManifestEntry]:
    """What earlier runs staged here, by relpath: the staged manifest, then the journal of a
    run killed before writing one (:mod:`stager.stagein.journal`); empty if unreadable."""
    previous: dict[str, ManifestEntry] = {}
    if staged.manifest_path.is_file():
        try:
            previous = Manifest.read(staged.manifest_path).by_relpath()
        except StagerError:
            pass  # a damaged staged manifest only costs copies
    previous.update(Journal(staged.journal_path).read())
    return previous


def clean_partials(dataset_dir: Path) -> int:
    """Delete the ``.partial`` files a killed run left; returns how many.

    One that cannot be deleted (a read-only scratch) stays: it never has a final name, so
    nothing trusts it, and a staged copy that is complete is still verified and used; a copy
    that needs writing fails with the destination's own error.
    """
    removed = 0
    for leftover in dataset_dir.rglob(f"*{PARTIAL_SUFFIX}"):
        try:
            if leftover.is_file() or leftover.is_symlink():
                leftover.unlink()
                removed += 1
        except OSError:
            pass
    return removed


def count_samples_of(final: Path, warn: Callable[[str], None] | None = None) -> int | None:
    """Samples in a staged shard, or None when its tar cannot be read, said to ``warn``. The
    copier and the plan pass none: the finish counts the rest, and fails unreadable tars."""
    if not final.name.endswith((".tar", ".tgz", ".tar.gz")):
        return None
    try:
        return tarindex.count_samples(final)
    except IntegrityError as exc:
        if warn is not None:
            warn(str(exc))
        return None


def sized_while_copying(
    source: SourceSet,
    shards: Sequence[SourceShard],
    undescribed: AbstractSet[str],
    dataset_dir: Path,
    staged_names: StagedNames | None = None,
) -> set[str]:
    """Walked shards to size during the copy (:mod:`stager.stagein.sizing`) rather than before.

    Those of a local source that the manifest does not describe (``undescribed``) and that are
    not staged yet: a staged file is compared with the source by size in the plan, so it needs
    its size first. "Not staged" is looked up in ``staged_names`` (one walk of the staged tree,
    where an ``lexists`` per shard cost 6 s at a million); with a symlink in the tree, which
    could lead anywhere, each name is checked with ``lexists``.
    """
    if source.remote_fs is not None or not undescribed:
        return set()
    unsized = [s.relpath for s in shards if s.size is None]
    if staged_names is not None and not staged_names.linked:
        staged = staged_names.files | staged_names.dirs
        return {r for r in unsized if r in undescribed and r not in staged}
    base = str(dataset_dir)
    return {r for r in unsized if r in undescribed and not os.path.lexists(os.path.join(base, r))}


def _source_changed(shard: SourceShard, before: ManifestEntry | None) -> bool:
    """Whether the source was modified since the staged copy was made (its bytes also match a
    manifest's hash). By its modification time: a ``chmod``/``chown`` (the change time) or a
    copy that renews inodes keeps the bytes, and recopied a whole dataset that still matched
    the manifest; a rewrite at the same size with the mtime put back is the one change this
    misses, and then the staged bytes are still the manifest's."""
    if shard.version is None or before is None or before.version is None:
        return False  # (not stat'ed, or copied from a source that reported no version)
    local = not is_remote_url(shard.url)
    return node_neutral(before.version, local) != node_neutral(shard.version, local)


def _kept_entry(
    shard: SourceShard,
    final: Path,
    st: os.stat_result | None,
    want: ManifestEntry | None,
    before: ManifestEntry | None,
    options: StageInOptions,
    times: RecordTimes | None = None,
) -> ManifestEntry | None:
    """The entry for a staged file that holds the source's current bytes, else None (copy it).

    With a manifest hash, the bytes are compared by hash, and the source must still be the
    version the copy was made from where both are known. Without one, the staged copy must
    have been made from the source version the source reports now (inode, mtime and ctime;
    an ETag for object stores): a rewrite at the same size is copied again. Only a source
    that reports no version at all is trusted by size alone. A staged file changed since its
    record was written (:mod:`stager.stagein.recorded`) is hashed again, or copied again.
    """
    size = want.size if want is not None else shard.size
    if st is None or not stat.S_ISREG(st.st_mode):  # absent, or a symlink: copy it (again)
        return None
    have_size = st.st_size
    if size is not None and have_size != size:
        return None
    want_hash = want.hash if want is not None else None
    previous_hash = before.hash if before is not None and before.size == have_size else None
    changed = times is not None and times.changed_since_recorded(shard.relpath, st)
    if changed:
        previous_hash = None  # what the record says of its bytes no longer holds
    if want_hash is not None:
        if _source_changed(shard, before):  # (the copy would be refused by the manifest now)
            return None
        have_hash = previous_hash
        if have_hash != want_hash:
            have_hash = hash_file(final, want_hash.split(":", 1)[0])
        if have_hash != want_hash:
            return None
        if changed and times is not None:
            times.renewed.append(shard.relpath)
    elif changed:
        return None
    elif shard.version is not None:
        if before is None or before.version != shard.version or before.size != have_size:
            return None
        have_hash = previous_hash
    else:
        have_hash = previous_hash
    samples = want.samples if want is not None else None
    if samples is None and before is not None:
        samples = before.samples
    if samples is None and options.count_samples:
        samples = count_samples_of(final)
    version = shard.version or (before.version if before is not None else None)
    return ManifestEntry(shard.relpath, have_size, have_hash, samples, version)


def plan_local(
    shards: Sequence[SourceShard],
    staged: StagedDataset,
    expected: Mapping[str, ManifestEntry],
    previous: dict[str, ManifestEntry],
    options: StageInOptions,
    heartbeat: Callable[[], None] = lambda: None,
    aligned: Sequence[ManifestEntry] | None = None,
    staged_names: StagedNames | None = None,
    times: RecordTimes | None = None,
) -> LocalPlan:
    """Split ``shards`` into those to copy and those already staged with the source's bytes.

    The staged directory is listed once up front: a shard with nothing under its name is
    copied without a metadata call of its own, so a first run over a million shards plans in
    about a second. Names that exist, and every name once a symlink is seen anywhere in the
    tree (it could lead outside), go through :class:`SafeJoiner`'s ``lstat`` and checks.
    ``aligned``: the manifest's entries when they name ``shards`` one for one, in order;
    ``staged_names``: the staged tree as walked before this run removed anything (extra names
    only cost a check), else it is walked here. ``times``: when the records in ``previous``
    were written, to tell staged files changed since (:mod:`stager.stagein.recorded`).
    """
    to_copy: list[CopyItem] = []
    kept: dict[str, ManifestEntry] = {}
    join = SafeJoiner(staged.dir)
    names = staged_names if staged_names is not None else StagedNames.walk(str(staged.dir))
    present, linked = names.files, names.linked
    root = str(staged.dir)
    # Aligned entries came out of safe_relpath (or its whole-column check), which returns its
    # own output unchanged: the listing's names, equal to them, need no second check.
    relpaths = [s.relpath for s in shards]
    canonical = aligned is not None or all_canonical(relpaths)
    if canonical and not linked and not present:  # a first run: every shard is copied
        return LocalPlan(_first_run_items(shards, relpaths, root, expected, aligned), kept)
    for shard in shards:
        want = expected.get(shard.relpath)
        rel = shard.relpath if canonical else safe_relpath(shard.relpath)
        if linked or rel in present:
            target, st = join.lstat(shard.relpath)
            before = previous.get(shard.relpath)
            entry = _kept_entry(shard, Path(target), st, want, before, options, times)
            heartbeat()  # hashing staged copies against a manifest can take a while
            if entry is not None:
                kept[shard.relpath] = entry
                continue
            if st is not None and stat.S_ISREG(st.st_mode):
                _refuse_the_source_itself(shard, target, st)
                # Not the source's current bytes: gone now, not when the copy replaces it, so
                # that a run refused later (no space, a failed copy) leaves no stale final file.
                discard(target)  # (a read-only scratch: the copy into it fails with its error)
        else:
            target = root + "/" + rel
        to_copy.append(_copy_item(shard, target, want))
    return LocalPlan(to_copy, kept)


def _refuse_the_source_itself(shard: SourceShard, target: str, st: os.stat_result) -> None:
    """Refuse a local source shard that is the staged file it would replace (a symlink into
    the staged copy): deleting it as stale lost the source's only bytes (exit 3 after)."""
    try:
        source = os.stat(shard.path) if "://" not in shard.url else None
    except OSError:
        return
    if source is not None and (source.st_dev, source.st_ino) == (st.st_dev, st.st_ino):
        raise UsageError(
            f"the source shard {shard.url} is the staged file {target} itself (a link into the "
            "staged copy): staging would delete it; name the file itself, outside DEST/NAME"
        )


def _copy_item(shard: SourceShard, target: str, want: ManifestEntry | None) -> CopyItem:
    """What a copy of ``shard`` to ``target`` must hold: the manifest's entry, else the listing's
    size alone."""
    if want is None:
        return CopyItem(shard, target, shard.size, None, False)
    return CopyItem(shard, target, want.size, want.hash, True, want.samples)


def _first_run_items(
    shards: Sequence[SourceShard],
    relpaths: list[str],
    root: str,
    expected: Mapping[str, ManifestEntry],
    aligned: Sequence[ManifestEntry] | None,
) -> list[CopyItem]:
    """Every shard to copy, nothing staged yet: built column by column (C loops, ~0.3 s less
    than a loop at a million). Entries in the shards' order need no lookup by name."""
    wants = list(aligned) if aligned is not None else list(map(expected.get, relpaths))
    prefix = root + "/"
    targets = [prefix + r for r in relpaths]
    if all(w is not None for w in wants):  # a manifest describes every shard
        described: list[ManifestEntry] = wants  # type: ignore[assignment]
        return list(
            map(
                CopyItem,
                shards,
                targets,
                [w.size for w in described],
                [w.hash for w in described],
                repeat(True),
                [w.samples for w in described],
            )
        )
    return list(map(_copy_item, shards, targets, wants))


def remove_unlisted(
    staged: StagedDataset,
    previous: dict[str, ManifestEntry],
    shards: Sequence[SourceShard],
    found: Iterable[str] = (),
) -> int:
    """Delete staged files of earlier runs that this run's source no longer lists.

    A shard removed from the source (or from this node's subset) must not stay behind under
    its final name: a file there always holds a source shard's current bytes. Files the last
    runs recorded are removed, and, of the names ``found`` in the staged tree, those named like
    shards that no record names: a run killed between a rename and its journal line published
    them unrecorded (up to a run of small shards), and nothing removed them once the source had
    dropped them. Nothing else in the directory is touched.
    """
    current = {s.relpath for s in shards}
    unrecorded = [
        r
        for r in found
        if r not in previous and r not in current and is_shard_name(r) and not has_hidden_part(r)
    ]  # (hidden: .stager/ is this tool's; a hidden shard is staged only when named)
    if not previous and not unrecorded:
        return 0  # nothing recorded and nothing left unrecorded: a first run
    join = SafeJoiner(staged.dir)
    removed = 0
    for relpath in (previous.keys() - current) | set(unrecorded):
        try:
            path = join(relpath)
            if path.is_file() and not path.is_symlink():
                path.unlink()
                removed += 1
        except (OSError, StagerError):
            continue  # unsafe or already gone: nothing of ours to remove
    return removed
