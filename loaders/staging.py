"""The loader's side of ``stage-in --background``: find the copy being made, and read it.

:func:`resolve_staging` is asked first by :func:`stager_loaders.resolve.resolve_dataset`: when
this node's copier has published a plan (:mod:`stager.stagein.status`), the dataset is that
plan's shards at their final local paths, with the sample counts it promises, and
:class:`StagingReader` reads it, waiting for each shard as it lands
(:mod:`stager_loaders.waiting`). When the run already ended well, the dataset is the staged
manifest's as usual and the plain staged reader reads it; the plan's facts stay attached either
way, so that every rank takes part in the per-epoch order decision
(:mod:`stager_loaders.orders`). A loader started while a copier holds the node lock but has
published nothing yet waits for it rather than reading the source.

Compressed shards cannot be read by offset: for them the loader waits until the run ended.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.layout import StagedDataset
from stager.plan.ranks import PlanOptions, WorldLayout
from stager.plan.staging import StagingSpec
from stager.shards.digests import DigestColumn
from stager.shards.loader_index import build_flat_index
from stager.shards.packedstrings import PackedStrings
from stager.shards.tarindex import any_compressed
from stager.slurm import SlurmEnv
from stager.stagein.status import (
    CopierWatch,
    PlanFacts,
    is_current,
    lock_held,
    published,
    read_outcome,
    read_plan,
)

from .options import LoaderOptions
from .readers import StagedReader, _Collate
from .resolve import DatasetShards, _from_staged
from .sampler import RankBatchSampler
from .samples import SamplePipeline
from .selection import staged_selection
from .spelling import check_same_root, spelled_from
from .waiting import GrowingTarDataset, ShardGate, WaitTable, stopped_message

__all__ = ["resolve_staging", "StagingReader", "staging_incomplete"]

log = logging.getLogger("stager_loaders")

#: Between two looks at the copier from the training process (its result, its lock).
MONITOR_EVERY_S = 1.0


#: Longest wait, at an epoch's start, for a copier that has published every shard and is
#: writing its manifest and index.
FINISHING_S = 60.0


def _all_published(staged: StagedDataset) -> bool:
    loaded = read_plan(staged)
    if loaded is None:
        return False
    prefix = str(staged.dir) + "/"
    columns = loaded[0]
    return all(
        published(prefix + rel, size)
        for rel, size in zip(columns.relpaths, columns.sizes, strict=True)
    )


def staging_incomplete(staged_dir: Path | None, facts: PlanFacts | None) -> bool:
    """True while this node's background run has not ended well.

    A copier that has published every shard is only writing its manifest and index: its
    word is waited for (seconds) rather than raced, so that an epoch starting right after the
    last shard landed decides alike in every run of the job.
    """
    if facts is None or staged_dir is None:
        return False
    staged = StagedDataset.of(staged_dir)
    outcome = read_outcome(staged, facts)
    if outcome is None and lock_held(staged) and _all_published(staged):
        deadline = time.monotonic() + FINISHING_S
        while outcome is None and lock_held(staged) and time.monotonic() < deadline:
            time.sleep(0.05)
            outcome = read_outcome(staged, facts)
    return outcome is None or not outcome.ok


def _published_nothing_yet(staged: StagedDataset, slurm: SlurmEnv) -> bool:
    """No manifest and no plan of this run of the job (a requeued job finds the last run's)."""
    if staged.staging_path.is_file():
        loaded = read_plan(staged)
        return loaded is not None and not is_current(loaded[1], slurm)
    return not staged.manifest_path.is_file()


def _wait_for_copier(staged: StagedDataset) -> None:
    """A copier holds the node lock but has not published this run's plan (or manifest) yet:
    wait for it rather than read the source, or the last run's plan."""
    slurm = SlurmEnv.from_environ()
    said = False
    while lock_held(staged) and _published_nothing_yet(staged, slurm):
        if not said:
            log.warning(
                "waiting for the stage-in running on this node to publish %s (its lock is held)",
                staged.dir,
            )
            said = True
        time.sleep(0.1)


#: How a run ends when only shards failed (stager.errors): nothing else went wrong.
_SHARD_FAILURES = frozenset({"ShardsFailed", "ShardsCorrupt"})


def resolve_staging(
    staged: StagedDataset, spec: str | list[str] | None, on_error: str
) -> DatasetShards | None:
    """The dataset as a background stage-in stages it, or None (no plan: the usual rules)."""
    _wait_for_copier(staged)
    loaded = read_plan(staged)
    if loaded is None:
        return None
    columns, facts = loaded
    check_same_root({"source": facts.source}, spec, staged.dir)
    outcome = read_outcome(staged, facts)
    compressed = any_compressed(columns.relpaths)
    if compressed and outcome is None:
        log.warning(
            "%s is compressed (.tgz): it cannot be read while stage-in --background copies it; "
            "waiting for the copy to end",
            staged.dir,
        )
        while outcome is None and lock_held(staged):
            time.sleep(0.2)
            outcome = read_outcome(staged, facts)
    # A run that ended with only shard failures wrote its manifest, and its result names them:
    # resolved as after a plain stage-in, so on_error="skip" leaves the corrupt ones out of the
    # plan, not in it to raise mid-epoch when their turn comes.
    ended = outcome is not None and (outcome.ok or outcome.error_class in _SHARD_FAILURES)
    if (ended or compressed) and staged.manifest_path.is_file():
        return dataclasses.replace(_from_staged(staged.dir, spec, on_error), staging=facts)
    asked = spelled_from(spec, facts.source) if spec is not None else None
    if staged_selection(facts.spec, facts.source, asked, staged.dir) is not None:
        raise UsageError(
            f"{staged.dir} is being staged (stage-in --background) for {facts.spec}, of which "
            f"{spec} selects a part: load it by that SOURCE while it is copied, or once it is done"
        )
    prefix = str(staged.dir) + "/"
    count = len(columns.relpaths)
    if any(n is None for n in columns.samples):
        raise UsageError(f"{staged.staging_path} lacks sample counts; rerun stage-in --background")
    # kept compact for the workers' own fetches (stager.shards.digests), as read_plan gives
    # them, and the rest of the columns' hashes dropped before the paths are packed
    hashes = columns.hashes
    assert isinstance(hashes, DigestColumn)  # (read_plan asks for them so)
    columns = dataclasses.replace(columns, hashes=None)
    return DatasetShards(
        PackedStrings(columns.relpaths),
        PackedStrings.prefixed(prefix, columns.relpaths),
        np.ones(count, dtype=bool),
        np.zeros(count, dtype=bool),
        columns.samples,
        facts.subset,
        staged.dir,
        np.column_stack([np.asarray(columns.sizes, np.int64), np.full(count, -1, np.int64)]),
        staging=facts,
        growing=True,
        hashes=hashes,
    )


class StagingReader(StagedReader):
    """The staged reader over a copy still being made: the same plan and sampler, a dataset
    that waits for shards, and a look at the copier from the training process."""

    restarts_workers = True  # workers restart each epoch, so the complete index reaches them

    def __init__(
        self,
        shards: DatasetShards,
        options: LoaderOptions,
        pipeline: SamplePipeline | None,
        collate_fn: Any,
    ):
        assert shards.staging is not None and shards.staged_dir is not None
        assert shards.hashes is not None  # (resolve_staging gives a growing copy its hashes)
        self.facts = shards.staging
        self.staged = StagedDataset.of(shards.staged_dir)
        self.locations = shards.locations
        self.relpaths: Sequence[str] = shards.relpaths
        self.counts = np.asarray(shards.samples, dtype=np.int64)
        self.skipped_shards: list[str] = []
        sizes = shards.stats[:, 0].tolist() if shards.stats is not None else []
        self.gate = ShardGate(
            self.staged,
            self.facts,
            shards.relpaths,
            sizes,
            options.on_copier_death,
            stall_after_s=options.copier_stall_s,
            samples=self.counts,  # (the dataset's own array: pickled once with it)
            hashes=shards.hashes,
        )
        self.waits = WaitTable()
        self.dataset = GrowingTarDataset(self.gate, self.counts, pipeline, self.waits)
        self._options = options
        self._collate = collate_fn
        self.sampler: RankBatchSampler | None = None
        self.complete = False
        self._next_look = 0.0
        self._copier = CopierWatch(self.staged)
        self._said = False

    def bind(self, layout: WorldLayout, options: PlanOptions, per_rank: int) -> dict[str, Any]:
        self.sampler = RankBatchSampler(self.counts, layout, options, per_rank)
        return {
            "dataset": self.dataset,
            "batch_sampler": self.sampler,
            "collate_fn": _Collate(self._collate),
        }

    def start(self, epoch: int, first_batch: int) -> None:
        super().start(epoch, first_batch)
        if not self.complete and not staging_incomplete(self.staged.dir, self.facts):
            # The copier wrote the dataset's one index at its end: map it (a rebuild only if
            # it is missing), so this epoch's fresh workers read as the plain reader does.
            index, _ = build_flat_index(
                self.locations,
                relpaths=self.relpaths,
                expected_samples=self.counts.tolist(),
                cache_dir=self.staged.index_dir,
                on_error=self._options.on_error,
            )
            self.dataset.complete(index)
            self.complete = True

    def use_order(self, epoch: int, spec: StagingSpec | None) -> None:
        self._plan().staging = (epoch, spec) if spec is not None else None

    def wait_totals(self) -> tuple[float, int]:
        """Seconds the workers waited for shards, and how many times."""
        return self.waits.totals()

    def stopped_line(self) -> str:
        return stopped_message(self.gate, "the reader could not wait for a shard any longer")

    def look(self, *, final: bool = False) -> None:
        """From the training process, at most once a second: say in one line when the copier
        ended badly or is gone (the workers act on it; this is what the log shows).

        ``final``: the epoch has ended, now look whatever the time. Workers that read around a
        dead copier from the source can end an epoch before two looks a second apart saw its
        lock free; a lock free then, with no result, is a copier gone.
        """
        now = time.monotonic()
        if self.complete or self._said or (now < self._next_look and not final):
            return
        self._next_look = now + MONITOR_EVERY_S
        outcome = read_outcome(self.staged, self.facts)
        if outcome is not None:
            if not outcome.ok:
                self._say(f"it ended: {outcome.error or 'error'}")
            return
        if not self._copier.gone(now, at_once=final):
            return
        if final and not staging_incomplete(self.staged.dir, self.facts):
            return  # every shard is there: nothing was read around it
        self._say("its lock is free and it left no result")

    def _say(self, why: str) -> None:
        self._said = True
        log.warning("%s", stopped_message(self.gate, why))
