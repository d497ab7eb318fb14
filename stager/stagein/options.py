"""Everything that tunes one stage-in run, each default written once (the CLI reads them here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from stager.stagein.streams import DEFAULT_JOBS
from stager.storage.copy import DEFAULT_BLOCK_BYTES
from stager.storage.retry import RetryPolicy

__all__ = ["StageInOptions", "PROGRESS_STYLES", "SUBSETS"]

PROGRESS_STYLES = ("auto", "bar", "lines", "none")
SUBSETS = ("all", "node")


@dataclass(frozen=True)
class StageInOptions:
    """How one stage-in run copies; the CLI builds this from its flags."""

    dest_root: Path
    name: str | None = None  # default: stager.layout.dataset_name of the source
    jobs: int = DEFAULT_JOBS  # most concurrent copy streams per node
    min_jobs: int = 4  # fewest streams the latency model settles at (small files: see rateprobe)
    adaptive: bool = True  # False: always ``jobs`` streams
    bw_limit_mbps: float | None = None  # cap on source reads per node, MB/s
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    manifest: str | None = None  # default: stager-manifest.* beside the source
    block_bytes: int = DEFAULT_BLOCK_BYTES
    progress: str = "auto"  # one of PROGRESS_STYLES
    progress_interval_s: float = 10.0
    jitter_max_s: float = 2.0  # start delays spread over nodes up to this
    count_samples: bool = True  # count samples and index members of copied shards
    fsync: bool = False  # fsync each shard before publishing it
    #: Wait at most this long for another copier of the dataset on this node to show progress.
    lock_timeout_s: float = 3600.0
    min_free_bytes: int = 0  # keep this much free on scratch
    subset: str = "all"  # one of SUBSETS
    log: TextIO | None = None  # where progress and warnings go (default: stderr)
    cache_dir: Path | None = None  # the node cache (stager.stagein.cache); None: no cache
    cache_limit_bytes: int | None = None  # the cache's cap; None: half its filesystem
