"""The test cluster's layout as one frozen value, and the config files it renders (pure).

Kept apart from the process handling in :mod:`tests.cluster.cluster` so the rendered
``slurm.conf`` can be checked without starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterLayout", "render_slurm_conf", "render_gres_conf", "render_hosts"]


@dataclass(frozen=True)
class ClusterLayout:
    """Where everything of one test cluster lives and how its nodes are declared.

    ``cpus_per_node`` and ``gpus_per_node`` are what Slurm is told, not what exists:
    ``SlurmdParameters=config_overrides`` lets 2-4 "nodes" of 16 CPUs share a 2-core machine,
    and the GPUs are plain files (``gres.conf``), so GPU job scripts are accepted unmodified.
    """

    root: Path
    num_nodes: int = 2
    cpus_per_node: int = 16
    gpus_per_node: int = 4
    real_memory_mb: int = 4000
    node_prefix: str = "node"
    host_name: str = "localhost"  # the real `hostname -s`: SlurmctldHost and NodeHostname
    ctld_port: int = 6817
    node_ports: tuple[int, ...] = (6818, 6819)
    scratch_mount: str = "/scratch"
    cred_expire_s: int = 15

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= 8:
            raise ValueError(f"num_nodes must be 1..8, got {self.num_nodes}")
        if len(self.node_ports) != self.num_nodes:
            raise ValueError(
                f"need one port per node: {self.num_nodes} nodes, ports {self.node_ports}"
            )

    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.num_nodes + 1)]

    @property
    def conf_path(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def shared_dir(self) -> Path:
        """The "shared filesystem": a plain directory every node (and the test) sees."""
        return self.root / "shared"

    @property
    def hosts_file(self) -> Path:
        """Bind-mounted over ``/etc/hosts`` in every node: node names resolve to loopback."""
        return self.root / "etc" / "hosts"

    def scratch_store(self, node: str) -> Path:
        """The host-side directory bind-mounted as ``/scratch`` inside ``node`` only."""
        return self.root / "scratch-store" / node

    def fake_gpu(self, index: int) -> Path:
        return self.root / "fakegpu" / f"gpu{index}"

    def log_path(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"


def render_slurm_conf(layout: ClusterLayout) -> str:
    """A minimal, cgroup-free ``slurm.conf`` (facts in the project's LOCAL-CLUSTER notes)."""
    r = layout.root
    lines = [
        "ClusterName=stagertest",
        f"SlurmctldHost={layout.host_name}(127.0.0.1)",
        f"SlurmctldPort={layout.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # Our own munged on its own socket: never touches (or needs) a system munged.
        # cred_expire also sets how long a requeued job waits before it may start again
        # (default 120 s); starting it earlier is refused ("Job credential revoked").
        f"AuthInfo=socket={layout.munge_socket},cred_expire={layout.cred_expire_s}",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Nodes declare more CPUs than the machine has; without this slurmd would drain them.
        "SlurmdParameters=config_overrides",
        "GresTypes=gpu",
        "ReturnToService=2",
        "JobRequeue=1",
        f"StateSaveLocation={r}/state",
        f"SlurmdSpoolDir={r}/spool/%n",
        f"SlurmctldPidFile={r}/run/slurmctld.pid",
        f"SlurmdPidFile={r}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={layout.log_path('slurmctld')}",
        f"SlurmdLogFile={r}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "KillWait=5",
        "MessageTimeout=10",
        "InactiveLimit=0",
        "MinJobAge=300",
        # Tests submit, signal and requeue quickly; schedule as soon as something changes.
        "SchedulerParameters=sched_min_interval=0",
    ]
    for name, port in zip(layout.node_names, layout.node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeHostname={layout.host_name} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={layout.cpus_per_node} RealMemory={layout.real_memory_mb} "
            f"Gres=gpu:{layout.gpus_per_node} State=UNKNOWN"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_gres_conf(layout: ClusterLayout) -> str:
    """Fake GPUs: slurmd only needs the files to exist (it logs that they are not devices)."""
    last = layout.gpus_per_node - 1
    files = f"{layout.root}/fakegpu/gpu[0-{last}]" if last > 0 else str(layout.fake_gpu(0))
    return f"Name=gpu File={files}\n"


def render_hosts(layout: ClusterLayout, host_hosts: str) -> str:
    """The host's ``/etc/hosts`` plus every node name on loopback.

    Jobs resolve ``MASTER_ADDR`` (the first node's name) and gloo resolves the node's own host
    name, as on a real cluster; on one machine every node is 127.0.0.1.
    """
    extra = "127.0.0.1 " + " ".join(layout.node_names)
    return host_hosts.rstrip("\n") + "\n" + extra + "\n"
