"""``LoaderOptions``: the loader's less common settings, in one frozen value.

``ShardedLoader`` keeps a DataLoader-like signature (source, batch size, workers, shuffle, seed,
decoding, evening, collation, pinning); everything a training script rarely sets lives here, so
the constructor stays short and the settings can be built once and passed around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stager.errors import UsageError

__all__ = [
    "LoaderOptions",
    "LEGACY_KEYWORDS",
    "DROP_LAST_HINT",
    "DATALOADER_KEYWORDS",
    "refuse_batch_size",
    "to_dataloader",
]

#: Constructor keywords of earlier versions that now live in ``LoaderOptions``; still accepted.
LEGACY_KEYWORDS = ("rank", "world_size", "persistent_workers", "prefetch_factor")
#: DataLoader's own keywords that ShardedLoader passes on to it as they are.
DATALOADER_KEYWORDS = ("timeout", "worker_init_fn", "multiprocessing_context", "pin_memory_device")

DROP_LAST_HINT = (
    "ShardedLoader has no drop_last: pass even='drop' (every rank drops the same number of "
    "samples, so epochs stay equal) or keep even='pad' (the default: a few samples repeat)"
)


@dataclass(frozen=True)
class LoaderOptions:
    """Less common knobs of :class:`stager_loaders.ShardedLoader`."""

    # -- where the data is
    dest: str | None = None  # stage-in's --dest (default: $STAGER_DEST, /scratch/$SLURM_JOB_ID...)
    name: str | None = None  # stage-in's --name
    force_streaming: bool = False  # read local shards through the streaming path (tests, benches)
    # -- where this process sits (default: torch.distributed, then Slurm, then torchrun)
    rank: int | None = None
    world_size: int | None = None
    ranks_per_node: int | None = None
    # -- order and failures
    shuffle_mode: str = "global"  # "global" or "blocked" when shuffle=True
    block_samples: int = 4096  # window of the blocked shuffle
    buffer_samples: int = 1000  # shuffle buffer per worker on the streaming path
    on_error: str = "raise"  # "raise" or "skip" for corrupt/truncated shards
    # stage-in --background died before staging a shard the loader needs: "fail" (one line,
    # StagingStopped) or "source" (fetch it from the source, verified, into the staged copy)
    on_copier_death: str = "fail"
    # a copier that holds its lock but shows no progress this long (stopped, or hung on a
    # dead server) is given up on: StagingStopped, whatever on_copier_death says
    copier_stall_s: float = 3600.0
    # -- workers (as DataLoader's; persistent workers are ignored on the streaming path)
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    log_every: int = 0  # log data-wait time and samples/s every N steps; 0: off

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise UsageError(f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        if self.on_copier_death not in ("fail", "source"):
            raise UsageError(
                f"on_copier_death must be 'fail' or 'source', not {self.on_copier_death!r}"
            )
        if self.shuffle_mode not in ("global", "blocked"):
            raise UsageError(
                f"shuffle_mode must be 'global' or 'blocked', not {self.shuffle_mode!r}"
            )
        for name in ("block_samples", "prefetch_factor"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if not self.copier_stall_s > 0:
            raise UsageError(f"copier_stall_s must be > 0 seconds, got {self.copier_stall_s}")
        for name in ("buffer_samples", "log_every"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")


def to_dataloader(keywords: dict[str, Any]) -> dict[str, Any]:
    """Take DataLoader's own keywords the loader passes on as they are out of ``keywords``, and
    refuse in one line those that would undo its plan (a bare TypeError named none of them)."""
    if keywords.pop("generator", None) is not None:
        raise UsageError(
            "ShardedLoader shuffles with its own seeded order (the same on every rank, another "
            "each epoch): pass seed= instead of generator="
        )
    if not keywords.pop("in_order", True):
        raise UsageError(
            "in_order=False would let batches arrive out of the planned order, which exact "
            "resume and equal epochs rely on; it is not offered"
        )
    return {name: keywords.pop(name) for name in DATALOADER_KEYWORDS if name in keywords}


def refuse_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(
            f"batch_size must be a positive integer, not {batch_size!r}: the loader plans every "
            "rank's batches (equal counts on every rank), so unbatched loading "
            "(DataLoader's batch_size=None) is not offered; use batch_size=1"
        )
