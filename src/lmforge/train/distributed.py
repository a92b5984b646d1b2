"""Distributed set-up through torch.distributed (torchrun): gloo on CPU, NCCL on CUDA.

One process without torchrun's environment is world size 1 and needs no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; start the process group if > 1 rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local, device)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (identity for one process). Returns a new tensor."""
    x = x.clone()
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def wrap_model(model: torch.nn.Module, mode: str, info: DistInfo) -> torch.nn.Module:
    """DDP or FSDP2 (`fully_shard`) around `model` when there are several ranks.

    Both average gradients over ranks; the trainer multiplies its loss by the world size so
    the division by the global supervised-token count happens exactly once (P3).
    """
    if not info.distributed:
        return model
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()
