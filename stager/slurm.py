"""The SLURM job environment as one frozen value, and Slurm's hostlist syntax.

Slurm knowledge is kept as data: each field says which variable it comes from, so a reader can
check it against ``man srun`` without reading code. Outside Slurm the same value describes a
single-node, single-task job with job id ``local``, so every caller can treat both alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from stager.errors import UsageError

__all__ = ["SlurmEnv", "parse_hostlist", "usable_cpus", "LOCAL_JOB_ID"]

LOCAL_JOB_ID = "local"


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, which Slurm sets to the job's allocation
    (``--cpus-per-task``), not the whole node."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_ranges(body: str, spec: str) -> list[str]:
    """Expand ``01-04,07`` into ``["01", "02", "03", "04", "07"]``, keeping zero padding."""
    out: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise UsageError(
                f"bad range {part!r} in hostlist {spec!r}; expected e.g. node[01-04,07]"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise UsageError(f"descending range {part!r} in hostlist {spec!r}")
        if hi - lo > 100_000:
            raise UsageError(f"range {part!r} in hostlist {spec!r} is implausibly large")
        width = len(lo_text)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in spec:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UsageError(f"nested brackets in hostlist {spec!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"unbalanced ']' in hostlist {spec!r}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise UsageError(f"unbalanced '[' in hostlist {spec!r}")
    items.append("".join(current))
    return items


def parse_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[01-04,07],gpu-a[1-2]`` into host names.

    Supports several bracket groups per name (``r[1-2]n[1-2]`` gives the cartesian product in
    Slurm's order). Raises :class:`UsageError` on malformed input, never anything else.
    """
    spec = spec.strip()
    if not spec:
        return []
    hosts: list[str] = []
    for item in _split_top_level(spec):
        item = item.strip()
        if not item:
            raise UsageError(f"empty host name in hostlist {spec!r}")
        names = [""]
        pos = 0
        for match in re.finditer(r"\[([^\[\]]*)\]", item):
            prefix = item[pos : match.start()]
            expanded = _expand_ranges(match.group(1), spec)
            names = [n + prefix + e for n in names for e in expanded]
            pos = match.end()
            if len(names) > 1_000_000:
                raise UsageError(f"hostlist {spec!r} expands to too many hosts")
        tail = item[pos:]
        if "[" in tail or "]" in tail:
            raise UsageError(f"malformed brackets in hostlist {spec!r}")
        hosts.extend(n + tail for n in names)
    return hosts


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    # SLURM_TASKS_PER_NODE looks like "2(x3),1"; callers pass only plain ints here.
    try:
        return int(raw)
    except ValueError as exc:
        raise UsageError(f"environment variable {name}={raw!r} is not an integer") from exc


def _tasks_per_node(raw: str | None, ntasks: int, num_nodes: int) -> int:
    """Tasks on this job's first node from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` gives 2)."""
    if not raw:
        return max(1, ntasks // max(1, num_nodes))
    head = raw.split(",")[0]
    match = re.match(r"^(\d+)", head)
    return int(match.group(1)) if match else 1


@dataclass(frozen=True)
class SlurmEnv:
    """Where this process sits in the job: which job, which node, which task.

    Field          Source variable
    ------------   -------------------------------------------------
    job_id         SLURM_JOB_ID (``local`` outside Slurm)
    node           SLURM_NODEID (index of this node in the job)
    num_nodes      SLURM_JOB_NUM_NODES / SLURM_NNODES
    nodelist       SLURM_JOB_NODELIST / SLURM_NODELIST (expanded)
    node_name      SLURMD_NODENAME, else the host name
    rank           SLURM_PROCID (global rank of the task)
    local_rank     SLURM_LOCALID (rank of the task on its node)
    ntasks         SLURM_NTASKS
    tasks_per_node SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE
    restart_count  SLURM_RESTART_COUNT (requeues so far)
    """

    job_id: str
    node: int
    num_nodes: int
    nodelist: tuple[str, ...]
    node_name: str
    rank: int
    local_rank: int
    ntasks: int
    tasks_per_node: int
    restart_count: int

    @property
    def in_slurm(self) -> bool:
        """True when the process runs inside a Slurm allocation."""
        return self.job_id != LOCAL_JOB_ID

    @property
    def first_host(self) -> str:
        """The job's first node: where torchrun's rendezvous and MASTER_ADDR live."""
        return self.nodelist[0] if self.nodelist else self.node_name

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> SlurmEnv:
        """Read the job layout from ``env`` (default ``os.environ``)."""
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        node_name = (
            env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
        )  # gethostname(), without importing socket
        if not job_id:
            return cls(
                job_id=LOCAL_JOB_ID,
                node=0,
                num_nodes=1,
                nodelist=(node_name,),
                node_name=node_name,
                rank=0,
                local_rank=0,
                ntasks=1,
                tasks_per_node=1,
                restart_count=0,
            )
        if not job_id.isascii() or not job_id.isdigit():  # (it names /scratch/$SLURM_JOB_ID)
            raise UsageError(f"environment variable SLURM_JOB_ID={job_id!r} is not a job number")
        nodelist = tuple(
            parse_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        )
        num_nodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", len(nodelist) or 1))
        ntasks = _int(env, "SLURM_NTASKS", _int(env, "SLURM_NPROCS", num_nodes))
        if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
            tasks_per_node = int(env["SLURM_NTASKS_PER_NODE"])
        else:
            tasks_per_node = _tasks_per_node(env.get("SLURM_TASKS_PER_NODE"), ntasks, num_nodes)
        return cls(
            job_id=job_id,
            node=_int(env, "SLURM_NODEID", 0),
            num_nodes=num_nodes,
            nodelist=nodelist or (node_name,),
            node_name=node_name,
            rank=_int(env, "SLURM_PROCID", 0),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            ntasks=ntasks,
            tasks_per_node=tasks_per_node,
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        )
