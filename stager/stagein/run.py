"""stage-in: copy a dataset's shards to node-local scratch, in parallel, verified, resumable.

The flow, per node:

1. take the node lock (one copier per node; other tasks wait and adopt its result);
2. plan: shards whose final file exists with the right size (and hash, when the manifest has
   one) are skipped; leftover ``.partial`` files from a killed run are deleted;
3. preflight: refuse before copying anything if the bytes to copy exceed the free space;
4. wait a jitter derived from the node id, so hundreds of nodes do not hit NFS at once;
5. copy with ``jobs`` concurrent streams under a per-node bandwidth cap, retrying transient
   errors with backoff; each file is published by rename only after verification;
6. write the staged manifest (sizes, hashes, sample counts) that the loader reads, and the
   result that waiting tasks adopt.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from stager.errors import (
    EXIT_INTEGRITY,
    AdoptedFailure,
    DestinationError,
    IntegrityError,
    ScratchFull,
    ShardFailure,
    ShardsFailed,
    SourceError,
    StagerError,
    UsageError,
    exit_code_for,
)
from stager.shards import tarindex
from stager.shards.manifest import MANIFEST_NAMES, Manifest, ManifestEntry, find_manifest
from stager.shards.tarparse import TarSampleCounter
from stager.slurm import SlurmEnv
from stager.stagein.progress import Progress, human_bytes
from stager.stagein.report import StageInReport
from stager.stagein.sizing import DROPPED, UNKNOWN, DeferredPreflight
from stager.stagein.streams import DEFAULT_JOBS, StreamController
from stager.storage.copy import DEFAULT_BLOCK_BYTES, CopyResult, copy_file
from stager.storage.dest import ensure_private_dir
from stager.storage.hashing import hash_file
from stager.storage.lock import NodeLock
from stager.storage.paths import PARTIAL_SUFFIX, SafeJoiner, safe_relpath
from stager.storage.retry import RetryPolicy, call_with_retries
from stager.storage.sources import SourceSet, SourceShard, fill_sizes
from stager.storage.throttle import Throttle
from stager.storage.workers import run_in_threads

__all__ = [
    "StageInOptions",
    "stage_in",
    "staged_manifest_path",
    "STAGED_META_DIR",
    "jitter_s",
    "run_once_per_node",
    "attach_report",
]

STAGED_META_DIR = ".stager"


def staged_manifest_path(dataset_dir: str | Path) -> Path:
    """Where the staged copy keeps its manifest (read by the loader)."""
    return Path(dataset_dir) / STAGED_META_DIR / "manifest.json"


@dataclass(frozen=True)
class StageInOptions:
    """Everything that tunes one stage-in run; the CLI builds this from its flags."""

    dest_root: Path
    name: str | None = None
    jobs: int = DEFAULT_JOBS
    min_jobs: int = 4
    adaptive: bool = True
    bw_limit_mbps: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    manifest: str | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    progress: str = "auto"  # auto | bar | lines | none
    progress_interval_s: float = 10.0
    jitter_max_s: float = 2.0
    count_samples: bool = True
    fsync: bool = False
    lock_timeout_s: float = 24 * 3600
    min_free_bytes: int = 0
    subset: str = "all"
    log: TextIO | None = None


def jitter_s(node_id: int, num_nodes: int, max_s: float) -> float:
    """Start delay for a node: spread evenly over ``[0, max_s)`` by node id, zero on one node.

    Derived (golden-ratio sequence), not random, so reruns behave the same and neighbours in the
    node list land far apart.
    """
    if num_nodes <= 1 or max_s <= 0:
        return 0.0
    return ((node_id * 0.6180339887498949) % 1.0) * max_s


def _load_manifest(source: SourceSet, options: StageInOptions) -> Manifest | None:
    if options.manifest:
        if "://" in options.manifest:
            import fsspec

            with fsspec.open(options.manifest, "rb") as handle:
                local = (
                    Path(options.dest_root)
                    / ".stager-source-manifest"
                    / Path(options.manifest).name
                )
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(handle.read())
            return Manifest.read(local)
        return Manifest.read(options.manifest)
    if not source.shards:
        return None
    root = source.shards[0].path[: len(source.shards[0].path) - len(source.shards[0].relpath)]
    if source.is_local:
        found = find_manifest(root)
        return Manifest.read(found) if found else None
    # A remote dataset (s3://...): look for the same names beside it, fetch the first found.
    for candidate in MANIFEST_NAMES:
        remote = root.rstrip("/") + "/" + candidate
        try:
            if not source.fs.isfile(remote):
                continue
            local = Path(options.dest_root) / ".stager-source-manifest" / candidate
            local.parent.mkdir(parents=True, exist_ok=True)
            source.fs.get_file(remote, str(local))
        except (OSError, ValueError):
            continue  # no manifest is not an error: sizes are still verified
        return Manifest.read(local)
    return None


def _read_previous(dataset_dir: Path) -> dict[str, ManifestEntry]:
    path = staged_manifest_path(dataset_dir)
    if not path.is_file():
        return {}
    try:
        return Manifest.read(path).by_relpath()
    except StagerError:
        return {}  # a damaged staged manifest only costs re-verification by size


def _clean_partials(dataset_dir: Path) -> int:
    removed = 0
    for leftover in dataset_dir.rglob(f"*{PARTIAL_SUFFIX}"):
        try:
            leftover.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _count(final: Path, log: TextIO) -> int | None:
    if not final.name.endswith((".tar", ".tgz", ".tar.gz")):
        return None
    try:
        return tarindex.count_samples(final)
    except IntegrityError as exc:
        print(f"warning: {exc}", file=log, flush=True)
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@dataclass
class _Plan:
    to_copy: list[tuple[SourceShard, Path, int | None, str | None]]
    kept: dict[str, ManifestEntry]
    sized_later: set[str] = field(default_factory=set)  # relpaths sized while they copy
    free_bytes: int = 0  # free on scratch before the first copy


def _sized_while_copying(
    source: SourceSet,
    shards: Sequence[SourceShard],
    expected: dict[str, ManifestEntry],
    dataset_dir: Path,
) -> set[str]:
    """Walked shards to size during the copy (:mod:`stager.stagein.sizing`) rather than before it.

    Those of a local source that the manifest does not describe and that are not staged yet: a
    staged file is compared with the source by size in the plan, so it needs its size first.
    """
    if source.remote_fs is not None:
        return set()
    base = str(dataset_dir)
    return {
        s.relpath
        for s in shards
        if s.size is None
        and s.relpath not in expected
        and not os.path.lexists(os.path.join(base, s.relpath))
    }


def _plan(
    shards: Sequence[SourceShard],
    dataset_dir: Path,
    expected: dict[str, ManifestEntry],
    previous: dict[str, ManifestEntry],
    options: StageInOptions,
    log: TextIO,
) -> _Plan:
    to_copy, kept = [], {}
    join = SafeJoiner(dataset_dir)
    for shard in shards:
        final = join(shard.relpath)
        want = expected.get(shard.relpath)
        size = want.size if want is not None else shard.size
        want_hash = want.hash if want is not None else None
        if final.is_file() and (size is None or final.stat().st_size == size):
            before = previous.get(shard.relpath)
            have_hash = (
                before.hash if before is not None and before.size == final.stat().st_size else None
            )
            if want_hash is not None and have_hash != want_hash:
                have_hash = hash_file(final, want_hash.split(":", 1)[0])
            if want_hash is None or have_hash == want_hash:
                samples = want.samples if want is not None and want.samples is not None else None
                if samples is None and before is not None:
                    samples = before.samples
                if samples is None and options.count_samples:
                    samples = _count(final, log)
                kept[shard.relpath] = ManifestEntry(
                    shard.relpath, final.stat().st_size, have_hash, samples
                )
                continue
        to_copy.append((shard, final, size, want_hash))
    return _Plan(to_copy, kept)


def _preflight(dataset_dir: Path, needed: int, options: StageInOptions, node: str) -> int:
    """Refuse if ``needed`` bytes do not fit; return the free bytes."""
    free = shutil.disk_usage(dataset_dir).free
    if needed + options.min_free_bytes > free:
        raise _space_error(dataset_dir, needed, free, node)
    return free


def _space_error(dataset_dir: Path | str, needed: int, free: int, node: str) -> ScratchFull:
    return ScratchFull(
        f"[{node}] not enough space on {dataset_dir}: need {human_bytes(needed)} ({needed} bytes), "
        f"free {human_bytes(free)} ({free} bytes); nothing was copied. Free space, stage a subset "
        "(--subset node) or pass --dest to a larger filesystem",
        needed_bytes=needed,
        free_bytes=free,
        where=str(dataset_dir),
    )


def stage_in(
    source: SourceSet,
    options: StageInOptions,
    *,
    slurm: SlurmEnv | None = None,
    select: Callable[[SourceSet], Sequence[SourceShard]] | None = None,
) -> StageInReport:
    """Stage ``source`` into ``options.dest_root / name`` on this node and return the report.

    ``select`` narrows the shards (``--subset node``); default: all of them. Raises a
    :class:`StagerError` (with ``.report`` attached) when anything failed; everything that
    succeeded stays staged and is skipped by a rerun.
    """
    slurm = slurm or SlurmEnv.from_environ()
    log = options.log or sys.stderr

    def work(dataset_dir: Path) -> StageInReport:
        report = StageInReport(
            node=slurm.node_name,
            job_id=slurm.job_id,
            dataset_dir=str(dataset_dir),
            source=source.root_url,
            subset=options.subset,
        )
        try:
            _run(source, options, slurm, select, dataset_dir, report, log)
        except BaseException as exc:
            attach_report(exc, report)
            raise
        return report

    return run_once_per_node(source, options, work)


def attach_report(exc: BaseException, report: StageInReport) -> None:
    """Let the caller (the CLI, waiting tasks) see what was done before ``exc`` stopped it."""
    exc.report = report  # type: ignore[attr-defined]


def run_once_per_node(
    source: SourceSet, options: StageInOptions, work: Callable[[Path], StageInReport]
) -> StageInReport:
    """Run ``work(dataset_dir)`` as this node's only copier; tasks that waited adopt its result.

    The first task to take the node lock does the work and publishes its report (or its
    failure) beside the lock; a task that found the lock held waits, then returns that result or
    re-raises that failure with the same exit code. If the holder died without a fresh result
    (``kill -9``), the waiter does the work itself, which skips whatever is already staged.
    ``work`` attaches its report to any exception it raises (:func:`attach_report`).
    """
    name = safe_relpath(options.name or source.name)
    if "/" in name:
        raise UsageError(f"dataset name {name!r} must not contain '/'")
    root = ensure_private_dir(options.dest_root)
    dataset_dir = ensure_private_dir(root / name)
    result_path = root / f".stager-{name}.result.json"
    wait_started = time.time()
    with NodeLock(root / f".stager-{name}.lock", timeout_s=options.lock_timeout_s) as lock:
        if lock.contended:
            adopted = _adopt(result_path, wait_started)
            if adopted is not None:
                return adopted
        try:
            report = work(dataset_dir)
        except BaseException as exc:
            failed: StageInReport | None = getattr(exc, "report", None)
            if failed is not None:
                failed.exit_code = exit_code_for(exc)
                _write_result(result_path, failed, _one_line(exc))
            raise
        _write_result(result_path, report, "")
        return report


def _adopt(result_path: Path, wait_started: float) -> StageInReport | None:
    """The result of the copier we waited for, if it finished after we started waiting."""
    try:
        payload = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return None
    if payload.get("finished_at", 0) < wait_started:
        return None  # stale, from an earlier run; the holder died: do the work ourselves
    report = StageInReport.from_json(payload["report"])
    report.role = "waiter"
    if report.exit_code != 0:
        raise AdoptedFailure(
            payload.get("error") or "the copier on this node failed", report.exit_code
        )
    return report


def _write_result(result_path: Path, report: StageInReport, error: str) -> None:
    """Publish the result for waiting tasks; best effort.

    On a full scratch this write fails too, and must not mask the error being reported: a
    waiter that finds no fresh result takes the lock and re-plans, which skips what is staged.
    """
    tmp = result_path.with_name(result_path.name + PARTIAL_SUFFIX)
    try:
        tmp.write_text(
            json.dumps({"finished_at": time.time(), "error": error, "report": report.to_json()})
        )
        tmp.replace(result_path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _run(
    source: SourceSet,
    options: StageInOptions,
    slurm: SlurmEnv,
    select: Callable[[SourceSet], Sequence[SourceShard]] | None,
    dataset_dir: Path,
    report: StageInReport,
    log: TextIO,
) -> None:
    started = time.monotonic()
    shards = list(select(source) if select is not None else source.shards)
    manifest = _load_manifest(source, options)
    expected = manifest.by_relpath() if manifest is not None else {}
    # A listing made without stats (resolve_source(stat_listed=False)): the manifest's sizes
    # stand for the shards it describes; the others cost a metadata round trip, made while the
    # copies run for those not staged yet.
    sized_later = _sized_while_copying(source, shards, expected, dataset_dir)
    shards = fill_sizes(source, shards, options.jobs, known=expected.keys() | sized_later)
    if manifest is not None:
        unlisted = [s.relpath for s in shards if s.relpath not in expected]
        if unlisted:
            print(
                f"[{slurm.node_name}] warning: {len(unlisted)} shard(s) are not in the manifest (first: {unlisted[0]}); "
                "they are verified by size only. Re-run `stager index` if the dataset changed",
                file=log,
                flush=True,
            )
    _clean_partials(dataset_dir)
    plan = _plan(shards, dataset_dir, expected, _read_previous(dataset_dir), options, log)
    report.files_total = len(shards) + len(source.missing)
    report.files_skipped = len(plan.kept)
    report.bytes_total = sum(e.size for e in plan.kept.values()) + sum(
        s or 0 for _, _, s, _ in plan.to_copy
    )
    for url in source.missing:
        report.add_failure(ShardFailure(url, "not found on the source"))
    needed = sum(size or 0 for _, _, size, _ in plan.to_copy)
    plan.free_bytes = _preflight(dataset_dir, needed, options, slurm.node_name)
    plan.sized_later = sized_later

    entries: dict[str, ManifestEntry] = dict(plan.kept)
    parsed: dict[str, TarSampleCounter] = {}  # member offsets parsed in flight, for the loader
    corrupt = False
    if plan.to_copy:
        time.sleep(jitter_s(slurm.node_id, slurm.num_nodes, options.jitter_max_s))
        known_samples = {k: e.samples for k, e in expected.items()}
        if options.count_samples:
            _import_in_background("stager.shards.loader_index")  # numpy: ~0.2 s, overlapped with the copies' I/O
        corrupt = _copy_all(source, plan, options, report, entries, known_samples, parsed, log)

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
    try:
        staged.write(staged_path)
    except OSError as exc:
        if not report.failures:
            raise _manifest_write_error(exc, staged_path) from exc
        # else the shard failures raised below say more; a rerun re-verifies and rewrites it
    if not report.failures:
        _save_loader_index(dataset_dir, staged, parsed)
    report.seconds = time.monotonic() - started
    if report.failures:
        full = [f for f in report.failures if f["reason"].startswith("no space left")]
        failures = [ShardFailure(f["url"], f["reason"]) for f in report.failures]
        if full:
            raise ScratchFull(f"[{slurm.node_name}] {full[0]['reason']}", where=str(dataset_dir))
        failed = ShardsFailed(failures)
        if corrupt:  # a hash mismatch is an integrity problem (exit 4), not a flaky source (3)
            failed.exit_code = EXIT_INTEGRITY
        raise failed


def _import_in_background(module: str) -> None:
    """Start importing ``module`` on a daemon thread; a later ``import`` waits for it to finish.

    The index writer needs numpy, whose import costs ~0.2 s of CPU. Done lazily on the first
    finished copy, it held the import lock while the other copy threads queued behind it; done
    here, it overlaps copies that are waiting on the source.
    """
    threading.Thread(
        target=importlib.import_module, args=(module,), name="stage-in-import", daemon=True
    ).start()


def _save_loader_index(
    dataset_dir: Path, staged: Manifest, parsed: dict[str, TarSampleCounter]
) -> None:
    """Hand the loader the member offsets parsed in flight, so its first start reads no header.

    Only when every staged shard was parsed in this run; after a partial rerun the loader
    indexes the shards itself (correct either way, only slower).
    """
    if not staged.entries or any(e.relpath not in parsed for e in staged.entries):
        return
    indexes = [parsed[e.relpath].index() for e in staged.entries]
    if any(index is None for index in indexes):
        return
    from stager.shards.loader_index import save_dataset_index  # numpy only; same distribution as stager

    save_dataset_index(
        [dataset_dir / e.relpath for e in staged.entries],
        [e.relpath for e in staged.entries],
        [e.samples for e in staged.entries],
        indexes,  # type: ignore[arg-type]
        dataset_dir / STAGED_META_DIR / "index",
    )


def _manifest_write_error(exc: OSError, staged_path: Path) -> DestinationError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ScratchFull(
            f"no space left on {staged_path.parent} for the staged manifest; the shards are staged. "
            "Free space and rerun stage-in (it copies nothing again)",
            where=str(staged_path.parent),
        )
    return DestinationError(
        f"cannot write {staged_path}: {exc.strerror or exc}; check the destination"
    )


def _copy_all(
    source: SourceSet,
    plan: _Plan,
    options: StageInOptions,
    report: StageInReport,
    entries: dict[str, ManifestEntry],
    known_samples: dict[str, int | None],
    parsed: dict[str, TarSampleCounter],
    log: TextIO,
) -> bool:
    """Copy the planned shards; True when any failed verification against the manifest.

    Shards in ``plan.sized_later`` are stat'ed on probe threads running ahead of the copies;
    their copies stay ``.partial`` until the free-space check on those sizes has passed, and a
    refusal raises :class:`ScratchFull` with nothing new staged (:mod:`stager.stagein.sizing`).
    """
    progress = Progress(
        sum(size or 0 for _, _, size, _ in plan.to_copy),
        len(plan.to_copy),
        label=f"[{report.node}] stage-in",
        mode=options.progress,
        interval_s=options.progress_interval_s,
        stream=log,
    )
    throttle = Throttle(options.bw_limit_mbps * 1e6) if options.bw_limit_mbps else None
    lock = threading.Lock()
    stop = threading.Event()  # set when scratch is full: the remaining copies cannot succeed
    corrupt = threading.Event()  # set when a copy's hash differed from the manifest's
    dropped: list[str] = []  # sized later and found gone or a directory: not shards after all
    held: list[str] = []  # copied, but kept .partial until the free-space verdict
    count_later: list[str] = []  # held copies whose samples must be counted on the final file
    late_shards = [shard for shard, _, _, _ in plan.to_copy if shard.relpath in plan.sized_later]
    late = {
        shard.relpath: i for i, shard in enumerate(late_shards)
    }  # relpath -> index in the probe
    preflight: DeferredPreflight | None = None
    if late:
        preflight = DeferredPreflight(
            [shard.path for shard in late_shards],
            # Half the copy ceiling: a stat is one round trip where a copy makes three, so
            # half as many threads still keep the sizes ahead of the copies, and the node
            # has at most 1.5 x --jobs requests in flight on the source rather than 2 x.
            max(1, options.jobs // 2),
            known_bytes=progress.total_bytes,
            free_bytes=plan.free_bytes,
            min_free_bytes=options.min_free_bytes,
            on_sized=lambda nbytes, gone: progress.add_totals(nbytes, -gone),
        ).start()

    def on_bytes(n: int) -> None:
        with lock:
            report.bytes_read_source += n
        progress.advance(n)

    def on_retry(attempt: int, exc: BaseException) -> None:
        with lock:
            report.retries += 1
        print(f"[{report.node}] retry {attempt} after: {_one_line(exc)}", file=log, flush=True)

    def copy_one(item: tuple[SourceShard, Path, int | None, str | None]) -> None:
        shard, final, size, want_hash = item
        published = True
        if preflight is not None and shard.relpath in late:
            index = late[shard.relpath]
            size = preflight.size(index)
            if size == DROPPED:
                with lock:
                    dropped.append(shard.relpath)
                return
            if size == UNKNOWN:
                with lock:
                    report.add_failure(ShardFailure(shard.url, preflight.probe.error(index)))
                return
        if preflight is not None and preflight.refused:
            return  # the refusal raised at the end says it for all of them

        def publish(partial: str, final_path: str) -> None:
            nonlocal published
            published = preflight.gate.publish(partial, final_path)  # type: ignore[union-attr]

        if stop.is_set():
            failure = ShardFailure(shard.url, "not attempted: scratch is full")
        else:
            streams.acquire()
            result = None
            count_in_flight = options.count_samples and final.name.endswith(".tar")
            counter: TarSampleCounter | None = None

            def attempt() -> CopyResult:
                nonlocal counter
                counter = TarSampleCounter() if count_in_flight else None  # fresh per attempt
                return copy_file(
                    source.remote_fs,
                    shard.path,
                    final,
                    url=shard.url,
                    expected_size=size,
                    expected_hash=want_hash,
                    block_bytes=options.block_bytes,
                    throttle=throttle,
                    on_bytes=on_bytes,
                    inspect=counter.feed if counter is not None else None,
                    fsync=options.fsync,
                    size_from_manifest=shard.relpath in known_samples,
                    publish=publish if preflight is not None else None,
                )

            try:
                result = call_with_retries(attempt, options.retry, on_retry=on_retry)
            except ScratchFull as exc:
                stop.set()
                failure = ShardFailure(shard.url, _one_line(exc))
            except Exception as exc:  # noqa: BLE001 - every failure becomes one report line
                if isinstance(exc, IntegrityError) and not getattr(exc, "transient", False):
                    corrupt.set()
                failure = ShardFailure(shard.url, _one_line(exc))
            finally:
                streams.release(
                    result.first_byte_s if result else None, result.last_byte_s if result else None
                )
            if result is not None:
                samples = known_samples.get(shard.relpath)
                if counter is not None and counter.samples is not None:
                    parsed[shard.relpath] = (
                        counter  # arrays are built after the copy, off the copy threads
                    )
                if samples is None and counter is not None:
                    samples = counter.samples
                late_count = samples is None and options.count_samples
                if late_count and published:
                    samples = _count(
                        final, log
                    )  # compressed, or odd enough that the stream parser gave up
                entry = ManifestEntry(shard.relpath, result.size, result.hash, samples)
                with lock:
                    if (
                        not published
                    ):  # held as .partial until the verdict: counted, if need be, after it
                        held.append(shard.relpath)
                        if late_count:
                            count_later.append(shard.relpath)
                    entries[shard.relpath] = entry
                    report.files_copied += 1
                    report.bytes_copied += result.size
                progress.file_done()
                return
        with lock:
            report.add_failure(failure)

    # A thread per possible stream; the controller decides how many copy at once.
    ceiling = max(1, min(options.jobs, len(plan.to_copy)))
    streams = StreamController(ceiling, floor=options.min_jobs, adaptive=options.adaptive)
    try:
        run_in_threads(copy_one, plan.to_copy, ceiling, name="stage-in")
        if preflight is not None:
            preflight.finish()  # not on an error or interrupt: the probe's threads are daemons
    finally:
        progress.close()
        report.streams = streams.peak
    if preflight is not None:
        _settle_sized_later(
            preflight, plan, _Held(dropped, held, count_later), report, entries, log
        )
    return corrupt.is_set()


@dataclass
class _Held:
    """What the copy threads left for :func:`_settle_sized_later` (relpaths)."""

    dropped: list[str]  # sized later and found gone or a directory
    held: list[str]  # copied before the free-space verdict, so not renamed by their thread
    count_later: list[str]  # held copies to count samples of once renamed


def _settle_sized_later(
    preflight: DeferredPreflight,
    plan: _Plan,
    copies: _Held,
    report: StageInReport,
    entries: dict[str, ManifestEntry],
    log: TextIO,
) -> None:
    """Account for the shards sized during the copy, or raise the verdict against them.

    On a refusal (or a probe that broke) the held copies were deleted: they leave the report
    and the staged manifest before the error is raised, so neither claims a file not staged.
    """
    report.files_total -= len(copies.dropped)
    report.bytes_total += preflight.probed_bytes

    def unstage(relpath: str) -> None:
        entry = entries.pop(relpath, None)
        if entry is not None:
            report.files_copied -= 1
            report.bytes_copied -= entry.size

    if not preflight.gate.passed:
        for relpath in copies.held:
            unstage(relpath)
        if preflight.probe.failure is not None:
            raise SourceError(
                f"[{report.node}] sizing the source's shards failed: {_one_line(preflight.probe.failure)}; nothing was copied"
            ) from preflight.probe.failure
        raise _space_error(
            report.dataset_dir, preflight.needed_bytes, preflight.free_bytes, report.node
        )
    if preflight.failed_renames:
        shard_of = {os.fspath(final): shard for shard, final, _, _ in plan.to_copy}
        for final_path, exc in preflight.failed_renames:
            shard = shard_of[final_path]
            unstage(shard.relpath)
            report.add_failure(
                ShardFailure(shard.url, f"copied but not renamed into place: {exc.strerror or exc}")
            )
    if copies.count_later:
        final_of = {shard.relpath: final for shard, final, _, _ in plan.to_copy}
        for relpath in copies.count_later:
            entry = entries.get(relpath)
            if entry is not None:
                entries[relpath] = dataclasses.replace(
                    entry, samples=_count(final_of[relpath], log)
                )
