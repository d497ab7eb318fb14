"""NCCL smoke test, for a machine with a CUDA GPU; CI has none, so the test suite runs the same
paths on gloo, and this script is what checks the GPU side by hand.

It checks what gloo cannot: the loader's collectives put their tensors on the GPU when the
backend is NCCL (NCCL reduces only CUDA tensors), and the example training script runs end to
end on NCCL from data that stage-in put on scratch:

1. stage a small synthetic dataset with ``stage-in`` (a simulated one-node job);
2. ``jobs/examples/train.py`` under ``torchrun`` with one process per GPU (NCCL, since CUDA is
   there): loader, DDP, a checkpoint, and ``--resume`` from it;
3. in one NCCL process group: ``agree_per_rank`` (``--subset node``) and ``agree_incomplete``
   (background staging), the two all_reduce calls of the loader.

Run: ``python scripts/nccl_smoke.py [--workdir DIR]``; it ends with ``nccl smoke ok`` or exits
non-zero at the first step that fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(argv: list[str], env: dict[str, str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, env=env, cwd=REPO)


def check_collectives(backend: str = "nccl") -> None:
    """The loader's all_reduce calls on a group of ``backend`` (one process: the collective
    still runs, on CUDA tensors for NCCL)."""
    import torch
    import torch.distributed as dist

    from stager.errors import UsageError
    from stager.plan.ranks import WorldLayout
    from stager_loaders.orders import agree_incomplete
    from stager_loaders.world import agree_per_rank

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        assert dist.get_backend() == backend
        # The group's own world (one rank): a loader whose layout is another world than the
        # group's enters no collective (a validation loader on rank 0 alone).
        layout = WorldLayout(num_nodes=1, ranks_per_node=1, rank=0)
        assert agree_per_rank(1000, layout, "drop", "node") == 1000
        # Staging's agreement reduces over the group of the layout's world (one rank here);
        # a layout of another world (two nodes) under it is refused, never reduced
        assert agree_incomplete(True, layout) is True
        assert agree_incomplete(False, layout) is False
        two_nodes = WorldLayout(num_nodes=2, ranks_per_node=1, rank=0)
        try:
            agree_incomplete(True, two_nodes)
        except UsageError:
            pass
        else:
            raise AssertionError("a layout of two nodes was reduced over a group of one")
        print(f"collectives on {backend}: ok", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    parser.add_argument(
        "--cpu", action="store_true", help="every step on gloo: check this script where no GPU is"
    )
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("nccl smoke: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="nccl-smoke-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.setdefault("PYTHONPATH", str(REPO))
    try:
        source, scratch = work / "nfs" / "ds", work / "scratch"
        _run(
            [str(BIN / "stager"), "make-dataset", str(source), "--shards", "8", "--samples", "64"],
            env,
        )
        _run([str(BIN / "stage-in"), str(source), "--dest", str(scratch)], env)
        train = [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"],
            *[
                str(max(1, torch.cuda.device_count())),
                "jobs/examples/train.py",
                "--data",
                str(scratch / "ds"),
            ],
            *["--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "10", "--workers", "2"],
        ]
        _run([*train, "--steps", "20"], env)
        newest = sorted((work / "ckpt").glob("step-*"))[-1]
        _run([*train, "--steps", "30", "--resume", str(newest)], env)
        if args.cpu:
            check_collectives("gloo")
            print("nccl smoke: ok on gloo (the CPU); the NCCL checks need a GPU", flush=True)
            return 0
        check_collectives()
        print("nccl smoke ok", flush=True)
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
