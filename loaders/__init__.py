"""loaders: a rank-aware, drop-in DataLoader over staged WebDataset shards.

``ShardedLoader`` gives every DDP rank the same number of batches per epoch from node-local
staged shards, with exact mid-epoch resume (``state_dict``/``load_state_dict``).

Names are imported lazily: ``import stager.plan.ranks`` (the pure, numpy-only planner that
``stage-in --subset node`` uses in Slurm prologues) must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CsvMetrics",
    "LoaderMetrics",
    "LoaderOptions",
    "LoaderState",
    "PlanOptions",
    "ResumeMismatch",
    "ShardedLoader",
    "TensorBoardMetrics",
    "WorldLayout",
    "capture_rng_state",
    "restore_rng_state",
]

_HOME = {
    "CsvMetrics": "metrics_export",
    "TensorBoardMetrics": "metrics_export",
    "LoaderMetrics": "metrics",
    "LoaderOptions": "options",
    "ShardedLoader": "loader",
    "LoaderState": "state",
    "ResumeMismatch": "stager.errors",
    "PlanOptions": "stager.plan.ranks",
    "WorldLayout": "stager.plan.ranks",
    "capture_rng_state": "rng",
    "restore_rng_state": "rng",
}

if TYPE_CHECKING:
    from stager.errors import ResumeMismatch
    from stager.plan.ranks import PlanOptions, WorldLayout

    from .loader import ShardedLoader
    from .metrics import LoaderMetrics
    from .metrics_export import CsvMetrics, TensorBoardMetrics
    from .options import LoaderOptions
    from .rng import capture_rng_state, restore_rng_state
    from .state import LoaderState


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'stager_loaders' has no attribute {name!r}")
    module = _HOME[name]
    return getattr(
        importlib.import_module(module if "." in module else f"{__name__}.{module}"), name
    )


def __dir__() -> list[str]:
    return sorted(__all__)
