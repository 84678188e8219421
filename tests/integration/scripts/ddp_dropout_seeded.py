"""A DDP script written another way than examples/ddp_train.py, for the hand-over tests: a seed
per rank (so dropout masks differ between ranks), BatchNorm, dropout, SGD with Nesterov
momentum, a StepLR schedule stepped every optimizer step, gradient accumulation over 2
micro-batches with `no_sync`, gradient clipping.  No linkpass import."""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--samples", type=int, default=16384)
args = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1000 + rank)  # each rank its own stream

gen = torch.Generator().manual_seed(7)
xs = torch.randn(args.samples, 32, generator=gen)
ys = (xs[:, :4].sum(dim=1, keepdim=True) > 0).float()
data = TensorDataset(xs, ys)
sampler = DistributedSampler(data, seed=3)
loader = DataLoader(data, batch_size=16, sampler=sampler)

torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
net = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 1))
torch.manual_seed(1000 + rank)
model = DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.7)
loss_fn = nn.BCEWithLogitsLoss()

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        last = i % 2 == 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(x), y).div(2).backward()
        if last:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"epoch {epoch} lr {sched.get_last_lr()[0]:.5f}", flush=True)
dist.destroy_process_group()
