"""Moving the bytes of a fan-out: owners read from the source, everyone else receives.

Per shard, in the plan's order (the same on every node), its owner broadcasts a fixed-size
header (status, size, hash or failure reason) and then the bytes in ``chunk_bytes`` uint8
tensors. Receivers that need the shard write ``<name>.partial``, hash as they go, and rename
only when size and hash match the owner's (and the source manifest's, when there is one);
receivers that already hold it take part in the collective and drop the bytes. An owner whose
own scratch fails a shard says so, and each receiver then reads that shard from the source.

Concurrency: each owner's source reads (``copy_file``: .partial, verify, rename) run ahead in a
thread pool in the order the plan will broadcast them, while the main thread broadcasts; on
the receiving side a writer thread drains a small ring of buffers to disk while the main
thread receives the next chunk. Only the main thread makes collective calls, so their order is
the plan's. On any collective error the reads are cancelled (``on_bytes`` raises), the writer
is drained, and :class:`FanoutError` names the shard and its owner.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy

from stager.errors import FanoutError, ShardFailure, failure_kind, one_line
from stager.fanout import header as wire
from stager.fanout.group import FanoutOptions, NodeGroup
from stager.plan.fanout import FanoutPlan
from stager.shards.manifest import ManifestEntry
from stager.stagein.journal import Journal
from stager.stagein.options import StageInOptions
from stager.stagein.progress import Progress
from stager.stagein.report import StageInReport
from stager.storage.copy import CopyResult, copy_file, partial_path, placing_error
from stager.storage.hashing import hash_file, new_hasher, split_digest
from stager.storage.paths import discard
from stager.storage.retry import call_with_retries
from stager.storage.sources import SourceSet, SourceShard
from stager.storage.throttle import Throttle

__all__ = ["ExchangeShard", "ExchangeOutcome", "Exchange"]

_BUFFERS = 4  # chunks in flight between the receiving main thread and the writer


@dataclass(frozen=True)
class ExchangeShard:
    """One shard as this node sees it before the exchange."""

    shard: SourceShard
    final: Path
    size: int | None  # expected: from the source manifest or listing
    want_hash: str | None  # from the source manifest, when there is one
    have: bool  # already staged and verified here
    have_hash: str | None = None
    from_manifest: bool = False  # size and hash are the manifest's: a difference is corruption


@dataclass
class ExchangeOutcome:
    """Shards newly staged on this node (index -> size, hash) and the ones that failed."""

    staged: dict[int, tuple[int, str]] = field(default_factory=dict)
    failures: list[ShardFailure] = field(default_factory=list)


class _Cancelled(Exception):
    """Raised inside a source read when the exchange has failed: stop reading."""


def _names_scratch(exc: BaseException, item: ExchangeShard) -> bool:  # (this node's own)
    return str(getattr(exc, "filename", "")).startswith(str(item.final.parent))


class Exchange:
    """This node's side of the exchange; every node of the group runs ``Exchange(...).run()``."""

    def __init__(
        self,
        group: NodeGroup,
        plan: FanoutPlan,
        items: Sequence[ExchangeShard],
        *,
        source: SourceSet,
        options: StageInOptions,
        fanout: FanoutOptions,
        report: StageInReport,
        progress: Progress,
        node_label: Callable[[int], str],
        log: TextIO,
        journal: Journal | None = None,
        heartbeat: Callable[[], None] = lambda: None,
    ):
        self.group, self.plan, self.items, self.source = group, plan, items, source
        self.options, self.fanout, self.report, self.progress = options, fanout, report, progress
        self.node_label, self.log = node_label, log
        self.journal = journal  # each shard staged here is recorded as it is published
        self.heartbeat = heartbeat
        self.torch = group.torch
        self.me = node_label(group.node)
        self.outcome = ExchangeOutcome()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.throttle = Throttle(options.bw_limit_mbps * 1e6) if options.bw_limit_mbps else None
        self.free: queue.Queue[Any] = queue.Queue()
        for _ in range(_BUFFERS):
            self.free.put(self.torch.empty(fanout.chunk_bytes, dtype=self.torch.uint8))
        self.header = self.torch.empty(wire.HEADER_BYTES, dtype=self.torch.uint8)
        self.pending: queue.Queue[Any] | None = None  # the writer's queue while a receive runs
        self.late: dict[int, Future[CopyResult]] = {}  # read here: the owner's scratch failed
        self.readers: ThreadPoolExecutor | None = None

    def _on_bytes(self, n: int) -> None:
        if self.stop.is_set():
            raise _Cancelled("fan-out stopped")
        with self.lock:
            self.report.bytes_read_source += n
        self.progress.advance(n)

    def _read(self, item: ExchangeShard) -> CopyResult:
        """Copy ``item`` from the source (ahead of its broadcast, or where its owner's scratch
        failed) and journal it at once."""
        size = [item.size]  # as listed: again before each retry (an object rewritten since)

        def on_retry(attempt: int, exc: BaseException) -> None:
            with self.lock:
                self.report.retries += 1
            print(f"[{self.me}] retry {attempt} after: {one_line(exc)}", file=self.log, flush=True)
            if not item.from_manifest:  # (a manifest's size stays: a change is corruption)
                with contextlib.suppress(Exception):  # (the retry says what is wrong)
                    now = self.source.listed_now(item.shard.path)
                    size[0] = size[0] if now is None else now.size

        result = call_with_retries(
            lambda: copy_file(
                self.source.fs,
                item.shard.path,
                item.final,
                url=item.shard.url,
                expected_size=size[0],
                expected_hash=item.want_hash,
                block_bytes=self.options.block_bytes,
                throttle=self.throttle,
                on_bytes=self._on_bytes,
                fsync=self.options.fsync,
                size_from_manifest=item.from_manifest,
            ),
            self.options.retry,
            on_retry=on_retry,
        )
        self._journal(item, result.size, result.hash)
        return result

    def run(self) -> ExchangeOutcome:
        rank = self.group.node
        mine = self.plan.reads_of(rank)
        streams = max(1, min(self.fanout.read_streams, self.options.jobs, len(mine)))
        self.readers = readers = ThreadPoolExecutor(streams, thread_name_prefix="fanout-read")
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fanout-write")
        # Submitted in broadcast order; the pool starts them FIFO, so reads run ahead of sends.
        reads = {i: readers.submit(self._read, self.items[i]) for i in mine}
        try:
            for i in self.plan.order:
                owner = self.plan.owners[i]
                if owner == rank:
                    self._send(i, reads.get(i))
                else:
                    self._receive(i, owner, writer)
            self._finish_late()
            self._collective(self.group.barrier, "finishing after", len(self.items) - 1, rank)
        finally:
            self.stop.set()
            if self.pending is not None:
                self.pending.put(None)  # unblock the writer of an interrupted receive
            readers.shutdown(wait=True, cancel_futures=True)
            writer.shutdown(wait=True)
        return self.outcome

    def _finish_late(self) -> None:
        for i, late in self.late.items():
            try:
                result = late.result()
            except Exception as exc:  # noqa: BLE001 - that shard fails here, as any copy
                failure = ShardFailure(self.items[i].shard.url, one_line(exc), failure_kind(exc))
                self.outcome.failures.append(failure)
            else:
                self._staged(i, result.size, result.hash)

    def _collective(self, call: Callable[[], None], what: str, index: int, owner: int) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistError subclasses
            url = self.items[index].shard.url if self.items else "-"
            raise FanoutError(
                f"[{self.me}] fan-out failed while {what} {url} (owner {self.node_label(owner)}): "
                f"a peer node died, hung or left ({one_line(exc)[:300]}); verified shards stay "
                "staged, "
                "rerun `stage-in --fanout` to resume"
            ) from exc

    def _broadcast_header(
        self, index: int, owner: int, raw: bytes | None = None
    ) -> tuple[int, int, str]:
        view = self.header.numpy()
        if raw is not None:
            view[:] = numpy.frombuffer(raw, dtype=numpy.uint8)
        self._collective(
            lambda: self.group.broadcast(self.header, owner), "announcing", index, owner
        )
        return wire.decode(view.tobytes())

    def _send(self, index: int, read: Future[CopyResult] | None) -> None:
        item, rank = self.items[index], self.group.node
        handle = None
        try:
            if read is not None:
                result = read.result()
                size, digest = result.size, result.hash
            else:
                size = item.final.stat().st_size
                digest = item.have_hash or hash_file(item.final)
            handle = open(item.final, "rb", buffering=0)  # noqa: SIM115 - closed below
        except Exception as exc:  # noqa: BLE001 - the shard fails everywhere; the fan-out goes on
            reason, kind = one_line(exc), failure_kind(exc)
            kind = "dest" if kind == "source" and _names_scratch(exc, item) else kind
            self.outcome.failures.append(ShardFailure(item.shard.url, reason, kind))
            self._broadcast_header(index, rank, wire.encode(wire.status_of(kind), 0, reason))
            return
        if read is not None:
            self._staged(index, size, digest)
        self._broadcast_header(index, rank, wire.encode(wire.OK, size, digest))
        buf = self.free.get()
        try:
            for offset in range(0, size, self.fanout.chunk_bytes):
                chunk = buf[: min(self.fanout.chunk_bytes, size - offset)]
                view = memoryview(chunk.numpy())
                try:
                    got = handle.readinto(view) or 0
                except OSError:
                    got = 0
                if got != len(view):
                    # The file shrank or became unreadable after the header went out: send
                    # zeros, the receivers' hash check fails the shard and the exchange goes on.
                    view[got:] = bytes(len(view) - got)
                self._collective(partial(self.group.broadcast, chunk, rank), "sending", index, rank)
        finally:
            self.free.put(buf)
            handle.close()

    def _receive(self, index: int, owner: int, writer: ThreadPoolExecutor) -> None:
        item = self.items[index]
        status, size, text = self._broadcast_header(index, owner)
        if status == wire.OWNER_SCRATCH and not item.have and self.readers is not None:
            self.late[index] = self.readers.submit(self._read, item)  # (the source is fine)
            return
        if status != wire.OK:
            if not item.have:
                kind = "corrupt" if status == wire.CORRUPT else "source"
                said = text.removeprefix(f"{item.shard.url}: ")  # (the FAILED line names it)
                reason = f"its owner {self.node_label(owner)} could not read it: {said}"
                self.outcome.failures.append(ShardFailure(item.shard.url, reason, kind))
            return
        writing: Future[tuple[int, str]] | None = None
        if not item.have:
            self.pending = queue.Queue()
            writing = writer.submit(
                self._write, partial_path(item.final), split_digest(text)[0], self.pending
            )
        for offset in range(0, size, self.fanout.chunk_bytes):
            buf = self.free.get()
            chunk = buf[: min(self.fanout.chunk_bytes, size - offset)]
            try:
                self._collective(
                    partial(self.group.broadcast, chunk, owner), "receiving", index, owner
                )
            except BaseException:
                self.free.put(buf)
                raise
            n = chunk.numel()
            with self.lock:
                self.report.bytes_received_peers += n
            if self.pending is not None:
                self.pending.put((buf, n))
                self.progress.advance(n)
            else:
                self.free.put(buf)
        if writing is None or self.pending is None:
            return
        self.pending.put(None)
        self.pending = None
        try:
            written, digest = writing.result()
        except OSError as exc:  # (writing into this node's scratch)
            kind = "full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "dest"
            failure = ShardFailure(item.shard.url, self._write_reason(exc, item), kind)
            self.outcome.failures.append(failure)
            return
        problem = None
        # A listed size does not bind: the owner's copy took the size the source has now where
        # the shard changed since the listing (as plain stage-in does); a manifest's does.
        want = item.size if item.from_manifest else size
        if want is not None and written != want:
            origin = "the manifest lists" if item.from_manifest else "it announced"
            problem = f"received {written} bytes from {self.node_label(owner)}; {origin} {want}"
        elif digest != text:
            problem = (
                f"hash {digest} of the bytes received from {self.node_label(owner)} differs "
                f"from its {text}"
            )
        elif item.want_hash is not None and digest != item.want_hash:
            problem = f"hash {digest} differs from the manifest's {item.want_hash}"
        if problem is not None:
            discard(partial_path(item.final))
            self.outcome.failures.append(
                ShardFailure(item.shard.url, f"{problem}; rerun stage-in --fanout", "corrupt")
            )
            return
        try:
            os.replace(partial_path(item.final), item.final)
        except OSError as exc:  # (a directory in its way, ...: this node's scratch; it crashed)
            discard(partial_path(item.final))
            reason = one_line(placing_error(exc, str(item.final)))  # (as plain stage-in says)
            self.outcome.failures.append(ShardFailure(item.shard.url, reason, "dest"))
            return
        self._journal(item, written, digest)
        self._staged(index, written, digest)

    def _journal(self, item: ExchangeShard, size: int, digest: str) -> None:
        """Record and count a shard just published here (:mod:`stager.stagein.journal`)."""
        with self.lock:  # (now, not when sent: a run a peer fails counts what it left staged)
            self.report.files_copied += 1
            self.report.bytes_copied += size
        if self.journal is not None:
            self.journal.record(
                ManifestEntry(item.shard.relpath, size, digest, None, item.shard.version)
            )

    def _staged(self, index: int, size: int, digest: str) -> None:
        self.outcome.staged[index] = (size, digest)
        self.heartbeat()
        self.progress.file_done()

    @staticmethod
    def _write_reason(exc: OSError, item: ExchangeShard) -> str:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return (
                f"no space left on {item.final.parent} while writing {item.final.name}; "
                "free space or pass --dest elsewhere"
            )
        return f"cannot write {item.final}: {one_line(exc)}"

    def _write(self, partial: Path, algorithm: str, chunks: queue.Queue[Any]) -> tuple[int, str]:
        """Drain ``chunks`` to ``partial`` until ``None``; always hand every buffer back."""
        hasher = new_hasher(algorithm)
        error: OSError | None = None
        written = 0
        handle = None
        try:
            partial.parent.mkdir(parents=True, exist_ok=True)
            handle = open(partial, "wb", buffering=0)  # noqa: SIM115 - closed below, after draining
        except OSError as exc:
            error = exc
        while True:
            entry = chunks.get()
            if entry is None:
                break
            buf, n = entry
            try:
                if error is None and handle is not None:
                    view = memoryview(buf.numpy())[:n]
                    done = 0
                    while done < n:
                        done += handle.write(view[done:])
                    hasher.update(view)
                    written += n
            except OSError as exc:
                error = exc
            finally:
                self.free.put(buf)
        if handle is not None:
            try:
                if self.options.fsync and error is None:
                    os.fsync(handle.fileno())
                handle.close()
            except OSError as exc:
                error = error or exc
        if error is not None or self.stop.is_set():
            discard(partial)
            if error is not None:
                raise error
        return written, f"{algorithm}:{hasher.hexdigest()}"
