"""Two DDP ranks on two "nodes" (their own scratch each) in a real gloo group: one node's
background copy is complete, the other's still runs. The ranks must agree on the order of
each epoch (else their shares stop being a partition): epoch 0 in the staging order on both,
the next epoch, started once both copies are done, in the full shuffle on both."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stager.layout import StagedDataset
from stager.plan.ranks import WorldLayout
from stager.stagein.status import read_outcome, read_plan

from .background_util import SPEC, dataset, finished, planned_keys, start_copier, stop, wait_plan
from .conftest import REPO, clean_env

WORLD, BATCH, SEED = 2, 4, 1


def rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank: join the group, read epoch 0 (its node copying or not), wait until every
    node's copy is done, read epoch 1; write the keys."""
    import torch.distributed as dist

    from stager_loaders import LoaderOptions, ShardedLoader

    dist.init_process_group(
        "gloo", init_method=f"file://{job['out']}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        loader = ShardedLoader(
            job["source"],
            batch_size=BATCH,
            num_workers=1,
            seed=SEED,
            to_tuple=("__key__",),
            options=LoaderOptions(dest=job["dests"][rank]),
        )
        Path(job["out"], f"constructed{rank}").touch()  # the test lets the copier go on now
        epochs = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            epochs.append([k for (keys,) in loader for k in keys])
            if epoch == 0:  # both copies done before epoch 1 starts, on every rank
                for dest in job["dests"]:
                    staged = StagedDataset(Path(dest), "ds")
                    loaded = read_plan(staged)
                    assert loaded is not None
                    while not (read_outcome(staged, loaded[1]) or 0):
                        time.sleep(0.05)
                dist.barrier()
        kind = type(loader.reader).__name__
    finally:
        dist.destroy_process_group()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"epochs": epochs, "reader": kind}))


def _wait_for_markers(out: Path, procs: list[subprocess.Popen], timeout_s: float = 240) -> None:
    """Until every rank has built its loader (or one of them has ended: the test then fails
    on its exit code)."""
    deadline = time.monotonic() + timeout_s
    while not all((out / f"constructed{rank}").exists() for rank in range(WORLD)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def test_ranks_agree_on_the_staging_order_while_any_node_copies(tmp_path: Path) -> None:
    src = dataset(tmp_path)
    done, copying = tmp_path / "node0", tmp_path / "node1"
    assert finished(start_copier(src, done)) == 0
    copier = start_copier(src, copying, "--bw-limit", "0.3")
    out = tmp_path / "out"
    out.mkdir()
    job = {"source": str(src), "dests": [str(done), str(copying)], "out": str(out)}
    code = (
        "import json, sys; from tests.test_loader_background_ddp import rank_main; "
        "rank_main(int(sys.argv[1]), json.loads(sys.argv[2]))"
    )
    try:
        wait_plan(copying)
        # Paused (its lock still held, so it is not "gone") until both loaders are built: on a
        # loaded machine the ranks' start-up could outlast the throttled copy, and rank 1 would
        # then find it finished instead of still copying.
        copier.send_signal(signal.SIGSTOP)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(rank), json.dumps(job)],
                cwd=REPO,
                env=clean_env(LOCAL_WORLD_SIZE="1"),
            )
            for rank in range(WORLD)
        ]
        try:
            _wait_for_markers(out, procs)
            copier.send_signal(signal.SIGCONT)
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert codes == [0] * WORLD
        assert finished(copier) == 0
    finally:
        if copier.poll() is None:
            copier.send_signal(signal.SIGCONT)  # a stopped process would not see the SIGTERM
        stop(copier)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["reader"] for r in ranks] == ["StagedReader", "StagingReader"]
    counts = SPEC.shard_sizes()
    for rank, seen in enumerate(ranks):
        layout = WorldLayout(WORLD, 1, rank)
        for epoch, staging in ((0, True), (1, False)):
            want = planned_keys(
                counts, batch=BATCH, seed=SEED, epoch=epoch, staging=staging, layout=layout
            )
            assert seen["epochs"][epoch] == want, (rank, epoch)
    epoch0 = [k for r in ranks for k in r["epochs"][0]]
    assert len(set(epoch0)) == sum(counts)  # together the ranks read every sample
