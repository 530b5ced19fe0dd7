"""The SM90 grouped GEMM on two- and four-CTA clusters: token tiles (and on four, weight tiles) multicast (CuTe DSL).

``GroupedGemmSm90`` with ``GemmConfig.cluster`` 2 (recipe (1, 1, 128), register decode or the E4M3 copy, separate
launches only). Why: a CTA tile of ``tile_tokens`` token rows and ``tile_n`` weight rows reads both from L2 for every
128-K chunk; a 128 x 128 tile of FP8 tokens and E4M3 weights moves 32 KB per chunk, and its consumers wait for
stages that arrive late (bench/findings/recipe-128-gemm.md: measured with tokens on the wgmma M side, where clusters
help the L1 shapes; the swap-AB copy, bound elsewhere, gains nothing). The two CTAs of a cluster multiply the same
token tile with the two weight tiles of a pair, and each TMA-loads half of the token box (``tile_tokens / 2`` rows)
into both CTAs' stage (multicast): per CTA and chunk, half the token bytes leave L2.

Tile order: a pair tile is (expert, token tile, weight-tile pair) in ``GroupTiles`` order with ``n_tiles / 2`` weight
tiles per token tile; cluster rank r takes weight tile ``2 * pair + r`` (N must be a multiple of ``2 * tile_n``: the
entry points check it). Cluster c takes pair tiles c, c + clusters, ... (a static order: both CTAs must take the same
pair, which the stream's counter, read by one of them, would not give without a cluster-wide handoff).

Pipeline: each CTA's consumers release a stage on both CTAs' empty barriers, so a producer multicasts into a stage
only once both have read it; a stage's full barrier counts the same bytes as without the cluster (the CTA still
receives the whole token box, half of it from its partner). The kernel ends with a cluster barrier: no CTA exits while
its partner may still arrive on its barriers or write its shared memory.

Four-CTA clusters (``GemmConfig.cluster`` 4, tokens on the wgmma M side only: ``ClusterQuadGemmSm90``): a 2 x 2 quad
of two token tiles by two weight tiles. Cluster rank r holds token tile ``r % 2`` and weight tile ``r // 2`` of the
quad (the pipeline's (V, M, N, K) layout (1, 2, 2, 1)); the two CTAs of a token tile share its box as the pair does,
and the two CTAs of a weight tile share its box the same way (each loads ``tile_n / 2`` rows into both). Per CTA and
chunk half the token and half the weight bytes leave L2 (a 128 x 128 tile: 16 KB instead of the pair's 24 and one
CTA's 32). A producer writes into three CTAs (its own, its token partner, its weight partner), so each stage is
released by the consumers of those three. Tile order: a quad tile is (expert, token-tile pair, weight-tile pair) in
``GroupTiles`` order with token tiles of ``2 * tile_tokens`` rows; the second token tile of a group's last pair may
start past the group's rows, and its CTA then multiplies rows it never stores (its loads still feed its partners).
Clusters of four must sit in one GPC, so fewer may be resident than SMs / 4: the launch takes the device's count of
active clusters (``api``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

from ..weight_layout import K_CHUNK
from .args import TmaOps
from .gemm import GroupedGemmSm90
from .tile_scheduler import GroupTiles


class ClusterPairGemmSm90(GroupedGemmSm90):
    """Two CTAs per cluster share each token tile (TMA multicast); every other part as ``GroupedGemmSm90``."""

    cluster_size = 2
    stage_writers = 2

    def cluster_layout(self):
        return cute.make_layout((1, self.cluster_size, 1, 1))

    def token_tma(self, a, smem_layout):
        """The tokens' multicast TMA atom: a CTA's load is ``tile_tokens / 2`` rows of the box, written into both
        CTAs that multiply the token tile."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), a, smem_layout,
                                           (self.tile_tokens, K_CHUNK), num_multicast=2)

    def rank(self):
        """This CTA's rank in its cluster."""
        return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())

    def token_box_share(self):
        return self.rank(), cute.make_layout(2)

    def token_mask(self):
        """The CTAs (bit per rank) that multiply this CTA's token tile: both of the pair."""
        return cutlass.Int16(0b11)

    def copy_tokens(self, ops: TmaOps, src, dst, bar):
        """This CTA's half of the token box, into the same stage slot of both CTAs of the token tile."""
        cute.copy(ops.atom_a, src, dst, tma_bar_ptr=bar, mcast_mask=self.token_mask())

    def following_tile(self, t: Int32, channel, sync: Int64, groups, gdim: Int32) -> Int32:
        """Static order: CTA ``b`` takes tiles ``b, b + gdim, ...`` (``gdim`` a multiple of the cluster size: the CTAs
        of a cluster, ranks ``b % cluster_size``, the same pair or quad tile)."""
        return t + gdim

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, groups, total_rows: Int32):
        """Tile ``t`` of the CTA order -> pair tile ``t // 2`` of the group order, weight tile ``2 * pair + t % 2``."""
        e, base, valid, row0, row_end, n_pair = self.tiles.find(t // self.cluster_size, e, base,
                                                                dims[1] // self.cluster_size, groups, total_rows)
        return phase, e, base, t_off, valid, row0, row_end, n_pair * self.cluster_size + t % self.cluster_size, e

    def finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx):
        """Every thread: the cluster barrier (the partner's last releases and multicasts have landed)."""
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


class ClusterQuadGemmSm90(ClusterPairGemmSm90):
    """Four CTAs per cluster, a 2 x 2 quad of token and weight tiles (module docstring): rank r multiplies token tile
    ``r % 2`` with weight tile ``r // 2``, and shares the loads of both boxes with the CTA of the same token tile
    (ranks ``r % 2``, ``r % 2 + 2``) and the CTA of the same weight tile (ranks ``2 (r // 2)``, ``2 (r // 2) + 1``).
    Tokens on the wgmma M side only (the weights' E4M3 copy: ``E4M3CopyOperand``'s boxes)."""

    cluster_size = 4
    stage_writers = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quads = GroupTiles(self.group_mode, 2 * self.tile_tokens)  # token-tile pairs

    def cluster_layout(self):
        return cute.make_layout((1, 2, 2, 1))

    def token_box_share(self):
        return self.rank() // 2, cute.make_layout(2)

    def token_mask(self):
        return cutlass.Int16(0b0101 << (self.rank() % 2))

    def weight_tma(self, g2s, w, smem_layout):
        """The weights' multicast TMA atom: a CTA's load is ``tile_n / 2`` rows of the box, written into both CTAs
        that multiply the weight tile."""
        return self.mainloop.weight_tma(cpasync.CopyBulkTensorTileG2SMulticastOp(), w, smem_layout, num_multicast=2)

    def weight_box_share(self):
        return self.rank() % 2, cute.make_layout(2)

    def copy_weights(self, ops: TmaOps, src, dst, bar):
        """This CTA's half of the weight box, into the same stage slot of both CTAs of the weight tile."""
        cute.copy(ops.atom_w, src, dst, tma_bar_ptr=bar, mcast_mask=cutlass.Int16(0b11 << (2 * (self.rank() // 2))))

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, groups, total_rows: Int32):
        """Tile ``t`` of the CTA order -> quad tile ``t // 4`` of the group order; rank ``t % 4``: token tile
        ``t % 2`` of the quad's pair, weight tile ``2 * pair + t % 4 // 2``."""
        e, base, valid, row0, row_end, n_pair = self.quads.find(t // 4, e, base, dims[1] // 2, groups, total_rows)
        return (phase, e, base, t_off, valid, row0 + t % 2 * self.tile_tokens, row_end, n_pair * 2 + t % 4 // 2, e)
