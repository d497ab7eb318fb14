"""stager: stage datasets to node-local scratch on SLURM, and checkpoints back.

Importing this package never imports torch: it runs in sbatch prologues and on login nodes.
The loader lives in the separate ``loaders`` package.
"""

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
