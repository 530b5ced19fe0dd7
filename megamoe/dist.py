"""Process-group plumbing: torchrun initialisation and the collectives the EP paths use.

A ``group`` of ``None`` means a single process without torch.distributed (world size 1); every
helper here accepts it so single-GPU and CPU code runs the same path as multi-rank code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; (0, 1) for ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def init_from_env(use_cuda: bool | None = None) -> tuple[dist.ProcessGroup | None, torch.device]:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    NCCL with one GPU per local rank when ``use_cuda`` (default: CUDA is available), else gloo on
    CPU. Without torchrun's variables: no process group, device cuda:0 or cpu. Returns
    ``(group, device)``.
    """
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        return None, torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"megamoe: local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "use --nproc-per-node <= the GPU count"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    return dist.group.WORLD, device


def all_to_all_rows(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Exchange rows (dim 0) of ``inp`` so that rank r receives ``in_splits[r]`` rows from each peer.

    A thin wrapper over ``all_to_all_single`` that is a copy for a single rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        out.copy_(inp)
        return
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out [R * n, ...]`` = every rank's ``inp [n, ...]`` in rank order (a copy for one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        out.copy_(inp)
        return
    dist.all_gather_into_tensor(out, inp, group=group)
