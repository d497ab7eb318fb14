"""The end of every stage-in, plain or fan-out: manifest, loader index, report, exit code.

Plain copying and ``--fanout`` differ only in how bytes arrive; what a run leaves behind must
not differ, or the loader and a rerun see two kinds of staged dataset. So both end here:

1. count the samples of staged shards that were not counted in flight (fan-out receives bytes
   without parsing them), and index their members for the loader while at it;
2. write the staged manifest (what was staged, from which source), atomically;
3. write the loader's sample index, so the first loader on the node walks no tar header;
4. raise the run's error, if shards failed: :class:`ScratchFull` (exit 6) when the destination
   filled up, else :class:`ShardsCorrupt` (4) if any shard was corrupt, else
   :class:`ShardsFailed` (3). What was staged stays staged, and a rerun copies only the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TextIO, cast

from stager.errors import (
    DestinationError,
    IntegrityError,
    ScratchFull,
    ShardFailure,
    StagerError,
    one_line,
    shard_failures,
)
from stager.layout import CORRUPT_META, StagedDataset, is_shard_name
from stager.shards import indexfile, tarindex
from stager.shards.indexkey import StatsAhead
from stager.shards.manifest import Manifest, ManifestEntry
from stager.shards.manifestcolumns import columns_path, keep_columns
from stager.shards.tarindex import TarIndex
from stager.shards.tarnative import WalkResult
from stager.shards.tarparse import TarSampleCounter
from stager.stagein.journal import Journal
from stager.stagein.options import StageInOptions
from stager.stagein.report import StageInReport
from stager.storage.paths import discard
from stager.storage.sources import SourceSet, SourceShard

__all__ = ["Staging", "finish"]

#: Shards from which the loader index's stats are taken on another thread while the manifest
#: is written (:class:`StatsAhead`); below, a thread costs more than it saves.
_STATS_AHEAD_FROM = 256


@dataclass
class Staging:
    """One node's stage-in of one dataset, as both ways of moving bytes fill it in."""

    source: SourceSet
    options: StageInOptions
    staged: StagedDataset
    report: StageInReport
    log: TextIO
    shards: Sequence[SourceShard]  # the shards this node stages, in source order
    started: float = field(default_factory=time.monotonic)
    entries: dict[str, ManifestEntry] = field(default_factory=dict)  # staged ones, by relpath
    parsed: dict[str, TarSampleCounter] = field(default_factory=dict)  # parsed in flight
    journal: Journal | None = None  # where each publication is recorded as it happens
    #: Staged in this run without their samples counted in flight (fan-out): counted at the end
    #: and checked against the manifest's count.
    unverified: set[str] = field(default_factory=set)
    heartbeat: Callable[[], None] = field(default=lambda: None)  # progress, for lock waiters
    #: Write the manifest even with the same entries (stager.stagein.recorded.RecordTimes.stale)
    rewrite_manifest: bool = False
    #: Staged before this run and kept (in the report's "skipped"), not copied in it
    kept: set[str] = field(default_factory=set)
    #: Placed from the node cache in this run (in the report's "from the cache" too)
    from_cache: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.journal is None:
            self.journal = Journal(self.staged.journal_path)


def finish(run: Staging) -> None:
    """Write what ``run`` staged and raise its error, if it has one (see the module doc)."""
    report = run.report
    indexes = _count_and_index(run) if run.options.count_samples else {}
    meta = {
        "source": run.source.root_url,
        "spec": run.source.spec,
        "subset": run.options.subset,
        "node": report.node,
        "job_id": report.job_id,
    }
    corrupt = _corrupt_relpaths(run)
    if corrupt:  # kept with what was staged: a later run that fails early rewrites the result
        meta[CORRUPT_META] = json.dumps(corrupt)
    # in source order; (C loops, no Python frame per shard: ~1 us a shard of serial finish less)
    staged = map(run.entries.get, map(attrgetter("relpath"), run.shards))
    manifest = Manifest(tuple(filter(None, staged)), meta)
    indexing = not report.failures and run.options.count_samples
    base = f"{run.staged.dir}{os.sep}"  # str paths: a Path per shard costs ~10 us
    paths = [base + e.relpath for e in manifest.entries] if indexing else []
    stats = StatsAhead(paths) if len(paths) >= _STATS_AHEAD_FROM else None
    try:
        # Rewritten when a shard was published in this run although the entries are the same
        # (a copy made again): its mtime is what later runs compare staged files' ctimes with
        # (stager.stagein.recorded). A read-only scratch may hold an unchanged one.
        written = False
        if report.files_copied or not _unchanged(run.staged.manifest_path, manifest):
            run.staged.meta_dir.mkdir(exist_ok=True)
            manifest.write(run.staged.manifest_path)
            written = True
        elif run.rewrite_manifest:  # the same entries, only a newer record: best effort
            with contextlib.suppress(OSError):
                manifest.write(run.staged.manifest_path)
                written = True
        if written:  # (so that no rank parses its JSON)
            keep_columns(manifest, run.staged.manifest_path, columns_path(run.staged.index_dir))
        assert run.journal is not None
        run.journal.remove()  # every entry it held is in the manifest now
    except OSError as exc:
        if not report.failures:
            raise _manifest_write_error(exc, run.staged.manifest_path) from exc
        # else the shard failures raised below say more; a rerun re-verifies and rewrites it
    if indexing:
        _save_loader_index(run, manifest, indexes, paths, stats)
    report.seconds = time.monotonic() - run.started
    failures = [
        ShardFailure(f["url"], f["reason"], f.get("kind", "source")) for f in report.failures
    ]
    for kind, error in (("dest", DestinationError), ("full", ScratchFull)):
        first = next(
            (f for f in failures if f.kind == kind and "not attempted" not in f.reason), None
        )
        if first is not None:
            raise error(f"[{report.node}] {first.reason}")
    if failures:
        raise shard_failures(failures)


def _corrupt_relpaths(run: Staging) -> list[str]:
    prefix = run.source.root_url.rstrip("/") + "/"
    urls = [f["url"] for f in run.report.failures if f.get("kind") == "corrupt"]
    return sorted(url[len(prefix) :] for url in urls if url.startswith(prefix))


def _unchanged(path: Path, manifest: Manifest) -> bool:
    """True when ``path`` already holds ``manifest``'s shards and source (job and node aside)."""
    try:
        before = Manifest.read(path)
    except (OSError, StagerError):
        return False
    keys = ("source", "spec", "subset", CORRUPT_META)
    same_meta = all(before.meta.get(k) == manifest.meta.get(k) for k in keys)
    return same_meta and before.entries == manifest.entries


Indexes = dict[str, TarIndex | WalkResult]


def _count_and_index(run: Staging) -> Indexes:
    """Samples for entries that have none, and the member index of every uncompressed tar staged
    in this run, from the parse in flight or, where there was none, from the staged file. A
    shard whose tar cannot be read is unstaged as corrupt."""
    indexes: Indexes = {}
    for relpath, counter in run.parsed.items():
        index = counter.result()
        if index is not None and relpath in run.entries:
            indexes[relpath] = index
    # Fan-out's received shards, and those whose walk in flight found no tar: the samples a
    # manifest gives are no proof that the bytes are a readable tar (it may carry no hash).
    unreadable = {relpath for relpath in run.parsed if relpath not in indexes}
    for relpath in sorted((run.unverified | unreadable) & run.entries.keys()):
        _verify_count(run, relpath, indexes)
    for relpath, entry in list(run.entries.items()):
        if entry.samples is not None:
            continue
        final = run.staged.dir / relpath
        try:
            if not is_shard_name(final.name):
                samples = None  # a file named explicitly that is not a shard: copied as it is
            elif tarindex.is_compressed(final):
                samples = tarindex.count_samples(final)
            else:
                index = indexes.get(relpath) or tarindex.index_tar(final)
                indexes[relpath] = index
                samples = index.num_samples
        except IntegrityError as exc:
            # Corrupt at its source (the copy was checked against it): a failure, as `stager
            # index` makes it, not a warning under "0 failed" and exit 0 that let a job go on
            # to fail in its loader on the GPUs.
            _unstage_corrupt(run, relpath, _without_path(exc, final))
            continue
        run.entries[relpath] = dataclasses.replace(entry, samples=samples)
    _refuse_repeated_members(run, indexes)
    return indexes


def _refuse_repeated_members(run: Staging, indexes: Indexes) -> None:
    """Unstage as corrupt each shard with a member twice in one sample (``k.jpg`` twice, or
    ``k.jpg`` and ``k.JPG``): the loader refuses it, as webdataset does, and stage-in is where
    that should show, in the job's prologue with one FAILED line and exit 4, not as a warning
    under exit 0 and then in the loader once training has started."""
    # (one pass of plain lookups, the few found sorted: a sort and a property call per shard
    # were ~1.5 us of each shard's serial finish)
    problems: dict[str, str] = {}
    for relpath, index in indexes.items():
        if isinstance(index, WalkResult):
            parts = index.parts
            problem = index.problem if parts["duplicate"] or parts.get("split") else None
        else:
            problem = tarindex.grouping_problem(index)
        if problem is not None:
            problems[relpath] = problem
    for relpath in sorted(problems):
        if relpath in run.entries:
            del indexes[relpath]
            _unstage_corrupt(run, relpath, problems[relpath])


def _verify_count(run: Staging, relpath: str, indexes: Indexes) -> None:
    """Unstage ``relpath`` as corrupt when its samples differ from the manifest's count."""
    entry = run.entries[relpath]
    if entry.samples is None:
        return
    final = run.staged.dir / relpath
    try:
        if tarindex.is_compressed(final) or not final.name.endswith(".tar"):
            counted = tarindex.count_samples(final)
        else:
            index = indexes.get(relpath) or tarindex.index_tar(final)
            indexes[relpath] = index
            counted = index.num_samples
    except IntegrityError as exc:
        reason = _without_path(exc, final)
    else:
        if counted == entry.samples:
            return
        reason = (
            f"holds {counted} samples but the manifest says {entry.samples}; the manifest is "
            "stale or wrong: re-run stager index"
        )
    indexes.pop(relpath, None)
    _unstage_corrupt(run, relpath, reason)


def _without_path(exc: Exception, final: Path) -> str:
    """The reason without the staged path it starts with: the FAILED line names the source
    shard, and the staged copy is deleted."""
    return one_line(exc).removeprefix(f"{final}: ")


def _unstage_corrupt(run: Staging, relpath: str, reason: str) -> None:
    """Report ``relpath`` as a corrupt shard (exit 4) and delete its staged copy: a file with
    its final name is always what the manifest describes, and the loader, told by the report,
    never reads a corrupt shard from the source instead."""
    entry = run.entries.pop(relpath)
    if relpath in run.kept:
        run.report.files_skipped -= 1
    else:
        run.report.files_copied -= 1
        run.report.bytes_copied -= entry.size
    if relpath in run.from_cache:
        run.report.files_from_cache -= 1
        run.report.bytes_from_cache -= entry.size
    discard(run.staged.dir / relpath)
    run.report.add_failure(
        ShardFailure(f"{run.source.root_url.rstrip('/')}/{relpath}", reason, "corrupt")
    )


def _save_loader_index(
    run: Staging,
    manifest: Manifest,
    indexes: Indexes,
    paths: list[str],
    stats: StatsAhead | None,
) -> None:
    """The loader's one-file sample index of the staged copy, beside it (best effort).

    From the indexes in hand when every shard has one (joined without numpy where every one
    is a compiled walk's: :mod:`stager.shards.indexfile`); otherwise the loader's own builder,
    which returns at once when the index on disk is current and walks only what changed.
    ``paths``: the entries' staged files; ``stats``: their key's stats, taken meanwhile.
    """
    # (each pass over the shards a list's or map's C loop: this is serial Python per shard)
    entries = manifest.entries
    relpaths = [e.relpath for e in entries]
    if not relpaths or tarindex.any_compressed(relpaths):
        return  # compressed shards are streamed by the loader, never indexed
    if not any(map(is_shard_name, relpaths)):
        return  # files named as they are (`stage-in notes.md`): nothing a loader reads
    samples = [e.samples for e in entries]
    found = list(map(indexes.get, relpaths))
    try:
        if None not in found:  # (each checked for repeated members)
            walked = cast("list[TarIndex | WalkResult]", found)
            parts = [i.parts for i in walked if type(i) is WalkResult]
            if len(parts) == len(walked):  # (only the compiled walk makes a WalkResult)
                rows = stats.rows() if stats is not None else None
                indexfile.save_walked_index(
                    paths, relpaths, samples, parts, run.staged.index_dir, rows
                )
                return
            from stager.shards import loader_index  # numpy: imported only once copies are done

            loader_index.save_dataset_index(paths, relpaths, samples, walked, run.staged.index_dir)
        else:
            from stager.shards import loader_index

            loader_index.build_flat_index(
                [run.staged.dir / relpath for relpath in relpaths],
                relpaths=relpaths,
                expected_samples=samples,
                cache_dir=run.staged.index_dir,
            )
    except (IntegrityError, OSError) as exc:  # the loader indexes it itself; correct, only slower
        print(
            f"[{run.report.node}] warning: no loader index written ({one_line(exc)})",
            file=run.log,
            flush=True,
        )


def _manifest_write_error(exc: OSError, path: Path) -> DestinationError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ScratchFull(
            f"no space left on {path.parent} for the staged manifest; the shards are staged. "
            "Free space and rerun stage-in (it copies nothing again)",
            where=str(path.parent),
        )
    return DestinationError(
        f"cannot write {path}: {exc.strerror or exc}; check the destination (read-only? full?)"
    )
