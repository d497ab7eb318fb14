"""Where a stage-in's own outputs may go, checked before anything is written: its
``--report`` (never inside a staged dataset, whose files it would replace)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from stager.errors import UsageError
from stager.layout import META_DIR, dataset_name
from stager.stagein.options import StageInOptions

__all__ = ["check_report_place", "dataset_dir_of"]


def dataset_dir_of(args: argparse.Namespace, options: StageInOptions) -> Path | None:
    """Where this run stages its dataset, where that is known before listing (not for a list
    file, whose shards name it)."""
    name = args.name or (dataset_name(args.source) if args.source else None)
    return options.dest_root / name if name else None


def check_report_place(report: str, dest_root: Path, dataset_dir: Path | None) -> None:
    """Refuse a ``--report`` inside a staged dataset's directory (links followed): this run's,
    or any holding a ``.stager``. It was renamed over whatever was there, a staged shard too,
    with exit 0."""
    where, root = Path(os.path.realpath(report)), os.path.realpath(dest_root)
    inside = os.path.relpath(where, root)
    top = inside.split(os.sep, 1)[0]
    if inside.startswith("..") or os.sep not in inside:
        return  # (outside the destination root, or directly in it)
    staged = Path(root) / top
    if (staged / META_DIR).is_dir() or (
        dataset_dir is not None and staged == Path(os.path.realpath(dataset_dir))
    ):
        raise UsageError(
            f"--report {report} is inside the staged dataset {staged}: it would be written over "
            "a staged file; write it beside them (DEST/report.json) or elsewhere"
        )
