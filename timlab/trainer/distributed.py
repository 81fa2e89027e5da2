"""Data parallelism with torch.distributed: ``torchrun --nproc-per-node N -m timlab train ...``.

Each rank rolls out its shard of the step's prompts with its own generator, scores them with
the same exact forward (so the zero-mismatch guard holds on every rank), and gradients are
summed with all-reduce after a loss normalized by the GLOBAL token count, so the update equals
the single-process update on the whole batch up to summation order. gloo on CPU, nccl on GPU.
Rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_env(cls, device: str = "cpu") -> "World":
        if dist.is_available() and dist.is_initialized():
            rank, size = dist.get_rank(), dist.get_world_size()
            if device.startswith("cuda"):
                device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            return cls(rank, size, torch.device(device))
        return cls(0, 1, torch.device(device))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def sum(self, x: float) -> float:
        if self.size == 1:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def mean(self, x: float) -> float:
        return self.sum(x) / self.size

    def weighted_mean(self, x: float, n: float) -> float:
        """The global mean from each rank's mean ``x`` over its ``n`` items: exact when shards are
        uneven (a mean of per-rank means is not). One process: ``x`` itself, bit for bit."""
        if self.size == 1:
            return x
        total = self.sum(float(n))
        return self.sum(x * n) / total if total else float("nan")

    def all_reduce_grads(self, params) -> None:
        if self.size == 1:
            return
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)

    def gather_objects(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


@contextlib.contextmanager
def maybe_init_process_group(device: str = "cpu"):
    """Init a process group when launched by torchrun (WORLD_SIZE > 1); tear it down after."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
        try:
            yield
        finally:
            dist.destroy_process_group()
    else:
        yield
