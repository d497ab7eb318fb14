"""stage-in: copy a dataset's shards to node-local scratch, in parallel, verified, resumable.

The flow, per node:

1. take the node lock (:mod:`stager.stagein.node`: one copier per node; other tasks wait and
   adopt its result);
2. plan (:mod:`stager.stagein.plan`): shards whose final file holds the promised bytes are
   kept; leftover ``.partial`` files of a killed run are deleted;
3. preflight: refuse before copying anything if the bytes to copy exceed the free space;
4. wait a jitter derived from the node id, so hundreds of nodes do not hit NFS at once;
5. copy (:mod:`stager.stagein.copier`) with adaptive streams under a per-node bandwidth cap,
   retrying transient errors; each file is published by rename only after verification;
6. finish (:mod:`stager.stagein.finish`, shared with ``--fanout``): the staged manifest and
   the loader's index, then the run's exit code.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import TextIO

from stager.errors import ShardFailure, SourceError, UsageError
from stager.gcpause import collection_paused
from stager.layout import StagedDataset, has_hidden_part
from stager.leftout import (
    hidden_in_manifest,
    left_out_warnings,
    not_regular_message,
    skipped_message,
)
from stager.shards.manifest import Manifest, ManifestEntry
from stager.shards.tarparse import load_scanner
from stager.slurm import SlurmEnv
from stager.stagein.copier import Copier
from stager.stagein.expected import EntriesByRelpath
from stager.stagein.finish import Staging, finish
from stager.stagein.guards import check_outside_source, check_same_source, preflight
from stager.stagein.node import attach_report, run_once_per_node
from stager.stagein.options import StageInOptions
from stager.stagein.plan import (
    LocalPlan,
    clean_partials,
    plan_local,
    read_previous,
    remove_unlisted,
    sized_while_copying,
)
from stager.stagein.recorded import RecordTimes
from stager.stagein.report import StageInReport
from stager.stagein.sourcemanifest import load_source_manifest
from stager.stagein.stagedtree import StagedNames
from stager.stagein.status import discard_plan
from stager.stagein.subset import NodeSelect, node_share
from stager.storage.sources import SourceSet, SourceShard, fill_sizes, resolve_source

__all__ = [
    "StageInOptions",
    "stage_in",
    "staged_dataset",
    "jitter_s",
    "new_report",
    "checked_manifest",
    "prepare",
    "copy_per_node",
]


def jitter_s(node: int, num_nodes: int, max_s: float) -> float:
    """Start delay for a node: spread evenly over ``[0, max_s)`` by node index, zero on one node.

    Derived (golden-ratio sequence), not random, so reruns behave the same and neighbours in the
    node list land far apart.
    """
    if num_nodes <= 1 or max_s <= 0:
        return 0.0
    return ((node * 0.6180339887498949) % 1.0) * max_s


def staged_dataset(source: SourceSet, options: StageInOptions) -> StagedDataset:
    """Where ``source`` is staged under ``options``: ``--dest`` root, ``--name`` or its own name.

    Refused (before anything is created) when that is inside the source itself.
    """
    staged = StagedDataset(options.dest_root, options.name or source.name)
    check_outside_source(staged, source)
    return staged


def new_report(
    slurm: SlurmEnv,
    staged: StagedDataset,
    source: SourceSet,
    options: StageInOptions,
    fanout: str = "off",
) -> StageInReport:
    return StageInReport(
        node=slurm.node_name,
        job_id=slurm.job_id,
        dataset_dir=str(staged.dir),
        source=source.root_url,
        spec=source.spec,
        subset=options.subset,
        fanout=fanout,
    )


def _as_source_set(source: object) -> SourceSet:
    """``source`` as a SourceSet: a path, URL or list of URLs resolved (given one as is, the
    API failed deep inside with an AttributeError), anything else refused in one line."""
    if isinstance(source, SourceSet):
        return source
    if isinstance(source, (str, os.PathLike)):
        return resolve_source(os.fspath(source))
    if isinstance(source, Sequence) and all(isinstance(u, (str, os.PathLike)) for u in source):
        return resolve_source([os.fspath(u) for u in source])
    kind = type(source).__name__
    raise UsageError(f"stage_in takes a SourceSet, a path or URL, or a list of them, not {kind}")


def stage_in(
    source: SourceSet | str | os.PathLike[str] | Sequence[str],
    options: StageInOptions,
    *,
    slurm: SlurmEnv | None = None,
    select: NodeSelect | None = None,
) -> StageInReport:
    """Stage ``source`` into ``options.dest_root / name`` on this node and return the report.

    ``source``: a :class:`~stager.storage.sources.SourceSet`, or what
    :func:`~stager.storage.sources.resolve_source` takes (a directory, glob, brace pattern or
    URL, or a list of shard URLs), resolved here as the command line resolves it.

    ``select`` narrows the shards (``--subset node``), called with the listing and each listed
    shard's bytes, from the manifest where it describes the shard
    (:data:`stager.stagein.subset.NodeSelect`); default: all of them. Raises a
    :class:`~stager.errors.StagerError` (with ``.report`` attached) when anything failed;
    everything that succeeded stays staged and is skipped by a rerun.
    """
    source = _as_source_set(source)
    slurm = slurm or SlurmEnv.from_environ()
    log = options.log or sys.stderr
    staged = staged_dataset(source, options)

    def work(heartbeat: Callable[[], None]) -> StageInReport:
        report = new_report(slurm, staged, source, options)
        try:
            copy_per_node(source, options, slurm, select, staged, report, log, heartbeat)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    return run_once_per_node(staged, options, work, spec=source.spec)


def warn(log: TextIO, node: str, message: str) -> None:
    print(f"[{node}] warning: {message}", file=log, flush=True)


def checked_manifest(
    source: SourceSet, options: StageInOptions, staged: StagedDataset
) -> Manifest | None:
    """The source's manifest (:func:`load_source_manifest`) for :func:`prepare`, read once the
    staged copy is known to be this source's (one fetched from a URL lands in its directory).
    Read before the shards are chosen: ``--subset node`` partitions by the sizes it gives."""
    check_same_source(staged, source)
    return load_source_manifest(source, options, staged)


def prepare(
    source: SourceSet,
    options: StageInOptions,
    slurm: SlurmEnv,
    shards: list[SourceShard],
    staged: StagedDataset,
    report: StageInReport,
    log: TextIO,
    *,
    manifest: Manifest | None,
    size_later: bool,
    heartbeat: Callable[[], None] = lambda: None,
) -> tuple[Staging, LocalPlan, Mapping[str, ManifestEntry]]:
    """Steps 2-3 of the module doc, shared with ``--fanout``: what to copy, and what to delete.

    ``manifest``: :func:`checked_manifest`'s. Returns the run (kept shards already in it), the
    local plan, and the source manifest's entries by relpath (empty without a manifest; built
    on first use).
    """
    node = slurm.node_name
    discard_plan(staged)  # a background run's plan would vouch for names this run may replace
    expected = EntriesByRelpath(manifest)
    # A million shards: a Python pass per shard costs ~0.3 s, a dict of them 0.5 s, all before
    # the first copy. A listing that the manifest names one for one, in order (as `stager
    # index` writes it), needs neither: one list comparison in C shows nothing is undescribed
    # or missing. Otherwise set algebra over relpaths (C loops) finds them.
    relpaths = list(map(attrgetter("relpath"), shards))
    aligned: Sequence[ManifestEntry] | None = None
    if manifest is not None and list(map(attrgetter("relpath"), manifest.entries)) == relpaths:
        aligned = manifest.entries
    undescribed = set() if aligned is not None else set(relpaths) - expected.keys()
    # the staged tree before anything is removed from it: what is already there
    staged_names = StagedNames.walk(str(staged.dir))
    sized_later = (
        sized_while_copying(source, shards, undescribed, staged.dir, staged_names)
        if size_later
        else set()
    )
    skipped = list(source.skipped)
    directories: list[str] = []  # named like shards: taken by the walk, found by the stats
    # A listing made without stats (resolve_source(stat_listed=False)): a manifest hash stands
    # for the shards it describes; the others cost a metadata round trip, made while the copies
    # run for those not staged yet. With a cache every shard's version is needed: a cached copy
    # is served by identity.
    all_hashed = manifest is not None and all(map(attrgetter("hash"), manifest.entries))
    # A staged shard is kept only while its source is the version it was copied from: a
    # manifest's hash says what the bytes were, not that the source still holds them (a rerun
    # kept bytes the source had replaced, where a fresh run failed on them). So a rerun stats
    # the sources of the shards it finds staged; a first run stats none of them.
    present = staged_names.files
    restat = present.intersection(relpaths) if present else set()
    if options.cache_dir is not None:
        shards = fill_sizes(source, shards, options.jobs, skipped=skipped, directories=directories)
        aligned = None  # fill_sizes may have dropped some
    elif not ((manifest is None or all_hashed) and undescribed <= sized_later and not restat):
        # (else nothing is left to size now: described shards have hashes, the rest are
        # sized while copying, and none is staged yet)
        hashed = {relpath for relpath, entry in expected.items() if entry.hash}
        known = (hashed | sized_later) - restat
        shards = fill_sizes(
            source, shards, options.jobs, known=known, skipped=skipped, directories=directories
        )
        aligned = None  # fill_sizes may have dropped some
    if (skipped or directories) and not shards and options.subset == "all":
        urls = skipped + [d.rstrip("/") for d in directories]
        raise SourceError(not_regular_message(source.root_url, urls))
    for line in left_out_warnings([*source.left_out, *directories]):
        warn(log, node, line)
    for url in skipped:
        warn(log, node, skipped_message(url))
    if manifest is not None:
        unlisted = undescribed & {s.relpath for s in shards} if undescribed else set()
        if unlisted:
            first = next(s.relpath for s in shards if s.relpath in unlisted)
            warn(
                log,
                node,
                f"{len(unlisted)} shard(s) are not in the manifest (first: {first!r}); "
                "they are verified by size only. Re-run `stager index` if the dataset changed",
            )
        if source.walked and options.subset == "all" and aligned is None:
            listed = {s.relpath for s in shards}
            absent = sorted(expected.keys() - listed)
            hidden = [r for r in absent if has_hidden_part(r)]
            if hidden:  # (a manifest written before walks left hidden names out)
                warn(log, node, hidden_in_manifest(hidden))
            for relpath in sorted(set(absent) - set(hidden)):
                report.add_failure(
                    ShardFailure(
                        f"{source.root_url.rstrip('/')}/{relpath}",
                        "listed in the manifest but missing from the source",
                    )
                )
    clean_partials(staged.dir)
    previous = read_previous(staged)
    remove_unlisted(staged, previous, shards, staged_names.files)
    times = RecordTimes.of(staged)
    plan = plan_local(
        *(shards, staged, expected, previous, options, heartbeat, aligned, staged_names),
        times=times,
    )
    plan.sized_later = sized_later
    report.files_total = len(shards) + len(source.missing)
    report.files_skipped = len(plan.kept)
    report.bytes_total = sum(e.size for e in plan.kept.values()) + plan.bytes_to_copy
    for url in source.missing:
        report.add_failure(ShardFailure(url, "not found on the source"))
    run = Staging(source, options, staged, report, log, shards, heartbeat=heartbeat)
    run.rewrite_manifest = times.stale
    run.entries.update(plan.kept)
    run.kept = set(plan.kept)
    return run, plan, expected


def copy_per_node(
    source: SourceSet,
    options: StageInOptions,
    slurm: SlurmEnv,
    select: NodeSelect | None,
    staged: StagedDataset,
    report: StageInReport,
    log: TextIO,
    heartbeat: Callable[[], None] = lambda: None,
) -> None:
    """Steps 2-6 of the module doc: this node reads all its shards from the source itself."""
    cached = options.cache_dir is not None
    with collection_paused():  # a million shards: see stager.gcpause
        manifest = checked_manifest(source, options, staged)
        source, shards = node_share(source, manifest, select, options.jobs)
        run, plan, expected = prepare(
            source,
            options,
            slurm,
            shards,
            staged,
            report,
            log,
            manifest=manifest,
            size_later=not cached,
            heartbeat=heartbeat,
        )
    job_id = slurm.job_id if slurm.in_slurm else None
    cache = None
    if options.cache_dir is not None:
        from stager.stagein.cache import StageCache  # ~10 ms of imports a run without --cache skips

        cache = StageCache.start(options, source, staged, report, log, job_id=job_id)
    try:
        min_free = options.min_free_bytes
        needed = cache.register(plan, min_free) if cache is not None else plan.bytes_to_copy
        plan.free_bytes = preflight(staged.dir, needed, options, slurm.node_name)
        if plan.to_copy:
            if cache is None or cache.misses(plan):  # a full hit spares the source
                time.sleep(jitter_s(slurm.node, slurm.num_nodes, options.jitter_max_s))
            if options.count_samples:
                load_scanner()
            copier = Copier(
                source,
                plan,
                options,
                report,
                log,
                journal=run.journal,
                heartbeat=heartbeat,
                cache=cache,
            )
            outcome = copier.run()
            run.from_cache = copier.served
            if len(copier.dropped) == len(run.shards) and options.subset == "all":
                # (sized before or while copying, every one proved not a shard)
                raise SourceError(not_regular_message(source.root_url, [s.url for s in shards]))
            run.entries.update(outcome.entries)
            run.parsed.update(outcome.parsed)
        if cache is not None:
            report.cache_dir = str(cache.store.layout.root)
            cache.restore_index()
        finish(run)
        if cache is not None:
            cache.keep()
    finally:
        if cache is not None:
            cache.close()
