"""One shard copied on its own: from the node cache or the source, retried where it may help.

The path for every shard a run of small shards does not take (:mod:`stager.stagein.smallruns`):
large shards, remote ones, a shard a run refused. Its retries copy the source as it is now: an
object store's object is listed again before each retry (:func:`relisted`), since a retry of
an object rewritten after the listing otherwise expected the old size, and s3fs read it on the
old ETag, which the store refuses, so no retry could succeed.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from stager.errors import HashMismatch, PathBlocked, failure_kind, one_line
from stager.shards.tarparse import TarSampleCounter
from stager.stagein.plan import CopyItem
from stager.storage.copy import CopyResult, copy_file
from stager.storage.retry import call_with_retries
from stager.storage.sources import SourceSet

if TYPE_CHECKING:
    from stager.stagein.cache import Claim
    from stager.stagein.copier import Copier

__all__ = ["copy_one", "relisted"]


class _Rewritten(Exception):  # noqa: N818 - a signal between on_retry and copy_one, not an error
    """The object a cache claim was made for was rewritten: copy it as ``item``, past the
    cache."""

    def __init__(self, item: CopyItem):
        super().__init__(item.shard.url)
        self.item = item


def relisted(source: SourceSet, item: CopyItem) -> CopyItem:
    """``item`` with the size and version its object store lists now (a manifest's size stays:
    a different one is the manifest's to refuse); ``item`` itself for a local source."""
    info = source.listed_now(item.shard.path)
    if info is None:
        return item
    size = item.size if item.from_manifest and item.size is not None else info.size
    return item.sized(size, info.version)


def copy_one(copier: Copier, item: CopyItem, past_the_cache: bool = False) -> None:
    """Copy ``item`` with :func:`copy_file` and book it, or report why it failed; with
    ``past_the_cache``, straight to scratch (the cache's room ran out, or the object was
    rewritten during its fill)."""
    if not copier.still_wanted(item):
        return
    claim: Claim | None = None
    if copier.cache is not None and not past_the_cache:
        try:
            claim = copier.cache.claim(item)  # may wait while another job fills the shard
        except Exception as exc:  # noqa: BLE001 - one report line, as for a copy
            copier.fail(item, one_line(exc), failure_kind(exc))
            return
        if claim.served is not None:
            copier.served.add(item.shard.relpath)
            if claim.samples is not None:
                copier.served_samples[item.shard.relpath] = claim.samples
            copier.book_run([(item, claim.served, None)], True)
            return
    target = claim.target if claim is not None else item.target
    published = [True]
    count_in_flight = copier.options.count_samples and item.target.endswith(".tar")
    counters: list[TarSampleCounter] = []
    sizing = copier.sizing
    current = [item]  # as listed: again before each retry (relisted)

    def publish(partial: str, final_path: str) -> None:
        if not copier.samples_agree(item, counters[0] if counters else None):
            counted, want = counters[0].samples, copier.known_samples(item)
            raise HashMismatch(  # before the rename: nothing is published under this name
                f"{item.shard.url}: holds {counted} samples but the manifest says "
                f"{want}; the manifest is stale or wrong: re-run stager index"
            )
        if sizing is not None:
            published[0] = sizing.gate.publish(partial, final_path)
        else:
            os.replace(partial, final_path)

    def attempt() -> CopyResult:
        counters[:] = [TarSampleCounter()] if count_in_flight else []  # fresh per attempt
        listed = current[0]
        return copy_file(
            copier.source.remote_fs,
            listed.shard.path,
            target,
            url=listed.shard.url,
            expected_size=listed.size,
            expected_hash=listed.want_hash,
            block_bytes=copier.options.block_bytes,
            throttle=copier.throttle,
            on_bytes=copier.on_bytes,
            inspect=counters[0] if counters else None,
            fsync=copier.options.fsync,
            size_from_manifest=listed.from_manifest,
            publish=publish,
        )

    def on_retry(number: int, exc: BaseException) -> None:
        copier.on_retry(number, exc)
        now = current[0]
        with contextlib.suppress(Exception):  # (a failed listing: the retry says what)
            now = relisted(copier.source, current[0])
        if claim is None:
            current[0] = now
        elif now.shard.version != current[0].shard.version:
            # A cache claim is for the version listed (its key is made of it), and s3fs reads
            # on its ETag: once the object is rewritten no retry of this claim can succeed
            # (each failed, exit 3). The shard is copied at its new version past the cache:
            # filled under the listed version's key, the cache would hold other bytes there.
            raise _Rewritten(now)

    copier.slots.take()  # (again, if given back waiting for the walk, a size or the cache)
    result = None
    cache_failed = False
    rewritten: CopyItem | None = None
    try:
        retry = copier.options.retry
        result = call_with_retries(attempt, retry, on_retry=on_retry, sleep=copier.halt.pause)
        if claim is not None:  # copied into the cache: record it, place it in scratch
            result = claim.publish(result, counters[0].samples if counters else None)
    except _Rewritten as exc:
        rewritten = exc.item
    except Exception as exc:  # noqa: BLE001 - every failure becomes one report line
        cache = copier.cache if claim is not None else None
        cache_failed = cache is not None and (cache.ran_out_of_space(exc) or cache.refused(exc))
        if not cache_failed:
            kind = failure_kind(exc)
            if kind in ("full", "dest") and not isinstance(exc, PathBlocked):
                copier.full.set()  # no later copy can land either
            copier.fail(item, one_line(exc), kind)
    finally:
        timing = (result.first_byte_s, result.last_byte_s, result.cores_used) if result else ()
        copier.slots.finished(*timing)
        if claim is not None:
            claim.release()
    # Again, straight to scratch: the cache filled up or refused the shard, or the object changed
    # since its listing (then at its new version).
    if cache_failed or rewritten is not None:
        copy_one(copier, rewritten or item, past_the_cache=True)
        return
    if result is None:
        return  # (failed: reported above)
    copier.run_length.timed(result.seconds)
    copier.book_run([(current[0], result, counters[0] if counters else None)], published[0])
