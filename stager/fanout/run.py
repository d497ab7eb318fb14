"""``stage-in --fanout``: replicated staging that reads the source once, whatever the node count.

Run as one task per node (``srun --ntasks-per-node=1 stage-in --fanout SRC``). Per node:

1. take the node lock, as plain stage-in does (one copier per node; other tasks on the node
   wait and adopt its result, so only one task per node ever joins the group);
2. plan locally: verified shards are kept, leftovers of a killed run deleted, free space checked;
3. form the node group (:mod:`stager.fanout.group`) and all-gather a handshake: a digest of the
   shard list (all nodes must have listed the same shards), the preflight verdict, and a bitmap
   of the shards each node already holds;
4. plan the exchange (:mod:`stager.plan.fanout`, pure): owners, balanced by bytes, holders first;
5. exchange (:mod:`stager.fanout.exchange`): owners read their part from the source while the
   main thread broadcasts, receivers verify and rename;
6. end as plain stage-in ends (:mod:`stager.stagein.finish`): samples counted, the staged
   manifest and the loader's index written, the same exit code for the same failure.

A node that fails before the exchange (its listing of the source, its scratch, the space it
needs) still joins the group to say so in the handshake (:mod:`stager.fanout.handshake`), so
every node stops at once. If the group cannot form (peers absent, torch missing), the node
falls back to plain per-node copying after a one-line warning: slower for the source, never
wrong. Once the group has
formed, a failing peer makes every other node exit non-zero (:class:`FanoutError`); verified
shards stay, so a rerun resumes and reads from the source only what no node holds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from stager.errors import GroupUnavailable, UsageError, one_line
from stager.fanout.exchange import Exchange, ExchangeShard
from stager.fanout.group import FanoutOptions, form_group, quiet_torch_logs, resolve_endpoint
from stager.fanout.handshake import failure_told_to_peers, handshake
from stager.layout import StagedDataset
from stager.plan.fanout import plan_fanout
from stager.shards.manifest import ManifestEntry
from stager.slurm import SlurmEnv
from stager.stagein.finish import Staging, finish
from stager.stagein.guards import preflight
from stager.stagein.node import attach_report, run_once_per_node
from stager.stagein.options import StageInOptions
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport
from stager.stagein.run import (
    checked_manifest,
    copy_per_node,
    new_report,
    prepare,
    stage_in,
    staged_dataset,
)
from stager.storage.dest import ensure_private_dir
from stager.storage.paths import safe_join
from stager.storage.sources import SourceSet

__all__ = ["fanout_stage_in", "FanoutOptions", "told_to_peers"]


def node_label(slurm: SlurmEnv, node: int) -> str:
    """A node's name for messages: its host name when the node list is known, else its index."""
    if len(slurm.nodelist) == slurm.num_nodes:
        return slurm.nodelist[node]
    return f"node-{node}"


def fanout_stage_in(
    source: SourceSet,
    options: StageInOptions,
    fanout: FanoutOptions | None = None,
    *,
    slurm: SlurmEnv | None = None,
    env: Mapping[str, str] | None = None,
) -> StageInReport:
    """Stage all of ``source`` on this node, reading only this node's part from the source.

    Every node of the job must call it (one task per node). Raises like
    :func:`stager.stagein.run.stage_in`, plus :class:`FanoutError` (exit 10) when a peer fails
    after the group formed.
    """
    fanout = fanout or FanoutOptions()
    slurm = slurm or SlurmEnv.from_environ()
    if slurm.num_nodes <= 1:
        return stage_in(source, options, slurm=slurm)  # nobody to share with
    if not 0 <= slurm.node < slurm.num_nodes:
        raise UsageError(
            f"SLURM_NODEID={slurm.node} is outside 0..{slurm.num_nodes - 1}; run under srun"
        )
    log = options.log or sys.stderr
    endpoint = resolve_endpoint(slurm, fanout, env)
    with told_to_peers(slurm, fanout, lambda: options.name or source.name, env):
        staged = staged_dataset(source, options)
        ensure_private_dir(staged.root)  # (again in run_once_per_node: a read-only scratch
        ensure_private_dir(staged.dir)  # fails here, where the peers are told)

    def work(heartbeat: Callable[[], None]) -> StageInReport:
        # torch takes seconds to import: do it while this node plans and verifies its shards.
        quiet_torch_logs()
        threading.Thread(
            target=_import_torch_distributed, name="fanout-import", daemon=True
        ).start()
        report = new_report(slurm, staged, source, options, "on")
        try:
            try:
                _run_fanout(
                    source, options, fanout, slurm, endpoint, staged, report, log, heartbeat
                )
            except GroupUnavailable as exc:
                print(
                    f"[{slurm.node_name}] warning: {one_line(exc)}; falling back to plain per-node "
                    "copying (this node reads the whole dataset from the source)",
                    file=log,
                    flush=True,
                )
                report = new_report(slurm, staged, source, options, "fallback")
                copy_per_node(source, options, slurm, None, staged, report, log, heartbeat)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    # The same lock and result file as plain stage-in: the two exclude each other on a node.
    return run_once_per_node(staged, options, work, spec=source.spec)


def _import_torch_distributed() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - form_group imports again and reports the failure
        pass


def _exchange_items(
    run: Staging, expected: Mapping[str, ManifestEntry], kept: dict[str, ManifestEntry]
) -> list[ExchangeShard]:
    items = []
    for shard in run.shards:
        want, have = expected.get(shard.relpath), kept.get(shard.relpath)
        items.append(
            ExchangeShard(
                shard=shard,
                final=safe_join(run.staged.dir, shard.relpath),
                size=want.size if want is not None else shard.size,
                want_hash=want.hash if want is not None else None,
                have=have is not None,
                have_hash=have.hash if have is not None else None,
                from_manifest=want is not None,
            )
        )
    return items


def _run_fanout(
    source: SourceSet,
    options: StageInOptions,
    fanout: FanoutOptions,
    slurm: SlurmEnv,
    endpoint: tuple[str, int],
    staged: StagedDataset,
    report: StageInReport,
    log: TextIO,
    heartbeat: Callable[[], None] = lambda: None,
) -> None:
    with told_to_peers(slurm, fanout, lambda: staged.name, holding_lock=True):  # (full, too)
        run, local, expected = prepare(
            source,
            options,
            slurm,
            list(source.shards),
            staged,
            report,
            log,
            manifest=checked_manifest(source, options, staged),
            size_later=False,
            heartbeat=heartbeat,
        )
        items = _exchange_items(run, expected, local.kept)
        report.bytes_total = sum(it.size or 0 for it in items)
        needed = sum(it.size or 0 for it in items if not it.have)
        preflight(staged.dir, needed, options, slurm.node_name)

    def label(node: int) -> str:
        return node_label(slurm, node)

    forming = time.monotonic()
    tag = f"{slurm.job_id}/{staged.name}"
    with form_group(*endpoint, slurm.node, slurm.num_nodes, fanout, tag) as group:
        asked = (source.spec, fanout.chunk_bytes, source.is_local)
        have = handshake(group, items, label, asked)
        report.fanout_form_s = time.monotonic() - forming
        plan = plan_fanout([it.size for it in items], have)
        progress = Progress(
            needed,
            sum(not it.have for it in items),
            label=f"[{report.node}] stage-in --fanout",
            mode=options.progress,
            interval_s=options.progress_interval_s,
            stream=log,
        )
        try:
            outcome = Exchange(
                group,
                plan,
                items,
                source=source,
                options=options,
                fanout=fanout,
                report=report,
                progress=progress,
                node_label=label,
                log=log,
                journal=run.journal,
                heartbeat=heartbeat,
            ).run()
        finally:
            progress.close()
            report.seconds = time.monotonic() - run.started  # (a failed exchange's, too)
    for index, (size, digest) in outcome.staged.items():
        relpath = items[index].shard.relpath
        run.unverified.add(relpath)
        want = expected.get(relpath)
        run.entries[relpath] = ManifestEntry(
            relpath,
            size,
            digest,
            want.samples if want is not None else None,
            items[index].shard.version,
        )
    for failure in outcome.failures:
        report.add_failure(failure)
    finish(run)


def told_to_peers(
    slurm: SlurmEnv,
    fanout: FanoutOptions,
    dataset_name: Callable[[], str],
    env: Mapping[str, str] | None = None,
    *,
    holding_lock: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """A block whose failure (a :class:`StagerError`) this node tells its peers in the
    handshake before raising it (:mod:`stager.fanout.handshake`): every node stops at once,
    where the peers waited for it and then each read the whole dataset from the source.

    ``dataset_name`` is called only on failure (the group's key names the dataset); where it
    fails in turn (a --from-list this node cannot read), the peers are not told. Before the
    node lock (``holding_lock`` False) only the node's first task tells: every task of a node
    fails alike there, and each joining as the node's rank kept the others waiting for a
    group that had formed without them (2.5 form timeouts).
    """
    if not (holding_lock or slurm.local_rank == 0):
        return contextlib.nullcontext()
    return failure_told_to_peers(
        lambda: (resolve_endpoint(slurm, fanout, env), f"{slurm.job_id}/{dataset_name()}"),
        slurm.node,
        slurm.num_nodes,
        fanout,
    )
