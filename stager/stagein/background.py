"""``stage-in --background``: copy in the order the loader reads, while training runs.

Plain stage-in must finish before training starts; here the loader starts at once and reads
each shard as soon as it is published (:mod:`stager_loaders.staging`). The run is the plain one
(:mod:`stager.stagein.run`: node lock, plan, preflight, copier, shared ending) with four
differences:

1. every shard's sample count must be known before copying (a manifest written by
   ``stager index``): the loader plans equal epochs before the shards exist;
2. the final name of every shard still to copy is deleted, then the plan is published
   (:mod:`stager.stagein.status`): from then on a final name is proof that the shard is whole
   and current, which is all the loader checks;
3. shards are copied in :func:`stager.plan.staging.copy_order`, and ``--bw-limit`` is handed
   out in that order (:mod:`stager.stagein.pacing`), so they land in the order ranks need them;
4. SIGTERM and SIGINT (the step's end, ``scancel``, a requeue) stop the copies between two
   blocks: each copy deletes its ``.partial``, the run raises :class:`StagingStopped` (exit
   11) and keeps what was published (its journal lines); a rerun copies the rest.

Under Slurm the copier is a job step of its own that lives beside the training step
(``srun --overlap ... stage-in --background ... &``, see docs/jobs.md): Slurm ends it at the
job's end with SIGTERM, which is case 4.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from stager.errors import StagingStopped, UsageError
from stager.layout import StagedDataset
from stager.plan.staging import copy_order, copy_salt
from stager.shards.manifest import ManifestEntry
from stager.signalevent import SignalSafeEvent
from stager.slurm import SlurmEnv
from stager.stagein.copier import Copier
from stager.stagein.finish import finish
from stager.stagein.guards import preflight
from stager.stagein.node import attach_report, run_once_per_node
from stager.stagein.options import StageInOptions
from stager.stagein.pacing import CopierStopped, OrderedThrottle
from stager.stagein.plan import CopyItem, LocalPlan, clean_partials
from stager.stagein.report import StageInReport
from stager.stagein.run import checked_manifest, jitter_s, new_report, prepare, staged_dataset
from stager.stagein.status import PlanFacts, discard_plan, write_plan
from stager.stagein.subset import NodeSelect, node_share
from stager.storage.paths import discard
from stager.storage.sources import SourceSet, SourceShard

__all__ = ["background_stage_in", "plan_entries"]


class _OrderedCopier(Copier):
    """The plain copier, its bandwidth handed out in copy order and stoppable between blocks.

    Only the per-shard call is wrapped: which shard a copy thread serves is known there alone.
    Its streams do not grow to every CPU of the step: training and its loader workers run
    beside it on the same cores.
    """

    def __init__(
        self, *args: object, stop: threading.Event, priority: dict[str, int], **kwargs: object
    ):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.streams.grow_to_cores = False  # the cores are training's too
        rate = self.options.bw_limit_mbps * 1e6 if self.options.bw_limit_mbps else None
        self.pacing = OrderedThrottle(rate, stop)
        self.throttle = self.pacing
        self.halt = self.pacing.halt  # a retry's back-off ends on the stop too
        self.priority = priority
        self.small_runs = None  # every shard paced on its own (the throttle is set only now)

    def copy_prepared(self, item: CopyItem) -> None:
        self.slots.give_back()  # no slot kept across the wait for this item's turn
        self.pacing.check()
        self.pacing.begin(self.priority[item.shard.relpath])
        try:
            super().copy_prepared(item)
        finally:
            self.pacing.end()


def plan_entries(
    shards: Sequence[SourceShard], plan: LocalPlan, expected: Mapping[str, ManifestEntry]
) -> list[ManifestEntry]:
    """What the run will publish, in source order; refuses shards whose samples are unknown."""
    entries: list[ManifestEntry] = []
    to_copy = {item.shard.relpath: item for item in plan.to_copy}
    for shard in shards:
        kept = plan.kept.get(shard.relpath)
        if kept is not None:
            want = expected.get(shard.relpath)
            samples = kept.samples if kept.samples is not None else getattr(want, "samples", None)
            entries.append(ManifestEntry(kept.relpath, kept.size, kept.hash, samples, kept.version))
            continue
        item = to_copy[shard.relpath]
        want = expected.get(shard.relpath)
        samples = want.samples if want is not None else None
        entries.append(
            ManifestEntry(shard.relpath, item.size or 0, item.want_hash, samples, shard.version)
        )
    unknown = [e.relpath for e in entries if e.samples is None]
    if unknown:
        raise UsageError(
            f"stage-in --background needs every shard's sample count before copying (the "
            f"loader plans equal epochs while shards land), but {len(unknown)} shard(s) have "
            f"none (first: {unknown[0]!r}); run `stager index SOURCE` once (it writes "
            "stager-manifest.json beside the shards) or pass --manifest"
        )
    return entries


@contextlib.contextmanager
def _stop_on_signals(stop: SignalSafeEvent, copying: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop`` (before the copies start they also raise at once, as
    nothing partial exists yet); SIGUSR1/SIGUSR2 are ignored while the run lasts."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers live on the main thread; a caller elsewhere sets ``stop``
        return

    def handler(signum: int, _frame: object) -> None:
        stop.set()
        if not copying.is_set():
            raise StagingStopped(f"stopped by signal {signum} before copying anything")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    # Slurm's warning signals (--signal=USR1@T without B:) reach every task of every step; they
    # are the training script's business, and their default action would kill the copier.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def background_stage_in(
    list_source: Callable[[], SourceSet],
    staged: StagedDataset,
    options: StageInOptions,
    *,
    spec: str = "",
    copy_seed: int = 0,
    slurm: SlurmEnv | None = None,
    select: NodeSelect | None = None,
    stop: SignalSafeEvent | None = None,
) -> StageInReport:
    """Stage the source ``list_source()`` lists into ``staged``, in the loader's order.

    The source is listed once this process holds the node lock, so that a waiter
    (``--wait-staged``) can tell a copier still listing from one that never started; ``spec``
    (:func:`stager.layout.canonical_spec` of what was asked) is what other tasks of the node
    compare before adopting this run's result. ``stop`` (default: a new event, set by
    SIGTERM/SIGINT on the main thread) ends the run between two blocks with
    :class:`StagingStopped`. Other failures are the plain run's.
    """
    run = _BackgroundRun(
        options,
        slurm or SlurmEnv.from_environ(),
        staged,
        options.log or sys.stderr,
        stop or SignalSafeEvent(),
        copy_seed,
        select,
    )

    def work(heartbeat: Callable[[], None]) -> StageInReport:
        report = StageInReport(run.slurm.node_name, run.slurm.job_id, str(staged.dir), "", spec)
        try:
            discard_plan(staged)  # an earlier run's plan proves nothing from here on
            source = list_source()
            if staged_dataset(source, options) != staged:
                raise UsageError(f"{source.root_url} is not staged as {staged.dir}; pass --name")
            report = new_report(run.slurm, staged, source, options)
            run.stage(source, report, heartbeat)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    with _stop_on_signals(run.stop, run.copying):
        return run_once_per_node(staged, options, work, spec=spec)


@dataclass
class _BackgroundRun:
    """One node's background stage-in of one dataset (see the module doc)."""

    options: StageInOptions
    slurm: SlurmEnv
    staged: StagedDataset
    log: TextIO
    stop: SignalSafeEvent
    copy_seed: int
    select: NodeSelect | None
    copying: threading.Event = field(default_factory=threading.Event)

    def stage(
        self, source: SourceSet, report: StageInReport, heartbeat: Callable[[], None]
    ) -> None:
        options, staged, node = self.options, self.staged, self.slurm.node_name
        manifest = checked_manifest(source, options, staged)
        source, shards = node_share(source, manifest, self.select, options.jobs)
        run, plan, expected = prepare(
            source,
            options,
            self.slurm,
            shards,
            staged,
            report,
            self.log,
            manifest=manifest,
            size_later=False,
            heartbeat=heartbeat,
        )
        entries = plan_entries(shards, plan, expected)
        for item in plan.to_copy:
            discard(item.final)  # not verified by this run: its name must not stand for its bytes
        plan.free_bytes = preflight(staged.dir, plan.bytes_to_copy, options, node)
        salt = copy_salt(options.subset, self.slurm.node)
        order = copy_order(len(shards), seed=self.copy_seed, salt=salt)
        place = {shards[i].relpath: p for p, i in enumerate(order.tolist())}
        plan.to_copy.sort(key=lambda item: place[item.shard.relpath])
        facts = PlanFacts(
            run_id=uuid.uuid4().hex,
            started_at=time.time(),
            job_id=self.slurm.job_id,
            restart_count=self.slurm.restart_count,
            node=node,
            copy_seed=self.copy_seed,
            salt=salt,
            subset=options.subset,
            source=source.root_url,
            spec=source.spec,
        )
        write_plan(staged, entries, facts)
        heartbeat()
        self.say(
            f"{len(plan.kept)} of {len(shards)} shard(s) staged already, copying "
            f"{len(plan.to_copy)} in the loader's order (copy seed {self.copy_seed})"
        )
        self.copying.set()
        try:
            if self.stop.is_set():
                raise CopierStopped
            if plan.to_copy:
                time.sleep(jitter_s(self.slurm.node, self.slurm.num_nodes, options.jitter_max_s))
                outcome = _OrderedCopier(
                    source,
                    plan,
                    options,
                    report,
                    self.log,
                    journal=run.journal,
                    heartbeat=heartbeat,
                    stop=self.stop,
                    priority=place,
                ).run()
                run.entries.update(outcome.entries)
                run.parsed.update(outcome.parsed)
        except CopierStopped:
            clean_partials(staged.dir)  # every copy removed its own; this is belt and braces
            report.seconds = time.monotonic() - run.started
            raise StagingStopped(
                f"[{node}] stage-in --background stopped by a signal with "
                f"{len(plan.kept) + report.files_copied} of {len(shards)} shard(s) staged and "
                "no partial file left; rerun it to copy the rest"
            ) from None
        finish(run)
        failed = f", {len(report.failures)} failed" if report.failures else ""
        self.say(f"done, {len(run.entries)} of {len(shards)} shard(s) staged{failed}")

    def say(self, message: str) -> None:
        print(
            f"[{self.slurm.node_name}] stage-in --background: {message}", file=self.log, flush=True
        )
