"""The demo: make a small dataset on a pretend shared filesystem, stage it, load a few batches.

Outside Slurm it simulates a one-node job (SLURM_JOB_ID etc.) so the same code paths run as in
a real allocation; inside an allocation it uses the real environment and /scratch/$SLURM_JOB_ID.

    scripts/demo.sh            # set up and run
    .venv/bin/python jobs/examples/demo.py --workdir /tmp/stager-demo --batches 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def simulated_job_env(workdir: Path) -> dict[str, str]:
    """The variables a one-node, one-task Slurm job would have, plus a scratch location."""
    env = dict(os.environ)
    if "SLURM_JOB_ID" not in env:
        host = socket.gethostname().split(".")[0]
        env.update(
            SLURM_JOB_ID="1",  # (a number, as Slurm gives it: stager refuses others)
            SLURM_JOB_NUM_NODES="1",
            SLURM_JOB_NODELIST=host,
            SLURMD_NODENAME=host,
            SLURM_NODEID="0",
            SLURM_PROCID="0",
            SLURM_LOCALID="0",
            SLURM_NTASKS="1",
        )
        env.setdefault("STAGER_DEST", str(workdir / "scratch" / "demo"))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="stage a synthetic dataset and load it")
    parser.add_argument(
        "--workdir", type=Path, help="where the pretend NFS and scratch live (default: a temp dir)"
    )
    parser.add_argument("--batches", type=int, default=5, help="batches to print")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="stager-demo-"))
    env = simulated_job_env(workdir)
    os.environ.update(env)
    source = workdir / "nfs" / "demo-ds"
    try:
        print(f"1/3 writing a synthetic dataset to {source}", flush=True)
        subprocess.run(
            [
                str(BIN / "stager"),
                "make-dataset",
                str(source),
                "--shards",
                "8",
                "--samples",
                "64",
                "--uneven",
            ],
            check=True,
            env=env,
        )
        print(
            "2/3 stage-in (what `srun --ntasks-per-node=1 stage-in ...` does in a prologue)",
            flush=True,
        )
        subprocess.run([str(BIN / "stage-in"), str(source)], check=True, env=env)

        print("3/3 loading from node-local scratch with ShardedLoader", flush=True)
        from stager_loaders import ShardedLoader

        loader = ShardedLoader(
            str(source),
            batch_size=32,
            num_workers=2,
            shuffle=True,
            seed=0,
            decode="rgb8",  # (.npy arrays: uint8 HxWx3, as the README shows)
            to_tuple=("npy", "cls"),
        )
        print(f"    {len(loader)} batches per epoch on this rank")
        loader.set_epoch(0)
        for step, (images, labels) in enumerate(loader):
            if step >= args.batches:
                break
            print(
                f"    batch {step}: images {tuple(images.shape)} {images.dtype}, "
                f"labels {labels[:8].tolist()}..."
            )
        print("demo ok")
        return 0
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
