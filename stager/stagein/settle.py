"""The end of a copier whose shards were sized while they copied (:mod:`stager.stagein.sizing`):
the report takes the sizes found, and the free-space verdict is accounted for or raised."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from stager.errors import SourceError, one_line
from stager.leftout import left_out_warnings, skipped_message
from stager.stagein.guards import space_error
from stager.stagein.plan import count_samples_of
from stager.stagein.sizing import DeferredPreflight

if TYPE_CHECKING:
    from stager.stagein.copier import Copier

__all__ = ["settle_sized_later"]


def settle_sized_later(copier: Copier, sizing: DeferredPreflight) -> None:
    """Account for the shards sized during the copy, or raise the verdict against them.

    On a refusal (or a probe that broke) the held copies were deleted: they leave the report
    and the staged manifest before the error is raised, so neither claims a file not staged.
    """
    report = copier.report
    report.files_total -= len(copier.dropped)
    report.bytes_total += sizing.probed_bytes
    late = [item for item in copier.plan.to_copy if item.shard.relpath in copier.late]
    for index in sorted(sizing.probe.not_regular):
        message = skipped_message(late[index].shard.url)
        print(f"[{report.node}] warning: {message}", file=copier.log, flush=True)
    directories = [late[index].shard.url + "/" for index in sizing.probe.directories]
    for message in left_out_warnings(directories):
        print(f"[{report.node}] warning: {message}", file=copier.log, flush=True)
    if not sizing.gate.passed:
        for relpath in copier.held:
            copier.unstage(relpath)
        if copier.stopped_by is not None:
            raise copier.stopped_by
        if sizing.probe.failure is not None:
            raise SourceError(
                f"[{report.node}] sizing the source's shards failed: "
                f"{one_line(sizing.probe.failure)}; nothing was copied"
            ) from sizing.probe.failure
        reserve = copier.options.min_free_bytes
        raise space_error(
            *(report.dataset_dir, sizing.needed_bytes + reserve, sizing.free_bytes),
            *(report.node, reserve),
        )
    # (a dict per shard only when needed: a Path per shard cost 0.5 s at 10,000 shards)
    item_of = {i.target: i for i in copier.plan.to_copy} if sizing.failed_renames else {}
    for final_path, exc in sizing.failed_renames:
        item = item_of[final_path]
        copier.unstage(item.shard.relpath)
        copier.fail(item, f"copied but not renamed into place: {exc.strerror or exc}")
    later = set(copier.count_later)  # held copies counted only now that they are renamed
    final_of = {i.shard.relpath: i.final for i in copier.plan.to_copy} if later else {}
    unjournaled = []
    for index, relpath in enumerate(copier.held):  # journal those _journal_passed did not
        entry = copier.outcome.entries.get(relpath)
        if entry is None or (index < copier.held_journaled and relpath not in later):
            continue
        if relpath in later:
            samples = count_samples_of(final_of[relpath])
            entry = copier.outcome.entries[relpath] = dataclasses.replace(entry, samples=samples)
        unjournaled.append(entry)
    if copier.journal is not None:
        copier.journal.record_all(unjournaled)
