"""``stager ls`` and ``stager du`` output: rows from a :class:`NodeInventory`, as text or JSON.

Every row starts with the node's name, so the output of ``srun --ntasks-per-node=1 stager ls``
over an allocation can be merged, sorted and grepped; ``--json`` gives the same rows as one
JSON object per line, with sizes in bytes and ages in seconds.
"""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stager.node.inventory import JobDir, NodeInventory
from stager.units import human_bytes, human_duration

__all__ = ["LS_COLUMNS", "DU_COLUMNS", "ls_rows", "du_rows", "format_table", "owner_name"]

#: (key, header) of the text columns; the last one is not padded.
LS_COLUMNS = (
    ("node", "NODE"),
    ("where", "JOB"),
    ("state", "STATE"),
    ("owner", "OWNER"),
    ("age", "AGE"),
    ("size", "SIZE"),
    ("name", "NAME"),
    ("detail", "DETAIL"),
)
DU_COLUMNS = (
    ("node", "NODE"),
    ("where", "WHERE"),
    ("state", "STATE"),
    ("owner", "OWNER"),
    ("age", "AGE"),
    ("size", "SIZE"),
    ("files", "FILES"),
    ("detail", "DETAIL"),
)


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _job_state(job: JobDir, inventory: NodeInventory) -> str:
    if job.locks_held:
        return "in use"
    running = inventory.states.running(job.job_id)
    return "?" if running is None else "running" if running else "ended"


def _size(nbytes: int, readable: bool = True) -> str:
    return human_bytes(nbytes) if readable else "-"


def ls_rows(inventory: NodeInventory) -> list[dict[str, Any]]:
    """One row per dataset or other entry of each job's scratch, then one per cached dataset."""
    now = inventory.scanned_at
    rows: list[dict[str, Any]] = []
    for job in inventory.jobs:
        common = {
            "node": inventory.node,
            "where": job.job_id,
            "state": _job_state(job, inventory),
            "owner": owner_name(job.owner_uid),
        }
        for item in job.items or [None]:
            row: dict[str, Any]
            if item is None:
                size = 0 if job.readable else None
                row = {"name": "-", "kind": "empty", "path": str(job.path), "size_bytes": size}
                row |= {"age_s": job.age_s(now), "detail": "" if job.readable else "not readable"}
            else:
                detail = ""
                if item.kind == "dataset":
                    detail = f"{item.source} ({item.shards} shards)"
                elif item.kind == "staging":
                    detail = "being staged, or its stage-in was killed (no manifest yet)"
                row = {
                    "name": item.name,
                    "kind": item.kind,
                    "path": str(item.path),
                    "size_bytes": item.size_bytes,
                    "age_s": max(0.0, now - item.newest_mtime),
                    "detail": detail,
                }
                if item.kind == "dataset":
                    row |= {"source": item.source, "shards": item.shards}
            rows.append(common | row)
    cache = inventory.cache
    if cache is not None:
        for dataset in sorted(cache.datasets, key=lambda d: (d.record.name, d.record.spec)):
            record = dataset.record
            jobs = ", ".join(dataset.jobs_running)
            named = len(record.shards)
            count = (
                f"{named}"
                if dataset.shards_cached == named
                else f"{dataset.shards_cached} of {named}"
            )
            detail = f"{record.source or record.spec} ({count} shards"
            detail += f"; used by job {jobs})" if jobs else ")"
            rows.append(
                {
                    "node": inventory.node,
                    "where": "cache",
                    "state": "in use" if dataset.in_use else "idle",
                    "owner": owner_name(cache.owner_uid),
                    "name": record.name or "-",
                    "kind": "cached",
                    "path": str(cache.root),
                    "size_bytes": dataset.size_bytes,
                    "age_s": max(0.0, now - record.last_used),
                    "detail": detail,
                    "source": record.source,
                    "spec": record.spec,
                    "shards": len(record.shards),
                    "shards_cached": dataset.shards_cached,
                    "jobs": list(dataset.jobs_running),
                }
            )
    return rows


def _free(places: Sequence[Path]) -> str:
    """Free space on each filesystem among ``places`` (one mention per filesystem)."""
    seen, out = set(), []
    for path in places:
        try:
            device = os.stat(path).st_dev
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        if device not in seen:
            seen.add(device)
            out.append(f"{human_bytes(free)} free on {path}")
    return "; ".join(out)


def du_rows(inventory: NodeInventory, *, limit_bytes: int | None = None) -> list[dict[str, Any]]:
    """One row per job directory, one for the cache, and the node's total."""
    now = inventory.scanned_at
    rows: list[dict[str, Any]] = []
    for job in inventory.jobs:
        detail = (
            f"{human_bytes(job.linked_bytes)} linked from the cache" if job.linked_bytes else ""
        )
        rows.append(
            {
                "node": inventory.node,
                "where": str(job.path),
                "job": job.job_id,
                "state": _job_state(job, inventory),
                "owner": owner_name(job.owner_uid),
                "age_s": job.age_s(now),
                "size_bytes": job.size_bytes if job.readable else None,
                "files": job.files,
                "linked_bytes": job.linked_bytes,
                "detail": detail if job.readable else "not readable",
            }
        )
    cache = inventory.cache
    if cache is not None:
        in_use = sum(d.in_use for d in cache.datasets)
        detail = f"cache: {len(cache.datasets)} dataset(s), {in_use} in use"
        if limit_bytes is not None:
            detail += f", limit {human_bytes(limit_bytes)}"
        rows.append(
            {
                "node": inventory.node,
                "where": str(cache.root),
                "job": "cache",
                "state": "in use" if in_use else "idle",
                "owner": owner_name(cache.owner_uid),
                "age_s": None,
                "size_bytes": cache.size_bytes,
                "files": cache.files,
                "detail": detail,
            }
        )
    free = _free([inventory.scratch_root] + ([cache.root] if cache is not None else []))
    rows.append(
        {
            "node": inventory.node,
            "where": "total",
            "job": "",
            "state": "",
            "owner": "",
            "age_s": None,
            "size_bytes": inventory.total_bytes,
            "files": sum(j.files for j in inventory.jobs) + (cache.files if cache else 0),
            "detail": "hard links counted once" + (f"; {free}" if free else ""),
        }
    )
    return rows


def _text(key: str, row: dict[str, Any]) -> str:
    if key == "size":
        size = row.get("size_bytes")
        return "-" if size is None else _size(size)
    if key == "age":
        age = row.get("age_s")
        return "" if age is None else human_duration(age)
    value = row.get(key, "")
    return "" if value is None else " ".join(str(value).split())


def format_table(
    rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]], *, header: bool = True
) -> str:
    """Rows as aligned text columns (the last one unpadded), a header line first."""
    cells = [[_text(key, row) for key, _ in columns] for row in rows]
    if header:
        cells.insert(0, [title for _, title in columns])
    if not cells:
        return ""
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns) - 1)]
    lines = []
    for line in cells:
        padded = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        lines.append("  ".join([*padded, line[-1]]).rstrip())
    return "\n".join(lines) + "\n"
