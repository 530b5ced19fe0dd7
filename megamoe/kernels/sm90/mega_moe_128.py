"""The Mega MoE kernel under recipe (1, 1, 128) (CuTe DSL, sm_90a): ``MegaMoESm90`` with FP8-mode operands.

What differs from the recipe (1, 1, 32) kernel (``mega_moe``), each through a hook of it:

* the ring (``symm_buffer``): FP8 rows with one FP32 scale per 128 K (``l1_acts`` / ``l1_acts_sf``, ``l2_acts`` /
  ``l2_acts_sf``), half the bytes of the BF16 ring; the pull warps copy each token's FP8 bytes and scale words
  verbatim (``ring_phases``: ``comm.phases.Fp8RingPhases``);
* both GEMMs run the FP8 block-128 mainloop (``mainloops.Fp8Block128Mainloop``: one FP32 promotion per 128-K chunk
  with the token's scale) on weights whose block scales are folded into exact E4M3 relative to their row
  (``weight_layout.fold_fp8_scales``), each weight row times its FP32 scale after the K loop -- the scale of the
  tile's GEMM and of the expert that owns its pool block (``Fp8Block128MegaMainloop``); the producer loads each
  stage's token-scale box with its tokens (``load_tile``'s ``sfa``), so the scales wait with the rows they scale;
* the L1 epilogue is ``SwigluQuant128`` (FP8 + one FP32 scale per 128 intermediate columns into the L2 ring), which
  needs the 128 intermediate columns of a 256-row weight tile together. Both GEMMs run 256-row tiles (``mega.tile_config``)
  in one of two shapes: four consumer warpgroups of 64 rows, token tiles of at most
  ``config.FOUR_WG_FP8_MAX_TILE_TOKENS`` rows (small groups); or (``GemmConfig.n_passes`` 2) two sequential passes of
  128 rows on two consumer warpgroups with token tiles of ``config.TWO_PASS_TILE_TOKENS`` rows, so each decoded weight
  serves up to four times the tokens: the producer loads every K step of pass 0's weight rows, then of pass 1's (the
  same tokens and token scales again: L2 hits), the consumers run the mainloop and the epilogue per pass (L2: each pass
  stores its own 128 rows; L1: pass 0 stages its half of the 128 columns, pass 1 the other and quantizes the block).
  The tile order, the tile counts, the counters and the signals are per 256-row tile in both shapes;
* the L2 tiles, their stores into the source ranks' combine slots, the signals, combine and the ring schedule are
  the recipe-32 kernel's.

``mega_moe_128_tokens_m.MegaMoE128TokensMSm90`` extends this kernel to tiles with the tokens on the wgmma M side,
reading the weights' E4M3 copies.

Every value equals the staged path's bit for bit: ``grouped_gemm_fp8_fp4_swiglu_contiguous`` then
``grouped_gemm_fp8_fp4_contiguous`` on the same FP8 operands run the same mainloop and epilogue, with the same
rounding points (``megamoe.numerics``, recipe (1, 1, 128)), and combine sums the same BF16 rows in slot order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
from cutlass import Float32, cute

from ...scheduler import tiles
from ..comm.phases import DSL_OPS, Fp8RingPhases
from .args import RowScales
from .mainloops import Fp8Block128Mainloop
from .mega_moe import MegaMoESm90


class TileRowScales(NamedTuple):
    """A tile's folded row scales as the consumers hand them to the mainloop (``tile_row_scale``)."""

    l1: Any  # (2I, E_l) float32: L1's weight-row scales
    l2: Any  # (H, E_l) float32: L2's
    phase: Any  # Int32: the tile's GEMM (0: L1, 1: L2)
    firsts: Any  # shared int32 [E_l + 1]: the pool-block prefix (block -> expert)


class Fp8Block128MegaMainloop(Fp8Block128Mainloop):
    """``Fp8Block128Mainloop`` in a kernel of two GEMMs over pool blocks: the tile's ``group`` is its pool block and
    its row scales (``TileRowScales``) are chosen after the K loop, by GEMM and by the expert owning the block (a
    binary search of the block prefix in shared memory), so no register holds them across it."""

    def __init__(self, config, stages: int, cps: int, num_local_experts: int):
        super().__init__(config, stages, cps)
        self.num_local = num_local_experts

    @cute.jit
    def width_k_loops(self, ab_pipeline, f, width, ahead, release, k_tiles):
        """The token width's K loop as a chain of if / else from the narrowest width, the widest the last else: with
        one ``if`` per width ptxas serialized the wgmmas of the two-pass build at pro sizes (C7511)."""
        return self.width_chain(ab_pipeline, f, width, 0, ahead, release, k_tiles)

    @cute.jit
    def width_chain(self, ab_pipeline, f, width, w: cutlass.Constexpr[int], ahead, release, k_tiles):
        """``width_k_loops`` from width index ``w`` on."""
        if cutlass.const_expr(w == len(f.widths) - 1):
            ahead, release = self.k_loop(ab_pipeline, f, f.width_ops[w], ahead, release, k_tiles)
        else:
            if width == w:
                ahead, release = self.k_loop(ab_pipeline, f, f.width_ops[w], ahead, release, k_tiles)
            else:
                ahead, release = self.width_chain(ab_pipeline, f, width, w + 1, ahead, release, k_tiles)
        return ahead, release

    @cute.jit
    def row_scales(self, row_scale, row0, row1, group):
        """The FP32 scales of weight rows ``row0``, ``row1`` from ``row_scale.l1`` or ``.l2`` (``TileRowScales``), of
        the expert of pool block ``group``."""
        e = tiles.expert_of_block(group, row_scale.firsts, self.num_local, DSL_OPS)
        s0 = Float32(0.0)
        s1 = Float32(0.0)
        if row_scale.phase == 0:
            s0 = Float32(row_scale.l1[row0, e])
            s1 = Float32(row_scale.l1[row1, e])
        else:
            s0 = Float32(row_scale.l2[row0, e])
            s1 = Float32(row_scale.l2[row1, e])
        return s0, s1


class MegaMoE128Sm90(MegaMoESm90):
    """The one-launch Mega MoE kernel of recipe (1, 1, 128) for one SymmBuffer layout of that recipe (``comm``: its
    ``EpCommConfig``); ``config``: FP8 mode, ``token_block`` 128, ``tile_n`` 256, one pass or two
    (``mega.tile_config``)."""

    l1_epilogue = "swiglu_fp8"  # SwigluQuant128: FP8 + FP32 per-128 scales into l2_acts / l2_acts_sf
    folded = True
    ring_phases = Fp8RingPhases

    def __init__(self, config, comm, fast_math: bool = True):
        assert config.mma == "fp8" and config.token_block == 128 and config.tile_n == 256, config  # api checks
        super().__init__(config, comm, fast_math)

    def make_mainloop(self, folded: bool):
        return Fp8Block128MegaMainloop(self.cfg, self.stages, self.cps, self.comm.layout.num_local_experts)

    def kernel_row_scale(self, gemm, second):
        return RowScales(gemm.row_scale, second.gemm.row_scale)

    def tile_row_scale(self, row_scale, phase, groups):
        return TileRowScales(row_scale.l1, row_scale.l2, phase, groups.group_b)
