"""Train a small model sharded with FSDP2 (``fully_shard``), launched by torchrun, in the style
of PyTorch's FSDP2 examples (pytorch/examples distributed/FSDP2): each layer and the root are
sharded, AdamW, a DistributedSampler.  No linkpass import: run it as is, or under
``linkpass exec -- torchrun ...``.  gloo on CPU, NCCL when CUDA is there."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    p = argparse.ArgumentParser(description="FSDP2 training")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=8192)
    a = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(a.samples, 64, generator=g)
    y = torch.tanh(x @ torch.randn(64, 16, generator=g))
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=a.batch_size, sampler=sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 16)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
            n += 1
        print(f"[rank {rank}] epoch {epoch}: {n} steps, mean loss {total / max(n, 1):.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
