"""Recipe (1, 1, 128) reading a precomputed E4M3 copy of the folded weights (``GemmConfig(decode="copy")``): no
decode at all. SS wgmma e4m3 x e4m3 as in ``mainloop_fp8_smem`` (weights on the wgmma M side, 64 rows per consumer
warpgroup, tokens on N: the register mainloops' accumulator layout, so every epilogue applies as it is).

Why: the register decode (``Fp8Block128Mainloop``) spends consumer issue slots on the E2M1 -> E4M3 decode beside the
wgmmas, and the shared-memory decode (``Fp8SmemMainloop``) cannot decode a tile per chunk time on three warps. A
compute-bound call (thousands of token rows per expert) can afford one byte per weight, and this mainloop also shows
what the block-128 FP8 K loop reaches with no decode at all (bench/findings/recipe-128-gemm.md: the decode is part of
the gap to an FP8 GEMM, not all of it). ``weight_layout.e4m3_weight_copy`` makes, once at weight-load time, the
E4M3 values ``v * 2**d`` the decode would make, and the producer's TMA loads each stage's ``tile_n`` x 128 tile of
them straight into the 128-byte swizzled K-major layout the SS wgmma descriptor reads (one 128-byte row per weight
row and chunk: the swizzle atom's row). The producer warpgroup's warps 1-3 idle, as in the register-decode kernel.

Per stage ``s`` of the kernel's TMA pipeline (tokens, the weights' E4M3 tile, the folded scale words -- loaded with
the stage but not read: 4 bytes per row and chunk -- and the tokens' FP32 scales): the consumers wait for the stage,
load their token scales straight from the stage's scale box, issue the chunk's four ``m64 n{tokens} k32`` wgmmas into
a temporary (the first overwrites it), wait, free the stage and promote ``acc += tmp * s_token``, exactly as ``Fp8SmemMainloop`` (whose K loop this class runs, hooks ``weight_tile``, ``wait_weights``,
``token_scales``). After the K loop each weight row is multiplied by its FP32 scale (``apply_row_scales``).

Arithmetic: the same E4M3 values (``e4m3_weight_copy`` is exact), the same four k32 wgmmas per chunk in the same
order into a fresh temporary, the same FP32 promotion and row scale as the register and shared-memory decodes.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, cute
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..weight_layout import K_CHUNK
from .config import GemmConfig
from .mainloop_fp8_smem import Fp8SmemMainloop
from .mainloops import Mainloop


class E4M3CopyOperand:
    """The weights' operand of the mainloops that read their E4M3 copy (this module's, ``mainloop_fp8_tokens_m``):
    each stage's ``tile_n`` x 128 tile of the copy, TMA-loaded into the 128-byte swizzled K-major layout the SS wgmma
    descriptor reads (``Mainloop``'s weight hooks)."""

    def weight_smem_layout(self, slots: int):
        """(tile_n, 128, slots) E4M3, 128-byte swizzled K-major: the decode's stage layout (``decoded_layout``), here
        the TMA's destination and the wgmmas' source."""
        return cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.a_dtype),
            (self.tile_n, K_CHUNK, slots),
            order=(0, 1, 2),
        )

    def weight_tma(self, g2s, w, smem_layout, num_multicast: int = 1):
        """The copy ((N, K, E) E4M3, K contiguous) in ``tile_n`` x 128 boxes; the atom takes the swizzle from
        ``smem_layout``. ``num_multicast``: CTAs sharing each box (``gemm_cluster``'s quad: 2, with a multicast
        ``g2s``)."""
        return cpasync.make_tiled_tma_atom(g2s, w, smem_layout, (self.tile_n, K_CHUNK), num_multicast=num_multicast)

    def weight_smem(self, region, layout):
        """The stage slots as the swizzled E4M3 tensor of ``layout``."""
        return region.get_tensor(layout.outer, swizzle=layout.inner, dtype=self.a_dtype)


class Fp8CopyMainloop(E4M3CopyOperand, Fp8SmemMainloop):
    """FP8 tokens with one FP32 scale per 128 K x the weights' precomputed E4M3 copy, loaded by TMA into the SS wgmma
    tile (module docstring). ``config``: FP8 mode, ``token_block`` 128, one CTA per SM, decode "copy" (``GemmConfig``
    checks); the kernel's ``GemmArgs.w`` is the copy, (N, K, E) float8_e4m3fn with K contiguous."""

    stage_reader_warps = 0  # no decode warps: warps 1-3 idle
    producer_regs = None  # the kernel's choice, as the register mainloops'
    shared_state = Mainloop.shared_state  # no shared memory or barriers of its own
    helper_warps = Mainloop.helper_warps

    def __init__(self, config: GemmConfig, stages: int, cps: int):
        Mainloop.__init__(self, config, stages, cps)  # not the decode's stages, barriers and table (none here)
        assert cps == 1 and config.decode == "copy"  # FP8 mode: one 128-K chunk per stage

    def weight_tile(self, sW, dec):
        """The TMA's stage slots themselves."""
        return sW

    @cute.jit
    def fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec):
        """``Fp8SmemMainloop.fragments`` and the tokens' FP32 scales of every stage (``sfa``: (token, 4 chunks,
        stage), the TMA's box)."""
        f = Fp8SmemMainloop.fragments(self, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, dec)
        f.sfa = cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=Float32), sSFA.layout)
        return f

    def wait_weights(self, f, state):
        """Nothing (no code): the TMA stage the consumers waited for holds the weights."""

    @cute.jit
    def token_scales(self, f, kt, s):
        """Chunk ``kt``'s token scales into ``f.sa`` (value c + 2j: column 8j + 2q + c): word kt % 4 of each column's
        4-chunk box in stage ``s`` (the four lane quads' loads hit different banks)."""
        for j in cutlass.range_constexpr(self.tile_tokens // 8):
            for c in cutlass.range_constexpr(2):
                f.sa[c, j] = f.sfa[8 * j + 2 * f.q + c, kt % 4, s]
