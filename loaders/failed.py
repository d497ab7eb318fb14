"""What stage-in recorded as failed for a staged copy: its last result's failures, and the
shards its manifest records as corrupt. The loader reads the first kind from the source and
never reads the second (:mod:`loaders.resolve`)."""

from __future__ import annotations

import json
from pathlib import Path

from stager.layout import CORRUPT_META, StagedDataset

__all__ = ["recorded_corrupt", "recorded_failures"]


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
