"""A tiny DDP training run over staged shards: the example that the sbatch templates launch.

It shows the parts a real script needs on Slurm, with a model small enough for CPU:

* ranks from torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or from ``srun`` alone
  (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``); NCCL when CUDA is there, else gloo;
* data from node-local scratch through :class:`stager_loaders.ShardedLoader`;
* checkpoints (model, optimizer, loader position, RNG, step) written atomically to scratch
  every ``--ckpt-every`` steps, as ``<ckpt-dir>/step-XXXXXXXX/`` (published by one rename, so
  ``stage-out`` never sees half of one);
* ``--resume PATH`` (what ``stage-in --checkpoint`` printed) continues exactly where that
  checkpoint stopped: same next step, same next samples;
* SIGUSR1/SIGTERM: every rank agrees (one all-reduce per step) to stop at the same step, rank
  0 saves a checkpoint there and all exit 0, so the batch script's trap can stage it out and
  requeue with nothing lost.

Try it without Slurm: ``python jobs/examples/train.py --data DIR --ckpt-dir /tmp/ck --steps 20``
(one rank; set MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE or use torchrun for more).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stager_loaders import ShardedLoader
from stager_loaders.rng import capture_rng_state, restore_rng_state

CKPT_NAME = re.compile(r"^step-(\d{8})$")
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="staged dataset directory on node-local scratch")
    p.add_argument("--ckpt-dir", required=True, help="where checkpoints go on node-local scratch")
    p.add_argument(
        "--resume", default="", help="checkpoint directory to resume from (empty: start fresh)"
    )
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (over all runs)")
    p.add_argument(
        "--ckpt-every", type=int, default=20, metavar="N", help="checkpoint every N steps"
    )
    p.add_argument(
        "--keep-local", type=int, default=2, metavar="N", help="checkpoints kept on scratch"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, metavar="N")
    p.add_argument(
        "--step-sleep-s",
        type=float,
        default=0.0,
        help="pretend each step computes this long (demos)",
    )
    p.add_argument(
        "--key-log", default="", help="directory: each rank appends 'step key...' lines (tests)"
    )
    return p.parse_args(argv)


class StopFlag:
    """Set by SIGUSR1/SIGTERM; installed before the loader forks its workers, so they inherit a
    handler instead of dying on the signal that Slurm sends to every process of the step."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank was signalled (ranks must stop at one step)."""
        flag = torch.tensor([1 if self.signum else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def init_distributed() -> tuple[int, int, int, torch.device]:
    """(rank, world_size, local_rank, device) from torchrun's or srun's variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also sets LOCAL_RANK)
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    else:  # srun: one task per GPU
        rank = int(env.get("SLURM_PROCID", 0))
        world = int(env.get("SLURM_NTASKS", 1))
        local = int(env.get("SLURM_LOCALID", 0))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available():
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    return rank, world, local, device


class TinyNet(nn.Module):
    """Pools any HxWx3 uint8 image to 3x4x4 features, then two linear layers (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float() / 255.0
        return self.head(self.pool(x))


def model_digest(model: nn.Module) -> str:
    """sha256 over the parameters: equal digests mean bit-identical models."""
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(
    ckpt_dir: Path, step: int, epoch: int, model: nn.Module, optimizer, loader, keep: int
) -> Path:
    """Write ``step-XXXXXXXX/state.pt`` under a temporary name and publish it by one rename."""
    final = ckpt_dir / f"step-{step:08d}"
    if final.exists():
        return final
    tmp = ckpt_dir / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {
        "step": step,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        # All ranks consume batches in lockstep: rank 0's position resumes every rank.
        "loader": loader.state_dict(),
        "rng": capture_rng_state(),
    }
    torch.save(state, tmp / "state.pt")
    (tmp / "meta.json").write_text(
        json.dumps({"step": step, "epoch": epoch, "digest": model_digest(model)}) + "\n"
    )
    os.replace(tmp, final)
    for old in sorted(p for p in ckpt_dir.iterdir() if CKPT_NAME.match(p.name))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"train: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    rank, world, local_rank, device = init_distributed()
    ckpt_dir = Path(args.ckpt_dir)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    model = TinyNet().to(device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loader = ShardedLoader(
        args.data,
        batch_size=args.batch_size,
        num_workers=args.workers,
        shuffle=True,
        seed=args.seed,
        decode="rgb8",
        to_tuple=("npy", "cls", "__key__"),
        even="drop",
    )

    step, epoch = 0, 0
    if args.resume:
        state = torch.load(Path(args.resume) / "state.pt", map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        restore_rng_state(state["rng"])
        step, epoch = int(state["step"]), int(state["epoch"])
        log(rank, f"resumed from {args.resume} at step {step} (epoch {epoch})")
    else:
        loader.set_epoch(0)
    log(
        rank,
        f"rank 0 of {world}, backend {dist.get_backend()}, device {device}, "
        f"{len(loader)} batches/epoch",
    )

    key_log = None
    if args.key_log:
        Path(args.key_log).mkdir(parents=True, exist_ok=True)
        key_log = open(Path(args.key_log) / f"rank-{rank}.keys", "a")  # noqa: SIM115 - closed below

    loss_fn = nn.CrossEntropyLoss()
    stopped = False
    resumed_epoch = bool(args.resume)  # may legitimately be empty: saved after its last batch
    while step < args.steps and not stopped:
        batches = 0
        for images, labels, keys in loader:
            batches += 1
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(images.to(device)), torch.as_tensor(labels).to(device))
            loss.backward()
            optimizer.step()
            step += 1
            if key_log is not None:
                key_log.write(f"{step} {' '.join(keys)}\n")
                key_log.flush()
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            if step % args.log_every == 0:
                log(rank, f"step {step} epoch {epoch} loss {loss.item():.4f}")
            stopped = stop.agreed(device)
            if rank == 0 and (stopped or step % args.ckpt_every == 0 or step >= args.steps):
                path = save_checkpoint(
                    ckpt_dir, step, epoch, model, optimizer, loader, args.keep_local
                )
                log(rank, f"checkpoint {path}")
            if stopped or step >= args.steps:
                break
        else:
            if batches == 0 and not resumed_epoch:
                raise SystemExit(
                    f"train: epoch {epoch} yielded no batches; "
                    "is the dataset smaller than one batch per rank?"
                )
            resumed_epoch = False
            epoch += 1
            loader.set_epoch(epoch)
    dist.barrier()  # rank 0's checkpoint is published before any rank reports done
    if key_log is not None:
        key_log.close()
    if stopped:
        log(rank, f"stopped by signal {stop.signum} at step {step}; checkpoint saved")
    else:
        log(rank, f"done at step {step}, model {model_digest(model)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
