"""The SM90 grouped GEMM on two-CTA clusters: each token tile multicast to both CTAs (CuTe DSL).

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
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

from ..weight_layout import K_CHUNK
from .args import TmaOps
from .gemm import GroupedGemmSm90


class ClusterPairGemmSm90(GroupedGemmSm90):
    """Two CTAs per cluster share each token tile (TMA multicast); every other part as ``GroupedGemmSm90``."""

    cluster_size = 2

    def cluster_layout(self):
        return cute.make_layout((1, self.cluster_size, 1, 1))

    def token_tma(self, a, smem_layout):
        """The tokens' multicast TMA atom: a CTA's load is ``tile_tokens / 2`` rows of the box, written into both
        CTAs."""
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), a, smem_layout,
                                           (self.tile_tokens, K_CHUNK), num_multicast=self.cluster_size)

    def token_box_share(self):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return rank, cute.make_layout(self.cluster_size)

    def copy_tokens(self, ops: TmaOps, src, dst, bar):
        """This CTA's half of the token box, into the same stage slot of both CTAs."""
        cute.copy(ops.atom_a, src, dst, tma_bar_ptr=bar, mcast_mask=cutlass.Int16((1 << self.cluster_size) - 1))

    def following_tile(self, t: Int32, channel, sync: Int64, groups, gdim: Int32) -> Int32:
        """Static order: CTA ``b`` takes tiles ``b, b + gdim, ...`` (``gdim`` even: both CTAs of a cluster, ranks
        ``b % 2``, the same pair tile ``t // 2``)."""
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
