"""Which rank this process is, from wherever the launcher said so.

Order: an initialised ``torch.distributed`` group, then Slurm (``SLURM_PROCID``/``SLURM_NTASKS``,
via :class:`stager.slurm.SlurmEnv`), then torchrun's ``RANK``/``WORLD_SIZE``, else a world of one.
The ranks per node matter only for node-subset staging; they come from
``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` or torchrun's ``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from stager.errors import UsageError
from stager.plan.ranks import WorldLayout, samples_per_rank
from stager.slurm import SlurmEnv

__all__ = ["detect_layout", "agree_per_rank"]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from exc


def detect_layout(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    workers_per_rank: int = 0,
    ranks_per_node: int | None = None,
    env: Mapping[str, str] | None = None,
) -> WorldLayout:
    """The :class:`WorldLayout` of this process; explicit arguments win over the environment."""
    env = os.environ if env is None else env
    detected_rank, detected_world, detected_rpn = 0, 1, None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        detected_rank, detected_world = dist.get_rank(), dist.get_world_size()
        slurm = SlurmEnv.from_environ(env)
        detected_rpn = _env_int(env, "LOCAL_WORLD_SIZE") or (
            slurm.tasks_per_node if slurm.in_slurm else None
        )
    else:
        slurm = SlurmEnv.from_environ(env)
        if slurm.in_slurm and "SLURM_PROCID" in env:
            detected_rank, detected_world, detected_rpn = (
                slurm.rank,
                slurm.ntasks,
                slurm.tasks_per_node,
            )
        elif _env_int(env, "WORLD_SIZE") is not None:
            detected_rank = _env_int(env, "RANK") or 0
            detected_world = _env_int(env, "WORLD_SIZE") or 1
            detected_rpn = _env_int(env, "LOCAL_WORLD_SIZE")
    rank = detected_rank if rank is None else rank
    world_size = detected_world if world_size is None else world_size
    if world_size < 1 or (ranks_per_node is not None and ranks_per_node < 1):
        raise UsageError(
            f"world_size ({world_size}) and ranks_per_node ({ranks_per_node}) must be >= 1"
        )
    rpn = ranks_per_node or detected_rpn or world_size
    if world_size % rpn:
        # Uneven tasks per node: the node split is meaningless, but subset="all" needs only ranks.
        rpn = world_size
    if not 0 <= rank < world_size:
        raise UsageError(
            f"rank {rank} is outside a world of {world_size}; check RANK/WORLD_SIZE or SLURM_PROCID"
        )
    return WorldLayout(world_size // rpn, rpn, rank, workers_per_rank)


def agree_per_rank(local_total: int, layout: WorldLayout, even: str, subset: str) -> int:
    """Samples per rank this epoch; with node subsets every node must agree (one all_reduce).

    Nodes stage different shards under ``--subset node``, so each node proposes its own share
    and all take the smallest (``"drop"``) or the largest (``"pad"``), keeping epochs equal.
    """
    if subset != "node":
        return samples_per_rank(local_total, layout, even)
    share = samples_per_rank([local_total], WorldLayout(1, layout.ranks_per_node), even)
    import torch

    from .collective import layout_group

    group = layout_group(layout)  # (None for a loader of another world: rank 0's alone)
    if group is not None:
        dist, device = group
        value = torch.tensor([share], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN if even == "drop" else dist.ReduceOp.MAX)
        return int(value.item())
    if layout.num_nodes > 1:
        raise UsageError(
            "this dataset was staged with --subset node, so nodes hold different samples; "
            "initialise torch.distributed before creating the loader so nodes agree on the "
            "epoch length"
        )
    return share
