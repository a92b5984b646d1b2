"""Distributed set-up through torch.distributed (torchrun): gloo on CPU, NCCL on CUDA.

    torchrun --nproc-per-node N -m lmforge pretrain --set train.data_parallel=ddp|fsdp ...

One process without torchrun's environment is world size 1 and needs no process group.
Data parallel only: each rank reads its own rows (`RowStream`), DDP or FSDP2 (`fully_shard`)
reduces the gradients. The parallel degrees are checked against the world size before
the process group starts (`init_distributed(cfg)`, the only caller of `config.check_parallel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lmforge.config import check_parallel, world_size_from_env
from lmforge.runtime import default_device


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


def init_distributed(cfg=None) -> DistInfo:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; start the process group if > 1 rank.

    With `cfg` (a `Config`), the parallel degrees are checked against the world size first
    (`config.check_parallel`, their one check), before any work or any process group. The
    device is `runtime.default_device(LOCAL_RANK)`.

    Raises:
        ConfigError: an invalid or unsupported parallel configuration for this world size.
    """
    world = world_size_from_env()
    if cfg is not None:
        check_parallel(cfg, world)
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = default_device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        global _INITIALISED
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        _INITIALISED = True
    return DistInfo(rank, world, local, device)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (identity for one process). Returns a new tensor on x's device."""
    x = x.clone()
    if info.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_min(x: int, info: DistInfo) -> int:
    """The smallest of an integer over the ranks (itself for one process)."""
    if not info.distributed:
        return x
    t = torch.tensor([x], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_main(obj: Any, info: DistInfo) -> list[Any] | None:
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere (a collective; pickled objects)."""
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def wrap_model(model: torch.nn.Module, mode: str, info: DistInfo) -> torch.nn.Module:
    """DDP or FSDP2 (`fully_shard`) around `model` when there are several ranks.

    DDP returns a wrapper (the module itself stays `model`). FSDP2 shards each block and
    then the root *in place*: the returned module is `model`, its parameters become
    DTensors sharded over dim 0 (read full weights with
    `checkpoint.gather_model_state`).

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


#: Set once this process has called init_process_group (cli's exit past gloo's teardown reads it).
_INITIALISED = False


def initialised_this_process() -> bool:
    """Whether this process initialised a process group (it may be destroyed by now)."""
    return _INITIALISED


def shutdown(info: DistInfo, together: bool = False) -> None:
    """Destroy the process group. `together` (a stage that finished on every rank): meet at a
    barrier first, so no rank tears its gloo connections down while a peer still uses them (a
    rank of a 2-rank CPU test once aborted at exit with "terminate called without an active
    exception"). A stage that raised skips the barrier: its peers may never reach it."""
    if info.distributed and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
