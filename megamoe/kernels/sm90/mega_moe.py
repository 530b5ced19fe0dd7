"""The Mega MoE kernel (CuTe DSL, sm_90a): dispatch, L1, L2 and combine of one MoE layer in one persistent launch per
rank -- ``FusedL1L2Sm90`` with the protocol of ``megamoe.kernels.comm`` around its tiles.

Roles of every CTA (one per CTA slot of the GPU, all resident):

1. dispatch (``comm.phases.EpPhases``), all threads: CTA 0 announces this rank's tokens, every CTA scans the ranks'
   routing over NVLink, a grid barrier; then each CTA computes the expert offsets and the pool-block prefix into
   shared memory (they replace the group tensors) and the call's ring geometry (``scheduler.tiles.ring_layout``).
2. warps 2-3 (pull): pull the routed FP8 rows from their source ranks into the ring (dequantized exactly to BF16),
   each unit counted on its pool block's counter; a pull into a reused ring block first waits for the L2 tiles of
   the block before it there.
3. warp 0 (producer): tiles in ``scheduler.tiles``' bounded-ring order (``mega_tile``: phase p = window p's L1
   tiles, then window p - 1's L2 tiles), handed out to whichever CTA asks (``TileChannel.fetch``) and published to
   the consumers and the signal warp; an L1 tile loads its first weight chunks, then waits for its block's pulls.
4. warp 1 (signal): after each L1 tile, its block's counter; after an L2 tile of a call whose ring blocks are reused,
   the block's ``L2_DONE``.
5. consumer warpgroups: the L1 (SwiGLU-quant to BF16) and L2 tiles, L2 storing each row straight into its source
   rank's combine slot over NVLink; then combine: a grid barrier, the ``done`` exchange with every rank and the sum of
   each token's slots into y.
6. the last CTA out zeroes the counters and ends the call.

Deadlock freedom with a ring smaller than the call's rows: the tile order (``megamoe.scheduler``, checked by its
protocol model) lets every wait be satisfied by tiles that come earlier in the order, taken by resident CTAs.
The trace build (``EpCommConfig.trace``) stamps ``%globaltimer`` at phase boundaries (``megamoe.timeline``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ... import timeline
from ...scheduler import tiles
from .. import ptx
from ..comm.phases import DSL_OPS, EpPhases
from ..comm.protocol import RECORD_WORDS, SITE_C_BARRIER, SITE_D_BARRIER, SITE_L1_TILES, SITE_PULLED, EpCommConfig
from .config import (ALL_L1, FINISHED, GRID, L1_DONE, L2_DONE, MEGA_HEADER, NEXT_TILE, PULLED, GemmConfig,
                     mega_comm_words, mega_max_blocks, mega_smem_bytes, named_barriers)
from .l1_l2 import FusedL1L2Sm90


class MegaContext(NamedTuple):
    """What the dispatch leaves for the later phases."""

    call: Int32  # calls this rank's buffer completed before this one
    total: Int32  # rows routed to this rank
    flag: cute.Tensor  # one shared int32: the end-of-call election
    timeout_ns: Int64  # spin-wait limit (0: never)


class MegaMoESm90(FusedL1L2Sm90):
    """The one-launch Mega MoE kernel for one SymmBuffer layout (``comm``: its ``EpCommConfig``)."""

    published = True  # the producer warp hands out the tiles (``TileChannel``)
    extra_tile_readers = 32  # the signal warp
    ring_phases = EpPhases  # the dispatch and pull of every CTA (the pull fills the L1 ring: here the BF16-operand one)

    def __init__(self, config: GemmConfig, comm: EpCommConfig, fast_math: bool = True):
        self.comm = comm
        super().__init__(config, comm.debug, fast_math)
        self.trace = comm.trace  # phase timestamps into the record (``megamoe.timeline``)
        # Dispatch runs on every thread of the CTA; combine on the consumer warpgroups (named barrier).
        self.ep_all = self.ring_phases(comm, self.threads, bounded_ring=True)
        self.max_blocks = mega_max_blocks(comm.layout, self.tile_tokens)
        self.ep_cons = EpPhases(comm, 128 * self.num_consumer_wg, barrier_id=named_barriers(self.num_consumer_wg)[2])

    def extra_smem_bytes(self) -> int:
        return mega_smem_bytes(self.comm)

    def comm_words(self) -> int:
        return mega_comm_words(self.comm)

    def word(self, sync: Int64, num_groups: Int32, which: int, i=0) -> Int64:
        """Address of a counter in ``sync`` (``config.sync_words``): the header's ``FINISHED`` (CTAs), ``ALL_L1`` (L1
        tiles done), ``GRID`` (barrier arrivals), ``NEXT_TILE`` (tiles handed out), then per pool block i
        ``L1_DONE``, ``PULLED`` (row units) and ``L2_DONE``."""
        if which in (FINISHED, ALL_L1, GRID, NEXT_TILE):
            index = {FINISHED: 0, ALL_L1: 1, GRID: 2, NEXT_TILE: 3}[which]
        else:
            index = MEGA_HEADER + {L1_DONE: 0, PULLED: 1, L2_DONE: 2}[which] * self.max_blocks + i
        return sync + Int64(index) * 4

    # ------------------------------------------------------------------------------------------
    # Dispatch (all threads) and the ring geometry
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def setup_groups(self, storage, groups, total_rows, sync, second, mega, tidx, bidx, gdim):
        """Dispatch steps 1-3 on every thread: the expert offsets come from the counts in shared memory (they replace
        ``group_a``), then the pool-block prefix (replaces ``group_b``); the pull (step 4) overlaps the tiles. A timed
        out grid barrier (``EpPhases.grid_barrier_late``) traps once the offsets are in shared memory (nothing waits
        before; the offsets of an incomplete scan are never used): every trap position tried right after the barrier
        or at the end of this setup left ptxas a longer consumer mainloop schedule, or its regular-register one."""
        timeout_ns = second.timeout_ns
        num_local = self.ep_all.num_local
        offs = storage.sComm.get_tensor(cute.make_layout(num_local + 1))
        t_src = cute.make_tensor(offs.iterator + (num_local + 1), cute.make_layout(2))
        firsts = cute.make_tensor(offs.iterator + (num_local + 3), cute.make_layout(num_local + 1))
        flag = cute.make_tensor(offs.iterator + (2 * num_local + 8), cute.make_layout(1))
        lane = cute.arch.lane_idx()
        call = self.ep_all.current_call(mega.base)
        if bidx == 0:
            self.ep_all.announce(mega.me, mega.num_tokens, mega.peers, call, tidx)
        self.ep_all.scan(mega.me, mega.base, mega.peers, call, t_src, tidx, bidx, gdim, mega.record, timeout_ns)
        self.stamp(mega, gdim, bidx, tidx, "scanned")
        late = self.ep_all.grid_barrier_late(self.word(sync, groups.num_groups, GRID), gdim, 0, SITE_D_BARRIER, tidx,
                                             mega.me, mega.record, timeout_ns)
        total = self.ep_all.expert_offsets(offs, mega.base, mega.peers, mega.stats, tidx, lane, bidx, gdim, False, mega.me,
                                           mega.record)
        for g in cutlass.range(tidx, num_local, self.threads):
            firsts[g] = tiles.token_tiles(offs[g + 1] - offs[g], self.tile_tokens)
        cute.arch.sync_threads()
        if late != 0:  # the grid barrier timed out (reported)
            ptx.trap()
        if tidx < 32:
            self.ep_all.warp_exclusive_scan(firsts, lane)
        cute.arch.sync_threads()
        if tidx == 0:
            self.store_ring_geometry(offs, firsts, total_rows)
        cute.arch.sync_threads()
        self.stamp(mega, gdim, bidx, tidx, "offsets")
        return groups._replace(group_a=offs, group_b=firsts), MegaContext(call, total, flag, timeout_ns)

    @cute.jit
    def geometry_words(self, firsts: cute.Tensor):
        """The 4 shared int32 after the block prefix ``firsts`` (pool blocks, window, ring period, windows)."""
        return cute.make_tensor(firsts.iterator + (self.ep_all.num_local + 1), cute.make_layout(4))

    @cute.jit
    def store_ring_geometry(self, offs: cute.Tensor, firsts: cute.Tensor, total_rows: Int32):
        """One thread, once the block prefix is complete: this call's ring geometry (``scheduler.tiles.ring_layout``
        for a ring of ``total_rows`` rows) into shared memory, where the tile loops read it at each tile (values held
        in registers across the mainloop would cost the consumer warps registers they do not have with two CTAs per
        SM)."""
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
        """(pool blocks, window, ring period, windows) of this call (``store_ring_geometry``)."""
        geo = self.geometry_words(firsts)
        return Int32(geo[0]), Int32(geo[1]), Int32(geo[2]), Int32(geo[3])

    @cute.jit
    def ring_reused(self, firsts: cute.Tensor):
        """This call reuses ring blocks (more blocks than a window): L2 tiles signal too."""
        geo = self.geometry_words(firsts)
        return Int32(geo[1]) < Int32(geo[0])

    # ------------------------------------------------------------------------------------------
    # Tiles: the bounded-ring order
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, groups, total_rows: Int32):
        """Tile ``t`` of the bounded-ring order (``scheduler.tiles``: phase p = window p's L1 tiles, then window p - 1's
        L2 tiles; the phase in closed form) -> (GEMM 0 / 1, expert e, base, t_off, valid, row0, row_end, n_tile,
        block): ring rows [row0, row_end) of e's pool block ``block`` (``tiles.window_tile``). The only cursor is
        ``e``, the previous tile's expert (``base`` and ``t_off`` pass through)."""
        ops = DSL_OPS
        offs, firsts = groups.group_a, groups.group_b
        n1, n2 = dims[1], dims[3]
        nb, window, period, last = self.ring_geometry(firsts)
        p = tiles.phase_of(t, window, nb, n1, n2, ops)
        local = t - tiles.phase_start(p, window, nb, n1, n2, ops)
        l1n = n1 * tiles.window_blocks(p, window, nb, ops)
        gemm = Int32(cutlass.select_(local < l1n, Int32(0), Int32(1)))
        n_tiles = Int32(cutlass.select_(gemm == 0, n1, n2))
        local = local - gemm * l1n
        w0 = (p - gemm) * window
        # The expert: the previous tile's (``e``, any index < E: a tile loop's tiles mostly stay in one expert), else
        # a binary search over the block prefix.
        owned = tiles.window_block(local, n_tiles, w0)
        if (owned < Int32(firsts[e])) | (owned >= Int32(firsts[e + 1])):
            e = Int32(tiles.expert_of_block(owned, firsts, self.ep_all.num_local, ops))
        block, n_tile = tiles.window_tile(local, n_tiles, w0, cutlass.min(w0 + window, nb), firsts, e, ops)
        valid = p <= last
        f0 = Int32(firsts[e])
        start = Int32(offs[e])
        row0 = tiles.ring_row(block, f0, start, period, self.tile_tokens, ops)
        row_end = row0 + tiles.block_rows(block, f0, Int32(offs[e + 1]) - start, self.tile_tokens, ops)
        return gemm, e, base, t_off, valid, row0, row_end, n_tile, block

    # ------------------------------------------------------------------------------------------
    # Producer: L1 tiles wait for their pulls, L2 tiles for their block's L1 tiles
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def load_first_gemm(self, ab_pipeline, state, ops, parts, sSFA, e, n_tile, row0, row_end, block, dims, groups,
                        sync, second, mega):
        """An L1 tile: its rows are this launch's pulls (``EpPhases.pull_ring`` counts units per pool block)."""
        addr = self.word(sync, groups.num_groups, PULLED, block)
        target = tiles.pulled_target(row_end - row0, self.ep_all.row_units)
        ahead = self.chunks_ahead(addr, target, self.k_steps(dims[0]))
        return self.load_tile(ab_pipeline, state, ops, parts, self.token_scale_partitions(ops, row0, sSFA), e, n_tile,
                              self.k_steps(dims[0]), ahead, addr, target, second.timeout_ns, block, SITE_PULLED, mega)

    @cute.jit
    def first_gemm_count(self, sync: Int64, e: Int32, block: Int32, dims, groups, total_rows):
        """(address, target) of the counter an L2 tile waits on: its pool block's L1 tiles (``dims[1]`` of them)."""
        return self.word(sync, groups.num_groups, L1_DONE, block), dims[1]

    wait_what = SITE_L1_TILES

    @cute.jit
    def wait_counter(self, addr: Int64, target: Int32, index: Int32, timeout_ns: Int64, what: cutlass.Constexpr, mega):
        """Spin until the counter at ``addr`` (``what``: its ``comm.SITES`` entry, of pool block ``index``) reaches
        ``target`` (acquire), then order the async proxy (TMA) after it; after ``timeout_ns`` (0: never) report into
        the host-mapped record (``EpPhases.fail``; printf too in the debug build) and trap."""
        seen = ptx.spin_until(addr, target, False, "gpu", timeout_ns, True)
        if ptx.behind(seen, target) != 0:
            self.ep_all.fail(what, mega.me, mega.record, index, target, seen)
        cute.arch.fence_proxy("async.global")

    def wait_index(self, e, block):
        return block

    def l1_tile_count(self, t_off, dims, groups):
        return dims[1] * Int32(groups.group_b[self.ep_all.num_local])

    # ------------------------------------------------------------------------------------------
    # Warps 1-3: the signal warp and the pull warps
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def other_warps(self, warp_idx, groups, total_rows, dims, sync, second, mega, ctx, bidx, gdim, channel):
        if warp_idx == 1:
            self.signaller(groups, total_rows, dims, sync, bidx, gdim, channel)
        if warp_idx >= 2:
            # Every unit counted on its pool block's counter, for the L1 tiles' producers. They all finish before
            # combine's grid barrier: every pulled row's block has L1 tiles, each of which waited for all of its
            # block's units.
            num_groups = groups.num_groups
            self.ep_all.pull_ring(mega.me, mega.base, mega.peers, groups.group_a, groups.group_b, ctx.total,
                                  bidx * 2 + (warp_idx - 2), gdim * 2, cute.arch.lane_idx(), mega.record,
                                  self.tile_tokens, self.ring_geometry(groups.group_b)[2], dims[3],
                                  self.word(sync, num_groups, PULLED), self.word(sync, num_groups, L2_DONE),
                                  second.timeout_ns)
            self.stamp(mega, gdim, bidx, cute.arch.lane_idx(), "pull warp 0 done", warp_idx - 2)

    @cute.jit
    def signaller(self, groups, total_rows, dims, sync: Int64, bidx, gdim, channel):
        """Warp 1: the tiles come from the producer warp (every one released after its signal). After an L1 tile, meet
        every consumer warpgroup once its rows are stored, then add 1 to its pool block's ``L1_DONE`` and to
        ``ALL_L1``; with ring blocks reused (``ring_reused``), after an L2 tile (its reads of the ring -- tokens, row
        addresses -- done) add 1 to its block's ``L2_DONE``."""
        num_groups = groups.num_groups
        reused = self.ring_reused(groups.group_b)
        taken = channel.consumer_state()
        phase, valid, row0, row_end, n_tile, block = channel.take(taken)
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
            channel.release(taken)
            taken.advance()
            phase, valid, row0, row_end, n_tile, block = channel.take(taken)

    # ------------------------------------------------------------------------------------------
    # Consumers: L2 tiles free their ring block, then combine
    # ------------------------------------------------------------------------------------------

    @cute.jit
    def after_l2_tile(self, ctidx, groups):
        if self.ring_reused(groups.group_b):  # its ring rows are read: the signal warp frees them
            self.signal_barrier(ctidx // 128).arrive_and_wait()

    @cute.jit
    def after_consumers(self, ctidx, sync, groups, mega, ctx, bidx, gdim):
        """Combine on the consumer warpgroups (``comm`` combine steps 2-3): every row of every CTA is stored and
        fenced (sys) by its thread once all CTAs pass this barrier."""
        timeout_ns = ctx.timeout_ns
        num_warps = self.ep_cons.warps
        self.stamp(mega, gdim, bidx, ctidx, "tiles done")
        self.ep_cons.grid_barrier(self.word(sync, groups.num_groups, GRID), 2 * gdim, 1, SITE_C_BARRIER, ctidx,
                                  mega.me, mega.record, timeout_ns)
        self.stamp(mega, gdim, bidx, ctidx, "combine barrier")
        self.ep_cons.exchange_done(mega.me, mega.base, mega.peers, ctx.call, ctidx, bidx, mega.record, timeout_ns)
        self.stamp(mega, gdim, bidx, ctidx, "done exchanged")
        self.ep_cons.sum_tokens(mega.base, mega.num_tokens, mega.y, bidx * num_warps + ctidx // 32, gdim * num_warps,
                                cute.arch.lane_idx())
        self.stamp(mega, gdim, bidx, ctidx, "end")

    @cute.jit
    def finish(self, sync, groups, tidx, warp_idx, gdim, mega, ctx):
        """The last CTA to finish (all its tiles done, its waits over), every thread of it: zero the header and this
        call's blocks' counters (``firsts``: the block prefix; ``flag``: one shared int32), then end the call
        (``EpPhases.finish_call``)."""
        flag = ctx.flag
        cute.arch.sync_threads()
        if tidx == 0:
            flag[0] = ptx.atom_add(self.word(sync, groups.num_groups, FINISHED), 1, "acq_rel")
        cute.arch.sync_threads()
        if flag[0] == gdim - 1:
            nb = Int32(groups.group_b[self.ep_all.num_local])
            per = cutlass.max(nb, 1)
            for i in cutlass.range(tidx, MEGA_HEADER + 3 * nb, self.threads, unroll=1):
                j = cutlass.max(i - MEGA_HEADER, 0)
                kind = j // per
                index = Int32(cutlass.select_(i < MEGA_HEADER, i, MEGA_HEADER + kind * self.max_blocks + j - kind * per))
                ptx.st_global_u32(sync + Int64(index) * 4, Int32(0))
            self.ep_all.finish_call(mega.base, ctx.call, tidx)

    # ------------------------------------------------------------------------------------------
    # Trace build: timestamps (``megamoe.timeline``)
    # ------------------------------------------------------------------------------------------

    def trace_word(self, record: Int64, gdim: Int32, bidx: Int32, word) -> Int64:
        """Address of word ``word`` of this CTA's timeline row (after the ``gdim`` debug-record rows)."""
        return record + (Int64(gdim) * RECORD_WORDS + Int64(bidx) * timeline.TRACE_WORDS + word) * 8

    @cute.jit
    def stamp(self, mega, gdim: Int32, bidx: Int32, who: Int32, event: cutlass.Constexpr, offset=0):
        """Trace build, the thread whose index ``who`` in its group is 0: ``%globaltimer`` into this CTA's timeline
        row at ``event`` (``timeline.EVENTS``) + ``offset``; nothing in other builds."""
        if cutlass.const_expr(self.trace):
            if who == 0:
                ptx.st_global_u64(self.trace_word(mega.record, gdim, bidx, timeline.EVENT[event] + offset),
                                  ptx.globaltimer())

    @cute.jit
    def trace_start(self, mega, gdim: Int32, bidx: Int32, tidx: Int32):
        """Trace build, thread 0 at the kernel's start: stamp "start" and zero the words a call may leave unwritten
        (the tile counts; "last l1 tile" of a CTA without L1 tiles); two CTA barriers order these stores before the
        consumers' updates."""
        self.stamp(mega, gdim, bidx, tidx, "start")
        if cutlass.const_expr(self.trace):
            if tidx == 0:
                for word in (timeline.EVENT["last l1 tile"], timeline.COUNT["l1 tiles"], timeline.COUNT["l2 tiles"]):
                    for half in range(2):
                        ptx.st_global_u32(self.trace_word(mega.record, gdim, bidx, word) + half * 4, 0)

    @cute.jit
    def trace_tile(self, mega, gdim: Int32, bidx: Int32, ctidx: Int32, phase: Int32):
        """Trace build, the first consumer thread after each tile: count it (per GEMM), stamp "last l1 tile"."""
        if cutlass.const_expr(self.trace):
            if ctidx == 0:
                if phase == 0:
                    self.stamp(mega, gdim, bidx, ctidx, "last l1 tile")
                ptx.count_u64(self.trace_word(mega.record, gdim, bidx, timeline.COUNT["l1 tiles"] + phase))
