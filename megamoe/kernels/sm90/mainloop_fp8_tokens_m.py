"""Recipe (1, 1, 128) with tokens on the wgmma M side (``GemmConfig(token_side="m")``): SS wgmma e4m3 x e4m3, 64
token rows per consumer warpgroup (A: the tokens' TMA tile), the weights' E4M3 copy on N (B: ``tile_n`` weight rows,
the same TMA tile as ``mainloop_fp8_copy``), FP32 accumulator.

Why: in the swap-AB orientation (``mainloop_fp8_copy``) a consumer thread's accumulator covers ``tile_tokens / 4``
token columns, so each 128-K promotion ``acc += tmp * s_token`` first loads that many token scales from shared memory
(34 loads per chunk at 128 tokens: the largest stall of the copy kernel, bench/findings/recipe-128-gemm.md). Here a
thread's accumulator covers two token rows (``g`` and ``g + 8`` of its warp's 16) and ``tile_n / 4`` weight columns:
two scale loads per chunk, and the weights' per-row FP32 scale becomes a per-column multiply once per tile. This is
the orientation of DeepGEMM's SM90 FP8 GEMMs for large token counts; small groups keep swap-AB (wgmma N steps of 8
token columns, where M here pads every tile to 64 token rows per warpgroup).

Per stage ``s`` of the kernel's TMA pipeline (tokens, the weights' E4M3 tile, their folded scale words -- loaded but
not read -- and the tokens' FP32 scale box of four chunks): each consumer warpgroup waits for the stage, loads its
thread's two token scales of the chunk (word ``kt % 4`` of the box), issues the chunk's four ``m64 n{tile_n} k32``
wgmmas into a temporary (the first overwrites it), waits, frees the stage and promotes ``acc += tmp * s_row``, one
FP32 multiply-add per accumulator; the other consumer warpgroup's wgmmas run meanwhile. After the K loop each column
is multiplied by its weight row's FP32 scale (exact: a power of two), loaded at the tile's start.

Arithmetic: per (token, weight row) the same E4M3 products in the same four k32 wgmmas per chunk into a fresh FP32
temporary, the same promotion and the same row scale as the swap-AB mainloops; the GPU tests find the outputs equal
to the swap-AB E4M3 copy's bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import GemmConfig
from .mainloop_fp8_copy import E4M3CopyOperand
from .mainloops import Mainloop, make_tiled_mma


class Fp8CopyTokensMMainloop(E4M3CopyOperand, Mainloop):
    """FP8 tokens with one FP32 scale per 128 K (wgmma A, M side) x the weights' E4M3 copy (wgmma B, N side) (module
    docstring). ``config``: ``token_side`` "m" (``GemmConfig`` checks: decode "copy", one CTA per SM, 64 or 128 token
    rows, 64 or 128 weight rows); the kernel's ``GemmArgs.w`` is the copy, (N, K, E) float8_e4m3fn with K
    contiguous (``E4M3CopyOperand``). No shared memory, barriers or warps of its own: warps 1-3 idle."""

    a_dtype = cutlass.Float8E4M3FN

    def __init__(self, config: GemmConfig, stages: int, cps: int):
        super().__init__(config, stages, cps)
        assert cps == 1 and config.decode == "copy" and config.token_side == "m"
        assert self.num_consumer_wg == self.tile_tokens // 64

    def tiled_mma(self, tokens: int):
        """``tokens`` token rows (64 per consumer warpgroup, wgmma M) x ``tile_n`` weight columns (wgmma N), both from
        shared memory, K-major."""
        return make_tiled_mma(self.a_dtype, self.tile_n, tokens // 64, smem_a=True)

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        """The tokens' (A) and the weights' (B) wgmma descriptors of every stage, the accumulator and the temporary
        (value i = c + 2*r + 4*j: token row g + 8r of the thread's warp, weight column 8j + 2q + c; ``cC[i]`` =
        (token row, weight column) in the tile), the thread's two token rows (``rows``) and the stages' token scales
        (``sfa``: (token, 4 chunks, stage) float32, the TMA's box)."""
        tt, tn = self.tile_tokens, self.tile_n
        thr_mma = tiled_mma.get_slice(ctidx)
        acc_shape = ((2, 2, tn // 8), 1, 1)
        # The tokens' descriptors depend on the warpgroup only: sliced at a warp-uniform index, so ptxas keeps them in
        # uniform registers (sliced at the thread, it moved each with R2UR before its wgmma).
        thr_wg = tiled_mma.get_slice(cute.arch.make_warp_uniform(ctidx // 128) * 128)
        f = SimpleNamespace(
            tCrA=thr_wg.make_fragment_A(thr_wg.partition_A(sA)),  # (MMA, MMA_M, k blocks, stages)
            tCrB=thr_mma.make_fragment_B(thr_mma.partition_B(sW)),  # (MMA, MMA_N, k blocks, stages)
            acc=cute.make_rmem_tensor(acc_shape, Float32),
            tmp=cute.make_rmem_tensor(acc_shape, Float32),
            cC=thr_mma.partition_C(cute.make_identity_tensor((tt, tn))),
            sfa=cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=Float32), sSFA.layout),
        )
        f.rows = (f.cC[0][0], f.cC[2][0])
        f.mma_first, f.mma_acc = self.chunk_mmas(tiled_mma, tt)
        return f

    @cute.jit
    def tile(self, ab_pipeline, state, release, f, k_tiles, row0, row_end, row_scale, n_tile, group):
        """One tile's K loop into ``f.acc`` (zeroed by the caller), then each weight column times its row's scale
        (``row_scale``: (N, E) float32, row ``n_tile * tile_n + column`` of expert ``group``). ``release``: unused
        (returned as is)."""
        col_scales = self.column_scales(f.cC, row_scale, n_tile, group)  # loaded now, used after the K loop
        state = self.k_loops(ab_pipeline, state, f, k_tiles, row0, row_end)
        acc = f.acc
        # Folded weight scales: each accumulator column times its weight row's FP32 scale (exact: a power of two).
        for j in cutlass.range_constexpr(self.tile_n // 8):
            for c in cutlass.range_constexpr(2):
                acc[c + 4 * j] = acc[c + 4 * j] * col_scales[c + 2 * j]
                acc[c + 2 + 4 * j] = acc[c + 2 + 4 * j] * col_scales[c + 2 * j]
        return state, release

    @cute.jit
    def k_loops(self, ab_pipeline, state, f, k_tiles, row0, row_end):
        """The tile's K loop (``k_loop`` with its wgmmas) for the tile's rows ``[row0, row_end)``: here every consumer
        warpgroup runs it. Returns the advanced pipeline state."""
        return self.k_loop(ab_pipeline, state, f, k_tiles, True)

    @cute.jit
    def k_loop(self, ab_pipeline, state, f, k_tiles, mma: cutlass.Constexpr[bool]):
        """The tile's K steps: wait for each stage, with ``mma`` load the thread's two token scales of the chunk
        (word ``kt % 4`` of the stage's box) and issue its wgmmas into ``f.tmp``, free the stage, promote
        ``acc += tmp * s_row``; without, only wait and free. Returns the advanced pipeline state."""
        acc, tmp, sfa = f.acc, f.tmp, f.sfa
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.consumer_wait(state)
            if cutlass.const_expr(mma):
                s = state.index
                s0 = sfa[f.rows[0], kt % 4, s]  # the chunk's scales of the thread's two token rows, before the wgmmas
                s1 = sfa[f.rows[1], kt % 4, s]
                self.chunk_wgmmas(f, tmp, s)
                ab_pipeline.consumer_release(state)
                state.advance()
                for j in cutlass.range_constexpr(self.tile_n // 8):
                    for c in cutlass.range_constexpr(2):
                        acc[c + 4 * j] = acc[c + 4 * j] + tmp[c + 4 * j] * s0
                        acc[c + 2 + 4 * j] = acc[c + 2 + 4 * j] + tmp[c + 2 + 4 * j] * s1
            else:
                ab_pipeline.consumer_release(state)
                state.advance()
        return state

    @cute.jit
    def column_scales(self, cC, row_scale, n_tile, group):
        """The FP32 scales of the thread's ``tile_n / 4`` weight columns (value c + 2j: column 8j + 2q + c of the
        tile), loaded at the tile's start so that their latency hides under the K loop."""
        scales = row_scale[(None, group)]  # (N,): expert ``group``'s row scales
        col0 = n_tile * self.tile_n + cC[0][1]  # the thread's first column
        out = cute.make_rmem_tensor((self.tile_n // 4,), Float32)
        for j in cutlass.range_constexpr(self.tile_n // 8):
            for c in cutlass.range_constexpr(2):
                out[c + 2 * j] = Float32(scales[col0 + 8 * j + c])
        return out
