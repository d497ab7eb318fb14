"""stage-in --fanout with real processes: 2-3 simulated nodes on loopback, a real gloo group.

Bytes read from the source are counted independently of stage-in's own report: each node
process gets a ``sitecustomize.py`` (on PYTHONPATH) that registers a ``countfile://`` fsspec
protocol, a local filesystem whose file objects append every read's byte count to a log file.
The source is given as ``countfile:///...``, so every source byte passes through the counter.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from stager.errors import EXIT_FULL, EXIT_INTEGRITY
from stager.layout import StagedDataset
from stager.shards.build import build_manifest, write_manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.stagein.journal import Journal
from stager.storage.sources import resolve_source

from .conftest import BIN, clean_env, mount_tmpfs

SITECUSTOMIZE = """
import os
import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

_LOG = os.environ["FANOUT_TEST_COUNT_LOG"]


def _count(n):
    if n:
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\\n" % n)  # O_APPEND: whole lines even with several writers
        finally:
            os.close(fd)


class CountingOpener(LocalFileOpener):
    def read(self, *args, **kwargs):
        data = super().read(*args, **kwargs)
        _count(len(data))
        return data

    def readinto(self, buf):
        n = self.f.readinto(buf)
        _count(n or 0)
        return n


class CountingFileSystem(LocalFileSystem):
    protocol = ("countfile",)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)


fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)

if os.environ.get("FANOUT_TEST_FILL_BEFORE_MANIFEST"):
    # Another writer takes the last byte of scratch just as the staged manifest is written.
    import errno
    from stager.shards import manifest as _manifest

    _write = _manifest.Manifest.write

    def _fill_then_write(self, path):
        job = os.path.dirname(os.path.dirname(os.path.dirname(str(path))))
        with open(os.path.join(job, "filler"), "ab") as f:
            for size in (65536, 4096, 1):
                try:
                    while True:
                        f.write(b"x" * size)
                        f.flush()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        return _write(self, path)

    _manifest.Manifest.write = _fill_then_write
"""


@pytest.fixture(scope="module")
def fanout_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 uneven shards, ~1.3 MB: several per node and several 256 KiB chunks per shard."""
    src = tmp_path_factory.mktemp("fanout-src") / "ds"
    write_synthetic_dataset(
        src,
        SyntheticSpec(num_shards=9, samples_per_shard=24, image_bytes=6000, uneven=True, seed=5),
    )
    return src


def _shards(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.tar") if ".stager" not in p.parts)


def _assert_identical(src: Path, staged: Path) -> None:
    assert _shards(staged) == _shards(src)
    for rel in _shards(src):
        assert filecmp.cmp(src / rel, staged / rel, shallow=False), rel
    assert not list(staged.rglob("*.partial"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """N stage-in processes that see themselves as the nodes of one Slurm job on loopback."""

    def __init__(self, tmp: Path, num_nodes: int):
        self.tmp, self.num_nodes = tmp, num_nodes
        (tmp / "site").mkdir(exist_ok=True)
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.count_log = tmp / "source-reads.log"
        self.runs = 0

    def dest(self, rank: int) -> Path:
        return self.tmp / f"scratch-node{rank}"

    def report(self, rank: int) -> dict:
        return json.loads((self.tmp / f"report-{self.runs}-{rank}.json").read_text())

    def start(
        self,
        src: Path,
        *extra: str,
        ranks: list[int] | None = None,
        timeout_s: float = 60,
        port: int | None = None,
        sources: dict[int, Path] | None = None,
        job_id: str = "4711",
        **env_extra: str,
    ) -> dict[int, subprocess.Popen]:
        """``port``: the rendezvous port (to start ranks in several calls); ``sources``: a
        source of its own for some ranks."""
        self.runs += 1
        self.count_log.write_text("")
        port = port or _free_port()
        procs = {}
        for rank in range(self.num_nodes) if ranks is None else ranks:
            env = clean_env(
                SLURM_JOB_ID=job_id,
                SLURM_NODEID=str(rank),
                SLURM_JOB_NUM_NODES=str(self.num_nodes),
                SLURM_JOB_NODELIST="localhost",
                SLURMD_NODENAME=f"node{rank}",
                STAGER_FANOUT_PORT=str(port),
                PYTHONPATH=str(self.tmp / "site"),
                FANOUT_TEST_COUNT_LOG=str(self.count_log),
                **env_extra,
            )
            argv = [
                str(BIN / "stage-in"),
                f"countfile://{(sources or {}).get(rank, src)}",
                "--fanout",
                "--dest",
                str(self.dest(rank)),
                "--quiet",
                "--report",
                str(self.tmp / f"report-{self.runs}-{rank}.json"),
                "--fanout-timeout",
                str(timeout_s),
                *extra,
            ]
            procs[rank] = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        return procs

    def source_bytes_read(self) -> int:
        return sum(int(line) for line in self.count_log.read_text().split())


def _finish(procs: dict[int, subprocess.Popen], timeout: float = 120) -> dict[int, tuple[int, str]]:
    out = {}
    try:
        for rank, proc in procs.items():
            _, err = proc.communicate(timeout=timeout)
            out[rank] = (proc.returncode, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def _total(src: Path) -> int:
    return sum((src / rel).stat().st_size for rel in _shards(src))


def test_three_nodes_read_the_source_once_and_end_identical(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    nodes = Nodes(tmp_path, 3)
    # 64 KiB chunks: several per shard, so multi-chunk broadcasts are exercised.
    results = _finish(
        nodes.start(fanout_dataset, "--fanout-op-timeout", "60", "--fanout-chunk-kib", "64")
    )
    for rank, (code, err) in results.items():
        assert code == 0, (rank, err)
        assert "fan-out on" in err and "warning" not in err, err
    total = _total(fanout_dataset)
    assert nodes.source_bytes_read() == total  # counted by the filesystem, not by us
    reports = [nodes.report(r) for r in range(3)]
    assert sum(r["bytes_read_source"] for r in reports) == total
    for rank, report in enumerate(reports):
        _assert_identical(fanout_dataset, nodes.dest(rank) / "ds")
        assert report["fanout"] == "on" and report["files_copied"] == 9
        assert report["bytes_read_source"] + report["bytes_received_peers"] == total
        assert 0 < report["bytes_read_source"] < total  # every node did a part
    # Rerun: every node already has everything; nothing is read, nothing is sent.
    results = _finish(nodes.start(fanout_dataset))
    assert all(code == 0 for code, _ in results.values()), results
    assert nodes.source_bytes_read() == 0
    for rank in range(3):
        report = nodes.report(rank)
        assert (
            report["files_skipped"],
            report["bytes_read_source"],
            report["bytes_received_peers"],
        ) == (9, 0, 0)


def test_killed_node_fails_its_peers_and_a_rerun_resumes(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    nodes = Nodes(tmp_path, 2)
    # ~0.1 MB/s per node stretches the exchange to several seconds, so the kill lands mid-way.
    procs = nodes.start(fanout_dataset, "--bw-limit", "0.1", "--fanout-op-timeout", "60")
    victim = nodes.dest(1) / "ds"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (not victim.exists() or len(_shards(victim)) < 2):
        assert procs[0].poll() is None and procs[1].poll() is None, _finish(procs)
        time.sleep(0.05)
    staged_before_kill = len(_shards(victim))
    assert 2 <= staged_before_kill < 9, "the kill must land mid-fan-out"
    procs[1].send_signal(signal.SIGKILL)
    results = _finish(procs)
    code, err = results[0]
    assert code == 10, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "fan-out failed" in lines[0] and "rerun" in lines[0], err
    read_first = nodes.source_bytes_read()
    # Each shard published before the kill was journaled with its source version right after
    # its rename (a kill between the two costs that one shard a copy, never trust).
    journaled = [
        len(Journal(StagedDataset.of(nodes.dest(r) / "ds").journal_path).read()) for r in range(2)
    ]
    assert journaled[1] >= staged_before_kill - 1 and journaled[0] >= 1
    # The rerun keeps every journaled shard of both nodes and reads only what nobody has.
    results = _finish(nodes.start(fanout_dataset))
    assert all(code == 0 for code, _ in results.values()), results
    total = _total(fanout_dataset)
    kept = [nodes.report(r)["files_skipped"] for r in range(2)]
    assert all(k >= j for k, j in zip(kept, journaled, strict=True)), (kept, journaled)
    assert nodes.source_bytes_read() < total
    assert nodes.source_bytes_read() + read_first >= total
    for rank in range(2):
        _assert_identical(fanout_dataset, nodes.dest(rank) / "ds")


def test_group_that_cannot_form_falls_back_with_one_warning(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    nodes = Nodes(tmp_path, 2)
    # Node 1 starts alone: the rendezvous host never answers, so it copies everything itself.
    results = _finish(nodes.start(fanout_dataset, ranks=[1], timeout_s=2))
    code, err = results[1]
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "falling back to plain per-node copying" in warnings[0], err
    assert "c10d" not in err and "socket.cpp" not in err, err  # (torch's C++ log: kept out)
    assert nodes.report(1)["fanout"] == "fallback"
    assert nodes.source_bytes_read() == _total(fanout_dataset)
    _assert_identical(fanout_dataset, nodes.dest(1) / "ds")


# -- fan-out ends exactly as plain stage-in does (one shared ending) ----------------------------
def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


def test_a_shard_that_differs_from_the_manifest_exits_4_on_every_node(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src" / "ds"
    shutil.copytree(fanout_dataset, src)
    write_manifest(build_manifest(resolve_source(str(src))), str(src / "stager-manifest.json"))
    victim = sorted(src.glob("*.tar"))[4]
    data = bytearray(victim.read_bytes())
    data[-2000] ^= 0xFF  # same size, other bytes: only the hash can tell
    victim.write_bytes(bytes(data))
    nodes = Nodes(tmp_path, 2)
    results = _finish(nodes.start(src, "--fanout-op-timeout", "60"))
    for rank, (code, err) in results.items():
        assert code == EXIT_INTEGRITY, (rank, err)
        assert len(_error_lines(err)) == 1, err
        failed = [line for line in err.splitlines() if line.startswith("FAILED")]
        assert len(failed) == 1 and failed[0].count(victim.name) == 1, err  # (named once)
        staged = nodes.dest(rank) / "ds"
        assert not (staged / victim.name).exists() and not list(staged.rglob("*.partial"))


def test_scratch_filling_up_while_the_manifest_is_written_is_one_line_and_exit_6(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    with mount_tmpfs(tmp_path / "tmpfs", "8m") as scratch:
        nodes = Nodes(tmp_path, 2)
        nodes.dest = lambda rank: scratch / f"node{rank}" / "job"  # type: ignore[method-assign]
        results = _finish(
            nodes.start(
                fanout_dataset, "--fanout-op-timeout", "60", FANOUT_TEST_FILL_BEFORE_MANIFEST="1"
            )
        )
        for rank, (code, err) in results.items():
            assert code == EXIT_FULL, (rank, err)
            lines = _error_lines(err)
            assert len(lines) == 1 and "no space left" in lines[0], err
            assert not list(nodes.dest(rank).rglob("*.partial"))


def test_fanout_writes_the_loader_index_so_the_first_loader_walks_no_tar_header(
    fanout_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stager.shards import tarindex
    from stager_loaders import LoaderOptions, ShardedLoader

    nodes = Nodes(tmp_path, 2)
    results = _finish(nodes.start(fanout_dataset, "--fanout-op-timeout", "60"))
    assert all(code == 0 for code, _ in results.values()), results
    for rank in range(2):
        staged = nodes.dest(rank) / "ds"
        assert any(StagedDataset.of(staged).index_dir.iterdir())

        def no_walk(*args: object, **kwargs: object) -> None:
            raise AssertionError("the loader walked a tar header: no index from stage-in")

        monkeypatch.setattr(tarindex, "index_tar", no_walk)
        monkeypatch.setattr(tarindex, "count_samples", no_walk)
        loader = ShardedLoader(
            str(staged), batch_size=8, to_tuple=("__key__",), options=LoaderOptions()
        )
        assert sum(len(b) for (b,) in loader) == sum(
            SyntheticSpec(num_shards=9, samples_per_shard=24, uneven=True, seed=5).shard_sizes()
        )


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_nodes_that_list_other_versions_or_sources_or_chunks_stop_every_node(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    """The handshake compared shard names and sizes only. A node that listed the source before
    a same-size rewrite, holding a copy of the old bytes, sent them to a node that listed the
    new version, which recorded them as that version: old bytes trusted on every node, kept by
    every rerun. Nodes given different sources, or different chunk sizes, mixed datasets or
    crashed. Each now stops every node (exit 10), and a rerun stages the current bytes."""
    src = tmp_path / "src" / "ds"
    shutil.copytree(fanout_dataset, src)
    nodes = Nodes(tmp_path, 2)
    assert all(code == 0 for code, _ in _finish(nodes.start(src)).values())
    victim = sorted(src.glob("*.tar"))[0]
    other = sorted(src.glob("*.tar"))[1]
    port = _free_port()
    first = nodes.start(src, ranks=[0], port=port)  # lists the old bytes, holds a copy of them
    deadline = time.monotonic() + 60
    while not _listening(port):  # (node 0 listens once its listing is done)
        assert first[0].poll() is None and time.monotonic() < deadline, _finish(first)
        time.sleep(0.05)
    rewritten = bytearray(victim.read_bytes())
    rewritten[-4096] ^= 0xFF  # (in the end-of-archive padding: still a tar, same size)
    victim.write_bytes(bytes(rewritten))
    second = nodes.start(src, ranks=[1], port=port)  # lists the new version
    results = _finish({**first, **second})
    for rank, (code, err) in results.items():
        assert code == 10, (rank, err)
        assert "nodes listed different shards" in _error_lines(err)[0], err
    results = _finish(nodes.start(src))
    assert all(code == 0 for code, _ in results.values()), results
    for rank in range(2):
        _assert_identical(src, nodes.dest(rank) / "ds")

    elsewhere = tmp_path / "elsewhere" / "ds"  # the same names and sizes, other bytes
    shutil.copytree(src, elsewhere)
    (elsewhere / victim.name).write_bytes(other.read_bytes()[: victim.stat().st_size])
    (tmp_path / "fresh").mkdir()
    fresh = Nodes(tmp_path / "fresh", 2)  # (scratch holding nothing yet)
    results = _finish(fresh.start(src, sources={1: elsewhere}))
    assert [code for code, _ in results.values()] == [10, 10], results
    chunks = _finish(
        {
            **fresh.start(src, "--fanout-chunk-kib", "64", ranks=[0], port=(port := _free_port())),
            **fresh.start(src, "--fanout-chunk-kib", "128", ranks=[1], port=port),
        }
    )
    for code, err in chunks.values():
        assert code == 10 and "different --fanout-chunk-kib (node-0: 64, node-1: 128)" in err, err


def test_a_node_of_another_job_on_the_same_port_does_not_join_its_group(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    """Ports come from job ids, and two jobs' can collide: a node of job B that reached job A's
    rendezvous was paired with A's peers and hung in gloo's connect past every timeout. Keyed
    by job and dataset, it finds no peer of its own there and falls back; A is undisturbed."""
    nodes = Nodes(tmp_path, 2)
    port = _free_port()
    job_a = nodes.start(fanout_dataset, "--bw-limit", "0.2", port=port)  # (a few seconds long)
    deadline = time.monotonic() + 60
    while not _listening(port):
        assert time.monotonic() < deadline, _finish(job_a)
        time.sleep(0.05)
    (tmp_path / "b").mkdir()
    other = Nodes(tmp_path / "b", 2)
    job_b = other.start(fanout_dataset, ranks=[1], port=port, timeout_s=3, job_id="4712")
    code, err = _finish(job_b)[1]
    assert code == 0 and "falling back to plain per-node copying" in err, err
    _assert_identical(fanout_dataset, other.dest(1) / "ds")
    for rank, (code, err) in _finish(job_a).items():
        assert code == 0 and "fan-out on" in err, (rank, err)
        _assert_identical(fanout_dataset, nodes.dest(rank) / "ds")


def test_an_owner_whose_own_scratch_fails_leaves_the_shard_to_the_others_to_read(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    """node1's scratch has a directory where each shard would land: its copies fail there,
    on its side only. The shards it owned failed on every healthy node too, as if the source
    had ("its owner could not read it", exit 3); node0 now reads them from the source itself."""
    nodes = Nodes(tmp_path, 2)
    for shard in _shards(fanout_dataset):
        (nodes.dest(1) / "ds" / shard / "in-the-way").mkdir(parents=True)
    results = _finish(nodes.start(fanout_dataset))
    code, err = results[0]
    assert code == 0, (err, results[1])
    _assert_identical(fanout_dataset, nodes.dest(0) / "ds")
    code, err = results[1]  # (its own scratch: exit 5, one line, no traceback; it crashed)
    assert code == 5 and "in scratch: a directory has that name" in _error_lines(err)[0], err
    assert nodes.source_bytes_read() >= _total(fanout_dataset)  # (each of node1's, by node0)


def test_a_node_that_fails_before_the_exchange_stops_every_node_at_once(
    fanout_dataset: Path, tmp_path: Path
) -> None:
    """node1 fails before the exchange: its source is missing, its scratch is a file, its
    scratch is too small. It never joined the group, so node0 waited --fanout-timeout for it,
    then read the whole dataset from the source itself (the load a fan-out keeps off NFS),
    while the step failed on node1 anyway. node1 now says so in the handshake: node0 stops
    (exit 10, one line naming node1) and reads nothing; node1 exits with its own error."""
    failed = "failed before the exchange, so nobody copied anything; see their error line, fix "
    failed += "what it says, and rerun"
    full = "lack scratch space for the dataset, so nobody copied anything; see their error line, "
    full += "free space there or pass --dest, and rerun"
    cases = {
        "source": (3, "source not found", failed),
        "scratch": (5, "scratch-node1", failed),
        "space": (6, "not enough", full),
    }
    with mount_tmpfs(tmp_path / "tmpfs", "1m") as small:
        for case, (code1, says1, says0) in cases.items():
            (tmp_path / case).mkdir()
            nodes = Nodes(tmp_path / case, 2)
            sources = {1: tmp_path / "missing" / "ds"} if case == "source" else None
            if case == "scratch":
                nodes.dest(1).write_text("a file where node1's scratch should be")
            if case == "space":
                nodes.dest = lambda rank, n=nodes: small if rank else n.tmp / "scratch"  # type: ignore[method-assign]
            results = _finish(nodes.start(fanout_dataset, sources=sources, timeout_s=30))
            code, err = results[1]
            assert code == code1 and says1 in _error_lines(err)[0], (case, err)
            code, err = results[0]
            assert code == 10, (case, err)
            assert _error_lines(err) == [f"stage-in: error: node(s) node-1 {says0}"], (case, err)
            assert "falling back" not in err, (case, err)
            assert nodes.source_bytes_read() == 0, case
