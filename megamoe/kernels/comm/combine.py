"""The staged combine kernel (BF16 Mega MoE, ``megamoe.bf16_mega_moe``): protocol combine steps 1-4 of
``megamoe.kernels.comm``: push every ring row to its source rank, exchange ``done``, sum each token's slots."""

from __future__ import annotations

import cutlass
import torch
from cutlass import Int32, Int64, cute

from .. import ptx, runtime
from .phases import EpPhases
from .protocol import BARRIERS_PER_CALL, SITE_C_BARRIER, THREADS, VEC, WARP, WARPS, EpCommConfig


class Combine(EpPhases):
    """The combine kernel (module docstring, steps 1-4)."""

    @cute.jit
    def __call__(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, rows: Int64, y: Int64, record: Int64,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(me, num_tokens, base, peers, rows, y, record, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, rows: Int64, y: Int64, record: Int64,
               timeout_ns: Int64):
        cfg = self.cfg
        hidden = self.hidden
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        gw = cta * WARPS + tid // WARP
        call = self.current_call(base)

        # 1. Push every ring row to its source rank's combine area.
        total = ptx.ld_cg_u32(base + (cfg.offset("expert_offsets") + self.num_local * 4))
        row_vecs = hidden * 2 // VEC
        units = self.units(row_vecs)
        for u in cutlass.range(gw, total * units, num_ctas * WARPS):
            row = u // units
            dst = ptx.ld_cg_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8))
            self.copy_unit(rows + Int64(row) * (hidden * 2), dst, row_vecs, u - row * units, lane)
        ptx.fence_acq_rel_sys()

        # 2-4. Rows are out: tell every rank, wait until every rank's rows are in, sum, reset.
        self.grid_barrier(base + (self.signals + 4), (call * BARRIERS_PER_CALL + 2) * num_ctas, 1, SITE_C_BARRIER, tid,
                          me, record, timeout_ns)
        self.exchange_done(me, base, peers, call, tid, cta, record, timeout_ns)
        self.sum_tokens(base, num_tokens, y, gw, num_ctas * WARPS, lane)
        if cta == 0:
            self.finish_call(base, call, tid)


def compile_combine(cfg: EpCommConfig):
    """The compiled combine kernel for ``cfg`` (``has_stats`` plays no part)."""
    from cutlass.cute.runtime import make_fake_stream

    cfg = EpCommConfig(cfg.layout, cfg.debug)

    def build():
        z32, z64 = Int32(0), Int64(0)
        return cute.compile(Combine(cfg), z32, z32, z64, z64, z64, z64, z64, z64, Int32(1), make_fake_stream())

    return runtime.compiled(("comm.combine", cfg), build)


def combine(cfg: EpCommConfig, me: int, num_tokens: int, base: int, peers: torch.Tensor, rows: torch.Tensor,
            y: torch.Tensor, record: int, timeout_ns: int, num_ctas: int) -> None:
    """Launch combine on the current stream: ``rows`` BF16 [ring, H] (L2 outputs), ``y`` BF16 [T, H]."""
    kernel = compile_combine(cfg)
    kernel(me, num_tokens, base, peers.data_ptr(), rows.data_ptr(), y.data_ptr(), record, timeout_ns, num_ctas,
           runtime.current_stream())
