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

The tile order, the counters, the waits, the signals, the ring and combine are the swap-AB kernel's.

On two-CTA clusters (``GemmConfig.cluster`` 2): ``MegaMoE128TokensMPairSm90``, the two CTAs of a cluster multiplying
one token tile with the two weight tiles of a pair, each loading half of each token box into both (``gemm_cluster``).
Why: at 8192 tokens/rank the single-CTA kernel is bound by L2 throughput (Nsight Compute, bench/findings/
recipe-128-mega.md); per CTA and 128-K chunk the pair moves 24 KB out of L2 instead of 32.

Every value equals the staged path's with the same copies bit for bit (``StagedMoE(..., e4m3_copy=True)``: the same
mainloop and epilogue arithmetic, ``mainloop_fp8_tokens_m``), and so the swap-AB kernel's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ...scheduler import tiles
from .. import ptx
from ..comm.phases import DSL_OPS
from .config import NEXT_TILE
from .epilogues import ScatterRowsTokensM, SwigluQuant128TokensMThreadStores
from .gemm_cluster import ClusterPairGemmSm90
from .mainloop_fp8_tokens_m import Fp8CopyTokensMMainloop
from .mega_moe import MegaMoESm90
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


HANDOFF_SLOTS = 16
"""Pair tiles rank 0's producer warp may hand to rank 1's ahead (``MegaMoE128TokensMPairSm90.following_tile``): at
least ``stages + 2``, so a slot is read before it is written again."""


class MegaMoE128TokensMPairSm90(ClusterPairGemmSm90, MegaMoE128TokensMSm90):
    """``MegaMoE128TokensMSm90`` on two-CTA clusters sharing each token tile (module docstring).

    Tile order: pair tile p is tile p of the bounded-ring order (``MegaMoESm90.next_tile``) with half the weight tiles
    per GEMM (``dims[1] / 2``, ``dims[3] / 2``: both even, the API checks); cluster rank r takes its weight tile
    ``2 * pair + r``. Cluster c's first pair tile is c; then rank 0's producer warp takes the next from the stream's
    counter (``TileChannel.fetch`` per cluster) and hands it to rank 1's through rank 1's shared memory
    (``following_tile``), so the clusters that run faster take more pair tiles and the order's deadlock freedom
    holds as with one CTA. Everything a tile counts or signals -- ``PULLED`` waits, ``L1_DONE`` of ``dims[1]`` tiles
    per block, ``L2_DONE`` -- is per 256-row tile as on one CTA.

    The handoff: slot ``seq % HANDOFF_SLOTS`` of rank 1's ``sComm`` words (after the Mega MoE kernel's,
    ``handoff_at``) takes the 64-bit word (seq + 1, pair tile) of the producer's ``seq``-th fetch (release /
    acquire at cluster scope); each producer counts its fetches in the word after the slots. Rank 0 writes slot i
    again only after rank 1 has read it: rank 0 fetches its ``seq``-th next tile once its loads of the tile before
    are issued, and those waited for rank 1's consumers to free stages of later tiles than slot ``seq -
    HANDOFF_SLOTS``'s (``HANDOFF_SLOTS`` >= stages + 2). Rank 1's wait has no limit of its own: rank 0's producer
    reaches each handoff unless one of its own timed waits reports and traps."""

    def __init__(self, config, comm, fast_math: bool = True):
        super().__init__(config, comm, fast_math)
        assert self.stages + 2 <= HANDOFF_SLOTS, self.stages

    def handoff_at(self) -> int:
        """The first ``sComm`` word of the handoff slots (8-byte aligned)."""
        return -(-MegaMoESm90.comm_words(self) // 2) * 2

    def comm_words(self) -> int:
        return self.handoff_at() + 2 * HANDOFF_SLOTS + 2

    def extra_smem_bytes(self) -> int:
        return MegaMoESm90.extra_smem_bytes(self) + 4 * (self.comm_words() - MegaMoESm90.comm_words(self))

    def handoff_words(self, comm):
        """The handoff slots (int32 pairs) and the fetch count: ``sComm`` (its first word ``comm``) from
        ``handoff_at``."""
        return cute.make_tensor(comm + self.handoff_at(), cute.make_layout(2 * HANDOFF_SLOTS + 1))

    @cute.jit
    def setup_groups(self, storage, groups, total_rows, sync, second, mega, tidx, bidx, gdim):
        """The handoff words zeroed on both CTAs before either producer hands a tile (a cluster barrier), then the
        Mega MoE kernel's dispatch."""
        words = self.handoff_words(storage.sComm.get_tensor(cute.make_layout(1)).iterator)
        for i in cutlass.range(tidx, 2 * HANDOFF_SLOTS + 1, self.threads):
            words[i] = Int32(0)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        return MegaMoESm90.setup_groups(self, storage, groups, total_rows, sync, second, mega, tidx, bidx, gdim)

    @cute.jit
    def following_tile(self, t, channel, sync, groups, gdim):
        """The producer warp: the next tile of this CTA, ``2 * pair + rank``: rank 0 takes the pair tile from the
        stream's counter and hands it on (class docstring), rank 1 waits for it."""
        words = self.handoff_words(groups.group_a.iterator)  # the expert offsets: sComm's first words
        seq = Int32(words[2 * HANDOFF_SLOTS])
        slot = (words.iterator + 2 * (seq % HANDOFF_SLOTS)).toint()
        rank = self.rank()
        pair = Int32(0)
        if cute.arch.lane_idx() == 0:
            if rank == 0:
                pair = ptx.atom_add(self.word(sync, groups.num_groups, NEXT_TILE), 1, "relaxed") + gdim // 2
                ptx.st_release_cluster_peer_u64(slot, Int32(1), seq + 1, pair)
            else:
                tag, pair = ptx.ld_acquire_cluster_shared_u64(slot)
                while tag != seq + 1:
                    tag, pair = ptx.ld_acquire_cluster_shared_u64(slot)
            words[2 * HANDOFF_SLOTS] = seq + 1
        cute.arch.sync_warp()
        return 2 * cute.arch.shuffle_sync(pair, 0) + rank

    @cute.jit
    def next_tile(self, t, phase, e, base, t_off, dims, groups, total_rows):
        """Tile ``t`` of the CTA order -> pair tile ``t // 2`` of the bounded-ring order, weight tile
        ``2 * pair + t % 2``."""
        pairs = (dims[0], dims[1] // self.cluster_size, dims[2], dims[3] // self.cluster_size)
        gemm, e, base, t_off, valid, row0, row_end, n_pair, block = MegaMoESm90.next_tile(
            self, t // self.cluster_size, phase, e, base, t_off, pairs, groups, total_rows)
        return gemm, e, base, t_off, valid, row0, row_end, n_pair * self.cluster_size + t % self.cluster_size, block

    @cute.jit
    def finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx):
        """The cluster barrier (the partner's last releases and multicasts have landed), then the last CTA's end of
        the call (``MegaMoESm90.finish``)."""
        ClusterPairGemmSm90.finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx)
        MegaMoESm90.finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx)
