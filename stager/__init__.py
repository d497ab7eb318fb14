"""stager: stage datasets to node-local scratch on SLURM, and checkpoints back.

Importing this package never imports torch: it runs in sbatch prologues and on login nodes.
The loader lives in the separate ``loaders`` package.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Names are imported on first use: the stage-in CLI should not pay for stage-out, restore and
# fan-out modules at start-up (an sbatch prologue runs it on every node of every job).
_HOME = {
    "CheckpointError": "errors",
    "CommitRecord": "stageout.record",
    "DestinationError": "errors",
    "IntegrityError": "errors",
    "LockTimeout": "errors",
    "Manifest": "shards.manifest",
    "ManifestEntry": "shards.manifest",
    "NoCheckpoint": "errors",
    "ScratchFull": "errors",
    "ShardsFailed": "errors",
    "SlurmEnv": "slurm",
    "SourceError": "errors",
    "SourceSet": "storage.sources",
    "SourceShard": "storage.sources",
    "StageInOptions": "stagein.run",
    "StageInReport": "stagein.report",
    "StageOutOptions": "stageout.run",
    "StagerError": "errors",
    "StagingStopped": "errors",
    "UnsafePath": "errors",
    "UsageError": "errors",
    "parse_hostlist": "slurm",
    "resolve_dest_root": "storage.dest",
    "resolve_source": "storage.sources",
    "restore_checkpoint": "stageout.restore",
    "stage_in": "stagein.run",
    "stage_out": "stageout.run",
    "StagedDataset": "layout",
    "dataset_name": "layout",
}

if TYPE_CHECKING:
    from stager.errors import (
        CheckpointError,
        DestinationError,
        IntegrityError,
        LockTimeout,
        NoCheckpoint,
        ScratchFull,
        ShardsFailed,
        SourceError,
        StagerError,
        StagingStopped,
        UnsafePath,
        UsageError,
    )
    from stager.layout import StagedDataset, dataset_name
    from stager.shards.manifest import Manifest, ManifestEntry
    from stager.slurm import SlurmEnv, parse_hostlist
    from stager.stagein.report import StageInReport
    from stager.stagein.run import StageInOptions, stage_in
    from stager.stageout.record import CommitRecord
    from stager.stageout.restore import restore_checkpoint
    from stager.stageout.run import StageOutOptions, stage_out
    from stager.storage.dest import resolve_dest_root
    from stager.storage.sources import SourceSet, SourceShard, resolve_source

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CheckpointError",
    "CommitRecord",
    "DestinationError",
    "IntegrityError",
    "LockTimeout",
    "Manifest",
    "ManifestEntry",
    "NoCheckpoint",
    "ScratchFull",
    "ShardsFailed",
    "SlurmEnv",
    "SourceError",
    "SourceSet",
    "SourceShard",
    "StageInOptions",
    "StageInReport",
    "StagedDataset",
    "StageOutOptions",
    "StagerError",
    "StagingStopped",
    "UnsafePath",
    "UsageError",
    "dataset_name",
    "parse_hostlist",
    "resolve_dest_root",
    "resolve_source",
    "restore_checkpoint",
    "stage_in",
    "stage_out",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'stager' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
