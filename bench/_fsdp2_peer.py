"""The bench's copy of ``examples/fsdp2_train.py`` with two additions (the peer of bench/snapshot.py):

* ``--width W``: the hidden width (the example's is 128), so the state size is a knob: about
  ``12 * (W*W + 81*W + 16)`` bytes of fp32 parameters and AdamW's two moments in all, half per rank
  on 2 ranks (W=256: ~1 MB, W=1600: ~32 MB, W=4096: ~205 MB);
* ``--save-every N --save-dir D``: after every N-th optimizer step each rank saves its shards the
  way a script does it by hand, synchronously: ``torch.save(get_state_dict(model, optimizer),
  D/step-S-rank-R.pt)`` (DTensors' local shards), training waits for the write.  Each save prints
  one line ``bench-save {"rank", "step", "ms", "bytes"}`` (``ms``: get_state_dict + torch.save +
  close, monotonic clock).

With ``--width 128 --save-every 0`` it trains exactly what the example trains.  gloo on CPU, NCCL
when CUDA is there.  Not a linkpass component: it imports no linkpass code.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def _local(sd):
    """The state dict with each DTensor replaced by this rank's shard (a plain tensor)."""
    if isinstance(sd, dict):
        return {k: _local(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_local(v) for v in sd]
    to_local = getattr(sd, "to_local", None)
    return to_local() if callable(to_local) else sd


def main():
    p = argparse.ArgumentParser(description="FSDP2 training (bench peer)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--save-dir", default="torch-save")
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

    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 16)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if a.save_every:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        os.makedirs(a.save_dir, exist_ok=True)

    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        total, n = 0.0, 0
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(source.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            step += 1
            total += loss.item()
            n += 1
            if a.save_every and step % a.save_every == 0:
                t0 = time.monotonic_ns()
                msd, osd = get_state_dict(model, optimizer)
                path = os.path.join(a.save_dir, f"step-{step}-rank-{rank}.pt")
                torch.save({"model": _local(msd), "optim": _local(osd), "step": step}, path)
                ms = (time.monotonic_ns() - t0) / 1e6
                print("bench-save " + json.dumps({"rank": rank, "step": step, "ms": round(ms, 3),
                                                  "bytes": os.path.getsize(path)}), flush=True)
        print(f"[rank {rank}] epoch {epoch}: {n} steps, mean loss {total / max(n, 1):.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
