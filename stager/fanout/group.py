"""The node group of a fan-out: one gloo process group, one rank per node, over TCP.

torch is imported here lazily, inside :func:`form_group`, so ``import stager`` stays torch-free
(prologues, login nodes). Rendezvous is torch's own ``tcp://HOST:PORT`` (a TCPStore served by
rank 0 on the job's first host); rank is ``SLURM_NODEID`` and the world is the node count.

Two timeouts with different jobs:

* ``form_timeout_s`` bounds forming the group (store, gloo mesh, handshake). A group that does
  not form is not an error: the caller falls back to plain per-node copying.
* ``op_timeout_s`` bounds each collective once formed. It must exceed the longest source read
  of one shard, because receivers wait in the shard's first broadcast while its owner reads it.
  A peer that *dies* is noticed at once (its TCP connections close); the timeout only matters
  for a peer that hangs.

Errors (subclasses of :class:`stager.errors.StagerError`)::

    FanoutError           the fan-out failed after the group formed       exit 10
    └── GroupUnavailable  the group could not form; caller falls back     (never exits)
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stager.errors import GroupUnavailable, UsageError
from stager.slurm import SlurmEnv

__all__ = [
    "FanoutOptions",
    "NodeGroup",
    "form_group",
    "fanout_port",
    "resolve_endpoint",
    "PORT_BASE",
    "PORT_SPAN",
    "quiet_torch_logs",
]

#: Ports derived from the job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's
#: ephemeral range (32768+) and clear of torch's customary 29500.
PORT_BASE = 21000
PORT_SPAN = 8000


@dataclass(frozen=True)
class FanoutOptions:
    """How the nodes find each other and how long they wait; the CLI builds this from flags."""

    host: str | None = None  # default: $STAGER_FANOUT_HOST, else the job's first node
    port: int | None = None  # default: $STAGER_FANOUT_PORT, else derived from the job id
    form_timeout_s: float = 120.0
    op_timeout_s: float = 900.0
    chunk_bytes: int = 4 << 20
    read_streams: int = 8  # concurrent source reads per node (each node reads only its part)


def fanout_port(job_id: str) -> int:
    """A port every node of a job derives alike from the job id, without talking."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def resolve_endpoint(
    slurm: SlurmEnv, options: FanoutOptions, env: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """``(host, port)`` of the rendezvous: flag, then environment, then derived from the job."""
    env = os.environ if env is None else env
    host = options.host or env.get("STAGER_FANOUT_HOST") or slurm.first_host
    raw: int | str = options.port or env.get("STAGER_FANOUT_PORT") or fanout_port(slurm.job_id)
    try:
        port = int(raw)
    except ValueError as exc:
        raise UsageError(f"STAGER_FANOUT_PORT={raw!r} is not a port number") from exc
    if not 0 < port < 65536:
        raise UsageError(f"fan-out port {port} is out of range 1-65535; pass --fanout-port")
    return host, port


class NodeGroup:
    """The formed group: thin wrappers over the few collectives the fan-out uses.

    Every call is a collective: all nodes make the same calls in the same order (the plan
    guarantees it). Errors from torch come out as they are; the caller maps them to
    :class:`FanoutError` with the shard and node in the message.
    """

    def __init__(self, dist: Any, torch: Any, node: int, num_nodes: int, group: Any):
        self._dist = dist
        self.torch = torch
        self.node = node  # this node's index in the job, which is its rank in the group
        self.num_nodes = num_nodes
        self._group = group

    def all_gather(self, tensor: Any, *, forming: bool = False) -> list[Any]:
        """Every node's ``tensor``, by node; ``forming`` runs it under the short form timeout."""
        out = [self.torch.empty_like(tensor) for _ in range(self.num_nodes)]
        self._dist.all_gather(out, tensor, group=None if forming else self._group)
        return out

    def broadcast(self, tensor: Any, src: int) -> None:
        self._dist.broadcast(tensor, src=src, group=self._group)

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def close(self) -> None:
        """Tear the group down; never raises (it runs on error paths too)."""
        try:
            if self._dist.is_initialized():
                self._dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to close; the process exits anyway
            pass

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def quiet_torch_logs() -> None:
    """Keep c10d's C++ log (a rendezvous poll timing out, with source lines and stack
    frames) out of the job log, where a group that does not form is said in one line; read by
    torch when it loads, so called before it is imported. A value the user set stays."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def form_group(
    host: str, port: int, node: int, num_nodes: int, options: FanoutOptions, tag: str = ""
) -> NodeGroup:
    """Join the node group or raise :class:`GroupUnavailable` (torch missing, peers absent).

    ``tag`` (the job and dataset) names the group's keys in the rendezvous store: two fan-outs
    whose ports collide (derived from job ids, or the same job staging two datasets) cannot
    join each other's group, which paired a node with another job's peers and hung it in
    gloo's connect past every timeout; a node that reaches another's store finds no peer of
    its own there and falls back when forming times out."""
    quiet_torch_logs()
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise GroupUnavailable(f"torch.distributed is not importable here ({exc})") from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise GroupUnavailable("this torch build has no gloo backend")
    from datetime import timedelta  # (~2 ms of every stage-in's start, fan-out or not)

    url = f"tcp://{host}:{port}"
    try:
        # The default group lives only for forming and the handshake, under the short timeout;
        # the exchange runs on a second group of the same nodes with the long per-op timeout.
        forming = timedelta(seconds=options.form_timeout_s)
        store = dist.TCPStore(
            host, port, num_nodes, is_master=node == 0, timeout=forming, wait_for_workers=False
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"stager-fanout/{tag}/", store),
            rank=node,
            world_size=num_nodes,
            timeout=forming,
        )
        exchange = dist.new_group(
            ranks=list(range(num_nodes)),
            timeout=timedelta(seconds=options.op_timeout_s),
            backend="gloo",
        )
    except Exception as exc:  # noqa: BLE001 - any failure to form means: fall back
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise GroupUnavailable(
            f"no fan-out group at {url} within {options.form_timeout_s:g} s ({reason})"
        ) from exc
    return NodeGroup(dist, torch, node, num_nodes, exchange)
