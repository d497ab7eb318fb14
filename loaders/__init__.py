"""loaders: a rank-aware, drop-in DataLoader over staged WebDataset shards.

``ShardedLoader`` gives every DDP rank the same number of batches per epoch from node-local
staged shards, with exact mid-epoch resume (``state_dict``/``load_state_dict``).

Names are imported lazily: ``import loaders.sharding`` (the pure, numpy-only planner that
``stage-in --subset node`` uses in Slurm prologues) must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "LoaderMetrics",
    "LoaderOptions",
    "LoaderState",
    "PlanOptions",
    "ResumeMismatch",
    "ShardedLoader",
    "WorldLayout",
    "capture_rng_state",
    "restore_rng_state",
    "select_node_shards",
]

_HOME = {
    "LoaderMetrics": "metrics",
    "LoaderOptions": "loader",
    "ShardedLoader": "loader",
    "LoaderState": "state",
    "ResumeMismatch": "errors",
    "PlanOptions": "sharding",
    "WorldLayout": "sharding",
    "capture_rng_state": "rng",
    "restore_rng_state": "rng",
    "select_node_shards": "subset",
}

if TYPE_CHECKING:
    from .errors import ResumeMismatch
    from .loader import LoaderOptions, ShardedLoader
    from .metrics import LoaderMetrics
    from .rng import capture_rng_state, restore_rng_state
    from .sharding import PlanOptions, WorldLayout
    from .state import LoaderState
    from .subset import select_node_shards


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'loaders' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
