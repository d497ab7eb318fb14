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
6. write the staged manifest and the result waiting tasks adopt, as plain stage-in does.

If the group cannot form (peers absent, torch missing), the node falls back to plain per-node
copying after a one-line warning: slower for the source, never wrong. Once the group has
formed, a failing peer makes every other node exit non-zero (:class:`FanoutError`); verified
shards stay, so a rerun resumes and reads from the source only what no node holds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

import numpy

from stager.errors import ScratchFull, ShardFailure, ShardsFailed, UsageError
from stager.fanout.exchange import Exchange, ExchangeShard
from stager.fanout.group import (
    FanoutError,
    FanoutOptions,
    GroupUnavailable,
    NodeGroup,
    form_group,
    resolve_endpoint,
)
from stager.plan.fanout import plan_fanout, shard_list_digest
from stager.shards.manifest import Manifest, ManifestEntry
from stager.slurm import SlurmEnv
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport

# Planning, preflight, lock adoption and the plain copy are stage-in's own; reusing them keeps
# the two paths' skip/verify/adopt semantics identical.
from stager.stagein.run import (
    StageInOptions,
    _clean_partials,
    _count,
    _load_manifest,
    _one_line,
    _plan,
    _preflight,
    _read_previous,
    _run,
    attach_report,
    run_once_per_node,
    stage_in,
    staged_manifest_path,
)
from stager.storage.paths import safe_join
from stager.storage.sources import SourceSet

__all__ = [
    "fanout_stage_in",
    "FanoutOptions",
    "FanoutError",
    "GroupUnavailable",
]


def node_label(slurm: SlurmEnv, rank: int) -> str:
    """A node's name for messages: its host name when the node list is known, else its rank."""
    if len(slurm.nodelist) == slurm.num_nodes:
        return slurm.nodelist[rank]
    return f"node-rank-{rank}"


def fanout_stage_in(
    source: SourceSet,
    options: StageInOptions,
    fanout: FanoutOptions | None = None,
    *,
    slurm: SlurmEnv | None = None,
    env: Mapping[str, str] | None = None,
) -> StageInReport:
    """Stage all of ``source`` on this node, reading only this node's part from the source.

    Every node of the job must call it (one task per node). Raises like :func:`stage_in`, plus
    :class:`FanoutError` (exit 10) when a peer fails after the group formed.
    """
    fanout = fanout or FanoutOptions()
    slurm = slurm or SlurmEnv.from_environ()
    if slurm.num_nodes <= 1:
        return stage_in(source, options, slurm=slurm)  # nobody to share with
    if not 0 <= slurm.node_id < slurm.num_nodes:
        raise UsageError(
            f"SLURM_NODEID={slurm.node_id} is outside 0..{slurm.num_nodes - 1}; run under srun"
        )
    log = options.log or sys.stderr
    host, port = resolve_endpoint(slurm, fanout, env)

    def work(dataset_dir: Path) -> StageInReport:
        # torch takes seconds to import: do it while this node plans and verifies its shards.
        threading.Thread(
            target=_import_torch_distributed, name="fanout-import", daemon=True
        ).start()
        report = _new_report(slurm, dataset_dir, source, options, "on")
        try:
            try:
                _run_fanout(source, options, fanout, slurm, (host, port), dataset_dir, report, log)
            except GroupUnavailable as exc:
                print(
                    f"[{slurm.node_name}] warning: {_one_line(exc)}; falling back to plain per-node copying "
                    "(this node reads the whole dataset from the source)",
                    file=log,
                    flush=True,
                )
                report = _new_report(slurm, dataset_dir, source, options, "fallback")
                _run(source, options, slurm, None, dataset_dir, report, log)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    # The same lock and result file as plain stage-in: the two exclude each other on a node.
    return run_once_per_node(source, options, work)


def _import_torch_distributed() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - form_group imports again and reports the failure
        pass


def _new_report(
    slurm: SlurmEnv, dataset_dir: Path, source: SourceSet, options: StageInOptions, mode: str
) -> StageInReport:
    return StageInReport(
        node=slurm.node_name,
        job_id=slurm.job_id,
        dataset_dir=str(dataset_dir),
        source=source.root_url,
        subset=options.subset,
        fanout=mode,
    )


def _run_fanout(
    source: SourceSet,
    options: StageInOptions,
    fanout: FanoutOptions,
    slurm: SlurmEnv,
    endpoint: tuple[str, int],
    dataset_dir: Path,
    report: StageInReport,
    log: TextIO,
) -> None:
    started = time.monotonic()
    shards = list(source.shards)
    manifest = _load_manifest(source, options)
    expected = manifest.by_relpath() if manifest is not None else {}
    _clean_partials(dataset_dir)
    local = _plan(shards, dataset_dir, expected, _read_previous(dataset_dir), options, log)
    items = []
    for shard in shards:
        want, kept = expected.get(shard.relpath), local.kept.get(shard.relpath)
        items.append(
            ExchangeShard(
                shard=shard,
                final=safe_join(dataset_dir, shard.relpath),
                size=want.size if want is not None else shard.size,
                want_hash=want.hash if want is not None else None,
                have=kept is not None,
                have_hash=kept.hash if kept is not None else None,
            )
        )
    report.files_total = len(shards) + len(source.missing)
    report.files_skipped = len(local.kept)
    report.bytes_total = sum(it.size or 0 for it in items)
    for url in source.missing:
        report.add_failure(ShardFailure(url, "not found on the source"))
    needed = sum(it.size or 0 for it in items if not it.have)
    refusal: ScratchFull | None = None
    try:
        _preflight(dataset_dir, needed, options, slurm.node_name)
    except ScratchFull as exc:
        refusal = exc  # told to the peers in the handshake, so they stop too instead of hanging

    def label(rank: int) -> str:
        return node_label(slurm, rank)

    forming = time.monotonic()
    with form_group(endpoint[0], endpoint[1], slurm.node_id, slurm.num_nodes, fanout) as group:
        have = _handshake(group, items, refusal is None, label)
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
            ).run()
        finally:
            progress.close()

    entries: dict[str, ManifestEntry] = dict(local.kept)
    for index, (size, digest) in outcome.staged.items():
        relpath = items[index].shard.relpath
        want = expected.get(relpath)
        samples = want.samples if want is not None else None
        if samples is None and options.count_samples:
            samples = _count(items[index].final, log)
        entries[relpath] = ManifestEntry(relpath, size, digest, samples)
    for failure in outcome.failures:
        report.add_failure(failure)
    staged = Manifest(
        tuple(entries[s.relpath] for s in shards if s.relpath in entries),
        {
            "source": source.root_url,
            "subset": options.subset,
            "node": slurm.node_name,
            "job_id": slurm.job_id,
        },
    )
    staged_path = staged_manifest_path(dataset_dir)
    staged_path.parent.mkdir(exist_ok=True)
    staged.write(staged_path)
    report.seconds = time.monotonic() - started
    if report.failures:
        full = [f for f in report.failures if f["reason"].startswith("no space left")]
        if full:
            raise ScratchFull(f"[{slurm.node_name}] {full[0]['reason']}", where=str(dataset_dir))
        raise ShardsFailed([ShardFailure(f["url"], f["reason"]) for f in report.failures])


def _handshake(
    group: NodeGroup, items: Sequence[ExchangeShard], ready: bool, label
) -> list[list[bool]]:
    """All-gather (shard-list digest, preflight verdict, have-bitmap); refuse any disagreement.

    Runs under the short form timeout: a failure here still means "no group", so every node
    falls back rather than some exchanging and some not.
    """
    torch = group.torch
    digest = shard_list_digest([(it.shard.relpath, it.size) for it in items])
    meta = torch.tensor([digest, int(ready), len(items)], dtype=torch.int64)
    # packbits of zero shards is empty; gloo wants at least one element, so pad one byte.
    bits = numpy.packbits(numpy.array([it.have for it in items] + [False], dtype=bool))
    try:
        metas = [m.tolist() for m in group.all_gather(meta, forming=True)]
        if any(m[0] != metas[0][0] or m[2] != metas[0][2] for m in metas):
            counts = ", ".join(f"{label(r)}: {m[2]}" for r, m in enumerate(metas))
            raise FanoutError(
                f"nodes listed different shards ({counts} shards, or different sizes); the source changed "
                "while the job started? rerun once it is stable"
            )
        gathered = group.all_gather(torch.from_numpy(bits), forming=True)
    except FanoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch errors while forming: no group
        raise GroupUnavailable(f"handshake failed ({_one_line(exc)[:300]})") from exc
    refusing = [label(r) for r, m in enumerate(metas) if not m[1] and r != group.rank]
    if refusing and ready:
        raise FanoutError(
            f"node(s) {', '.join(refusing)} lack scratch space for the dataset, so nobody copied anything; "
            "see their error line, free space there or pass --dest"
        )
    count = len(items)
    return [numpy.unpackbits(t.numpy())[:count].astype(bool).tolist() for t in gathered]
