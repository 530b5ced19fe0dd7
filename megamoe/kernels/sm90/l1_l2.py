"""L1 and L2 of the MoE layer in one persistent launch (CuTe DSL, BF16 mode): ``GroupedGemmSm90`` with a second GEMM.

The tile list is L1's tiles (``SwigluQuant`` into BF16 rows of ``act``) then L2's (``ScatterRows`` of rows of
``act`` x L2's weights to per-row addresses); each CTA takes tiles ``bidx, bidx + grid, ...`` of that list, so every
CTA finishes its L1 tiles before its first L2 tile: with all CTAs resident, no wait can deadlock.

Warp 1, the signal warp (idle otherwise), meets each consumer warpgroup on a named barrier after an L1 tile's
stores and adds 1 (``fence.acq_rel.gpu`` + release add) to the expert's counter and to an all-tiles counter, so the
consumers never wait on a fence. An L2 tile's producer checks (acquire) the all-tiles counter, then the expert's: if
not ready it TMA-loads the weights of up to ``stages`` chunks, spins, and loads the tokens after a
``fence.proxy.async.global``; once all L1 tiles are seen done it checks no more. The last CTA out zeroes the
counters (``sync``, ``config.sync_words``). Both epilogues stage their tile in one shared-memory region.

Only the debug build (``timeout_ns`` > 0) times the wait and printf's: a function call anywhere in a kernel makes
ptxas serialize all its wgmmas (C7510). The Mega MoE kernel (``mega_moe``) overrides ``wait_counter``: every build
times its waits and reports into its host-mapped record, with no call.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64

from ...scheduler import tiles
from .. import ptx
from ..weight_layout import K_CHUNK
from .args import EpilogueArgs, TmaOps
from .config import ALL_L1, FINISHED, L1_DONE, GemmConfig, named_barriers
from .epilogues import ScatterRows
from .gemm import GroupedGemmSm90


class FusedL1L2Sm90(GroupedGemmSm90):
    """L1 (``SwigluQuant`` to BF16) then L2 (``ScatterRows``) in one launch; ``debug``: timed waits that report and
    trap (their printf serializes the wgmmas)."""

    kind = "l1_l2"
    published = False  # each role walks the tile list itself (``next_tile``)
    l1_epilogue = "swiglu_fp8_bf16"  # the first GEMM's epilogue (``GroupedGemmSm90``'s names)
    folded = False  # the weights' FP8-mode scales folded into the decode (``weight_layout.fold_fp8_scales``)

    def __init__(self, config: GemmConfig, debug: bool = False, fast_math: bool = True):
        super().__init__(config, "offsets", self.l1_epilogue, self.folded, fast_math)
        self.debug = debug
        self.scatter = True
        self.l2_epilogue = ScatterRows(config)

    # ------------------------------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------------------------------

    def dims(self, tma1: TmaOps, tma2: TmaOps):
        k_tiles = Int32(tma1.a.shape[1]) // K_CHUNK
        n_tiles = Int32(cute.size(tma1.w, mode=[0])) // self.tile_n
        return (k_tiles, n_tiles, Int32(tma2.a.shape[1]) // K_CHUNK, Int32(cute.size(tma2.w, mode=[0])) // self.tile_n)

    def before_dependency_wait(self, warp_idx, tma1, sW, sSFW, groups, total_rows, dims, bidx):
        """No prefetch: the first tiles' weights arrive while the CTA's first loads wait for nothing anyway."""

    def epilogue_smem(self, storage):
        """One region serves both epilogues: rows of both staging tiles are 2 * tile_n + 16 bytes, and consumer
        warpgroup w touches only bytes [128w, 128w + 128) of each row in both, which it runs one after the other (a
        pipeline stage more at large tiles); beyond them only the per-128 SwiGLU epilogue writes (its second pass's
        columns, its amax exchange: after a barrier of all consumer warpgroups), which no scatter tile touches."""
        assert self.act_stride * 4 == self.out_stride * 2
        sAct = storage.sAct.get_tensor(cute.make_layout((self.tile_tokens, self.act_stride), stride=(self.act_stride, 1)))
        out_layout = cute.make_layout((self.tile_tokens, self.out_stride), stride=(self.out_stride, 1))
        return sAct, cute.make_tensor(cute.recast_ptr(sAct.iterator, dtype=cutlass.BFloat16), out_layout)

    def out_smem_elems(self) -> int:
        return 8  # the scatter tile lies in sAct (``epilogue_smem``)

    def tile_k_steps(self, phase, dims):
        return self.k_steps(Int32(cutlass.select_(phase == 0, dims[0], dims[2])))

    def word(self, sync: Int64, num_groups: Int32, which: int, i=0) -> Int64:
        """Address of a counter in ``sync`` (``config.sync_words``): ``L1_DONE`` of group i, ``FINISHED`` (CTAs),
        ``ALL_L1`` (L1 tiles done)."""
        return sync + Int64({L1_DONE: i, FINISHED: num_groups, ALL_L1: num_groups + 1}[which]) * 4

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, groups, total_rows: Int32):
        """Tile ``t`` of the list: the first GEMM's tiles (``phase`` 0), then the second's (phase 1, tile ids from
        ``t_off`` = the first GEMM's tile count on)."""
        n_tiles = Int32(cutlass.select_(phase == 0, dims[1], dims[3]))
        e, base, valid, row0, row_end, n_tile = self.tiles.find(t - t_off, e, base, n_tiles, groups, total_rows)
        if phase == 0:
            if e >= groups.num_groups:  # past the first GEMM's tiles; base: their count
                phase = Int32(1)
                t_off = t_off + base
                e, base, valid, row0, row_end, n_tile = self.tiles.find(t - t_off, Int32(0), Int32(0), dims[3], groups,
                                                                        total_rows)
        return phase, e, base, t_off, valid, row0, row_end, n_tile, Int32(0)

    @cute.jit
    def other_warps(self, warp_idx, groups, total_rows, dims, sync, second, mega, ctx, bidx, gdim, channel):
        if warp_idx == 1:
            self.signaller(groups, total_rows, dims, sync, bidx, gdim, channel)

    @cute.jit
    def finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx):
        """The last CTA to finish (all its tiles done, its waits over) zeroes the counters for the next launch."""
        cute.arch.sync_threads()
        if warp_idx == 0:
            self.zero_if_last(sync, groups.num_groups, gdim, groups.num_groups + 2)

    def producer_done(self, sync, groups, gdim):
        """The counters are zeroed in ``finish``."""

    # ------------------------------------------------------------------------------------------
    # Producer: a second-GEMM tile waits for its rows
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def load_second_gemm(self, ab_pipeline, state, tma2, parts2, sA, sSFA, e, n_tile, row0, block, t_off, dims, groups,
                         total_rows, sync, second, mega, all_done):
        """An L2 tile: load the weights of up to ``stages`` chunks (they do not depend on L1), then wait for its
        tokens' rows (the L1 tiles of its group), then load them (``load_tile``). Once every L1 tile is seen done
        (acquired + proxy fence) no more checks."""
        tWs2, tWg2, tSFWs2, tSFWg2 = parts2
        tAs2, tAg2 = self.token_partitions(tma2, row0, sA)
        addr, target = self.first_gemm_count(sync, e, block, dims, groups, total_rows)
        l1_tiles = self.l1_tile_count(t_off, dims, groups)
        # Rows ready (always once all first-GEMM tiles are seen done): load chunks as the first GEMM does. Else the
        # weights of the first chunks are loaded before the wait.
        ahead = Int32(0)
        if all_done == 0:
            if ptx.behind(ptx.ld_acquire(self.word(sync, groups.num_groups, ALL_L1), False, "gpu"), l1_tiles) == 0:
                all_done = Int32(1)
                cute.arch.fence_proxy("async.global")
            else:
                ahead = self.chunks_ahead(addr, target, self.k_steps(dims[2]))
        state = self.load_tile(ab_pipeline, state, tma2, (tAg2, tAs2, tWg2, tWs2, tSFWg2, tSFWs2),
                               self.token_scale_partitions(tma2, row0, sSFA), e, n_tile, self.k_steps(dims[2]), ahead,
                               addr, target, second.timeout_ns, self.wait_index(e, block), self.wait_what, mega)
        return state, all_done

    wait_what = "first-GEMM tiles of group"  # the debug report's name of an L2 tile's wait

    def wait_index(self, e, block):
        return e

    def l1_tile_count(self, t_off, dims, groups):
        """All first-GEMM tiles: the tile id where the second GEMM's start."""
        return t_off

    @cute.jit
    def first_gemm_count(self, sync: Int64, e: Int32, block: Int32, dims, groups, total_rows):
        """(address, target) of the counter an L2 tile of group e waits on: each first-GEMM tile of the group adds 1
        (release) once its rows are stored (``signaller``)."""
        addr = self.word(sync, groups.num_groups, L1_DONE, e)
        start, end = self.tiles.bounds(e, groups, total_rows)
        target = tiles.token_tiles(end - start, self.tile_tokens) * dims[1]
        return addr, target

    @cute.jit
    def wait_counter(self, addr: Int64, target: Int32, index: Int32, timeout_ns: Int64, what: cutlass.Constexpr, mega):
        """Spin until the counter at ``addr`` (``what`` it counts, of group / block ``index``) reaches ``target``
        (acquire), then order the async proxy (TMA) after it. Debug build: with ``timeout_ns`` > 0, expiry printf's
        the wait and traps (this kernel has no host-mapped record; ``mega``: unused here)."""
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

    @cute.jit
    def chunks_ahead(self, addr: Int64, target: Int32, k_tiles: Int32) -> Int32:
        """The K steps a tile whose token rows other CTAs produce loads the weights of before it waits (``load_tile``'s
        ``ahead``): none if the counter at ``addr`` already reached ``target`` (acquired; the async proxy then ordered
        after it), else up to ``stages``."""
        ahead = Int32(0)
        if ptx.behind(ptx.ld_acquire(addr, False, "gpu"), target) != 0:
            ahead = cutlass.min(k_tiles, Int32(self.stages))
        else:
            cute.arch.fence_proxy("async.global")
        return ahead

    @cute.jit
    def load_tile(self, ab_pipeline, state, ops, parts, sfa, e: Int32, n_tile: Int32, k_tiles: Int32, ahead: Int32,
                  addr: Int64, target: Int32, timeout_ns: Int64, index: Int32, what: cutlass.Constexpr, mega):
        """The TMA loads of a tile whose token rows other CTAs produce in this launch. The first ``ahead`` chunks (at
        most ``stages``: they need no stage of this tile released) load their weights, then the wait for the counter
        (``wait_counter``; ``index``, ``what``: its name in the report; ``mega``: the kernel's ``MegaArgs``), then
        their tokens; the rest load both. A tile of several passes (``GemmConfig.n_passes``) loads this way its first
        pass's weight rows, then every K step of each later pass's (its rows ready: waited for in the first).
        ``ahead`` = 0: the rows are known ready (acquired, proxy-fenced). ``parts``: the GEMM's (tAg, tAs, tWg, tWs,
        tSFWg, tSFWs) partitions; ``sfa``: FP8 mode, its token-scale partitions, loaded with the tokens (they are
        produced with them), else None. Returns the advanced pipeline state."""
        tAg, tAs, tWg, tWs, tSFWg, tSFWs = parts
        n0 = self.pass_tile(n_tile, 0)
        pending = state.clone()
        for kt in cutlass.range(ahead, unroll=1):
            ab_pipeline.producer_acquire(state)
            self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n0, False, True)
            ab_pipeline.producer_commit(state)
            state.advance()
        if ahead > 0:
            self.wait_counter(addr, target, index, timeout_ns, what, mega)
        for kt in cutlass.range(ahead, unroll=1):
            self.load_chunk(ab_pipeline, pending, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n0, True, False, sfa)
            pending.advance()
        state = self.load_chunks(ab_pipeline, state, ahead, k_tiles, ops, parts, sfa, e, n0)
        for p in cutlass.range_constexpr(1, self.n_passes):
            state = self.load_chunks(ab_pipeline, state, Int32(0), k_tiles, ops, parts, sfa, e, self.pass_tile(n_tile, p))
        return state

    @cute.jit
    def load_chunks(self, ab_pipeline, state, start: Int32, k_tiles: Int32, ops, parts, sfa, e: Int32, n_pass: Int32):
        """K steps [start, k_tiles) of the weight rows ``n_pass`` (``pass_tile``) with their tokens (``load_tile``'s
        arguments), each in a stage acquired here. Returns the advanced pipeline state."""
        tAg, tAs, tWg, tWs, tSFWg, tSFWs = parts
        for kt in cutlass.range(start, k_tiles, unroll=1):
            ab_pipeline.producer_acquire(state)
            self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_pass, True, True, sfa)
            ab_pipeline.producer_commit(state)
            state.advance()
        return state

    # ------------------------------------------------------------------------------------------
    # Signal warp
    # ------------------------------------------------------------------------------------------

    def signal_barrier(self, wg):
        """Consumer warpgroup wg (128 threads) and the signal warp (32) (``config.named_barriers``), once per signalled
        tile."""
        return pipeline.NamedBarrier(barrier_id=named_barriers(self.num_consumer_wg)[1] + wg, num_threads=160)

    @cute.jit
    def signaller(self, groups, total_rows, dims, sync: Int64, bidx, gdim, channel):
        """Warp 1: for each of this CTA's first-GEMM tiles, meet every consumer warpgroup once its rows are stored
        (``signal_barrier``), then add 1 to the group's counter and to the all-tiles counter (``fence.acq_rel.gpu`` +
        release add: cumulative over the stores the barrier ordered before). The fence waits here, not in the
        consumers. Ends at the first second-GEMM tile (each CTA's first-GEMM tiles come first)."""
        t = bidx
        phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
            t, Int32(0), Int32(0), Int32(0), Int32(0), dims, groups, total_rows
        )
        more = valid & (phase == 0)
        while more:
            for wg in cutlass.range_constexpr(self.num_consumer_wg):
                self.signal_barrier(wg).arrive_and_wait()
            if cute.arch.lane_idx() == 0:
                ptx.arrive(self.word(sync, groups.num_groups, L1_DONE, e))
                ptx.arrive(self.word(sync, groups.num_groups, ALL_L1))
            t = t + gdim
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, phase, e, base, t_off, dims, groups, total_rows
            )
            more = valid & (phase == 0)

    # ------------------------------------------------------------------------------------------
    # Consumers: the epilogue by GEMM
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def tile_epilogue(self, acc, cC, ctidx, phase, sAct, sOut, epi, second, row0, row_end, n_tile, groups, p):
        """Pass ``p`` (static) of the tile's epilogue; after the last pass the tile's rows are stored (L1: the signal
        warp counts them) or read (L2: ``after_l2_tile``)."""
        if phase == 0:
            self.epilogue(acc, cC, ctidx, sAct, epi, row0, row_end, n_tile, p)
            if cutlass.const_expr(p == self.n_passes - 1):
                # This warpgroup's rows of the tile are stored: hand the count to the signal warp.
                self.signal_barrier(ctidx // 128).arrive_and_wait()
        else:
            self.l2_epilogue(acc, cC, ctidx, sOut, EpilogueArgs(None, None, second.row_addr, None), row0, row_end,
                             self.pass_tile(n_tile, p))
            if cutlass.const_expr(p == self.n_passes - 1):
                self.after_l2_tile(ctidx, groups)

    def after_l2_tile(self, ctidx, groups):
        """After an L2 tile's stores (nothing here)."""
