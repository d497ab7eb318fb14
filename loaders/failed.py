"""What stage-in recorded as failed for a staged copy: its last result's failures, and the
shards its manifest records as corrupt. The loader reads the first kind from the source and
never reads the second (:mod:`loaders.resolve`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stager.errors import IntegrityError, SourceError
from stager.layout import CORRUPT_META, StagedDataset

__all__ = ["recorded_corrupt", "recorded_failures", "refuse_nothing"]


def recorded_failures(dataset_dir: Path) -> list[dict[str, str]]:
    """The shards stage-in reported as failed in its last result for this dataset on this node."""
    result = StagedDataset.of(dataset_dir).result_path
    try:
        failures = json.loads(result.read_text())["report"].get("failures", [])
        return [f for f in failures if isinstance(f, dict) and isinstance(f.get("url"), str)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def recorded_corrupt(meta: dict[str, str], failures: list[dict[str, str]]) -> list[dict[str, str]]:
    """The shards the staged manifest records as corrupt (:data:`stager.layout.CORRUPT_META`)
    that the last result does not name: a later run that failed early rewrote the result."""
    try:
        relpaths = json.loads(meta.get(CORRUPT_META, "[]"))
    except ValueError:
        return []
    if not isinstance(relpaths, list):
        return []
    root = meta.get("source", "").rstrip("/")
    named = {f["url"] for f in failures}
    urls = [f"{root}/{relpath}" for relpath in relpaths if isinstance(relpath, str)]
    reason = "found corrupt by an earlier stage-in"
    return [{"url": u, "kind": "corrupt", "reason": reason} for u in urls if u not in named]


def refuse_nothing(source: object, counts: Any, skipped: list[str], subset: str) -> None:
    """Refuse a dataset with nothing to train on, rather than epochs of no batch."""
    if subset == "all" and not int(counts.sum()) and not skipped:
        # (a node's share may be empty; the dataset not)
        raise SourceError(
            f"the {len(counts)} shard(s) of {source} hold no sample: nothing to train on "
            "(empty tars?)"
        )
    if skipped and not int(counts.sum()):
        raise IntegrityError(  # else a training loop of no steps, said only in a log line
            f"every shard of {source} with samples was left out as corrupt ({len(skipped)}, "
            f"first: {skipped[0]}): nothing to train on"
        )
