"""A first stage-in of a directory without a manifest: copies start while the walk goes on.

Why: on NFS, listing a million shards is thousands of directory-read round trips. Listing
everything before the first copy leaves the node's streams idle for the whole walk. Here
:func:`stager.storage.listing.walk_local` hands over each directory's shards as it reads them
(in batches within a large directory), and the copier starts on them while the walk goes on.
Every shard is sized while it copies (:mod:`stager.stagein.sizing`).

Nothing is published until the walk has ended and the free-space check on every size has
passed. Until then finished copies stay ``.partial``. So a walk that fails (an unreadable
directory, a name that is not UTF-8) or a scratch too small leaves nothing new staged, as when
the listing comes first.

Only a first run streams: the dataset directory holds nothing staged yet. Once shards are
staged, deciding which to keep and which to delete needs the whole listing
(:mod:`stager.stagein.plan`), so those runs list first, as before. The stream also needs a
plain local directory (a URL's listing arrives whole from fsspec), no manifest (a manifest
plans without stats, and its first copy is already seconds away at a million shards), no
``--cache``, and the whole dataset on every node (``--subset node`` partitions by size).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from stager.errors import SourceError, StagerError
from stager.gcpause import collection_paused
from stager.layout import META_DIR, StagedDataset, canonical_spec, dataset_name
from stager.leftout import left_out_warnings, no_shards_message, not_regular_message
from stager.shards.manifest import find_manifest
from stager.shards.tarparse import load_scanner
from stager.slurm import SlurmEnv
from stager.stagein.copier import Copier
from stager.stagein.finish import Staging, finish
from stager.stagein.guards import check_same_source, preflight
from stager.stagein.node import attach_report, run_once_per_node
from stager.stagein.options import StageInOptions
from stager.stagein.plan import (
    CopyItem,
    LocalPlan,
    clean_partials,
    read_previous,
)
from stager.stagein.report import StageInReport
from stager.stagein.run import (
    copy_per_node,
    jitter_s,
    new_report,
    stage_in,
    staged_dataset,
)
from stager.stagein.status import discard_plan
from stager.stagein.subset import NodeSelect
from stager.storage.listing import some_file_names, split_fs, translate, walk_local
from stager.storage.paths import check_encodable
from stager.storage.sources import SourceSet, SourceShard

__all__ = ["streamable_root", "stage_in_streamed", "stage_in_foreground", "WHOLE_WALK_S"]

#: The copies wait this long for the walk before they start on what it found so far. A local
#: walk of up to ~100k names ends within it, and its copies then start with every shard known,
#: as when the listing comes first: copies that started on the first few shards ran 10,000 tiny
#: shards on a tmpfs ~25% slower (with the stream count adapting; at a fixed count, no slower).
WHOLE_WALK_S = 0.1


def stage_in_foreground(
    spec: str | None,
    options: StageInOptions,
    slurm: SlurmEnv,
    list_source: Callable[[], SourceSet],
    select: NodeSelect | None,
) -> StageInReport:
    """The command line's stage-in without ``--background`` or ``--fanout``: streamed where
    :func:`streamable_root` allows, else listed by ``list_source()`` first. ``spec``: the
    SOURCE argument, None with ``--from-list`` (whose shards are named, not walked)."""
    if spec and select is None:
        root = streamable_root(spec, options)
        if root is not None:
            return stage_in_streamed(spec, root, options, list_source, slurm=slurm)
    return stage_in(list_source(), options, slurm=slurm, select=select)


def streamable_root(spec: str, options: StageInOptions) -> str | None:
    """The local directory ``spec`` names, where its first run may stream (see the module
    doc); None where it must list first."""
    if options.cache_dir is not None or options.subset != "all" or options.manifest:
        return None
    if "{" in spec or any(c in spec for c in "*?["):
        return None  # a pattern or a glob: its shards are named, not walked
    if spec.endswith("://"):
        return None  # names no path: refused by the listing (resolve_source)
    fs, path = split_fs(spec)
    if fs is not None or not os.path.isdir(path):
        return None
    root = path.rstrip("/") or "/"
    if find_manifest(root) is not None:
        return None
    return root


def stage_in_streamed(
    spec: str,
    root: str,
    options: StageInOptions,
    list_source: Callable[[], SourceSet],
    *,
    slurm: SlurmEnv | None = None,
) -> StageInReport:
    """Stage the directory ``root`` (as ``spec`` names it) on this node: streamed on a first
    run, else listed by ``list_source()`` (as the command line lists it) and staged as
    :func:`stager.stagein.run.stage_in` does."""
    slurm = slurm or SlurmEnv.from_environ()
    log = options.log or sys.stderr
    name = options.name or dataset_name(spec)
    check_encodable(root, "source")
    check_encodable(name, "dataset name")
    empty = SourceSet(root, name, (), spec=canonical_spec(spec), walked=True)
    staged = staged_dataset(empty, options)

    def work(heartbeat: Callable[[], None]) -> StageInReport:
        report = new_report(slurm, staged, empty, options)
        try:
            if _first_run(staged):
                # the shards' objects hold no cycles and are built all along the copies: the
                # collector stays paused throughout (see stager.gcpause)
                with collection_paused():
                    _stream(spec, empty, options, slurm, staged, report, log, heartbeat)
            else:
                copy_per_node(list_source(), options, slurm, None, staged, report, log, heartbeat)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    return run_once_per_node(staged, options, work, spec=empty.spec)


def _first_run(staged: StagedDataset) -> bool:
    """Nothing staged here yet: no manifest, no journal, no file beside the bookkeeping."""
    if staged.manifest_path.is_file() or read_previous(staged):
        return False
    try:
        with os.scandir(staged.dir) as entries:
            return all(entry.name == META_DIR for entry in entries)
    except OSError:
        return False  # the usual path says what is wrong with it


def _stream(
    spec: str,
    empty: SourceSet,
    options: StageInOptions,
    slurm: SlurmEnv,
    staged: StagedDataset,
    report: StageInReport,
    log: TextIO,
    heartbeat: Callable[[], None],
) -> None:
    root = empty.root_url
    check_same_source(staged, empty)
    discard_plan(staged)
    clean_partials(staged.dir)
    plan = LocalPlan([], {})
    plan.free_bytes = preflight(staged.dir, 0, options, slurm.node_name)
    run = Staging(empty, options, staged, report, log, [], heartbeat=heartbeat)
    time.sleep(jitter_s(slurm.node, slurm.num_nodes, options.jitter_max_s))
    if options.count_samples:
        load_scanner()
    copier = Copier(
        empty, plan, options, report, log, journal=run.journal, heartbeat=heartbeat, streamed=True
    )
    cut = len(root.rstrip("/")) + 1  # the walk joins names under root with "/"
    target = os.fspath(staged.dir) + "/"

    def found(paths: list[str]) -> None:
        for path in paths:
            if not path.isascii():
                check_encodable(path, "source shard name")
        shards = [SourceShard(p, p, p[cut:], None) for p in paths]
        copier.add([CopyItem(s, target + s.relpath, None, None, False) for s in shards])

    listing: list[str] = []
    left_out: list[str] = []

    def walk() -> None:
        try:
            listing.extend(walk_local(root, options.jobs, on_found=found, left_out=left_out))
        except BaseException as exc:  # noqa: BLE001 - raised by copier.run on the main thread
            listing_failed = isinstance(exc, OSError) and not isinstance(exc, StagerError)
            copier.abort(translate(exc, spec) if listing_failed else exc)
        else:
            copier.close()

    walker = threading.Thread(target=walk, name="stage-in-walk", daemon=True)
    walker.start()
    walker.join(WHOLE_WALK_S)  # a walk this quick hands the copier its whole listing at once
    outcome = copier.run()
    walker.join()
    if not listing:
        raise SourceError(no_shards_message(spec, some_file_names(root)))
    for line in left_out_warnings(left_out):
        print(f"[{slurm.node_name}] warning: {line}", file=log, flush=True)
    if len(copier.dropped) == len(listing):  # every one a FIFO, a device, a broken link...
        urls = [f"{root.rstrip('/')}/{relpath}" for relpath in copier.dropped]
        raise SourceError(not_regular_message(root, urls))
    shards = tuple(SourceShard(p, p, p[cut:], None) for p in listing)
    run.source = dataclasses.replace(empty, shards=shards)
    run.shards = shards
    run.entries.update(outcome.entries)
    run.parsed.update(outcome.parsed)
    finish(run)
