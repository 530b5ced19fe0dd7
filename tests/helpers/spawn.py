"""Run a function on N local processes joined in one process group: torchrun's job, in-process.

Tests use it where a pytest process must start the ranks itself. Each worker gets the
environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and is
initialised by ``megamoe.dist.init_from_env``, so spawned and torchrun-launched code share one path.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from megamoe.dist import init_from_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, use_cuda: bool, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    group, device = init_from_env(use_cuda)
    try:
        fn(rank, group, device, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, use_cuda: bool = False) -> None:
    """Call ``fn(rank, group, device, *args)`` on ``world_size`` processes (gloo on CPU, or NCCL
    with one GPU each when ``use_cuda``). ``fn`` must be a module-level function. Raises if any rank
    raises."""
    mp.spawn(_worker, args=(world_size, _free_port(), use_cuda, fn, args), nprocs=world_size, join=True)
