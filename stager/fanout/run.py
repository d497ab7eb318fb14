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

If the group cannot form (peers absent, torch missing), the node falls back to plain per-node
copying after a one-line warning: slower for the source, never wrong. Once the group has
formed, a failing peer makes every other node exit non-zero (:class:`FanoutError`); verified
shards stay, so a rerun resumes and reads from the source only what no node holds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import numpy

from stager.errors import (
    FanoutError,
    GroupUnavailable,
    ScratchFull,
    UsageError,
    one_line,
)
from stager.fanout.exchange import Exchange, ExchangeShard
from stager.fanout.group import FanoutOptions, NodeGroup, form_group, resolve_endpoint
from stager.layout import StagedDataset
from stager.plan.fanout import plan_fanout, shard_list_digest
from stager.shards.manifest import ManifestEntry
from stager.slurm import SlurmEnv
from stager.stagein.finish import Staging, finish
from stager.stagein.guards import preflight
from stager.stagein.node import attach_report, run_once_per_node
from stager.stagein.options import StageInOptions
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport
from stager.stagein.run import copy_per_node, new_report, prepare, stage_in, staged_dataset
from stager.storage.identity import node_neutral
from stager.storage.paths import safe_join
from stager.storage.sources import SourceSet

__all__ = ["fanout_stage_in", "FanoutOptions"]


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
    staged = staged_dataset(source, options)

    def work(heartbeat: Callable[[], None]) -> StageInReport:
        # torch takes seconds to import: do it while this node plans and verifies its shards.
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
    run, local, expected = prepare(
        source,
        options,
        slurm,
        list(source.shards),
        staged,
        report,
        log,
        size_later=False,
        heartbeat=heartbeat,
    )
    items = _exchange_items(run, expected, local.kept)
    report.bytes_total = sum(it.size or 0 for it in items)
    needed = sum(it.size or 0 for it in items if not it.have)
    refusal: ScratchFull | None = None
    try:
        preflight(staged.dir, needed, options, slurm.node_name)
    except ScratchFull as exc:
        refusal = exc  # told to the peers in the handshake, so they stop too instead of hanging

    def label(node: int) -> str:
        return node_label(slurm, node)

    forming = time.monotonic()
    tag = f"{slurm.job_id}/{staged.name}"
    with form_group(*endpoint, slurm.node, slurm.num_nodes, fanout, tag) as group:
        asked = (source.spec, fanout.chunk_bytes, source.is_local)
        have = _handshake(group, items, refusal is None, label, asked)
        report.fanout_form_s = time.monotonic() - forming
        if refusal is not None:
            raise refusal
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


def _handshake(
    group: NodeGroup,
    items: Sequence[ExchangeShard],
    ready: bool,
    label: Callable[[int], str],
    asked: tuple[str, int, bool],
) -> list[list[bool]]:
    """All-gather (shard-list digest, preflight verdict, have-bitmap); refuse any disagreement.
    ``asked``: the source spec and chunk size, which every node must share too, and whether the
    source is local (its versions are then compared by their modification times only).

    Runs under the short form timeout: a failure here still means "no group", so every node
    falls back rather than some exchanging and some not.
    """
    torch = group.torch
    spec, chunk_bytes, local = asked
    listed = [
        (it.shard.relpath, it.size, node_neutral(it.shard.version, local), it.want_hash)
        for it in items
    ]
    digest = shard_list_digest(listed, spec)
    meta = torch.tensor([digest, int(ready), len(items), chunk_bytes], dtype=torch.int64)
    # packbits of zero shards is empty; gloo wants at least one element, so pad one byte.
    bits = numpy.packbits(numpy.array([it.have for it in items] + [False], dtype=bool))
    try:
        metas = [m.tolist() for m in group.all_gather(meta, forming=True)]
        if any(m[3] != metas[0][3] for m in metas):
            chunks = ", ".join(f"{label(r)}: {m[3] // 1024}" for r, m in enumerate(metas))
            raise FanoutError(f"nodes were given different --fanout-chunk-kib ({chunks})")
        if any(m[0] != metas[0][0] or m[2] != metas[0][2] for m in metas):
            counts = ", ".join(f"{label(r)}: {m[2]}" for r, m in enumerate(metas))
            raise FanoutError(
                f"nodes listed different shards ({counts} shards, or other sizes or versions), "
                "or were given different sources: the source changed while the job started? "
                "rerun once it is stable, with one SOURCE for every node"
            )
        gathered = group.all_gather(torch.from_numpy(bits), forming=True)
    except FanoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch errors while forming: no group
        raise GroupUnavailable(f"handshake failed ({one_line(exc)[:300]})") from exc
    refusing = [label(r) for r, m in enumerate(metas) if not m[1] and r != group.node]
    if refusing and ready:
        raise FanoutError(
            f"node(s) {', '.join(refusing)} lack scratch space for the dataset, so nobody copied "
            "anything; "
            "see their error line, free space there or pass --dest"
        )
    count = len(items)
    return [numpy.unpackbits(t.numpy())[:count].astype(bool).tolist() for t in gathered]
