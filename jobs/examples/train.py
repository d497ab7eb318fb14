"""A tiny DDP training run over staged shards: the example that the sbatch templates launch.

It runs unmodified on any image WebDataset (``.jpg``/``.jpeg``/``.png``/``.webp`` or ``.npy``
images plus an integer ``.cls`` label): the image member is detected from the first sample,
JPEG, PNG and WebP samples each decoded as they are (``--image-key`` names it), the class
count is read from the labels (``--num-classes`` skips that pass), and loader workers default
to ``SLURM_CPUS_PER_TASK - 1`` per process (one core stays with the training loop). It shows
the parts a real script needs on Slurm, with a model small enough for CPU:

* ranks from torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) or from ``srun`` alone
  (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``); NCCL when CUDA is there, else gloo;
* data from node-local scratch through :class:`stager_loaders.ShardedLoader` (``decode="rgb8"``:
  uint8 HxWx3 whatever the image format; images of several sizes are pooled one by one);
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
import functools
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

from stager_loaders import CsvMetrics, ShardedLoader, TensorBoardMetrics
from stager_loaders.rng import capture_rng_state, restore_rng_state

CKPT_NAME = re.compile(r"^step-(\d{8})$")
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
#: Image members looked for, in this order, when --image-key is "auto".
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "npy")


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
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader worker processes per rank (default: SLURM_CPUS_PER_TASK - 1, shared among "
        "torchrun's processes; 2 outside Slurm)",
    )
    p.add_argument(
        "--image-key",
        default="auto",
        help="image member of a sample; alternatives as jpg;png (default: "
        f"{ENCODED_IMAGES}, each sample's own, or npy, from the first sample)",
    )
    p.add_argument("--label-key", default="cls", help="integer label member of a sample")
    p.add_argument(
        "--num-classes",
        type=int,
        default=0,
        metavar="N",
        help="classes (default: 1 + the largest label, read from the data once)",
    )
    p.add_argument(
        "--metrics-dir",
        default="",
        help="directory: each rank appends loader metrics (data wait, samples/s) to a CSV file",
    )
    p.add_argument(
        "--tensorboard",
        default="",
        help="directory: rank 0 logs loss and loader metrics for TensorBoard (needs tensorboard)",
    )
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
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = default_workers(os.environ)
    return args


def default_workers(env: dict[str, str] | os._Environ) -> int:
    """Loader workers per training process from the CPUs Slurm gave its task.

    One core stays with the training process itself. Under torchrun one task holds all the
    node's processes (``LOCAL_WORLD_SIZE``), so they share its CPUs. Outside Slurm: 2.
    """
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    if not cpus.isdigit():
        return 2
    processes = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(0, int(cpus) // max(1, processes) - 1)


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
    """Pools any HxWx3 (or HxW) uint8 image to 3x4x4 features, then two linear layers."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def features(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim == 3:  # grey: B x H x W
            images = images.unsqueeze(-1).expand(-1, -1, -1, 3)
        x = images.permute(0, 3, 1, 2).float() / 255.0
        return self.pool(x).flatten(1)

    def forward(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        if isinstance(images, (list, tuple)):  # images of different sizes: pooled one by one
            return self.head(torch.cat([self.features(im.unsqueeze(0)) for im in images]))
        return self.head(self.features(images))


#: The encoded formats, as alternatives: each sample's own is decoded (rgb8 gives them all as
#: uint8 HxWx3). The format of the first sample alone failed on the first PNG of a dataset of
#: JPEGs and PNGs.
ENCODED_IMAGES = "jpg;jpeg;png;webp"


def detect_image_key(data: str, wanted: str) -> str:
    """``wanted``, or the image member of the dataset's first sample: the encoded formats as
    alternatives (:data:`ENCODED_IMAGES`) where it has one, else ``npy``."""
    if wanted != "auto":
        return wanted
    # Any one sample will do: shuffled, the first one comes from the first shard staged
    # (stage-in --background copies in that order), never from a shard still on its way.
    probe = ShardedLoader(data, batch_size=1, shuffle=True, rank=0, world_size=1)
    members = set(next(iter(probe)))  # raw batch: a dict of member columns
    for key in IMAGE_KEYS:
        if key in members:
            return ENCODED_IMAGES if key in ENCODED_IMAGES.split(";") else key
    raise SystemExit(
        f"train: the samples of {data} have none of the image members {', '.join(IMAGE_KEYS)} "
        f"(they have {', '.join(sorted(members - {'__key__'}))}); pass --image-key"
    )


def _label_only(label_key: str, sample: dict) -> dict:
    return {label_key: int(sample[label_key])}


def count_classes(data: str, label_key: str, workers: int, device: torch.device) -> int:
    """1 + the largest label in the dataset: every rank reads its share, one all-reduce."""
    loader = ShardedLoader(
        data,
        batch_size=256,
        num_workers=workers,
        shuffle=False,
        decode=functools.partial(_label_only, label_key),  # reads the labels only
        to_tuple=(label_key,),
    )
    loader.set_epoch(0)
    top = torch.tensor([-1], dtype=torch.int64)
    for (labels,) in loader:
        if int(labels.min()) < 0:
            raise SystemExit(f"train: negative label {int(labels.min())} in {data}")
        top = torch.maximum(top, labels.max().reshape(1))
    top = top.to(device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    if int(top.item()) < 0:
        raise SystemExit(f"train: no labels in {data}")
    return int(top.item()) + 1


def model_digest(model: nn.Module) -> str:
    """sha256 over the parameters: equal digests mean bit-identical models."""
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    epoch: int,
    model: nn.Module,
    optimizer,
    loader,
    keep: int,
    data_layout: dict,
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
        "data": data_layout,  # image key, label key, class count: a resume needs no probing
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

    state = None
    if args.resume:
        # On the CPU: load_state_dict copies the model's and optimizer's tensors to their
        # device, and the RNG states must stay CPU tensors.
        state = torch.load(Path(args.resume) / "state.pt", map_location="cpu", weights_only=False)
    if state is not None and "data" in state:
        data_layout = dict(state["data"])
    else:
        image_key = detect_image_key(args.data, args.image_key)
        num_classes = args.num_classes or count_classes(
            args.data, args.label_key, args.workers, device
        )
        data_layout = {
            "image_key": image_key,
            "label_key": args.label_key,
            "num_classes": num_classes,
        }
    log(
        rank,
        f"images from .{data_layout['image_key'].replace(';', '/.')}, "
        f"labels from .{data_layout['label_key']}, "
        f"{data_layout['num_classes']} classes, {args.workers} loader workers per rank",
    )

    torch.manual_seed(args.seed)
    model = TinyNet(data_layout["num_classes"]).to(device)
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
        decode="rgb8",  # uint8 HxWx3 from JPEG/PNG/WebP; .npy arrays as stored
        to_tuple=(data_layout["image_key"], data_layout["label_key"], "__key__"),
        even="drop",
    )

    step, epoch = 0, 0
    if state is not None:
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
    writers = metrics_writers(args, rank)
    for writer in writers:
        loader.metrics.attach(writer, every_steps=args.log_every)

    loss_fn = nn.CrossEntropyLoss()
    stopped = False
    resumed_epoch = bool(args.resume)  # may legitimately be empty: saved after its last batch
    while step < args.steps and not stopped:
        batches = 0
        for images, labels, keys in loader:
            batches += 1
            optimizer.zero_grad(set_to_none=True)
            if isinstance(images, list):
                images = [im.to(device) for im in images]
            else:
                images = images.to(device)
            loss = loss_fn(ddp(images), torch.as_tensor(labels).to(device))
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
                    ckpt_dir,
                    step,
                    epoch,
                    model,
                    optimizer,
                    loader,
                    args.keep_local,
                    data_layout,
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
    for writer in writers:
        writer.close()
    if stopped:
        log(rank, f"stopped by signal {stop.signum} at step {step}; checkpoint saved")
    else:
        log(rank, f"done at step {step}, model {model_digest(model)}")
    # gloo's threads free the last collectives before Python exits, or the exit may abort:
    # docs/troubleshooting.md, "terminate called without an active exception".
    time.sleep(0.1)
    dist.destroy_process_group()
    return 0


def metrics_writers(args: argparse.Namespace, rank: int) -> list:
    """Loader metrics every --log-every steps: a CSV per rank, TensorBoard on rank 0."""
    writers: list = []
    if args.metrics_dir:
        writers.append(CsvMetrics(Path(args.metrics_dir) / f"loader-rank{rank}.csv"))
    if args.tensorboard and rank == 0:
        writers.append(TensorBoardMetrics(args.tensorboard))
    return writers


if __name__ == "__main__":
    sys.exit(main())
