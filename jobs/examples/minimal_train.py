"""The smallest training script the job templates run (docs/jobs.md: bring your own script)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from stager_loaders import ShardedLoader

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)  # the template passes --data, --ckpt-dir, [--resume]
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--resume", default="")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--num-classes", type=int, default=1000)
args = p.parse_args()
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)  # MASTER_ADDR/PORT: the template
workers = max(0, int(os.environ.get("SLURM_CPUS_PER_TASK", "3")) - 1)
images_labels = ("jpg;jpeg;png;webp;npy", "cls")  # the first image member present, the label
loader = ShardedLoader(args.data, 16, workers, decode="rgb8", to_tuple=images_labels, even="drop")
model = nn.parallel.DistributedDataParallel(nn.Linear(3, args.num_classes))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
if args.resume:  # the newest committed checkpoint, restored to scratch by the template
    state = torch.load(args.resume, weights_only=False)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    step = state["step"]
os.makedirs(args.ckpt_dir, exist_ok=True)
epoch = loader.epoch  # 0, or the resumed epoch, which keeps its position
loss = torch.zeros(())  # (resumed at the last step, the loop does not run)
while step < args.steps:
    loader.set_epoch(epoch)
    for images, labels in loader:  # images: uint8 B x H x W x 3, or a list when sizes differ
        colours = torch.stack([image.float().mean(dim=(0, 1)) / 255 for image in images])
        loss = nn.functional.cross_entropy(model(colours), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and (step % 10 == 0 or step == args.steps):  # any name: write, then rename
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            tmp = os.path.join(args.ckpt_dir, "last.pt.tmp")  # stage-out skips *.tmp
            torch.save({**state, "loader": loader.state_dict(), "step": step}, tmp)
            os.replace(tmp, os.path.join(args.ckpt_dir, "last.pt"))
        if step == args.steps:
            break
    epoch += 1
dist.barrier()  # every rank done (rank 0's checkpoint saved) before any tears the group down
print(f"rank {rank}: done at step {step}, loss {loss.item():.4f}", flush=True)
time.sleep(0.1)  # gloo's threads free the last collectives before Python exits, else it
dist.destroy_process_group()  # may abort: docs/troubleshooting.md, "terminate called"
