"""Node subsets and the settings of a real gloo group of two ranks on two "nodes".

Under ``stage-in --subset node`` each node holds other shards. The state rank 0 saves (the
templates and examples save rank 0's only) was refused by every other node's ranks: its
fingerprint was node 0's shards, so a requeued multi-node job could not resume. And ranks given
different epoch settings (``seed=base + rank``, another batch size) planned epochs that did not
line up, without a word: samples read twice or never, or a DDP hang.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .conftest import BIN, clean_env
from .test_loader_ddp import WORLD, run_world

SPEC = SyntheticSpec(num_shards=4, samples_per_shard=9, seed=12, image_bytes=64, uneven=True)


def rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank on node ``rank``: read two batches, save, then resume from rank 0's state."""
    import torch.distributed as dist

    from stager_loaders import LoaderOptions, ShardedLoader

    dist.init_process_group(
        "gloo",
        init_method=f"file://{job['out']}/rendezvous",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),  # (a collective one rank never joins: an error)
    )
    out: dict[str, Any] = {}
    try:
        options = LoaderOptions(dest=job["dests"][rank], ranks_per_node=1)
        if job.get("solo"):  # a validation pass on rank 0 alone, as docs/loader.md shows
            if rank == 0:
                solo = LoaderOptions(dest=job["dests"][0], ranks_per_node=1, rank=0, world_size=1)
                alone = ShardedLoader(
                    job["source"], batch_size=2, to_tuple=("__key__",), options=solo
                )
                out["solo"] = [k for (b,) in alone for k in b]
            dist.barrier()
            Path(job["out"], f"rank{rank}.json").write_text(json.dumps(out))
            return

        def loader(seed: int = 0, batch_size: int = 2) -> ShardedLoader:
            return ShardedLoader(
                job["source"],
                batch_size=batch_size,
                seed=seed,
                to_tuple=("__key__",),
                options=options,
            )

        try:
            first = loader(**job.get("settings", [{}, {}])[rank])
            first.set_epoch(0)
            batches = iter(first)
            out["read"] = [k for _ in range(2) for k in next(batches)[0]]
            Path(job["out"], f"state{rank}.json").write_text(json.dumps(first.state_dict()))
            out["rest"] = [k for (b,) in batches for k in b]
            dist.barrier()
            resumed = loader()
            resumed.load_state_dict(json.loads(Path(job["out"], "state0.json").read_text()))
            out["resumed"] = [k for (b,) in resumed for k in b]
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out = {"error": type(exc).__name__, "message": str(exc)}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(out))


def _staged_per_node(tmp_path: Path, subsets: tuple[str, ...] = ("node", "node")) -> dict[str, Any]:
    """The dataset staged with --subset node on two simulated nodes, each its own scratch."""
    source = tmp_path / "nfs" / "ds"
    write_synthetic_dataset(source, SPEC)
    dests = []
    for node, subset in enumerate(subsets):
        dest = tmp_path / f"node{node}"
        env = clean_env() | {"SLURM_JOB_ID": "77", "SLURM_NNODES": str(WORLD)}
        subprocess.run(
            [str(BIN / "stage-in"), str(source), "--dest", str(dest), "--subset", subset]
            + ["--quiet", "--jitter-max", "0"],
            env=env | {"SLURM_NODEID": str(node)},
            check=True,
        )
        dests.append(str(dest))
    return {"source": str(source), "dests": dests, "out": str(tmp_path / "out"), "phase": "x"}


def test_rank_0s_state_resumes_every_node_under_node_subsets(tmp_path: Path) -> None:
    ranks = run_world(_staged_per_node(tmp_path), module="tests.test_loader_node_subsets")
    assert all("error" not in r for r in ranks), ranks
    for rank in ranks:
        assert rank["resumed"] == rank["rest"]  # exactly where it stopped, on its own shards
    on_node = [set(r["read"] + r["rest"]) for r in ranks]
    assert not on_node[0] & on_node[1]  # (each node its own shards)
    assert len(on_node[0]) != len(on_node[1])  # (shares of other sizes: uneven shards)


def test_ranks_given_different_settings_all_raise(tmp_path: Path) -> None:
    job = _staged_per_node(tmp_path)
    for settings in ([{"seed": 0}, {"seed": 1}], [{"batch_size": 2}, {"batch_size": 3}]):
        job["out"] = str(tmp_path / f"out{len(list(tmp_path.glob('out*')))}")
        ranks = run_world({**job, "settings": settings}, module="tests.test_loader_node_subsets")
        for rank in ranks:
            assert rank.get("error") == "UsageError", ranks
            assert "ranks were given different loader settings" in rank["message"]


def test_ranks_reading_copies_of_other_subsets_raise_together_not_wait(tmp_path: Path) -> None:
    """Rank 0 reads a --subset node copy, rank 1 a --subset all one: their first collectives
    had other shapes, and both waited in them until the group's timeout."""
    job = _staged_per_node(tmp_path, ("node", "all"))
    ranks = run_world(job, module="tests.test_loader_node_subsets")
    for rank in ranks:
        assert rank.get("error") == "UsageError", ranks
        assert "ranks were given different loader settings" in rank["message"]


def test_a_loader_of_rank_0_alone_enters_no_collective_under_node_subsets(tmp_path: Path) -> None:
    """A validation loader on rank 0 alone (rank=0, world_size=1) all-reduced its epoch length
    with a group whose other ranks never joined (they waited in a barrier)."""
    job = _staged_per_node(tmp_path) | {"solo": True}
    ranks = run_world(job, module="tests.test_loader_node_subsets")
    assert "error" not in ranks[0] and len(ranks[0]["solo"]) > 0, ranks
