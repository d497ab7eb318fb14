"""Samples of shards that ``stage-in --background`` is still copying: wait, then read locally.

:class:`GrowingTarDataset` is the staged reader's dataset for a copy that is not complete yet.
A batch names its samples; before reading one, the worker makes sure its shard is published
(:class:`ShardGate`): a ``stat`` of the shard's final name, which under the current plan exists
only when the file is whole and current (:mod:`stager.stagein.status`). Until then it polls
(10 to 50 ms apart); it never opens a ``.partial`` and never reads the shared filesystem for
a shard the copier will deliver. The shard's member index is then built from the local file
(or taken from stage-in's per-shard cache) and kept for the few shards a window spans.

The time workers spend waiting goes to a small shared table (one row per process, so no
update is lost), which the loader adds to its metrics (``staging_wait_s``, ``shards_waited``).

When the copier will not deliver a shard:

* the run ended and listed the shard as corrupt: :class:`IntegrityError` (the source is never
  read for it);
* the run ended and the shard failed otherwise (source errors after retries): the shard is
  fetched from the source, as the plain reader reads a failed shard there;
* the copier is gone (its lock free for :data:`stager.stagein.status.GONE_AFTER_S` with no
  result) or was stopped: per ``LoaderOptions.on_copier_death``, :class:`StagingStopped`
  (``"fail"``) or the shard is fetched from the source (``"source"``);
* the copier holds its lock but has shown no progress for ``LoaderOptions.copier_stall_s``
  (stopped, or hung on a dead server): :class:`StagingStopped` whatever ``on_copier_death``
  says, since a fetch needs the lock it holds (said once, as a warning, from 120 s on).

Fetching copies the shard into its final name exactly as stage-in would (``.partial``,
verified size, hash and sample count, rename), holding the node lock so that one process of the
node fetches it while the others wait for it to appear. It verifies against the plan the rank
resolved, whose size, hash and count per shard the gate holds as columns (the hashes as raw
bytes, :class:`stager.shards.digests.DigestColumn`): a worker never reads the plan itself,
which cost each one ~5 s and ~670 MB kept at 1e6 shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from stager.errors import IntegrityError, StagingStopped
from stager.layout import StagedDataset
from stager.shards.digests import DigestColumn
from stager.shards.loader_index import FlatIndex, cached_index
from stager.shards.tarindex import TarIndex, grouping_problem, index_tar
from stager.stagein.status import CopierWatch, Outcome, PlanFacts, published, read_outcome
from stager.storage.copy import copy_file
from stager.storage.listing import split_fs

from .dataset import PackedBatch, StagedTarDataset, batch_buffer
from .samples import SamplePipeline
from .shardio import open_shards

__all__ = ["GrowingTarDataset", "ShardGate", "WaitTable", "COPIER_DEATH_MODES"]

log = logging.getLogger("stager_loaders")

#: ``LoaderOptions.on_copier_death``: what a reader does with shards a dead copier left.
COPIER_DEATH_MODES = ("fail", "source")
#: Member indexes a process keeps while the copy is incomplete (a window spans at most eight).
INDEXES_KEPT = 64
_SLOTS = 257  # rows of the wait table: the main process and up to 256 workers
#: A wait on a copier that holds its lock but has shown no progress this long is said, once.
QUIET_WARN_S = 120.0


class WaitTable:
    """Seconds waited and shards waited for, one row per process, in shared memory."""

    def __init__(self) -> None:
        self.rows = torch.zeros((_SLOTS, 2), dtype=torch.float64).share_memory_()

    def add(self, wait_s: float) -> None:
        info = get_worker_info()
        row = 0 if info is None else 1 + info.id % (_SLOTS - 1)
        self.rows[row, 0] += wait_s
        self.rows[row, 1] += 1

    def totals(self) -> tuple[float, int]:
        wait_s, count = self.rows.sum(dim=0).tolist()
        return float(wait_s), int(count)


class ShardGate:
    """Waits until a shard is published (see the module doc); picklable, per process state.

    ``relpaths``, ``sizes``, ``samples`` and ``hashes``: the plan's columns as the rank
    resolved them, the only record of the plan a worker holds (a fetch verifies against them).
    """

    def __init__(
        self,
        staged: StagedDataset,
        facts: PlanFacts,
        relpaths: Sequence[str],
        sizes: Sequence[int],
        on_copier_death: str,
        *,
        samples: Sequence[int] | np.ndarray,
        hashes: DigestColumn,
        stall_after_s: float = 3600.0,
    ):
        self.staged, self.facts = staged, facts
        self.relpaths = np.asarray([r.encode() for r in relpaths] or [b""], dtype="S")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.samples = np.asarray(samples, dtype=np.int64)
        self.hashes = hashes
        self.on_copier_death = on_copier_death
        self.prefix = str(staged.dir) + "/"
        # Since when the copier's lock has been seen free. With on_copier_death="source" it is
        # kept across waits: once the copier is gone, each later missing shard is fetched at
        # once, not after GONE_AFTER_S again (1,000 missing shards were 83 minutes of waiting);
        # a fetch too early is harmless (it copies under the node lock). With "fail" each wait
        # starts its own grace: a copier taking over in between must not be taken for dead.
        self._copier = CopierWatch(staged)
        self.stall_after_s = stall_after_s
        self._warned = False  # (that the copier is quiet: once per process)

    def path(self, shard: int) -> str:
        return self.prefix + self.relpaths[shard].decode()

    def is_published(self, shard: int) -> bool:
        return published(self.path(shard), int(self.sizes[shard]))

    def wait(self, shard: int) -> float:
        """Return once ``shard`` is published (fetching it if need be); the seconds waited."""
        if self.is_published(shard):
            return 0.0
        started = time.monotonic()
        delay, check_at = 0.01, started
        if self.on_copier_death != "source":
            self._copier.forget()
        while not self.is_published(shard):
            now = time.monotonic()
            if now >= check_at:
                check_at = now + 0.5
                outcome = read_outcome(self.staged, self.facts)
                if outcome is not None:
                    self._settle(shard, outcome)
                    break
                if self._copier.gone(now):
                    self._copier_gone(shard, "its lock is free and it left no result")
                    break
                self._check_quiet(shard)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return time.monotonic() - started

    def _check_quiet(self, shard: int) -> None:
        """Say once that the copier holding the lock shows no progress, and give up on it
        after ``stall_after_s``: stopped (SIGSTOP, a suspended step) or hung on a dead server,
        it would keep every rank waiting until the job's time limit. The source cannot stand
        in while it holds the node lock (a fetch takes that lock), whatever on_copier_death."""
        quiet = self._copier.quiet_for()
        if quiet is None or quiet < min(QUIET_WARN_S, self.stall_after_s):
            return
        relpath = self.relpaths[shard].decode()
        if quiet >= self.stall_after_s:
            why = f"it holds its lock but has shown no progress for {quiet:.0f} s: stopped or hung"
            raise StagingStopped(
                f"{stopped_message(self, why, alive=True)}; end it (kill its step) and rerun "
                "`stage-in --background`, or raise LoaderOptions(copier_stall_s)"
            )
        if not self._warned:
            self._warned = True
            log.warning(
                "waiting for %s of %s: the background stage-in holds its lock but has shown no "
                "progress for %.0f s (a large shard on a slow source, or a stopped copier); "
                "giving up after %.0f s (LoaderOptions.copier_stall_s)",
                relpath,
                self.staged.dir,
                quiet,
                self.stall_after_s,
            )

    def _settle(self, shard: int, outcome: Outcome) -> None:
        """The run ended without publishing ``shard``: refuse it, fetch it, or give up."""
        if self.is_published(shard):
            return
        relpath = self.relpaths[shard].decode()
        mine = [f for f in outcome.failures if f.get("url", "").endswith("/" + relpath)]
        if any(f.get("kind") == "corrupt" for f in mine):
            raise IntegrityError(
                f"stage-in found {relpath} of {self.staged.dir} corrupt ({mine[0].get('reason')}); "
                "its source is not read. Fix the source and rerun stage-in"
            )
        if mine:  # failed after retries: read at the source, as the plain reader does
            self.fetch(shard)
        else:
            self._copier_gone(shard, f"it ended ({outcome.error or 'no error'})")

    def _copier_gone(self, shard: int, why: str) -> None:
        if self.on_copier_death != "source":
            raise StagingStopped(stopped_message(self, why))
        self.fetch(shard)

    def fetch(self, shard: int) -> None:
        """Copy ``shard`` from the source into its final name, verified, under the node lock."""
        while not self.is_published(shard):
            fd = os.open(self.staged.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a copier, or another reader fetching: wait a little
                    time.sleep(0.05)
                    continue
                with contextlib.suppress(OSError):  # (a holder's heartbeat: see _check_quiet)
                    os.utime(fd)
                if not self.is_published(shard):
                    self._copy(shard)
            finally:
                os.close(fd)  # releases the flock

    def _copy(self, shard: int) -> None:
        relpath = self.relpaths[shard].decode()
        url = f"{self.facts.source.rstrip('/')}/{relpath}"
        fs, src_path = split_fs(url)
        # The plan this reader resolved, whose sizes it tests a shard by and whose counts it
        # reads by: a fetch verified against another plan's entry (a copier taking over writes
        # its own) could publish a file this gate never takes for published.
        want_samples = int(self.samples[shard])
        final = Path(self.path(shard))

        def publish(partial: str, final_path: str) -> None:
            index = index_tar(partial) if final_path.endswith(".tar") else None
            problem = grouping_problem(index) if index is not None else None
            if problem is not None:
                raise IntegrityError(f"{url}: {problem}")
            counted = index.num_samples if index is not None else None
            if counted is not None and counted != want_samples:
                raise IntegrityError(
                    f"{url}: holds {counted} samples but the plan says {want_samples}; the source "
                    "changed since stager index: re-run it"
                )
            os.replace(partial, final_path)

        final.parent.mkdir(parents=True, exist_ok=True)
        copy_file(
            fs,
            src_path,
            final,
            url=url,
            expected_size=int(self.sizes[shard]),
            expected_hash=self.hashes[shard],
            size_from_manifest=True,
            publish=publish,
        )


def stopped_message(gate: ShardGate, why: str, *, alive: bool = False) -> str:
    """The one line a reader says when the copier will not deliver what it waits for
    (``alive``: the head only, for a copier that still holds the node lock)."""
    staged = sum(gate.is_published(i) for i in range(len(gate.sizes)))
    head = (
        f"the background stage-in of {gate.staged.dir} on {gate.facts.node} stopped ({why}) "
        f"with {staged} of {len(gate.sizes)} shard(s) staged"
    )
    if alive:
        return head
    if gate.on_copier_death == "source":
        return f"{head}; reading the others from the source (on_copier_death='source')"
    return (
        f"{head}; rerun `stage-in --background`, or pass "
        "LoaderOptions(on_copier_death='source') to read the others from the source"
    )


class GrowingTarDataset(Dataset):
    """Map-style dataset over a staged copy still being made (global sample numbers, as
    :class:`stager_loaders.dataset.StagedTarDataset`, which it becomes via :meth:`complete`)."""

    def __init__(
        self,
        gate: ShardGate,
        counts: np.ndarray,
        pipeline: SamplePipeline | None,
        waits: WaitTable,
    ):
        self.gate = gate
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.counts)])
        self.pipeline = pipeline
        self.waits = waits
        self.files = open_shards([gate.path(i) for i in range(len(self.counts))])
        self.flat: StagedTarDataset | None = None
        self._indexes: OrderedDict[int, TarIndex] = OrderedDict()

    def complete(self, index: FlatIndex) -> None:
        """Staging is done: read through the dataset's one mapped index from now on."""
        paths = [self.gate.path(i) for i in range(len(self.counts))]
        self.flat = StagedTarDataset(paths, index, self.pipeline)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_indexes": OrderedDict()}

    def _index(self, shard: int) -> TarIndex:
        index = self._indexes.get(shard)
        if index is not None:
            self._indexes.move_to_end(shard)
            return index
        waited = self.gate.wait(shard)
        if waited:
            self.waits.add(waited)
        relpath = self.gate.relpaths[shard].decode()
        index = cached_index(
            Path(self.gate.path(shard)), cache_dir=self.gate.staged.index_dir, relpath=relpath
        )
        if index.num_samples != self.counts[shard]:
            raise IntegrityError(
                f"{self.gate.path(shard)}: has {index.num_samples} samples but the plan says "
                f"{self.counts[shard]}; rerun stage-in"
            )
        problem = grouping_problem(index)  # (as the staged, source and streamed paths refuse
        if problem is not None:  # it: half-samples were read while the copier still ran)
            raise IntegrityError(f"{self.gate.path(shard)}: {problem}")
        self._indexes[shard] = index
        if len(self._indexes) > INDEXES_KEPT:
            self._indexes.popitem(last=False)
        return index

    def _locate(self, samples: np.ndarray) -> tuple[list[int], list[int]]:
        shards = np.searchsorted(self.offsets, samples, side="right") - 1
        return shards.tolist(), (samples - self.offsets[shards]).tolist()

    def __getitems__(self, indices: Sequence[int]) -> Any:
        if self.flat is not None:
            return self.flat.__getitems__(indices)
        samples = np.asarray(indices, dtype=np.int64)
        shards, within = self._locate(samples)
        indexes = {s: self._index(s) for s in dict.fromkeys(shards)}
        if self.pipeline is not None:
            return [self._sample(indexes[s], s, i) for s, i in zip(shards, within, strict=True)]
        keys: list[str] = []
        owner: list[int] = []
        exts: list[str] = []
        member_shard: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        for position, (s, i) in enumerate(zip(shards, within, strict=True)):
            index = indexes[s]
            keys.append(index.keys[i])
            lo, hi = int(index.member_start[i]), int(index.member_start[i + 1])
            owner.extend([position] * (hi - lo))
            exts.extend(index.exts[lo:hi])
            member_shard.extend([s] * (hi - lo))
            offsets.extend(index.offsets[lo:hi].tolist())
            sizes.extend(index.sizes[lo:hi].tolist())
        names = tuple(dict.fromkeys(exts))
        code = {name: c for c, name in enumerate(names)}
        payload, out = batch_buffer(sum(sizes))
        short = self.files.copy_members(member_shard, offsets, sizes, out)
        if short >= 0:
            raise IntegrityError(
                f"{self.files.path(member_shard[short])}: member of sample "
                f"{keys[owner[short]]!r} is truncated; re-stage this shard"
            )
        return PackedBatch(
            payload=payload,
            keys=keys,
            member_sample=np.asarray(owner, dtype=np.int32),
            member_ext=np.asarray([code[e] for e in exts], dtype=np.int32),
            member_size=np.asarray(sizes, dtype=np.int64),
            ext_names=names,
        )

    def _sample(self, index: TarIndex, shard: int, i: int) -> Any:
        sample: dict[str, Any] = {"__key__": index.keys[i], "__shard__": self.files.path(shard)}
        for ext, offset, size in index.members(i):
            payload = self.files.read(shard, offset, size)
            if len(payload) != size:
                raise IntegrityError(
                    f"{self.files.path(shard)}: member of sample {index.keys[i]!r} is "
                    "truncated; re-stage this shard"
                )
            sample[ext] = payload
        return self.pipeline(sample) if self.pipeline is not None else sample

    def __getitem__(self, g: int) -> Any:
        """One sample as a dict of bytes (or through the pipeline), for tools that index singly."""
        if self.flat is not None:
            return self.flat[g]
        if not 0 <= g < len(self):
            raise IndexError(g)
        shards, within = self._locate(np.asarray([g], dtype=np.int64))
        return self._sample(self._index(shards[0]), shards[0], within[0])
