"""The Mega MoE kernel of recipe (1, 1, 128) with tokens on the wgmma M side (CuTe DSL, sm_90a): ``MegaMoE128Sm90``
on the tiles of ``gemm_tokens_m``, reading the weights' E4M3 copies.

Why: in the swap-AB kernel (``mega_moe_128``) each consumer thread decodes its FP4 weight rows to E4M3 in registers
and, at every 128-K promotion, loads ``tile_tokens / 4`` token scales; the separate GEMMs with tokens on M and the
weights' E4M3 copy (``mainloop_fp8_tokens_m``: TMA loads the copy straight into the wgmma's B tile, two token scales
per thread and chunk) ran L1 with its SwiGLU epilogue 1.55-2.14x faster at the same shapes
(bench/findings/recipe-128-gemm.md). This kernel runs both GEMMs of the layer that way.

What differs from ``MegaMoE128Sm90``, each through a hook:

* the mainloop (``Fp8CopyTokensMMegaMainloop``): ``mainloop_fp8_tokens_m``'s, each weight column times its row's FP32
  scale of the tile's GEMM and of the expert owning its pool block (``TileRowScales``) after the K loop;
* the weights: both GEMMs' ``GemmArgs.w`` are their E4M3 copies (``weight_layout.e4m3_weight_copy``, (N, K, E)
  float8_e4m3fn, TMA boxes of ``pass_n`` rows x 128 K), the folded scale words as before;
* L1's epilogue: ``SwigluQuant128TokensMThreadStores`` (``SwigluQuant128TokensM``'s bytes into the L2 ring, the
  warps' threads storing the rows, so the signal warp's release covers them), on 256-row tiles as two passes of 128
  weight rows (``GemmConfig.n_passes``) on token tiles of 128 rows (two consumer warpgroups; the one-warpgroup
  build of 64-row tiles spills registers, and the API refuses it);
* L2's epilogue: ``ScatterRowsTokensM``, each warp's BF16 rows to their source ranks' combine slots, staged in the
  warp's own rows of the SwiGLU staging tile (``epilogue_smem``).

The tile order, the counters, the waits, the signals, the ring and combine are the swap-AB kernel's. Every value
equals the staged path's with the same copies bit for bit (``StagedMoE(..., e4m3_copy=True)``: the same mainloop and
epilogue arithmetic, ``mainloop_fp8_tokens_m``), and so the swap-AB kernel's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ...scheduler import tiles
from ..comm.phases import DSL_OPS
from .epilogues import ScatterRowsTokensM, SwigluQuant128TokensMThreadStores
from .mainloop_fp8_tokens_m import Fp8CopyTokensMMainloop
from .mega_moe_128 import MegaMoE128Sm90


class Fp8CopyTokensMMegaMainloop(Fp8CopyTokensMMainloop):
    """``Fp8CopyTokensMMainloop`` in a kernel of two GEMMs over pool blocks: the tile's ``group`` is its pool block and
    its column scales come from ``TileRowScales`` (the tile's GEMM, the expert of the block: a binary search of the
    block prefix in shared memory), loaded at the tile's start."""

    def __init__(self, config, stages: int, cps: int, num_local_experts: int):
        super().__init__(config, stages, cps)
        self.num_local = num_local_experts

    @cute.jit
    def k_loops(self, ab_pipeline, state, f, k_tiles, row0, row_end):
        """A consumer warpgroup none of whose 64 token rows lies in the tile's pool block (``row_end``: its last
        tile) only waits for and frees each stage (``k_loop`` without wgmmas): its accumulator stays zero and is
        never stored, and the other warpgroup's wgmmas have the tensor pipe to themselves."""
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1  # consumer warpgroups follow the producer's
        if row0 + 64 * wg < row_end:
            state = self.k_loop(ab_pipeline, state, f, k_tiles, True)
        else:
            state = self.k_loop(ab_pipeline, state, f, k_tiles, False)
        return state

    @cute.jit
    def column_scales(self, cC, row_scale, n_tile, group):
        """The FP32 scales of the thread's ``tile_n / 4`` weight columns (value c + 2j: column 8j + 2q + c of the
        pass ``n_tile``) from ``row_scale.l1`` or ``.l2``, of the expert of pool block ``group``. Each branch loads
        into ``out`` itself: storing the base class's fragment from either branch made ptxas spill."""
        e = tiles.expert_of_block(group, row_scale.firsts, self.num_local, DSL_OPS)
        col0 = n_tile * self.tile_n + cC[0][1]  # the thread's first column
        out = cute.make_rmem_tensor((self.tile_n // 4,), Float32)
        if row_scale.phase == 0:
            for j in cutlass.range_constexpr(self.tile_n // 8):
                for c in cutlass.range_constexpr(2):
                    out[c + 2 * j] = Float32(row_scale.l1[col0 + 8 * j + c, e])
        else:
            for j in cutlass.range_constexpr(self.tile_n // 8):
                for c in cutlass.range_constexpr(2):
                    out[c + 2 * j] = Float32(row_scale.l2[col0 + 8 * j + c, e])
        return out


class MegaMoE128TokensMSm90(MegaMoE128Sm90):
    """The one-launch Mega MoE kernel of recipe (1, 1, 128) with tokens on the wgmma M side (module docstring);
    ``config``: ``mega.tile_config``'s with the copies, token_side "m", decode "copy", tile_n 256 in two passes."""

    def __init__(self, config, comm, fast_math: bool = True):
        assert config.token_side == "m" and config.decode == "copy" and config.n_passes == 2, config  # api checks
        super().__init__(config, comm, fast_math)
        self.out_stride = 2 * self.act_stride  # BF16 elements per staged L2 row: the SwiGLU staging rows
        self.l2_epilogue = ScatterRowsTokensM(config, self.out_stride)

    def make_mainloop(self, folded: bool):
        return Fp8CopyTokensMMegaMainloop(self.cfg, self.stages, self.cps, self.comm.layout.num_local_experts)

    def make_epilogue(self, epilogue: str, fast_math: bool):
        return SwigluQuant128TokensMThreadStores(self.cfg, fast_math)

    def epilogue_smem(self, storage):
        """One region serves both epilogues: the SwiGLU staging tile (tokens, ``act_stride``) float32 and, over the
        same rows, L2's BF16 rows (tokens, ``out_stride`` = 2 * ``act_stride``) bf16. Both epilogues touch only their
        warp's 16 rows (warp w: rows 16w ..), one tile after the other."""
        sAct = storage.sAct.get_tensor(cute.make_layout((self.tile_tokens, self.act_stride), stride=(self.act_stride, 1)))
        out_layout = cute.make_layout((self.tile_tokens, self.out_stride), stride=(self.out_stride, 1))
        return sAct, cute.make_tensor(cute.recast_ptr(sAct.iterator, dtype=cutlass.BFloat16), out_layout)
