"""The staged dispatch kernel (BF16 Mega MoE, ``megamoe.bf16_mega_moe``): protocol steps 1-4 of
``megamoe.kernels.comm`` on every thread of ``num_ctas`` resident CTAs, ending with the pulled rows in the ring."""

from __future__ import annotations

import torch
from cutlass import Int32, Int64, cute, utils

from .. import runtime
from .phases import EpPhases
from .protocol import BARRIERS_PER_CALL, SITE_D_BARRIER, THREADS, WARP, WARPS, EpCommConfig


class Dispatch(EpPhases):
    """The dispatch kernel (module docstring, steps 1-4)."""

    @cute.jit
    def __call__(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(me, num_tokens, base, peers, stats, record, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
               timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        smem = utils.SmemAllocator()
        offs = smem.allocate_tensor(Int32, cute.make_layout(self.num_local + 1), 16)
        t_src = smem.allocate_tensor(Int32, cute.make_layout(2), 16)
        call = self.current_call(base)
        if cta == 0:
            self.announce(me, num_tokens, peers, call, tid)
        self.scan(me, base, peers, call, t_src, tid, cta, num_ctas, record, timeout_ns)
        self.grid_barrier(base + (self.signals + 4), (call * BARRIERS_PER_CALL + 1) * num_ctas, 0, SITE_D_BARRIER, tid,
                          me, record, timeout_ns)
        total = self.expert_offsets(offs, base, peers, stats, tid, lane, cta, num_ctas, True, me, record)
        self.pull(me, base, peers, offs, total, cta * WARPS + tid // WARP, num_ctas * WARPS, lane, record)


def compile_dispatch(cfg: EpCommConfig):
    """The compiled dispatch kernel for ``cfg`` (cached; compiles on a CPU under ``CUTE_DSL_ARCH``)."""
    from cutlass.cute.runtime import make_fake_stream

    def build():
        z32, z64 = Int32(0), Int64(0)
        return cute.compile(Dispatch(cfg), z32, z32, z64, z64, z64, z64, z64, Int32(1), make_fake_stream())

    return runtime.compiled(("comm.dispatch", cfg), build)


def dispatch(cfg: EpCommConfig, me: int, num_tokens: int, base: int, peers: torch.Tensor, stats: torch.Tensor | None,
             record: int, timeout_ns: int, num_ctas: int) -> None:
    """Launch dispatch on the current stream (arguments as the kernel's; ``stats`` int32 [E_l] or None)."""
    kernel = compile_dispatch(cfg)
    kernel(me, num_tokens, base, peers.data_ptr(), 0 if stats is None else stats.data_ptr(), record, timeout_ns,
           num_ctas, runtime.current_stream())
