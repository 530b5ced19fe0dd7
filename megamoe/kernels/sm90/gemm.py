"""The SM90 grouped GEMM kernel class (CuTe DSL): FP4 expert weights dequantized in registers, RS wgmma."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from ... import timeline
from ...scheduler import tiles
from .. import dequant, ptx
from ..comm.phases import DSL_OPS, EpPhases
from ..comm.protocol import RECORD_WORDS, SITE_C_BARRIER, SITE_D_BARRIER
from ..warp_ops import nth_set_bit, warp_inclusive_sum
from ..weight_layout import BF16_ACC_SHIFT, CHUNK_BYTES, E4M3_LUT_HI, E4M3_LUT_LO, K_CHUNK, ROW_BLOCK
from .config import (ALL_L1, DEFERRED_MAX_TILE_TOKENS, FINISHED, GRID, L1_DONE, L2_DONE, MEGA_HEADER, NEXT_TILE, PULLED,
                     SCATTER_PAD, TILE_SLOTS, TILE_WORDS, GemmConfig, mega_comm_words, mega_max_blocks, mega_smem_bytes,
                     named_barriers, token_widths)


class Sm90Fp4GroupedGemm:
    """One compiled variant: ``GemmConfig`` (incl. the MMA mode) x group mode ("offsets", "offsets_counts",
    "masked") x epilogue ("bf16": D [M, N] BF16; "swiglu_fp8": SwiGLU of interleaved gate/up rows, FP8
    [M, N/2] + UE8M0; "swiglu_fp8_bf16": those FP8 values as BF16 [M, N/2]; "bf16_scatter": BF16 rows to
    per-row addresses; "l1_l2": "swiglu_fp8_bf16" into the second GEMM's tokens, then that GEMM with
    "bf16_scatter", in one launch) x debug ("l1_l2": the wait is timed and reports with printf; any
    function call in a kernel makes ptxas serialize all its wgmmas, C7510, so only debug builds have one) x
    fast_math (the SwiGLU epilogues' silu: approximate exp and reciprocal, or IEEE exp and division)."""

    def __init__(self, config: GemmConfig, group_mode: str, epilogue: str = "bf16", debug: bool = False,
                 comm=None, folded: bool = False, fast_math: bool = True):
        self.cfg = config
        self.fast_math = fast_math
        # FP8 mode, folded weight scales (``weight_layout.fold_fp8_scales``): the decode applies each block's
        # scale relative to its row's, the promotion multiplies by the token's scale alone, the epilogue by the
        # row's scale.
        self.folded = folded
        self.wide = config.wide_fp8
        self.comm = comm  # "l1_l2" + EpCommConfig: the one-launch Mega MoE kernel (see mega_moe_sm90)
        self.trace = comm is not None and comm.trace  # phase timestamps into record (megamoe.timeline)
        self.debug = debug
        self.bf16 = config.mma == "bf16"
        # FP8 mode, 8-row token tiles: a chunk's four k32 wgmmas into four temporaries, one wait, four promotions.
        self.deferred = not self.bf16 and config.tile_tokens <= DEFERRED_MAX_TILE_TOKENS
        self.group_mode = group_mode
        self.epilogue = epilogue
        self.fused = epilogue == "l1_l2"  # L1 tiles (swiglu_fp8_bf16), then L2 tiles (bf16_scatter)
        # Separate launches (not "l1_l2", not Mega MoE) take their tiles from a counter (``fetch_tile``; ``sync``:
        # ``tile_counters``), so CTAs that run faster take more tiles; the producer warp publishes each tile.
        self.dynamic = comm is None and not self.fused
        self.published = comm is not None or self.dynamic
        assert self.dynamic or not folded  # compile_grouped_gemm: folded scales in separate launches only
        self.swiglu = epilogue.startswith("swiglu") or self.fused
        self.swiglu_bf16 = epilogue == "swiglu_fp8_bf16" or self.fused
        self.scatter = epilogue == "bf16_scatter" or self.fused
        self.out_stride = config.tile_n + SCATTER_PAD  # BF16 elements per staged row (scatter)
        self.tile_tokens = config.tile_tokens
        self.tile_n = config.tile_n
        self.num_consumer_wg = config.consumer_warpgroups
        self.stages = config.num_stages(epilogue, mega_smem_bytes(comm))
        self.cps = config.chunks_per_stage(epilogue)  # 128-K chunks per stage: chunk c of stage s lies in slot s * cps + c % cps
        self.act_stride = config.tile_n // 2 + 4  # FP32 activations per token row in smem (padded)
        self.threads = 128 * (1 + self.num_consumer_wg)
        # One CTA per SM: move registers from the producer warpgroup to the consumers (setmaxnreg).
        # Two CTAs per SM: every warp keeps the launch allocation (<= 64K / (2 * threads)); an
        # increase could wait forever for registers the other CTA holds.
        self.rebalance_registers = config.ctas_per_sm == 1
        # setmaxnreg.inc draws on the registers the CTA's other warps released (the pool is the launch
        # allocation, 64K / threads per thread, multiples of 8): the consumers get the launch count plus their
        # share of what the producer warpgroup gives back (1 / 2 consumer warpgroups: 240 / 232; 4: 112 with a
        # 32-register producer up to 32-row token tiles, 104 with 40 at 64 rows -- ptxas of CUDA 13.0 serializes
        # the wgmmas (C7512) of 32-row tiles at 104 and of 64-row tiles at 112).
        four_small = self.num_consumer_wg == 4 and config.tile_tokens <= 32
        self.producer_regs = 32 if four_small else 40
        launch_regs = min(65536 // self.threads, 255) // 8 * 8
        self.consumer_regs = min(240, (launch_regs + (launch_regs - self.producer_regs) // self.num_consumer_wg) // 8 * 8)
        if comm is not None:
            # Dispatch runs on every thread of the CTA; combine on the consumer warpgroups (named barrier).
            self.ep_all = EpPhases(comm, self.threads, bounded_ring=True)
            self.max_blocks = mega_max_blocks(comm.layout, self.tile_tokens)
            self.ep_cons = EpPhases(comm, 128 * self.num_consumer_wg,
                                            barrier_id=named_barriers(self.num_consumer_wg)[2])

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K) bf16 or fp8, K-major
        mSFA,  # FP8 mode: (M, K/128) int32; BF16 mode: None
        mW: cute.Tensor,  # (64 rows, N/64, 64 bytes, K/128, E) uint8 view of the mode's blocked kernel layout
        mSFW: cute.Tensor,  # (N, K/128, E) int32
        mD: cute.Tensor,  # (M, N) bf16; "swiglu_fp8": (M, N/8) int32 view of FP8 [M, N/2]; "swiglu_fp8_bf16": (M, N/4) of BF16
        mDSF: cute.Tensor,  # "swiglu_fp8": (M, N/64) uint8 view of the packed UE8M0 scales; else unused
        mRowW: cute.Tensor,  # swiglu: (M,) float32 routing weight; "bf16_scatter": (M,) int64 row address
        mGroupA: cute.Tensor,  # offsets [E+1] ("offsets*") or masked_m [E] ("masked")
        mGroupB: cute.Tensor,  # counts [E] ("offsets_counts"), else any int32 tensor (unused)
        mA2,  # "l1_l2": (M, I) bf16, the second GEMM's tokens (= mD's memory); else None
        mW2,  # "l1_l2": the second GEMM's weights, as mW; else None
        mSFW2,  # "l1_l2": (H, I/128, E) int32; else None
        mRowAddr,  # "l1_l2": (M,) int64 row addresses of the second GEMM's scatter; else None
        mRowScale,  # FP8 mode, folded scales: (N, E) float32 weight-row scales; else None
        num_groups: Int32,
        max_m: Int32,  # rows per group slab ("masked"), else unused
        clamp: Float32,  # "swiglu_fp8" with clamp: gate <= clamp, |up| <= clamp; +inf = no clamp
        sync: Int64,  # zeroed int32 counters, left zeroed: "l1_l2" ``sync_words``, separate launches ``tile_counters``
        timeout_ns: Int64,  # "l1_l2", debug build: spin-wait limit (0: none), then printf + trap
        me: Int32,  # Mega MoE (``comm``): this rank, its tokens, its SymmBuffer base, the peers' bases (int64
        num_tokens: Int32,  # [R] device array), the recv stats (int32 [E], 0: none), the debug record
        base: Int64,  # (host-mapped int64 [CTAs, 8]) and y (bf16 [T, H]); else unused
        peers: Int64,
        stats: Int64,
        record: Int64,
        y: Int64,
        num_ctas: Int32,
        stream,
    ):
        tt, tn, st = self.tile_tokens, self.tile_n, self.stages
        slots = st * self.cps  # token, weight and weight-scale chunk slots
        a_dtype = cutlass.BFloat16 if cutlass.const_expr(self.bf16) else cutlass.Float8E4M3FN
        a_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, a_dtype),
            (tt, K_CHUNK, slots),
            order=(0, 1, 2),
        )
        w_layout = cute.make_layout((tn, CHUNK_BYTES, slots), stride=(CHUNK_BYTES, 1, tn * CHUNK_BYTES))
        sfw_layout = cute.make_layout((tn, self.cps, st), stride=(1, tn, tn * self.cps))  # chunk-major, as in global
        sfa_layout = cute.make_layout((tt, 4, st), stride=(4, 1, tt * 4))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(a_layout, (None, None, 0)), (tt, K_CHUNK))
        tma_w, tW = self.weight_tma(g2s, mW, w_layout)
        tma_sfw, tSFW = cpasync.make_tiled_tma_atom(g2s, mSFW, cute.slice_(sfw_layout, (None, None, 0)), (tn, self.cps))
        second = (None,) * 6
        if cutlass.const_expr(self.fused):
            tma_a2, tA2 = cpasync.make_tiled_tma_atom(g2s, mA2, cute.slice_(a_layout, (None, None, 0)), (tt, K_CHUNK))
            tma_w2, tW2 = self.weight_tma(g2s, mW2, w_layout)
            tma_sfw2, tSFW2 = cpasync.make_tiled_tma_atom(
                g2s, mSFW2, cute.slice_(sfw_layout, (None, None, 0)), (tn, self.cps)
            )
            second = (tma_a2, tA2, tma_w2, tW2, tma_sfw2, tSFW2)
        tma_sfa, tSFA = None, None
        if cutlass.const_expr(not self.bf16):
            tma_sfa, tSFA = cpasync.make_tiled_tma_atom(
                g2s, mSFA, cute.slice_(sfa_layout, (None, None, 0)), (tt, 4)
            )

        tiled_mma = self.make_tiled_mma(a_dtype, tt)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, st * 2]
            tile_mbar: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS if self.published else 1]
            sTile: cute.struct.Align[cute.struct.MemRange[Int32, TILE_SLOTS * TILE_WORDS if self.published else 1], 16]
            sA: cute.struct.Align[cute.struct.MemRange[a_dtype, cute.cosize(a_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_layout)], 1024]
            sSFW: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(sfw_layout)], 128]
            sSFA: cute.struct.Align[cute.struct.MemRange[Int32, 1 if self.bf16 else cute.cosize(sfa_layout)], 128]
            sScale: cute.struct.Align[cute.struct.MemRange[Float32, max(self.cfg.scale_table_bytes() // 4, 1)], 16]
            sAct: cute.struct.Align[cute.struct.MemRange[Float32, tt * self.act_stride if self.swiglu else 1], 16]
            sOut: cute.struct.Align[  # "l1_l2": shares sAct's bytes (see kernel())
                cute.struct.MemRange[cutlass.BFloat16, tt * self.out_stride if self.scatter and not self.fused else 8], 16
            ]
            sComm: cute.struct.Align[cute.struct.MemRange[Int32, max(mega_comm_words(self.comm), 1)], 16]

        self.shared_storage = SharedStorage
        self.tx_bytes = self.cps * (tt * K_CHUNK * a_dtype.width // 8 + tn * (CHUNK_BYTES + 4)) + (0 if self.bf16 else 16 * tt)

        self.kernel(
            tma_a, tA, tma_w, tW, tma_sfw, tSFW, tma_sfa, tSFA, *second,
            mD, mDSF, mRowW, mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, sync, timeout_ns,
            me, num_tokens, base, peers, stats, record, y,
            tiled_mma, a_layout, w_layout, sfw_layout, sfa_layout,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=self.cfg.ctas_per_sm,
                 stream=stream, use_pdl=True)

    def make_tiled_mma(self, a_dtype, tokens: int):
        """The consumer warpgroups' RS wgmma: 64 weight rows per warpgroup (A from registers) x ``tokens``
        token columns (B from shared memory), both K-major, FP32 accumulator."""
        return sm90_utils.make_trivial_tiled_mma(
            a_dtype, a_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (self.num_consumer_wg, 1, 1), (64, tokens), a_source=warpgroup.OperandSource.RMEM,
        )

    def weight_tma(self, g2s, mW: cute.Tensor, w_layout: cute.Layout):
        """TMA atom and coordinate tensor of blocked kernel-layout weights (``mW``: (64 rows, N/64, 64 bytes,
        K/128, E) uint8): logical (N, K/2, E) = ((64, N/64), (64, K/128), E), so the 64-row box of one K
        chunk is contiguous (static 64s: the TMA box must map onto static modes)."""
        mW = cute.make_tensor(mW.iterator, cute.make_layout(
            ((ROW_BLOCK, mW.shape[1]), (CHUNK_BYTES, mW.shape[3]), mW.shape[4]),
            stride=((CHUNK_BYTES, mW.stride[1]), (1, ROW_BLOCK * CHUNK_BYTES), mW.stride[4]),
        ))
        return cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(w_layout, (None, None, 0)), (self.tile_n, CHUNK_BYTES))

    # ------------------------------------------------------------------------------------------
    # Work decomposition, shared by the producer warp and the consumer warpgroups.
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def group_bounds(self, e: Int32, mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
        """Rows [start, end) of group e, clamped into [0, total_rows)."""
        start = Int32(0)
        end = Int32(0)
        if cutlass.const_expr(self.group_mode == "masked"):
            start = e * max_m
            end = start + cutlass.min(cutlass.max(Int32(mGroupA[e]), Int32(0)), max_m)
        else:
            start = cutlass.min(cutlass.max(Int32(mGroupA[e]), Int32(0)), total_rows)
            if cutlass.const_expr(self.group_mode == "offsets_counts"):
                end = start + cutlass.max(Int32(mGroupB[e]), Int32(0))
            else:
                end = Int32(mGroupA[e + 1])
            end = cutlass.min(cutlass.max(end, start), total_rows)
        return start, end

    @cute.jit
    def find_tile(self, t: Int32, e: Int32, base: Int32, n_tiles: Int32, num_groups: Int32,
                  mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
        """Advance the (group e, first tile id ``base`` of e) cursor to linear tile ``t``.

        Returns (e, base, valid, row0, row_end, n_tile): token rows [row0, min(row0+tile_tokens, row_end))
        against weight rows [n_tile*tile_n, +tile_n) of expert e. ``t`` must not decrease between calls.
        Warp-cooperative (every lane, the same ``t``): lane l sizes group e + l, a prefix sum over the lanes
        finds the group holding ``t`` -- 32 groups per round of loads, not one (a call that skips many
        empty or small groups, as few-token decode makes them, costs a few rounds instead of a chain of
        dependent loads per group)."""
        lane = cute.arch.lane_idx()
        searching = e < num_groups
        while searching:
            g = e + lane
            tiles_g = Int32(0)
            if g < num_groups:
                start, end = self.group_bounds(g, mGroupA, mGroupB, max_m, total_rows)
                tiles_g = tiles.token_tiles(end - start, self.tile_tokens) * n_tiles
            incl = warp_inclusive_sum(tiles_g, lane)
            # Lanes past the last group add no tiles, so the lowest hit is always a real group.
            hit = cute.arch.vote_ballot_sync(t < base + incl)
            if hit != 0:
                first = nth_set_bit(hit, Int32(0))
                e = e + first
                base = base + cute.arch.shuffle_sync(incl - tiles_g, first)
                searching = False
            else:
                base = base + cute.arch.shuffle_sync(incl, 31)
                e = e + 32
                searching = e < num_groups
        valid = e < num_groups
        row0 = Int32(0)
        row_end = Int32(0)
        n_tile = Int32(0)
        if valid:
            start, end = self.group_bounds(e, mGroupA, mGroupB, max_m, total_rows)
            m, n_tile = tiles.tile_coords(t - base, tiles.token_tiles(end - start, self.tile_tokens))
            row0 = start + m * self.tile_tokens
            row_end = end
        return e, base, valid, row0, row_end, n_tile

    @cute.jit
    def geometry_words(self, firsts: cute.Tensor):
        """Mega MoE: the 4 shared int32 after the block prefix ``firsts`` (pool blocks, window, ring period,
        windows)."""
        return cute.make_tensor(firsts.iterator + (self.ep_all.num_local + 1), cute.make_layout(4))

    @cute.jit
    def store_ring_geometry(self, offs: cute.Tensor, firsts: cute.Tensor, total_rows: Int32):
        """Mega MoE, one thread, once the block prefix is complete: this call's ring geometry
        (``scheduler.tiles.ring_layout`` for a ring of ``total_rows`` rows) into shared memory,
        where the tile loops read it at each tile (values held in registers across the mainloop would cost
        the consumer warps registers they do not have with two CTAs per SM)."""
        geo = self.geometry_words(firsts)
        num_blocks = Int32(firsts[self.ep_all.num_local])
        window, period = tiles.ring_layout(Int32(offs[self.ep_all.num_local]), num_blocks, total_rows, self.tile_tokens,
                                           DSL_OPS)
        geo[0] = num_blocks
        geo[1] = window
        geo[2] = period
        geo[3] = tiles.num_windows(num_blocks, window)

    @cute.jit
    def ring_geometry(self, firsts: cute.Tensor):
        """Mega MoE: (pool blocks, window, ring period, windows) of this call (``store_ring_geometry``)."""
        geo = self.geometry_words(firsts)
        return Int32(geo[0]), Int32(geo[1]), Int32(geo[2]), Int32(geo[3])

    @cute.jit
    def ring_reused(self, firsts: cute.Tensor):
        """Mega MoE: this call reuses ring blocks (more blocks than a window): L2 tiles signal too."""
        geo = self.geometry_words(firsts)
        return Int32(geo[1]) < Int32(geo[0])

    @cute.jit
    def mega_tile(self, t: Int32, e: Int32, dims, offs: cute.Tensor, firsts: cute.Tensor):
        """Mega MoE: tile ``t`` of the bounded-ring order (``scheduler.tiles``: phase p = window p's L1 tiles,
        then window p - 1's L2 tiles; the phase in closed form). Returns (GEMM 0 / 1, expert e, valid, row0,
        row_end, n_tile, block): ring rows [row0, row_end) of e's pool block ``block`` (``tiles.window_tile``). The
        only cursor is ``e``, the previous tile's expert: values held across the consumers' mainloop cost
        registers they do not have with two CTAs per SM."""
        ops = DSL_OPS
        n1, n2 = dims[1], dims[3]
        nb, window, period, last = self.ring_geometry(firsts)
        p = tiles.phase_of(t, window, nb, n1, n2, ops)
        local = t - tiles.phase_start(p, window, nb, n1, n2, ops)
        l1n = n1 * tiles.window_blocks(p, window, nb, ops)
        gemm = Int32(cutlass.select_(local < l1n, Int32(0), Int32(1)))
        n_tiles = Int32(cutlass.select_(gemm == 0, n1, n2))
        local = local - gemm * l1n
        w0 = (p - gemm) * window
        # The expert: the previous tile's (``e``, any index < E: a tile loop's tiles mostly stay in one
        # expert), else a binary search over the block prefix.
        owned = tiles.window_block(local, n_tiles, w0)
        if (owned < Int32(firsts[e])) | (owned >= Int32(firsts[e + 1])):
            e = Int32(tiles.expert_of_block(owned, firsts, self.ep_all.num_local, ops))
        block, n_tile = tiles.window_tile(local, n_tiles, w0, cutlass.min(w0 + window, nb), firsts, e, ops)
        valid = p <= last
        f0 = Int32(firsts[e])
        start = Int32(offs[e])
        row0 = tiles.ring_row(block, f0, start, period, self.tile_tokens, ops)
        row_end = row0 + tiles.block_rows(block, f0, Int32(offs[e + 1]) - start, self.tile_tokens, ops)
        return gemm, e, valid, row0, row_end, n_tile, block

    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        tA: cute.Tensor,
        tma_w: cute.CopyAtom,
        tW: cute.Tensor,
        tma_sfw: cute.CopyAtom,
        tSFW: cute.Tensor,
        tma_sfa,  # FP8 mode: cute.CopyAtom; BF16 mode: None
        tSFA,  # FP8 mode: cute.Tensor; BF16 mode: None
        tma_a2,  # "l1_l2": the second GEMM's token, weight and scale atoms and tensors; else None
        tA2,
        tma_w2,
        tW2,
        tma_sfw2,
        tSFW2,
        mD: cute.Tensor,
        mDSF: cute.Tensor,
        mRowW: cute.Tensor,
        mRowAddr,
        mRowScale,
        mGroupA: cute.Tensor,
        mGroupB: cute.Tensor,
        num_groups: Int32,
        max_m: Int32,
        clamp: Float32,
        sync: Int64,
        timeout_ns: Int64,
        me: Int32,
        num_tokens: Int32,
        base: Int64,
        peers: Int64,
        stats: Int64,
        record: Int64,
        y: Int64,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        w_layout: cute.Layout,
        sfw_layout: cute.Layout,
        sfa_layout: cute.Layout,
    ):
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()

        if warp_idx == 0:  # the descriptors are kernel parameters: no memory of an earlier grid
            for atom in (tma_a, tma_w, tma_sfw) if cutlass.const_expr(self.bf16) else (tma_a, tma_w, tma_sfw, tma_sfa):
                cpasync.prefetch_descriptor(atom)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
            tx_count=self.tx_bytes,
        )
        tiles_pub = None  # the tiles the producer warp publishes to the consumer warpgroups (Mega MoE: and the signal warp)
        if cutlass.const_expr(self.published):
            tiles_pub = (
                pipeline.PipelineAsync.create(
                    barrier_storage=storage.tile_mbar.data_ptr(),
                    num_stages=TILE_SLOTS,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                             128 * self.num_consumer_wg + (32 if self.fused else 0)),
                ),
                storage.sTile.get_tensor(cute.make_layout((TILE_SLOTS, TILE_WORDS), stride=(TILE_WORDS, 1))),
            )

        # (k_tiles, n_tiles) of each GEMM; the second is the first's unless fused.
        k_tiles = Int32(tA.shape[1]) // K_CHUNK
        n_tiles = Int32(cute.size(tW, mode=[0])) // tn
        dims = (k_tiles, n_tiles, k_tiles, n_tiles)
        if cutlass.const_expr(self.fused):
            dims = (k_tiles, n_tiles, Int32(tA2.shape[1]) // K_CHUNK, Int32(cute.size(tW2, mode=[0])) // tn)
        total_rows = Int32(tA.shape[0])
        sW = storage.sW.get_tensor(w_layout)
        sSFW = storage.sSFW.get_tensor(sfw_layout)
        if cutlass.const_expr(self.dynamic):
            if warp_idx == 0:
                self.prefetch_first_tile((tma_a, tA, tma_w, tW, tma_sfw, tSFW), sW, sSFW, mGroupA, mGroupB,
                                         num_groups, max_m, total_rows, dims, bidx)
        # Launched as a programmatic dependent (use_pdl): the CTA's start, its shared-memory setup and the
        # prefetch above may overlap the previous grid on the stream; nothing below runs before that grid has
        # finished and its memory is visible. The next grid may launch now: its CTAs start as these exit.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        self.trace_start(record, gdim, bidx, tidx)
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sSFA = None
        if cutlass.const_expr(not self.bf16):
            sSFA = storage.sSFA.get_tensor(sfa_layout)
        sScale = None
        if cutlass.const_expr(self.wide):
            # (4 values, column pair jp, lane quad q, 32-K block, chunk parity, warpgroup): the FP32 scales of
            # token columns 8 * (2 jp + v // 2) + 2 q + v % 2; a quad's row padded by 4 floats (no bank conflicts
            # between the quads' 16-byte loads).
            row = self.tile_tokens // 4 + 4
            sScale = storage.sScale.get_tensor(cute.make_layout(
                (4, self.tile_tokens // 16, 4, 4, 2, self.num_consumer_wg),
                stride=(1, 4, row, 4 * row, 16 * row, 32 * row),
            ))
        sAct = None
        if cutlass.const_expr(self.swiglu):
            sAct = storage.sAct.get_tensor(
                cute.make_layout((self.tile_tokens, self.act_stride), stride=(self.act_stride, 1))
            )
        sOut = None
        if cutlass.const_expr(self.scatter):  # the staged tile, (token, column) BF16
            out_layout = cute.make_layout((self.tile_tokens, self.out_stride), stride=(self.out_stride, 1))
            if cutlass.const_expr(self.fused):
                # Rows of both staging tiles are 2 * tile_n + 16 bytes, and consumer warpgroup w touches only
                # bytes [128w, 128w + 128) of each row in both epilogues, which it runs one after the other:
                # one region serves both (a pipeline stage more at large tiles).
                assert self.act_stride * 4 == self.out_stride * 2
                sOut = cute.make_tensor(cute.recast_ptr(sAct.iterator, dtype=cutlass.BFloat16), out_layout)
            else:
                sOut = storage.sOut.get_tensor(out_layout)

        call = Int32(0)
        flag = None
        if cutlass.const_expr(self.comm is not None):
            # Mega MoE dispatch steps 1-3 on every thread (comm.phases): the expert offsets come from the counts in
            # shared memory (they replace mGroupA), then the pool-block prefix (replaces mGroupB); the pull
            # (step 4) overlaps the tiles (warps 2 and 3).
            num_local = self.ep_all.num_local
            offs = storage.sComm.get_tensor(cute.make_layout(num_local + 1))
            t_src = cute.make_tensor(offs.iterator + (num_local + 1), cute.make_layout(2))
            firsts = cute.make_tensor(offs.iterator + (num_local + 3), cute.make_layout(num_local + 1))
            flag = cute.make_tensor(offs.iterator + (2 * num_local + 8), cute.make_layout(1))
            lane = cute.arch.lane_idx()
            call = self.ep_all.current_call(base)
            if bidx == 0:
                self.ep_all.announce(me, num_tokens, peers, call, tidx)
            self.ep_all.scan(me, base, peers, call, t_src, tidx, bidx, gdim, record, timeout_ns)
            self.stamp(record, gdim, bidx, tidx, "scanned")
            self.ep_all.grid_barrier(self.word(sync, num_groups, GRID), gdim, 0, SITE_D_BARRIER, tidx, me,
                                     record, timeout_ns)
            total = self.ep_all.expert_offsets(offs, base, stats, tidx, lane, bidx, False, me, record)
            for g in cutlass.range(tidx, num_local, self.threads):
                firsts[g] = tiles.token_tiles(offs[g + 1] - offs[g], self.tile_tokens)
            cute.arch.sync_threads()
            if tidx < 32:
                self.ep_all.warp_exclusive_scan(firsts, lane)
            cute.arch.sync_threads()
            if tidx == 0:
                self.store_ring_geometry(offs, firsts, total_rows)
            cute.arch.sync_threads()
            self.stamp(record, gdim, bidx, tidx, "offsets")
            mGroupA = offs
            mGroupB = firsts
        if warp_idx < 4:
            if cutlass.const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.producer(
                    ab_pipeline, (tma_a, tA, tma_w, tW, tma_sfw, tSFW), (tma_a2, tA2, tma_w2, tW2, tma_sfw2, tSFW2),
                    tma_sfa, tSFA, sA, sW, sSFW, sSFA, mGroupA, mGroupB, num_groups, max_m,
                    total_rows, dims, sync, timeout_ns, bidx, gdim, tiles_pub,
                )
            if cutlass.const_expr(self.fused):
                if warp_idx == 1:
                    self.signaller(mGroupA, mGroupB, num_groups, max_m, total_rows, dims, sync, bidx, gdim, tiles_pub)
            if cutlass.const_expr(self.comm is not None):
                if warp_idx >= 2:
                    # Mega MoE pull: every unit counted on its pool block's counter, for the L1 tiles' producers.
                    # They all finish before combine's grid barrier: every pulled row's block has L1 tiles,
                    # each of which waited for all of its block's units.
                    self.ep_all.pull_ring(me, base, peers, mGroupA, mGroupB, total, bidx * 2 + (warp_idx - 2), gdim * 2,
                                          cute.arch.lane_idx(), record, self.tile_tokens,
                                          self.ring_geometry(mGroupB)[2], dims[3],
                                          self.word(sync, num_groups, PULLED), self.word(sync, num_groups, L2_DONE),
                                          timeout_ns)
                    self.stamp(record, gdim, bidx, cute.arch.lane_idx(), "pull warp 0 done", warp_idx - 2)
        else:
            if cutlass.const_expr(self.rebalance_registers):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer(
                ab_pipeline, tiled_mma, tidx - 128, sA, sW, sSFW, sSFA, sScale, sAct, sOut, mD, mDSF, mRowW,
                mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, total_rows, dims, sync, bidx,
                gdim, tiles_pub, record,
            )
            if cutlass.const_expr(self.comm is not None):
                # Mega MoE combine on the consumer warpgroups (comm combine steps 2-3): every row of every CTA is
                # stored and fenced (sys) by its thread once all CTAs pass this barrier.
                ctidx = tidx - 128
                num_warps = self.ep_cons.warps
                self.stamp(record, gdim, bidx, ctidx, "tiles done")
                self.ep_cons.grid_barrier(self.word(sync, num_groups, GRID), 2 * gdim, 1, SITE_C_BARRIER,
                                          ctidx, me, record, timeout_ns)
                self.stamp(record, gdim, bidx, ctidx, "combine barrier")
                self.ep_cons.exchange_done(me, base, peers, call, ctidx, bidx, record, timeout_ns)
                self.stamp(record, gdim, bidx, ctidx, "done exchanged")
                self.ep_cons.sum_tokens(base, num_tokens, y, bidx * num_warps + ctidx // 32, gdim * num_warps,
                                        cute.arch.lane_idx())
                self.stamp(record, gdim, bidx, ctidx, "end")
        if cutlass.const_expr(self.fused):
            self.reset_counters(sync, num_groups, tidx, warp_idx, gdim, base, call, mGroupB, flag)

    def trace_word(self, record: Int64, gdim: Int32, bidx: Int32, word) -> Int64:
        """Address of word ``word`` of this CTA's timeline row (after the ``gdim`` debug-record rows)."""
        return record + (Int64(gdim) * RECORD_WORDS + Int64(bidx) * timeline.TRACE_WORDS + word) * 8

    @cute.jit
    def stamp(self, record: Int64, gdim: Int32, bidx: Int32, who: Int32, event: cutlass.Constexpr, offset=0):
        """Trace build, the thread whose index ``who`` in its group is 0: ``%globaltimer`` into this CTA's
        timeline row at ``event`` (``timeline.EVENTS``) + ``offset``; nothing in other builds."""
        if cutlass.const_expr(self.trace):
            if who == 0:
                ptx.st_global_u64(self.trace_word(record, gdim, bidx, timeline.EVENT[event] + offset), ptx.globaltimer())

    @cute.jit
    def trace_start(self, record: Int64, gdim: Int32, bidx: Int32, tidx: Int32):
        """Trace build, thread 0 at the kernel's start: stamp "start" and zero the words a call may leave
        unwritten (the tile counts; "last l1 tile" of a CTA without L1 tiles); two CTA barriers order these
        stores before the consumers' updates."""
        self.stamp(record, gdim, bidx, tidx, "start")
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                for word in (timeline.EVENT["last l1 tile"], timeline.COUNT["l1 tiles"], timeline.COUNT["l2 tiles"]):
                    for half in range(2):
                        ptx.st_global_u32(self.trace_word(record, gdim, bidx, word) + half * 4, 0)

    @cute.jit
    def trace_tile(self, record: Int64, gdim: Int32, bidx: Int32, ctidx: Int32, phase: Int32):
        """Trace build, the first consumer thread after each tile: count it (per GEMM), stamp "last l1 tile"."""
        if cutlass.const_expr(self.trace):
            if ctidx == 0:
                if phase == 0:
                    self.stamp(record, gdim, bidx, ctidx, "last l1 tile")
                ptx.count_u64(self.trace_word(record, gdim, bidx, timeline.COUNT["l1 tiles"] + phase))

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, num_groups: Int32,
                  mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
        """``find_tile`` over the launch's tiles: those of the first GEMM (``phase`` 0), then, when fused,
        those of the second (phase 1, tile ids from ``t_off`` = the first GEMM's tile count on); Mega MoE:
        ``mega_tile`` (its cursor: e; base and t_off pass through; ``mGroupB``: the block prefix).
        Returns (phase, e, base, t_off, valid, row0, row_end, n_tile, block); ``t`` must not decrease."""
        block = Int32(0)
        if cutlass.const_expr(self.comm is not None):
            phase, e, valid, row0, row_end, n_tile, block = self.mega_tile(t, e, dims, mGroupA, mGroupB)
        else:
            n_tiles = dims[1]
            if cutlass.const_expr(self.fused):
                n_tiles = Int32(cutlass.select_(phase == 0, dims[1], dims[3]))
            e, base, valid, row0, row_end, n_tile = self.find_tile(
                t - t_off, e, base, n_tiles, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
            if cutlass.const_expr(self.fused):
                if phase == 0:
                    if e >= num_groups:  # past the first GEMM's tiles; base: their count
                        phase = Int32(1)
                        t_off = t_off + base
                        e, base, valid, row0, row_end, n_tile = self.find_tile(
                            t - t_off, Int32(0), Int32(0), dims[3], num_groups, mGroupA, mGroupB, max_m, total_rows
                        )
            if cutlass.const_expr(self.dynamic):
                block = e  # published in the block word: the consumers' group (folded row scales)
        return phase, e, base, t_off, valid, row0, row_end, n_tile, block

    @cute.jit
    def publish_tile(self, tiles_pub, pub, phase: Int32, valid, row0: Int32, row_end: Int32, n_tile: Int32,
                     block: Int32):
        """Mega MoE and separate launches, the producer warp (every lane): publish the next tile (or, ``valid``
        false, the end) to the consumer warpgroups (Mega MoE: and the signal warp) in a free slot of ``tiles_pub``
        (PipelineAsync, shared words; the block word: Mega MoE's pool block, else the group); returns ``pub``
        advanced.
        The consumers then compute nothing per tile: the search over the tile order costs the producer warp
        time it hides behind the loads in flight, but the consumers time between two mainloops."""
        tiles_pub[0].producer_acquire(pub)
        slot = tiles_pub[1]
        i = pub.index
        slot[i, 0] = phase
        slot[i, 1] = Int32(cutlass.select_(valid, Int32(1), Int32(0)))
        slot[i, 2] = row0
        slot[i, 3] = row_end
        slot[i, 4] = n_tile
        slot[i, 5] = block
        tiles_pub[0].producer_commit(pub)
        pub.advance()
        return pub  # the caller assigns it: a state advanced in a callee is loop-carried only when assigned

    @cute.jit
    def fetch_tile(self, sync: Int64, num_groups: Int32, gdim: Int32) -> Int32:
        """Mega MoE and separate launches, the producer warp (every lane): the CTA's next tile id, handed out in
        tile order to whichever CTA asks first (CTA c's first tile is c; then ``gdim`` + a relaxed add to
        ``NEXT_TILE``, zeroed at the end of the launch): CTAs that run faster take more tiles, so they finish
        closer together."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = ptx.atom_add(self.word(sync, num_groups, NEXT_TILE), 1, "relaxed")
        return gdim + cute.arch.shuffle_sync(taken, 0)

    @cute.jit
    def take_tile(self, tiles_pub, taken):
        """Mega MoE and separate launches, the consumer warpgroups (and the signal warp): wait for the tile published in ``taken``'s slot
        (released by the caller after the tile) -> (phase, valid, row0, row_end, n_tile, block)."""
        tiles_pub[0].consumer_wait(taken)
        slot = tiles_pub[1]
        i = taken.index
        return (Int32(slot[i, 0]), Int32(slot[i, 1]) != 0, Int32(slot[i, 2]), Int32(slot[i, 3]), Int32(slot[i, 4]),
                Int32(slot[i, 5]))

    def word(self, sync: Int64, num_groups: Int32, which: int, i=0) -> Int64:
        """Address of a counter in ``sync``: a fused launch's (``sync_words``), ``which`` one of ``L1_DONE`` (of
        group i; Mega MoE: of pool block i), ``FINISHED`` (CTAs), ``ALL_L1`` (L1 tiles done), and Mega MoE
        only ``GRID`` (barrier arrivals), ``NEXT_TILE`` (tiles handed out), ``PULLED`` and ``L2_DONE`` (of pool
        block i); a separate launch's (``tile_counters``): ``NEXT_TILE`` and ``FINISHED``."""
        if self.dynamic:
            index = {NEXT_TILE: 0, FINISHED: 1}[which]
        elif self.comm is None:
            index = {L1_DONE: i, FINISHED: num_groups, ALL_L1: num_groups + 1}[which]
        elif which in (FINISHED, ALL_L1, GRID, NEXT_TILE):
            index = {FINISHED: 0, ALL_L1: 1, GRID: 2, NEXT_TILE: 3}[which]
        else:
            index = MEGA_HEADER + {L1_DONE: 0, PULLED: 1, L2_DONE: 2}[which] * self.max_blocks + i
        return sync + Int64(index) * 4

    @cute.jit
    def first_gemm_count(self, sync: Int64, e: Int32, block: Int32, dims, num_groups, mGroupA, mGroupB, max_m,
                         total_rows):
        """Fused: (address, target) of the counter an L2 tile of group e waits on: each first-GEMM tile of the
        group adds 1 (release) once its rows are stored (``signaller``); Mega MoE: of pool block ``block``."""
        addr = self.word(sync, num_groups, L1_DONE, e)
        target = dims[1]
        if cutlass.const_expr(self.comm is not None):
            addr = self.word(sync, num_groups, L1_DONE, block)
        else:
            start, end = self.group_bounds(e, mGroupA, mGroupB, max_m, total_rows)
            target = tiles.token_tiles(end - start, self.tile_tokens) * dims[1]
        return addr, target

    @cute.jit
    def wait_counter(self, addr: Int64, target: Int32, index: Int32, timeout_ns: Int64, what: cutlass.Constexpr):
        """Fused: spin until the counter at ``addr`` (``what`` it counts, of group / block ``index``) reaches ``target`` (acquire),
        then order the async proxy (TMA) after it. Debug build: with ``timeout_ns`` > 0, expiry printf's the
        wait and traps."""
        seen = ptx.spin_until(addr, target, False, "gpu", timeout_ns, self.debug)
        if cutlass.const_expr(self.debug):
            if ptx.behind(seen, target) != 0:
                cute.printf(
                    "megamoe debug: fused grouped GEMM CTA %d (SM %d) role producer: timed out: waits "
                    + what + " %d: count >= %d, sees %d",
                    cute.arch.block_idx()[0], ptx.smid(), index, target, seen,
                )
                ptx.trap()
        cute.arch.fence_proxy("async.global")

    def k_steps(self, chunks):
        """K steps (pipeline stages) of a tile of ``chunks`` 128-K chunks (``cps`` divides every K: 512 | K)."""
        return chunks if cutlass.const_expr(self.cps == 1) else chunks // self.cps

    @cute.jit
    def chunks_ahead(self, addr: Int64, target: Int32, k_tiles: Int32) -> Int32:
        """Fused: the K steps (``k_tiles`` stages of ``cps`` chunks) a tile whose token rows other CTAs produce
        loads the weights of before it waits (``load_tile``'s ``ahead``): none if the counter at ``addr`` already
        reached ``target`` (acquired; the async proxy then ordered after it), else up to ``stages``."""
        ahead = Int32(0)
        if ptx.behind(ptx.ld_acquire(addr, False, "gpu"), target) != 0:
            ahead = cutlass.min(k_tiles, Int32(self.stages))
        else:
            cute.arch.fence_proxy("async.global")
        return ahead

    @cute.jit
    def load_tile(self, ab_pipeline, state, ops, parts, e: Int32, n_tile: Int32, k_tiles: Int32, ahead: Int32,
                  addr: Int64, target: Int32, timeout_ns: Int64, index: Int32, what: cutlass.Constexpr):
        """Fused: the TMA loads of a tile whose token rows other CTAs produce in this launch. The first ``ahead``
        chunks (at most ``stages``: they need no stage of this tile released) load their weights, then the wait
        for the counter (``wait_counter``; ``index``, ``what``: its name in the debug report), then their tokens; the rest load both. ``ahead`` = 0: the
        rows are known ready (acquired, proxy-fenced). ``ops``: the GEMM's TMA atoms and tensors, ``parts``: its
        (tAg, tAs, tWg, tWs, tSFWg, tSFWs) partitions. Returns the advanced pipeline state."""
        tAg, tAs, tWg, tWs, tSFWg, tSFWs = parts
        pending = state.clone()
        for kt in cutlass.range(ahead, unroll=1):
            ab_pipeline.producer_acquire(state)
            self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, False, True)
            ab_pipeline.producer_commit(state)
            state.advance()
        if ahead > 0:
            self.wait_counter(addr, target, index, timeout_ns, what)
        for kt in cutlass.range(ahead, unroll=1):
            self.load_chunk(ab_pipeline, pending, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, True, False)
            pending.advance()
        for kt in cutlass.range(ahead, k_tiles, unroll=1):
            ab_pipeline.producer_acquire(state)
            self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, True, True)
            ab_pipeline.producer_commit(state)
            state.advance()
        return state

    def epilogue_barrier(self, wg):
        """Consumer warpgroup wg's own 128 threads (``named_barriers``)."""
        return pipeline.NamedBarrier(barrier_id=named_barriers(self.num_consumer_wg)[0] + wg, num_threads=128)

    def signal_barrier(self, wg):
        """Consumer warpgroup wg (128 threads) and the signal warp (32) (``named_barriers``), once per signalled
        tile."""
        return pipeline.NamedBarrier(barrier_id=named_barriers(self.num_consumer_wg)[1] + wg, num_threads=160)

    @cute.jit
    def signaller(self, mGroupA, mGroupB, num_groups, max_m, total_rows, dims, sync: Int64, bidx, gdim, tiles_pub):
        """Fused, warp 1: for each of this CTA's first-GEMM tiles, meet every consumer warpgroup once its rows
        are stored (``signal_barrier``), then add 1 to the group's (Mega MoE: pool block's) counter and to the
        all-tiles counter (``fence.acq_rel.gpu`` + release add: cumulative over the stores the barrier ordered
        before). The fence waits here, not in the consumers. Ends at the first second-GEMM tile (each CTA's
        first-GEMM tiles come first). Mega MoE: the tiles come from the producer warp (``take_tile``, every one
        released after its signal), and with ring blocks reused (``ring_reused``) an L2 tile adds 1 to its
        block's ``L2_DONE`` once its reads of the ring (tokens, row addresses) are done."""
        if cutlass.const_expr(self.comm is not None):
            reused = self.ring_reused(mGroupB)
            taken = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)
            phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
            while valid:
                if (phase == 0) | reused:
                    for wg in cutlass.range_constexpr(self.num_consumer_wg):
                        self.signal_barrier(wg).arrive_and_wait()
                    if cute.arch.lane_idx() == 0:
                        if phase == 0:
                            ptx.arrive(self.word(sync, num_groups, L1_DONE, block))
                            ptx.arrive(self.word(sync, num_groups, ALL_L1))
                        else:
                            ptx.arrive(self.word(sync, num_groups, L2_DONE, block))
                tiles_pub[0].consumer_release(taken)
                taken.advance()
                phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
        else:
            t = bidx
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
            more = valid & (phase == 0)
            while more:
                for wg in cutlass.range_constexpr(self.num_consumer_wg):
                    self.signal_barrier(wg).arrive_and_wait()
                if cute.arch.lane_idx() == 0:
                    ptx.arrive(self.word(sync, num_groups, L1_DONE, e))
                    ptx.arrive(self.word(sync, num_groups, ALL_L1))
                t = t + gdim
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
                more = valid & (phase == 0)

    @cute.jit
    def reset_counters(self, sync: Int64, num_groups: Int32, tidx: Int32, warp_idx: Int32, gdim: Int32, base: Int64,
                       call: Int32, firsts, flag):
        """Fused, at the end: the last CTA to finish (all its tiles done, its waits over) zeroes the counters
        (``sync_words``) for the next launch; Mega MoE: every thread of it, the header and this call's blocks'
        counters (``firsts``: the block prefix; ``flag``: one shared int32), then it ends the call
        (``EpPhases.finish_call``)."""
        cute.arch.sync_threads()
        if cutlass.const_expr(self.comm is not None):
            if tidx == 0:
                flag[0] = ptx.atom_add(self.word(sync, num_groups, FINISHED), 1, "acq_rel")
            cute.arch.sync_threads()
            if flag[0] == gdim - 1:
                nb = Int32(firsts[self.ep_all.num_local])
                per = cutlass.max(nb, 1)
                for i in cutlass.range(tidx, MEGA_HEADER + 3 * nb, self.threads, unroll=1):
                    j = cutlass.max(i - MEGA_HEADER, 0)
                    kind = j // per
                    index = Int32(cutlass.select_(i < MEGA_HEADER, i, MEGA_HEADER + kind * self.max_blocks + j - kind * per))
                    ptx.st_global_u32(sync + Int64(index) * 4, Int32(0))
                self.ep_all.finish_call(base, call, tidx)
        else:
            if warp_idx == 0:
                self.zero_if_last(sync, num_groups, gdim, num_groups + 2)

    @cute.jit
    def zero_if_last(self, sync: Int64, num_groups: Int32, gdim: Int32, words):
        """One warp per CTA, once its CTA is done with the counters: add 1 to ``FINISHED`` (acq_rel, so every
        earlier counter update of the CTA precedes it); the last of the ``gdim`` CTAs zeroes the first ``words``
        words of ``sync`` for the next launch."""
        lane = cute.arch.lane_idx()
        old = Int32(0)
        if lane == 0:
            old = ptx.atom_add(self.word(sync, num_groups, FINISHED), 1, "acq_rel")
        if cute.arch.shuffle_sync(old, 0) == gdim - 1:
            for i in cutlass.range(lane, words, 32, unroll=1):
                ptx.st_global_u32(sync + Int64(i) * 4, Int32(0))

    @cute.jit
    def load_chunk(self, ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile,
                   tokens: cutlass.Constexpr[bool], weights: cutlass.Constexpr[bool]):
        """TMA loads of K step ``kt`` (chunks ``kt * cps`` ..., ``cps`` of them) into ``state``'s stage (acquired
        by the caller): the token tiles and/or the weight tiles with their packed scale words (one box of the
        step's chunks, tile_n words each). ``ops``: the GEMM's (tma_a, tA, tma_w, tW, tma_sfw, tSFW)."""
        bar = ab_pipeline.producer_get_barrier(state)
        s = state.index
        for h in cutlass.range_constexpr(self.cps):
            c = kt * self.cps + h
            if cutlass.const_expr(tokens):
                cute.copy(ops[0], tAg[(None, c)], tAs[(None, s * self.cps + h)], tma_bar_ptr=bar)
            if cutlass.const_expr(weights):
                cute.copy(ops[2], tWg[(None, n_tile, c, e)], tWs[(None, s * self.cps + h)], tma_bar_ptr=bar)
        if cutlass.const_expr(weights):
            cute.copy(ops[4], tSFWg[(None, n_tile, kt, e)], tSFWs[(None, s)], tma_bar_ptr=bar)

    def weight_partitions(self, ops, sW, sSFW):
        """Weight and scale TMA partitions of one GEMM (``ops``: tma_a, tA, tma_w, tW, tma_sfw, tSFW); static:
        (TMA, RestN, RestK, E)."""
        one = cute.make_layout(1)
        tWs, tWg = cpasync.tma_partition(
            ops[2], 0, one, cute.group_modes(sW, 0, 2),
            cute.group_modes(cute.local_tile(ops[3], (self.tile_n, CHUNK_BYTES), (None, None, None)), 0, 2),
        )
        tSFWs, tSFWg = cpasync.tma_partition(
            ops[4], 0, one, cute.group_modes(sSFW, 0, 2),
            cute.group_modes(cute.local_tile(ops[5], (self.tile_n, self.cps), (None, None, None)), 0, 2),
        )
        return tWs, tWg, tSFWs, tSFWg

    def token_partitions(self, ops, row0, sA):
        """Token TMA partitions of one GEMM for the tile starting at ``row0`` (any row: the coordinate
        domain is offset): (TMA, K chunk)."""
        gA = cute.local_tile(cute.domain_offset((row0, 0), ops[1]), (self.tile_tokens, K_CHUNK), (0, None))
        return cpasync.tma_partition(ops[0], 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                     cute.group_modes(gA, 0, 2))

    @cute.jit
    def prefetch_first_tile(self, ops, sW, sSFW, mGroupA, mGroupB, num_groups: Int32, max_m: Int32,
                            total_rows: Int32, dims, bidx: Int32):
        """Separate launches, the producer warp, before ``griddepcontrol.wait``: an L2 prefetch (TMA) of the
        weights and scale words of the first ``stages`` K steps of this CTA's first tile, so they stream while
        the previous grid ends. The tile comes from the group bounds as they are then -- the previous grid may
        still be writing them, so it is a guess that only this prefetch uses; a wrong one costs bandwidth, never
        a value: the loads come after the wait, and L2 holds the previous grid's stores over any prefetched
        line. ``ops``: (tma_a, tA, tma_w, tW, tma_sfw, tSFW)."""
        tWs, tWg, tSFWs, tSFWg = self.weight_partitions(ops, sW, sSFW)
        _, e, _, _, valid, _, _, n_tile, _ = self.next_tile(
            bidx, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
        )
        if valid:
            n_tile = cutlass.min(n_tile, dims[1] - 1)
            for kt in cutlass.range(cutlass.min(self.k_steps(dims[0]), Int32(self.stages)), unroll=1):
                for h in cutlass.range_constexpr(self.cps):
                    cute.prefetch(ops[2], tWg[(None, n_tile, kt * self.cps + h, e)])
                cute.prefetch(ops[4], tSFWg[(None, n_tile, kt, e)])

    @cute.jit
    def producer(self, ab_pipeline, first, second, tma_sfa, tSFA, sA, sW, sSFW, sSFA, mGroupA, mGroupB,
                 num_groups, max_m, total_rows, dims, sync, timeout_ns, bidx, gdim, tiles_pub):
        """Warp 0: TMA loads of every tile's K chunks. ``first``/``second``: (tma_a, tA, tma_w, tW, tma_sfw,
        tSFW) of the two GEMMs (second: all None unless fused). A second-GEMM tile first loads the weights of
        up to ``stages`` chunks (they do not depend on the first GEMM), then waits for its tokens' rows
        (``load_tile``); Mega MoE: a first-GEMM tile likewise waits for its rows' pulls, and every tile (then
        an invalid one, the end) is published to the consumer warpgroups (``publish_tile``) before its loads."""
        tt = self.tile_tokens
        one = cute.make_layout(1)
        tWs, tWg, tSFWs, tSFWg = self.weight_partitions(first, sW, sSFW)
        if cutlass.const_expr(self.fused):
            tWs2, tWg2, tSFWs2, tSFWg2 = self.weight_partitions(second, sW, sSFW)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        pub = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
        t = bidx
        phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
            t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
        )
        if cutlass.const_expr(self.published):
            pub = self.publish_tile(tiles_pub, pub, phase, valid, row0, row_end, n_tile, block)
        all_done = Int32(0)  # fused: every first-GEMM tile seen done (acquired + proxy fence): no more checks
        while valid:
            if phase == 0:
                tAs, tAg = self.token_partitions(first, row0, sA)
                if cutlass.const_expr(self.comm is not None):
                    # Mega MoE: the tile's rows are this launch's pulls (``EpPhases.pull_ring`` counts units).
                    addr = self.word(sync, num_groups, PULLED, block)
                    target = tiles.pulled_target(row_end - row0, self.ep_all.row_units)
                    ahead = self.chunks_ahead(addr, target, self.k_steps(dims[0]))
                    state = self.load_tile(ab_pipeline, state, first, (tAg, tAs, tWg, tWs, tSFWg, tSFWs), e, n_tile,
                                           self.k_steps(dims[0]), ahead, addr, target, timeout_ns, block, "pulled row units of pool block")
                else:
                    tSFAs, tSFAg = None, None
                    if cutlass.const_expr(not self.bf16):
                        gSFA = cute.local_tile(cute.domain_offset((row0, 0), tSFA), (tt, 4), (0, None))
                        tSFAs, tSFAg = cpasync.tma_partition(
                            tma_sfa, 0, one, cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2)
                        )
                    for kt in cutlass.range(self.k_steps(dims[0]), unroll=1):
                        ab_pipeline.producer_acquire(state)
                        self.load_chunk(ab_pipeline, state, kt, first, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile,
                                        True, True)
                        if cutlass.const_expr(not self.bf16):
                            bar = ab_pipeline.producer_get_barrier(state)
                            cute.copy(tma_sfa, tSFAg[(None, kt // 4)], tSFAs[(None, state.index)], tma_bar_ptr=bar)
                        ab_pipeline.producer_commit(state)
                        state.advance()
            else:
                if cutlass.const_expr(self.fused):
                    tAs2, tAg2 = self.token_partitions(second, row0, sA)
                    addr, target = self.first_gemm_count(sync, e, block, dims, num_groups, mGroupA, mGroupB, max_m,
                                                         total_rows)
                    l1_tiles = t_off  # all first-GEMM tiles (Mega MoE: n_l1 per pool block)
                    if cutlass.const_expr(self.comm is not None):
                        l1_tiles = dims[1] * Int32(mGroupB[self.ep_all.num_local])
                    # Rows ready (always once all first-GEMM tiles are seen done): load chunks as the first GEMM
                    # does. Else the weights of the first chunks are loaded before the wait.
                    ahead = Int32(0)
                    if all_done == 0:
                        if ptx.behind(ptx.ld_acquire(self.word(sync, num_groups, ALL_L1), False, "gpu"), l1_tiles) == 0:
                            all_done = Int32(1)
                            cute.arch.fence_proxy("async.global")
                        else:
                            ahead = self.chunks_ahead(addr, target, self.k_steps(dims[2]))
                    state = self.load_tile(ab_pipeline, state, second, (tAg2, tAs2, tWg2, tWs2, tSFWg2, tSFWs2), e,
                                           n_tile, self.k_steps(dims[2]), ahead, addr, target, timeout_ns,
                                           block if self.comm is not None else e,
                                           "first-GEMM tiles of pool block" if self.comm is not None
                                           else "first-GEMM tiles of group")
            if cutlass.const_expr(self.published):
                t = self.fetch_tile(sync, num_groups, gdim)
            else:
                t = t + gdim
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
            if cutlass.const_expr(self.published):
                pub = self.publish_tile(tiles_pub, pub, phase, valid, row0, row_end, n_tile, block)
        if cutlass.const_expr(self.dynamic):
            self.zero_if_last(sync, num_groups, gdim, 2)  # after this CTA's last claim
        ab_pipeline.producer_tail(state)

    @cute.jit
    def consumer(self, ab_pipeline, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, sAct, sOut, mD, mDSF, mRowW,
                 mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, total_rows, dims, sync, bidx,
                 gdim, tiles_pub, record):
        """Consumer warpgroups: every tile's mainloop and epilogue; the tiles come from ``next_tile``, or Mega
        MoE: from the producer warp (``take_tile``). ``record``: the trace build's timeline rows."""
        tt, tn = self.tile_tokens, self.tile_n
        thr_mma = tiled_mma.get_slice(ctidx)
        # Register A fragment as int32, ((1, 2, 2), 1, k blocks): per (row r, k-half h) of each k block
        # (FP8: k32, four e4m3; BF16: k16, two bf16).
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((tn, K_CHUNK)))
        frag = cute.recast_tensor(tCrA, Int32)
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sA))  # (MMA, MMA_N, k blocks, stages)
        # Explicit ((2, 2, tt/8), 1, 1): partition_shape_C drops the unit mode at tt == 8, which cute.gemm rejects.
        acc_shape = ((2, 2, tt // 8), 1, 1)
        acc = cute.make_rmem_tensor(acc_shape, Float32)

        # This thread's coordinates: A-fragment rows (weights) and accumulator (row, token column).
        cA = thr_mma.partition_A(cute.make_identity_tensor((tn, K_CHUNK)))
        q = cA[(0, 0, 0), 0, 0][1] // (2 if self.bf16 else 4)
        wrow0 = cA[(0, 0, 0), 0, 0][0]
        wrow1 = cA[(0, 1, 0), 0, 0][0]
        # Accumulator value i = c + 2*r + 4*j is (weight row g + 8r, token column 8j + 2q + c).
        cC = thr_mma.partition_C(cute.make_identity_tensor((tn, tt)))
        n_cols = tt // 8

        sW_words = cute.make_tensor(  # (word, quad, row, slot)
            cute.recast_ptr(sW.iterator, dtype=Int32),
            cute.make_layout((4, 4, tn, self.stages * self.cps), stride=(1, 4, 16, tn * 16)),
        )
        wbuf = cute.make_rmem_tensor((4, 2), Int32)  # (word, r): FP8 k32 block kb / BF16 k16 blocks 2w, 2w+1
        sfw_words = cute.make_rmem_tensor((2,), Int32)
        if cutlass.const_expr(self.bf16):
            mult = cute.make_rmem_tensor((2, 2), Int32)  # (k32 block pair, r): two BF16 decode multipliers
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            # Token widths: a tile whose rows fit the first n of its tt rows multiplies only those (wgmma N = n):
            # per width its MMA, the token fragments of the first n rows of sA, the first n/8 accumulator
            # column groups (the rest stay 0 and are not stored); the full width is the tile's own.
            widths = token_widths(tt)
            mmas, accs, tCrBs = [], [], []
            for n in widths:
                if cutlass.const_expr(n == tt):
                    mmas.append(tiled_mma)
                    accs.append(acc)
                    tCrBs.append(tCrB)
                else:
                    mma_n = self.make_tiled_mma(cutlass.BFloat16, n)
                    mma_n.set(warpgroup.Field.ACCUMULATE, True)
                    thr_n = mma_n.get_slice(ctidx)
                    sA_n = cute.local_tile(sA, (n, K_CHUNK, self.stages * self.cps), (0, 0, 0))
                    mmas.append(mma_n)
                    tCrBs.append(thr_n.make_fragment_B(thr_n.partition_B(sA_n)))
                    accs.append(cute.make_tensor(acc.iterator, cute.make_layout(((2, 2, n // 8), 1, 1))))
        else:
            tmp0 = cute.make_rmem_tensor(acc_shape, Float32)
            tmp1 = cute.make_rmem_tensor(acc_shape, Float32)
            tmps = (tmp0, tmp1, cute.make_rmem_tensor(acc_shape, Float32), cute.make_rmem_tensor(acc_shape, Float32))
            sfa_words = cute.make_rmem_tensor((2, n_cols), Int32)  # (c, j)
            sw = cute.make_rmem_tensor((2,), Float32)
            sa = cute.make_rmem_tensor((2, n_cols), Float32)
            lut_lo = Int32(E4M3_LUT_LO)
            lut_hi = Int32(E4M3_LUT_HI)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            if cutlass.const_expr(self.wide):
                # Wide tiles: each k32 block as two wgmmas of half the tokens (their own temporaries, together
                # one tile's worth of registers), so one half's promotion overlaps the other half's wgmma.
                half = tt // 2
                half_mma = self.make_tiled_mma(cutlass.Float8E4M3FN, half)
                half_mma.set(warpgroup.Field.ACCUMULATE, False)
                thr_half = half_mma.get_slice(ctidx)
                half_B = [thr_half.make_fragment_B(thr_half.partition_B(
                    cute.local_tile(sA, (half, K_CHUNK, self.stages * self.cps), (h, 0, 0)))) for h in range(2)]
                half_shape = ((2, 2, half // 8), 1, 1)
                halves = (cute.make_rmem_tensor(half_shape, Float32), cute.make_rmem_tensor(half_shape, Float32))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        t = bidx
        e = Int32(0)
        base = Int32(0)
        t_off = Int32(0)
        block = Int32(0)
        taken = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)
        if cutlass.const_expr(self.published):
            phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
            self.stamp(record, gdim, bidx, ctidx, "first tile")
        else:
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
        while valid:
            k_tiles = self.k_steps(dims[0])
            if cutlass.const_expr(self.fused):
                k_tiles = self.k_steps(Int32(cutlass.select_(phase == 0, dims[0], dims[2])))
            acc.fill(0.0)
            if cutlass.const_expr(self.bf16):
                if cutlass.const_expr(len(widths) == 1):
                    state, release = self.bf16_mainloop(ab_pipeline, state, release, k_tiles, mmas[0], accs[0], frag,
                                                        tCrA, tCrBs[0], sW_words, sSFW, q, wrow0, wrow1, wbuf,
                                                        sfw_words, mult)
                else:
                    # The narrowest width holding the tile's rows (every branch runs a whole K loop).
                    rows = cutlass.max(row_end - row0, 1)
                    step = widths[0]
                    width = cutlass.min((rows + step - 1) // step, len(widths)) - 1
                    for w in cutlass.range_constexpr(len(widths)):
                        if width == w:
                            state, release = self.bf16_mainloop(
                                ab_pipeline, state, release, k_tiles, mmas[w], accs[w], frag, tCrA, tCrBs[w],
                                sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult,
                            )
                acc.store(acc.load() * Float32(2.0**BF16_ACC_SHIFT))  # undo the decode's 2**-P (exact)
            else:
                for kt in cutlass.range(k_tiles, unroll=1):
                    ab_pipeline.consumer_wait(state)
                    s = state.index
                    if cutlass.const_expr(self.wide):
                        self.stage_token_scales(sSFA, sScale, ctidx, kt, s)
                    # Packed scale words of this 128-K chunk, the weights' (one per row): absolute codes, or
                    # folded into the decode tables.
                    sfw_words[0] = sSFW[wrow0, 0, s]
                    sfw_words[1] = sSFW[wrow1, 0, s]
                    # FP4 -> E4M3 into the A fragment (one 16-byte load per weight row).
                    cute.autovec_copy(sW_words[None, q, wrow0, s], wbuf[None, 0])
                    cute.autovec_copy(sW_words[None, q, wrow1, s], wbuf[None, 1])
                    for kb in cutlass.range_constexpr(4):
                        for r in cutlass.range_constexpr(2):
                            if cutlass.const_expr(self.folded):
                                t_lo, t_hi = dequant.fold_luts(sfw_words[r], kb)
                                lo, hi = dequant.decode_e2m1x8(wbuf[kb, r], t_lo, t_hi)
                            else:
                                lo, hi = dequant.decode_e2m1x8(wbuf[kb, r], lut_lo, lut_hi)
                            frag[(0, r, 0), 0, kb] = lo
                            frag[(0, r, 1), 0, kb] = hi
                    if cutlass.const_expr(self.wide):
                        # This warpgroup's token scales of the chunk are in shared memory.
                        self.epilogue_barrier(ctidx // 128).arrive_and_wait()
                        # Step u = (block kb, token half h) = divmod(u, 2): issue u, wait for u - 1, promote it
                        # (its temporary is the one step u + 1 writes).
                        for u in cutlass.range_constexpr(9):
                            if cutlass.const_expr(u < 8):
                                warpgroup.fence()
                                cute.gemm(half_mma, halves[u % 2], tCrA[(None, None, u // 2)],
                                          half_B[u % 2][(None, None, u // 2, s)], halves[u % 2])
                                warpgroup.commit_group()
                            if cutlass.const_expr(u > 0):
                                warpgroup.wait_group(1 if u < 8 else 0)
                                self.promote_wide(acc, halves[(u - 1) % 2], (u - 1) // 2, (u - 1) % 2, sScale, q,
                                                  kt % 2, ctidx // 128, sfw_words, sw)
                    else:
                        # The tokens' packed scale words: word (kt % 4) of each 4-word box row.
                        w = kt % 4
                        for j in cutlass.range_constexpr(n_cols):
                            for c in cutlass.range_constexpr(2):
                                sfa_words[c, j] = sSFA[cC[c + 4 * j][1], w, s]
                        if cutlass.const_expr(self.deferred):
                            warpgroup.fence()
                            for kb in cutlass.range_constexpr(4):
                                cute.gemm(tiled_mma, tmps[kb], tCrA[(None, None, kb)], tCrB[(None, None, kb, s)],
                                          tmps[kb])
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            for kb in cutlass.range_constexpr(4):
                                self.promote(acc, tmps[kb], kb, sfw_words, sfa_words, sw, sa)
                        else:
                            for kb in cutlass.range_constexpr(4):
                                tmp = tmp0 if kb % 2 == 0 else tmp1
                                warpgroup.fence()
                                cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb)], tCrB[(None, None, kb, s)], tmp)
                                warpgroup.commit_group()
                                if cutlass.const_expr(kb > 0):
                                    warpgroup.wait_group(1)
                                    self.promote(acc, tmp1 if kb % 2 == 0 else tmp0, kb - 1, sfw_words, sfa_words,
                                                 sw, sa)
                            warpgroup.wait_group(0)
                            self.promote(acc, tmp1, 3, sfw_words, sfa_words, sw, sa)
                    ab_pipeline.consumer_release(state)
                    state.advance()
                if cutlass.const_expr(self.folded):
                    # The weight rows' scales, left out of the decode (exact power-of-two products); folded
                    # weights run in separate launches only, whose block word is the group.
                    for r in cutlass.range_constexpr(2):
                        row_scale = Float32(mRowScale[n_tile * tn + cC[2 * r][0], block])
                        for j in cutlass.range_constexpr(n_cols):
                            for c in cutlass.range_constexpr(2):
                                acc[c + 2 * r + 4 * j] = acc[c + 2 * r + 4 * j] * row_scale

            if cutlass.const_expr(self.fused):
                if phase == 0:
                    self.epilogue_swiglu(acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile)
                    # This warpgroup's rows of the tile are stored: hand the count to the signal warp.
                    self.signal_barrier(ctidx // 128).arrive_and_wait()
                else:
                    self.epilogue_scatter(acc, cC, ctidx, sOut, mRowAddr, row0, row_end, n_tile)
                    if cutlass.const_expr(self.comm is not None):
                        if self.ring_reused(mGroupB):  # its ring rows are read: the signal warp frees them
                            self.signal_barrier(ctidx // 128).arrive_and_wait()
            elif cutlass.const_expr(self.swiglu):
                self.epilogue_swiglu(acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile)
            elif cutlass.const_expr(self.scatter):
                self.epilogue_scatter(acc, cC, ctidx, sOut, mRowW, row0, row_end, n_tile)
            else:
                # BF16, stored only for token rows inside the group.
                n0 = n_tile * tn
                for j in cutlass.range_constexpr(n_cols):
                    for c in cutlass.range_constexpr(2):
                        m = row0 + cC[c + 4 * j][1]
                        if m < row_end:
                            for r in cutlass.range_constexpr(2):
                                i = c + 2 * r + 4 * j
                                mD[m, n0 + cC[i][0]] = acc[i].to(cutlass.BFloat16)

            self.trace_tile(record, gdim, bidx, ctidx, phase)
            if cutlass.const_expr(self.published):
                tiles_pub[0].consumer_release(taken)
                taken.advance()
                phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
            else:
                t = t + gdim
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
        if cutlass.const_expr(self.scatter):
            ptx.fence_acq_rel_sys()  # rows stored to other GPUs precede any release after this kernel

    @cute.jit
    def epilogue_scatter(self, acc, cC, ctidx, sOut, mRowAddr, row0, row_end, n_tile):
        """BF16 rows of one tile to per-row addresses: each consumer warpgroup stages its 64 columns x
        tile_tokens rows in shared memory, then stores each row's 128 bytes with eight 16-byte stores
        (lanes 8r..8r+7 of a warp: one row), so peer memory receives whole 128-byte lines."""
        n_cols = self.tile_tokens // 8
        wg = ctidx // 128
        barrier = self.epilogue_barrier(wg)
        for j in cutlass.range_constexpr(n_cols):
            for c in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j
                    sOut[cC[i][1], cC[i][0]] = acc[i].to(cutlass.BFloat16)
        barrier.arrive_and_wait()
        words = cute.make_tensor(
            cute.recast_ptr(sOut.iterator, dtype=Int32),
            cute.make_layout((self.tile_tokens, self.out_stride // 2), stride=(self.out_stride // 2, 1)),
        )
        t = ctidx % 128
        col = 64 * wg + 8 * (t % 8)  # first of this lane's 8 columns in the tile
        vals = cute.make_rmem_tensor((4,), Int32)
        for pass_ in cutlass.range_constexpr((self.tile_tokens + 15) // 16):
            tok = 16 * pass_ + t // 8
            m = row0 + tok
            if (tok < self.tile_tokens) & (m < row_end):
                cute.autovec_copy(cute.local_tile(words[tok, None], (4,), (col // 8,)), vals)
                addr = Int64(mRowAddr[m]) + Int64(n_tile * self.tile_n + col) * 2
                ptx.st_global_v4(addr, [vals[0], vals[1], vals[2], vals[3]], Int32(1))
        barrier.arrive_and_wait()  # the staged tile is read before the next tile overwrites it

    @cute.jit
    def epilogue_swiglu(self, acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile):
        """``megamoe.numerics`` steps 2-5 for one tile of interleaved (granularity 8) gate/up rows.

        Accumulator rows g and g+8 of a 16-row group are gate and up of intermediate column
        ``(row // 16) * 8 + row % 8``; each consumer warpgroup owns 32 consecutive columns, i.e. one
        UE8M0 block per token. Phase 1: every thread writes ``silu(gate) * up`` (BF16-rounded, clamped
        inputs, FP32 math) to shared memory; phase 2: thread t of the warpgroup takes token t, multiplies
        by its routing weight, quantizes the 32 values (smallest power-of-two scale with amax / scale <= 448,
        RNE) and stores 32 FP8 bytes and one scale byte. ``fast_math``: silu with ``ex2.approx`` and
        ``rcp.approx`` (a few FP32 ulps, as ``megamoe.numerics`` allows): against the IEEE exp and division, flash
        L1 (256 experts, 192 rows each) 3169-3172 vs 3708-3722 us on one H200, as fast as no silu at all
        (``bench/results/gemm/2026-12-01_gemm_swiglu_fast_math_h200.json``)."""
        n_cols = self.tile_tokens // 8
        wg = ctidx // 128
        barrier = self.epilogue_barrier(wg)
        for j in cutlass.range_constexpr(n_cols):
            for c in cutlass.range_constexpr(2):
                row = cC[c + 4 * j][0]
                gate = acc[c + 4 * j].to(cutlass.BFloat16).to(Float32)
                up = acc[c + 2 + 4 * j].to(cutlass.BFloat16).to(Float32)
                gate = cutlass.min(gate, clamp)
                up = cutlass.max(cutlass.min(up, clamp), -clamp)
                if cutlass.const_expr(self.fast_math):
                    silu = gate * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gate, fastmath=True))
                else:
                    silu = gate / (Float32(1.0) + Float32(cute.math.exp(-gate)))
                sAct[cC[c + 4 * j][1], (row // 16) * 8 + row % 8] = silu * up
        barrier.arrive_and_wait()
        t = ctidx % 128
        m = row0 + t
        if t < self.tile_tokens:
            if m < row_end:
                weight = Float32(mRowW[m])
                vals = cute.make_rmem_tensor((32,), Float32)
                amax = Float32(0.0)
                for v in cutlass.range_constexpr(32):
                    vals[v] = sAct[t, 32 * wg + v] * weight
                    amax = cutlass.max(amax, cutlass.max(vals[v], -vals[v]))
                # Smallest e with amax <= 448 * 2^e: amax = 1.f * 2^(E-127) and 448 = 1.75 * 2^8, so
                # e = E - 135 + (f > 0.75), at least -127 (also for amax = 0 and subnormals).
                bits = ptx.f32_bits(amax)
                e = ((bits >> 23) & Int32(0xFF)) - Int32(135)
                if (bits & Int32(0x7FFFFF)) > Int32(0x600000):
                    e = e + Int32(1)
                e = cutlass.max(e, Int32(-127))
                inv_scale = ptx.bits_to_f32((Int32(127) - e) << 23)  # 2^-e, exact
                words = cute.make_rmem_tensor((8,), Int32)
                for w in cutlass.range_constexpr(8):
                    words[w] = ptx.f32x4_to_e4m3x4(
                        vals[4 * w] * inv_scale,
                        vals[4 * w + 1] * inv_scale,
                        vals[4 * w + 2] * inv_scale,
                        vals[4 * w + 3] * inv_scale,
                    )
                block = n_tile * (self.tile_n // 64) + wg  # 32-wide block of the intermediate dim
                if cutlass.const_expr(self.swiglu_bf16):
                    scale = dequant.ue8m0_code_to_f32(e + Int32(127))  # 2^e, exact
                    halves = cute.make_rmem_tensor((16,), Int32)
                    for w in cutlass.range_constexpr(8):
                        h0, h1 = ptx.e4m3x4_to_bf16x4(words[w], scale)
                        halves[2 * w] = h0
                        halves[2 * w + 1] = h1
                    cute.autovec_copy(halves, cute.local_tile(mD[m, None], (16,), (block,)))
                else:
                    cute.autovec_copy(words, cute.local_tile(mD[m, None], (8,), (block,)))
                    mDSF[m, block] = (e + Int32(127)).to(cutlass.Uint8)
        barrier.arrive_and_wait()

    @cute.jit
    def bf16_mainloop(self, ab_pipeline, state, release, k_tiles, tiled_mma, acc, frag, tCrA, tCrB, sW_words, sSFW, q,
                      wrow0, wrow1, wbuf, sfw_words, mult):
        """BF16 mode: one tile's K loop (``k_tiles`` stages of ``cps`` chunks) into ``acc`` (``tiled_mma``'s token
        width); returns the advanced pipeline states (waits, then frees every stage it used)."""
        # The release of stage kt-1 sits between stage kt's wgmma groups; a data-dependent branch
        # there makes ptxas serialize every wgmma, so stage 0 (nothing to release) is peeled.
        ab_pipeline.consumer_wait(state)
        for h in cutlass.range_constexpr(self.cps):
            self.bf16_load(state, Int32(0), h, sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult)
            for kb in cutlass.range_constexpr(4):
                warpgroup.wait_group(3)
                self.bf16_block(tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, state.index * self.cps + h, kb)
        state.advance()
        for kt in cutlass.range(1, k_tiles, unroll=1):
            ab_pipeline.consumer_wait(state)
            for h in cutlass.range_constexpr(self.cps):
                self.bf16_load(state, kt, h, sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult)
                for kb in cutlass.range_constexpr(4):
                    # Block kb's registers were last read by the previous chunk's block-kb wgmmas, four
                    # groups ago: at most three may still be pending.
                    warpgroup.wait_group(3)
                    if cutlass.const_expr(h == 0 and kb == 3):  # every group of stage kt-1 is done: free it
                        ab_pipeline.consumer_release(release)
                        release.advance()
                    self.bf16_block(tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, state.index * self.cps + h, kb)
            state.advance()
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(release)
        release.advance()
        return state, release

    @cute.jit
    def bf16_load(self, state, kt, h: cutlass.Constexpr[int], sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult):
        """BF16 mode, chunk h of stage ``state`` (K step kt; the caller waited for it): this thread's weight words
        of rows wrow0/wrow1 (one 16-byte load each) and the BF16 decode multipliers of its four 32-K blocks,
        two per word."""
        s = state.index
        cute.autovec_copy(sW_words[None, q, wrow0, s * self.cps + h], wbuf[None, 0])
        cute.autovec_copy(sW_words[None, q, wrow1, s * self.cps + h], wbuf[None, 1])
        sfw_words[0] = sSFW[wrow0, h, s]
        sfw_words[1] = sSFW[wrow1, h, s]
        for r in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(2):
                mult[p, r] = dequant.ue8m0_to_bf16_multiplier_pair(sfw_words[r], p)

    @cute.jit
    def bf16_block(self, tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, slot, kb: cutlass.Constexpr[int]):
        """BF16 mode: decode 32-K block kb (word kb of both rows) into the fragment registers of k16 blocks
        2kb, 2kb+1 and issue their wgmmas (tokens of chunk ``slot``) as one group."""
        for r in cutlass.range_constexpr(2):
            d0, d1, d2, d3 = dequant.decode_e2m1x8_bf16(wbuf[kb, r], mult[kb // 2, r], kb % 2)
            frag[(0, r, 0), 0, 2 * kb] = d0
            frag[(0, r, 1), 0, 2 * kb] = d1
            frag[(0, r, 0), 0, 2 * kb + 1] = d2
            frag[(0, r, 1), 0, 2 * kb + 1] = d3
        warpgroup.fence()
        for kk in cutlass.range_constexpr(2 * kb, 2 * kb + 2):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kk)], tCrB[(None, None, kk, slot)], acc)
        warpgroup.commit_group()

    @cute.jit
    def promote(self, acc, tmp, kb: cutlass.Constexpr[int], sfw_words, sfa_words, sw, sa):
        """acc += tmp * 2^(sb[row, kb]) * 2^(sa[token, kb]) (exact power-of-two scaling, one FP32 add)."""
        n_cols = self.tile_tokens // 8
        if cutlass.const_expr(not self.folded):
            for r in cutlass.range_constexpr(2):
                sw[r] = dequant.ue8m0_to_f32(sfw_words[r], kb)
        for j in cutlass.range_constexpr(n_cols):
            for c in cutlass.range_constexpr(2):
                sa[c, j] = dequant.ue8m0_to_f32(sfa_words[c, j], kb)
        for j in cutlass.range_constexpr(n_cols):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j  # flat index of accumulator value (c, r, j)
                    if cutlass.const_expr(self.folded):
                        acc[i] = acc[i] + tmp[i] * sa[c, j]
                    else:
                        acc[i] = acc[i] + tmp[i] * (sw[r] * sa[c, j])

    @cute.jit
    def stage_token_scales(self, sSFA, sScale, ctidx, kt, s):
        """Wide FP8 tiles: thread m of each consumer warpgroup converts token m's four UE8M0 codes of chunk
        ``kt`` (stage ``s``) to FP32 into its warpgroup's table half ``kt % 2`` (``sScale``); a named barrier
        of the warpgroup follows before any promotion reads them."""
        m = ctidx % 128
        word = sSFA[m, kt % 4, s]
        j = m // 8
        for kb in cutlass.range_constexpr(4):
            sScale[(j % 2) * 2 + m % 2, j // 2, (m % 8) // 2, kb, kt % 2, ctidx // 128] = dequant.ue8m0_to_f32(word, kb)

    @cute.jit
    def promote_wide(self, acc, tmp, kb: cutlass.Constexpr[int], h: cutlass.Constexpr[int], sScale, q, parity, wg,
                     sfw_words, sw):
        """``promote`` for wide FP8 tiles, token half ``h`` (``tmp``: its temporary): the token scales of block kb
        from this warpgroup's table half ``parity`` (one 16-byte load per two column groups)."""
        if cutlass.const_expr(not self.folded):
            for r in cutlass.range_constexpr(2):
                sw[r] = dequant.ue8m0_to_f32(sfw_words[r], kb)
        v = cute.make_rmem_tensor((4,), Float32)
        pairs = self.tile_tokens // 32  # column-group pairs per half
        for jp in cutlass.range_constexpr(pairs):
            cute.autovec_copy(sScale[None, h * pairs + jp, q, kb, parity, wg], v)
            for u in cutlass.range_constexpr(4):
                j = 2 * jp + u // 2  # column group within the half
                c = u % 2
                for r in cutlass.range_constexpr(2):
                    i = c + 2 * r + 4 * j
                    a = i + 4 * self.tile_tokens // 16 * h  # the same value's index in the whole tile
                    if cutlass.const_expr(self.folded):
                        acc[a] = acc[a] + tmp[i] * v[u]
                    else:
                        acc[a] = acc[a] + tmp[i] * (sw[r] * v[u])
