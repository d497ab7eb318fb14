"""A real Slurm cluster on this one machine, for the ``slurm`` test tier.

munged, slurmctld and N slurmd "nodes" run as our own child processes, everything (config,
state, logs, keys, scratch stores, the shared directory) under one fresh temp directory and on
free loopback ports, so two test runs (or a crashed earlier one) never collide. Each slurmd
runs in its own UTS + mount namespace: its own host name, its own ``/scratch`` (a bind mount of
a per-node store) and an ``/etc/hosts`` where every node name resolves to 127.0.0.1, so job
scripts written for a real cluster (``/scratch/$SLURM_JOB_ID``, ``MASTER_ADDR`` = first node)
run unmodified. Nothing is mounted on the host; the namespaces and their mounts vanish with
their last process.

Teardown is by PID: jobs are cancelled, then every process inside a node's mount namespace
(slurmd, slurmstepd, tasks) is killed, then slurmctld and munged. A run whose owner died
without tearing down is reaped by the next :meth:`SlurmCluster.start` (daemons matched by the
cluster root in their command line, so PID reuse cannot hit a stranger).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .config import ClusterLayout, render_gres_conf, render_hosts, render_slurm_conf
from .procs import (
    ROOT_PREFIX,
    cmdline,
    free_ports,
    kill_all,
    mnt_ns,
    pids_in_namespaces,
    reap_stale,
)

__all__ = [
    "SlurmCluster",
    "cannot_run_reason",
    "JobTimeout",
    "TERMINAL_STATES",
    "ROOT_PREFIX",
    "reap_stale",
]

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)
_VENV_BIN = Path(sys.executable).parent


class JobTimeout(AssertionError):
    """A job did not reach the wanted state in time; carries the job record and its output."""


def cannot_run_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the Slurm test cluster needs Linux namespaces"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (daemons, mount namespaces); run the tier as root"
    for tool in ("unshare", "munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not found; install Slurm and munge: `scripts/setup.sh --test` (Debian)"
    probe = subprocess.run(
        ["unshare", "--uts", "--mount", "--", "true"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        return f"cannot create UTS + mount namespaces (unshare: {probe.stderr.strip()[:200]})"
    return None


def _which(tool: str) -> str:
    found = shutil.which(tool)
    if found:
        return found
    return str(Path("/usr/sbin", tool))


class SlurmCluster:
    """One running test cluster. Use as a context manager, or ``start()`` / ``stop()``.

    ``env()`` gives the environment for client commands and job submission: ``SLURM_CONF``
    set, no variables of an enclosing job, and the venv's ``bin`` first on ``PATH``; sbatch
    exports it to the job (``--export=ALL`` is the default), so the project's console scripts
    run in jobs.
    """

    def __init__(
        self,
        num_nodes: int = 2,
        *,
        gpus_per_node: int = 4,
        cpus_per_node: int = 16,
        base: Path | None = None,
    ):
        if not 2 <= num_nodes <= 4:
            raise ValueError(f"the test cluster has 2-4 nodes, got {num_nodes}")
        self._num_nodes = num_nodes
        self._gpus_per_node = gpus_per_node
        self._cpus_per_node = cpus_per_node
        self._base = base
        self.layout: ClusterLayout | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._mnt_ns: list[str] = []

    # ----------------------------------------------------------------- start
    def start(self, *, timeout_s: float = 60) -> SlurmCluster:
        reap_stale(self._base)
        root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=self._base))
        os.chmod(root, 0o755)
        ports = free_ports(self._num_nodes + 1)
        self.layout = ClusterLayout(
            root=root,
            num_nodes=self._num_nodes,
            cpus_per_node=self._cpus_per_node,
            gpus_per_node=self._gpus_per_node,
            host_name=socket.gethostname().split(".")[0],
            ctld_port=ports[0],
            node_ports=tuple(ports[1:]),
        )
        try:
            self._write_files()
            self._start_munged(timeout_s)
            self._start_slurmctld(timeout_s)
            for node in self.layout.node_names:
                self._start_slurmd(node)
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_owner(self) -> None:
        assert self.layout is not None
        payload = {
            "pid": os.getpid(),
            "pids": [p.pid for p in self._procs.values()],
            "mnt_ns": self._mnt_ns,
        }
        tmp = self.layout.root / "owner.json.partial"
        tmp.write_text(json.dumps(payload))
        tmp.replace(self.layout.root / "owner.json")

    def _write_files(self) -> None:
        layout = self.layout
        assert layout is not None
        for sub in ("etc", "state", "run", "log", "munge", "fakegpu", "shared"):
            (layout.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(layout.root / "munge", 0o700)
        os.chmod(layout.shared_dir, 0o777)
        for node in layout.node_names:
            (layout.root / "spool" / node).mkdir(parents=True, exist_ok=True)
            layout.scratch_store(node).mkdir(parents=True, exist_ok=True)
            os.chmod(layout.scratch_store(node), 0o1777)  # like a real /scratch
        for i in range(layout.gpus_per_node):
            layout.fake_gpu(i).touch()
        layout.conf_path.write_text(render_slurm_conf(layout))
        (layout.conf_path.parent / "gres.conf").write_text(render_gres_conf(layout))
        layout.hosts_file.write_text(render_hosts(layout, Path("/etc/hosts").read_text()))
        key = layout.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        # The mount point every node's private scratch is bound onto; harmless on the host.
        Path(layout.scratch_mount).mkdir(parents=True, exist_ok=True)
        self._write_owner()

    def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        assert self.layout is not None
        log = open(self.layout.log_path(f"{name}.stdio"), "ab")  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(
                list(argv),
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self._procs[name] = proc
        self._write_owner()
        return proc

    def _start_munged(self, timeout_s: float) -> None:
        layout = self.layout
        assert layout is not None
        m = layout.root / "munge"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={layout.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={layout.log_path('munged')}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )

        def ready() -> bool:
            cred = subprocess.run(
                ["munge", "-n", "-S", str(layout.munge_socket)], capture_output=True, timeout=10
            )
            if cred.returncode != 0:
                return False
            check = subprocess.run(
                ["unmunge", "-S", str(layout.munge_socket)],
                input=cred.stdout,
                capture_output=True,
                timeout=10,
            )
            return check.returncode == 0

        self._wait(ready, timeout_s, "munged to answer", "munged")

    def _start_slurmctld(self, timeout_s: float) -> None:
        assert self.layout is not None
        self._spawn(
            "slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.layout.conf_path)]
        )

        def ready() -> bool:
            out = self.run(["scontrol", "ping"], check=False, timeout=15)
            return " UP" in out.stdout

        self._wait(ready, timeout_s, "slurmctld to answer `scontrol ping`", "slurmctld")

    def _start_slurmd(self, node: str) -> None:
        layout = self.layout
        assert layout is not None
        script = (
            'hostname "$1" && mount --bind "$2" "$3" && mount --bind "$4" /etc/hosts '
            '&& exec "$5" -D -f "$6" -N "$1"'
        )
        proc = self._spawn(
            f"slurmd-{node}",
            [
                _which("unshare"),
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                "-c",
                script,
                "sh",
                node,
                str(layout.scratch_store(node)),
                layout.scratch_mount,
                str(layout.hosts_file),
                _which("slurmd"),
                str(layout.conf_path),
            ],
        )
        host_ns = mnt_ns(os.getpid())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ns = mnt_ns(proc.pid)
            if ns is not None and ns != host_ns and "slurmd" in cmdline(proc.pid):
                self._mnt_ns.append(ns)
                self._write_owner()
                return
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(
            f"slurmd for {node} did not start in its namespace; "
            f"see {layout.log_path(f'slurmd-{node}.stdio')}"
        )

    def _wait_idle(self, timeout_s: float) -> None:
        assert self.layout is not None
        want = set(self.layout.node_names)

        def ready() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
            states = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
            return want <= set(states) and all(states[n].strip() == "idle" for n in want)

        self._wait(ready, timeout_s, "every node to be idle in sinfo", "slurmd")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, daemon: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}; "
                        + self._tail(name)
                    )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"timed out after {timeout_s:.0f} s waiting for {what}; {self._tail(daemon)}"
        )

    def _tail(self, name: str) -> str:
        assert self.layout is not None
        texts = []
        for path in sorted(self.layout.root.joinpath("log").glob(f"{name}*")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            texts.append(f"--- {path}:\n" + "\n".join(lines))
        return "\n".join(texts) or "(no log)"

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cancel jobs, then kill nodes (with everything in them), slurmctld and munged by PID."""
        if self.layout is None:
            return
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self.run(["scancel", "--full", "--quiet", "--user", "root"], check=False, timeout=15)
        in_nodes = pids_in_namespaces(self._mnt_ns)
        slurmds = [p.pid for n, p in self._procs.items() if n.startswith("slurmd-")]
        # slurmd first (exits in ~0.1 s when slurmctld is still up), then whatever it left.
        kill_all(slurmds, grace_s=5)
        kill_all(sorted(set(in_nodes) | set(pids_in_namespaces(self._mnt_ns))), grace_s=3)
        for name in ("slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is not None:
                kill_all([proc.pid], grace_s=15)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if os.environ.get("STAGER_TEST_KEEP_CLUSTER"):
            print(f"test cluster kept for inspection: {self.layout.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.layout.root, ignore_errors=True)
        self._procs.clear()
        self._mnt_ns.clear()
        self.layout = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------- clients
    @property
    def node_names(self) -> list[str]:
        assert self.layout is not None
        return self.layout.node_names

    @property
    def shared_dir(self) -> Path:
        assert self.layout is not None
        return self.layout.shared_dir

    def scratch(self, node: str) -> Path:
        """``node``'s private ``/scratch``, seen from the host (the test)."""
        assert self.layout is not None
        return self.layout.scratch_store(node)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for clients and jobs: no enclosing job's variables, venv bin on PATH."""
        assert self.layout is not None
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "STAGER_", "SBATCH_", "SRUN_"))
        }
        env["PATH"] = f"{_VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env["SLURM_CONF"] = str(self.layout.conf_path)
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 120,
        env: Mapping[str, str] | None = None,
        **kw,
    ) -> subprocess.CompletedProcess:
        """Run a client command (``srun``, ``sbatch``, ...) against this cluster."""
        result = subprocess.run(
            list(argv), env=self.env(env), capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def sbatch(self, script: str | Path, *args: str, env: Mapping[str, str] | None = None) -> str:
        """Submit ``script`` (extra sbatch ``args`` first) and return the job id."""
        out = self.run(["sbatch", "--parsable", *args, str(script)], env=env)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        record: dict[str, str] = {}
        for token in out.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in record:
                record[key] = value
        return record

    def wait_job(
        self,
        job_id: str,
        *,
        timeout_s: float = 120,
        until: Callable[[dict[str, str]], bool] | None = None,
        output: Path | None = None,
    ) -> dict[str, str]:
        """Poll until ``until(record)`` (default: a terminal state); JobTimeout otherwise."""
        until = until or (lambda rec: rec.get("JobState") in TERMINAL_STATES)
        deadline = time.monotonic() + timeout_s
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record and until(record):
                return record
            time.sleep(0.25)
        text = (
            output.read_text(errors="replace")[-4000:]
            if output is not None and output.exists()
            else ""
        )
        raise JobTimeout(
            f"job {job_id} not done after {timeout_s:.0f} s: {record}\noutput:\n{text}"
        )
