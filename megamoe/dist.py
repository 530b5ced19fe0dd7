"""Process-group plumbing: torchrun initialisation and the collectives the EP paths use.

A ``group`` of ``None`` means a single process without torch.distributed (world size 1); every
helper here accepts it so single-GPU and CPU code runs the same path as multi-rank code.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .checks import fail


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; (0, 1) for ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


PG_TIMEOUT_ENV = "MEGAMOE_PG_TIMEOUT_S"
DEFAULT_PG_TIMEOUT_S = 300.0
"""Seconds a host-side collective of the process group ``init_from_env`` creates may wait (torch's default is 30
minutes for gloo, 10 for NCCL): a rank that never joins a call then ends its peers' wait with an error."""


def pg_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``MEGAMOE_PG_TIMEOUT_S``, else ``DEFAULT_PG_TIMEOUT_S``; a positive finite number."""
    name = "timeout_s"
    if timeout_s is None:
        name, timeout_s = PG_TIMEOUT_ENV, os.environ.get(PG_TIMEOUT_ENV, DEFAULT_PG_TIMEOUT_S)
    try:
        seconds = float(timeout_s)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(timeout_s, bool) or not 0 < seconds < float("inf"):
        fail(name, f"must be a positive, finite number of seconds, got {timeout_s!r}")
    return seconds


def init_from_env(use_cuda: bool | None = None, timeout_s: float | None = None
                  ) -> tuple[dist.ProcessGroup | None, torch.device]:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    NCCL with one GPU per local rank when ``use_cuda`` (default: CUDA is available), else gloo on
    CPU. Without torchrun's variables: no process group, device cuda:0 or cpu. Returns
    ``(group, device)``. ``timeout_s``: how long a host-side collective may wait for its peers
    (``pg_timeout_s``: default ``MEGAMOE_PG_TIMEOUT_S`` or 300 s) before it raises (gloo) or the NCCL watchdog
    aborts the process with a message (NCCL, whose asynchronous error handling torch enables by default); a group
    initialised before this call keeps its own timeout.
    """
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=pg_timeout_s(timeout_s))
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
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
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
