"""A real DDP world: 2 processes in a gloo group, 2 DataLoader workers each, uneven shards.

The ranks run ``rank_main`` in fresh interpreters (subprocesses) and write what
they saw to JSON; the assertions run in the test process. test_resume.py reuses ``run_world``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stager.shards.synth import SyntheticSpec, sample_key
from stager.slurm import SlurmEnv
from stager.stagein.run import StageInOptions, stage_in
from stager.storage.sources import resolve_source

from .conftest import REPO, clean_env

WORLD = 2
WORKERS = 2
BATCH = 8
STOP_AFTER = (1, 3, 8)  # 1 and 3 stop while batches are still buffered in the 2 workers
MODES = ("staged", "stream")


def _make(job: dict[str, Any], mode: str, even: str) -> Any:
    from stager_loaders import LoaderOptions, ShardedLoader

    options = LoaderOptions(dest=job["dest"], force_streaming=mode == "stream", buffer_samples=40)
    return ShardedLoader(
        job["source"],
        batch_size=BATCH,
        num_workers=WORKERS,
        seed=3,
        even=even,
        to_tuple=("__key__",),
        options=options,
    )


def _phase(job: dict[str, Any], rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    epoch = 1
    if job["phase"] == "full":
        for mode in MODES:
            for even in ("pad", "drop"):
                loader = _make(job, mode, even)
                loader.set_epoch(epoch)
                out[f"{mode}/{even}"] = {
                    "len": len(loader),
                    "batches": [list(b[0]) for b in loader],
                }
    elif job["phase"] == "stop":
        for mode in MODES:
            for k in STOP_AFTER:
                loader = _make(job, mode, "pad")
                loader.set_epoch(epoch)
                it = iter(loader)
                head = [list(next(it)[0]) for _ in range(k)]
                out[f"{mode}/{k}"] = {"head": head, "state": loader.state_dict()}
                it.close()  # stops the workers mid-epoch, as a preempted job would
    else:
        saved = json.loads(Path(job["stopped"], f"rank{rank}.json").read_text())
        for mode in MODES:
            for k in STOP_AFTER:
                loader = _make(job, mode, "pad")  # a fresh process and a fresh loader
                loader.load_state_dict(saved[f"{mode}/{k}"]["state"])
                loader.set_epoch(epoch)
                out[f"{mode}/{k}"] = {"tail": [list(b[0]) for b in loader]}
    return out


def rank_main(rank: int, job: dict[str, Any]) -> None:
    """One DDP rank: join the gloo group, run the phase, write rank<N>.json."""
    import time

    import torch.distributed as dist

    started = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"file://{job['out']}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        result = _phase(job, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result["seconds"] = time.monotonic() - started
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))


def run_world(
    job: dict[str, Any], timeout_s: float = 180, module: str = "tests.test_loader_ddp"
) -> list[dict[str, Any]]:
    """Start WORLD fresh interpreters running ``module``'s ``rank_main``; a hang fails the test,
    never blocks it."""
    Path(job["out"]).mkdir(parents=True)
    code = (
        f"import json, sys; from {module} import rank_main; "
        "rank_main(int(sys.argv[1]), json.loads(sys.argv[2]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), json.dumps(job)], cwd=REPO, env=clean_env()
        )
        for rank in range(WORLD)
    ]
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * WORLD, f"rank exit codes {codes} in phase {job['phase']}"
    return [json.loads(Path(job["out"], f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def staged_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uneven shards staged once, and one uninterrupted epoch per rank for every mode."""
    root = tmp_path_factory.mktemp("ddp")
    spec = SyntheticSpec(num_shards=5, samples_per_shard=30, uneven=True, seed=6, image_bytes=256)
    from stager.shards.synth import write_synthetic_dataset

    write_synthetic_dataset(root / "ds", spec)
    dest = root / "scratch"
    options = StageInOptions(dest_root=dest, progress="none", jitter_max_s=0)
    stage_in(resolve_source(str(root / "ds")), options, slurm=SlurmEnv.from_environ({}))
    job = {"source": str(root / "ds"), "dest": str(dest), "root": str(root)}
    full = run_world({**job, "phase": "full", "out": str(root / "full")})
    keys = {sample_key(s, i) for s, n in enumerate(spec.shard_sizes()) for i in range(n)}
    assert len(set(spec.shard_sizes())) > 1, "the test needs shards of unequal sizes"
    return {**job, "full": full, "keys": keys}


@pytest.mark.parametrize("mode", MODES)
def test_ddp_equal_batches_cover_and_no_duplicates(staged_world: dict[str, Any], mode: str) -> None:
    keys = staged_world["keys"]
    for even in ("pad", "drop"):
        ranks = [r[f"{mode}/{even}"] for r in staged_world["full"]]
        lengths = {len(r["batches"]) for r in ranks} | {r["len"] for r in ranks}
        assert len(lengths) == 1, f"{mode}/{even}: ranks disagree on the epoch length {lengths}"
        delivered = [k for r in ranks for b in r["batches"] for k in b]
        if even == "pad":
            assert set(delivered) == keys
            assert len(delivered) - len(keys) < WORLD * WORKERS * BATCH
        else:
            assert len(delivered) == len(set(delivered)), "even='drop' repeated a sample"
            assert set(delivered) <= keys and len(keys) - len(delivered) <= WORLD * WORKERS * BATCH
