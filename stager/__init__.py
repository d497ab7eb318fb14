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
    "CommitRecord": "checkpoint",
    "DestinationError": "errors",
    "IntegrityError": "errors",
    "LockTimeout": "errors",
    "Manifest": "manifest",
    "ManifestEntry": "manifest",
    "NoCheckpoint": "errors",
    "ScratchFull": "errors",
    "ShardsFailed": "errors",
    "SlurmEnv": "slurm",
    "SourceError": "errors",
    "SourceSet": "sources",
    "SourceShard": "sources",
    "StageInOptions": "stagein",
    "StageInReport": "report",
    "StageOutOptions": "stageout",
    "StagerError": "errors",
    "UnsafePath": "errors",
    "UsageError": "errors",
    "parse_hostlist": "slurm",
    "resolve_dest_root": "dest",
    "resolve_source": "sources",
    "restore_checkpoint": "restore",
    "stage_in": "stagein",
    "stage_out": "stageout",
    "staged_manifest_path": "stagein",
}

if TYPE_CHECKING:
    from .checkpoint import CommitRecord
    from .dest import resolve_dest_root
    from .errors import (
        CheckpointError,
        DestinationError,
        IntegrityError,
        LockTimeout,
        NoCheckpoint,
        ScratchFull,
        ShardsFailed,
        SourceError,
        StagerError,
        UnsafePath,
        UsageError,
    )
    from .manifest import Manifest, ManifestEntry
    from .report import StageInReport
    from .restore import restore_checkpoint
    from .slurm import SlurmEnv, parse_hostlist
    from .sources import SourceSet, SourceShard, resolve_source
    from .stagein import StageInOptions, stage_in, staged_manifest_path
    from .stageout import StageOutOptions, stage_out

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
    "StageOutOptions",
    "StagerError",
    "UnsafePath",
    "UsageError",
    "parse_hostlist",
    "resolve_dest_root",
    "resolve_source",
    "restore_checkpoint",
    "stage_in",
    "stage_out",
    "staged_manifest_path",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'stager' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
