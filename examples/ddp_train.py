"""Train a small regression model with DistributedDataParallel, in the style of PyTorch's DDP
tutorial ("Multinode training" / "Fault-tolerant distributed training with torchrun",
pytorch.org/tutorials/intermediate/ddp_series_*): launched by torchrun, one process per GPU (or
per CPU worker with gloo), a DistributedSampler, AdamW, and a periodic snapshot that a restarted
job resumes from.

It knows nothing of linkpass.  Run it as is::

    torchrun --nproc-per-node 2 examples/ddp_train.py --epochs 4

or protected, unchanged::

    linkpass exec -- torchrun --nproc-per-node 2 examples/ddp_train.py --epochs 4
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n: int = 4096, d_in: int = 64, d_out: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return TensorDataset(x, y)


def make_model(d_in: int = 64, d_out: int = 16, hidden: int = 256) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


class Trainer:
    def __init__(self, model, loader, sampler, optimizer, snapshot_path, save_every, device):
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.loader = loader
        self.sampler = sampler
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if snapshot_path and os.path.exists(snapshot_path):
            print(f"[rank {self.global_rank}] resuming from snapshot {snapshot_path}", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if device.type == "cuda" else None)

    def _load_snapshot(self, path):
        snap = torch.load(path, map_location=self.device)
        self.model.load_state_dict(snap["MODEL_STATE"])
        self.optimizer.load_state_dict(snap["OPTIMIZER_STATE"])
        self.epochs_run = snap["EPOCHS_RUN"]

    def _save_snapshot(self, epoch):
        snap = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                "EPOCHS_RUN": epoch}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snap, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"[rank {self.global_rank}] epoch {epoch}: snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for source, targets in self.loader:
            total += self._run_batch(source.to(self.device), targets.to(self.device))
            n += 1
        print(f"[rank {self.global_rank}] epoch {epoch}: {n} steps, mean loss {total / max(n, 1):.5f}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.snapshot_path and self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main():
    p = argparse.ArgumentParser(description="DDP training, tutorial style")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    p.add_argument("--snapshot", default="", help="snapshot file (rank 0 writes it; every rank resumes from it)")
    p.add_argument("--samples", type=int, default=4096)
    a = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    dataset = make_dataset(a.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=a.batch_size, sampler=sampler, pin_memory=use_cuda)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Trainer(model, loader, sampler, optimizer, a.snapshot, a.save_every, device).train(a.epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
