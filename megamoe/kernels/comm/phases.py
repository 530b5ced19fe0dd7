"""The Mega MoE protocol's phases as device functions (``EpPhases``): the staged dispatch and combine kernels
(``comm.dispatch``, ``comm.combine``) run them with all their threads, the one-launch Mega MoE kernel
(``kernels.sm90.mega_moe``) around its GEMM tiles. The protocol and its memory model: ``megamoe.kernels.comm``."""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import dsl_user_op

from ...scheduler import tiles
from ...symm_buffer import ERROR_BAD_ID, ERROR_DUPLICATE_DROPPED
from .. import dequant, ptx
from ..warp_ops import warp_inclusive_sum
from .protocol import (RECORD_WORDS, SITE_DONE, SITE_EXPERT, SITE_POOL, SITE_READY, SITE_RING_FREE, SITE_ROWS, SITES,
                       THREADS, VEC, VECS_PER_LANE, WARP, EpCommConfig)

DSL_OPS = SimpleNamespace(
    min=cutlass.min, max=cutlass.max, select=lambda c, a, b: Int32(cutlass.select_(c, Int32(a), Int32(b)))
)
"""``scheduler.tiles`` ops over DSL integers."""


@dsl_user_op
def _st_record(record: Int64, words: list, *, loc=None, ip=None) -> None:
    """Store 8 int32 values (``words[2]``: the CTA) as int64 words into row ``words[2]`` of ``record`` (host-mapped
    memory), word 0 last (the host takes a row whose word 0 is nonzero as complete), then ``fence.sc.sys``. The row
    address is computed inside the block, so no failure path keeps one live (in registers) across the kernel."""
    lines = [".reg .b64 w, a;", f"mad.wide.u32 a, $3, {RECORD_WORDS * 8}, $0;"]
    for i in [*range(1, RECORD_WORDS), 0]:
        lines += [f"cvt.s64.s32 w, ${i + 1};", f"st.relaxed.sys.global.b64 [a+{8 * i}], w;"]
        if i == RECORD_WORDS - 1:
            lines.append("fence.sc.sys;")
    text = "{\n" + "\n".join(lines) + "\nfence.sc.sys;\n}"
    args = [ptx.ir_arg(record, Int64, loc, ip)] + [ptx.ir_arg(w, Int32, loc, ip) for w in words]
    ptx.volatile_asm([], args, text, "l" + ",r" * RECORD_WORDS + ",~{memory}", loc, ip)


class EpPhases:
    """The protocol's phases as device functions over a group of ``threads`` threads per CTA (every CTA of
    the grid takes part): the staged dispatch / combine kernels run them with all ``THREADS`` threads, the
    one-launch Mega MoE kernel (``kernels.sm90.mega_moe``) with its own CTA's threads. ``barrier_id``: None when
    the group is the whole CTA (``bar.sync 0``), else the named barrier the group synchronizes on. Every
    method takes the thread's index in the group (``tid``), the CTA's index and the grid size."""

    def __init__(self, cfg: EpCommConfig, threads: int = THREADS, barrier_id: int | None = None, bounded_ring: bool = False):
        lay = cfg.layout
        self.cfg = cfg
        self.debug = cfg.debug
        self.threads = threads
        self.warps = threads // WARP
        self.barrier_id = barrier_id
        self.num_ranks = lay.num_ranks
        self.num_local = lay.num_local_experts
        self.num_experts = lay.num_experts
        self.topk = lay.num_topk
        self.hidden = lay.kernel_hidden  # rows of x, the rings and combine (the kernels' size, symm_buffer)
        self.y_hidden = lay.hidden  # rows of y: the real size, the padded columns are never stored
        self.t_max = lay.num_max_tokens_per_rank
        self.ring = lay.num_ring_tokens
        self.row_limit = lay.max_recv_rows if bounded_ring else self.ring
        """Rows a call may route here: a bounded ring (the one-launch kernel reuses ring blocks) takes any
        rank's worth, else the ring holds them all."""
        self.pool_cap = lay.num_ranks * lay.num_max_tokens_per_rank  # rows per expert in ``pool``
        self.codes = self.pool_cap * lay.num_topk  # source codes lie in [0, codes)
        self.signals = cfg.offset("signals")
        self.fp8 = lay.mma_type == "fp8xfp4"  # tokens FP8 + packed UE8M0 scales, else BF16
        self.row_units = self.units(self.hidden // VEC if self.fp8 else self.hidden * 2 // VEC)
        """Pull units (one warp each) per ring row."""

    @cute.jit
    def fail(self, site: cutlass.Constexpr, rank: Int32, record: Int64, index: Int32, expected: Int32, seen: Int32):
        """``report``, then trap."""
        self.report(site, rank, record, index, expected, seen)
        ptx.trap()

    @cute.jit
    def report(self, site: cutlass.Constexpr, rank: Int32, record: Int64, index: Int32, expected: Int32, seen: Int32):
        """The host-mapped record (``record``, 0: none; the host prints its line, ``megamoe.mega``) and, in the debug
        build, the same line by printf (a function call: release builds of a kernel with wgmma must not contain
        one)."""
        cta = cute.arch.block_idx()[0]
        sm = ptx.smid()
        role, text = SITES[site]
        if cutlass.const_expr(self.debug):
            cute.printf("megamoe debug: rank %d CTA %d (SM %d) role " + role + ": " + text, rank, cta, sm, index, expected,
                        seen)
        if record != Int64(0):
            _st_record(record, [Int32(site + 1), rank, cta, sm, index, expected, seen, Int32(int(self.debug))])

    @cute.jit
    def wait_flag(self, addr: Int64, expected: Int32, wide: cutlass.Constexpr, scope: cutlass.Constexpr,
                  site: cutlass.Constexpr, index: Int32, rank: Int32, record: Int64, timeout_ns: Int64):
        """Spin until the flag's call part reaches ``expected`` (acquire); after ``timeout_ns`` (0: never) report
        (``fail``) and trap."""
        seen = ptx.spin_until(addr, expected, wide, scope, timeout_ns, True)
        if ptx.behind(seen, expected) != 0:
            self.fail(site, rank, record, index, expected, seen)

    @cute.jit
    def group_sync(self):
        """Barrier over the group's threads."""
        if cutlass.const_expr(self.barrier_id is None):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.threads)

    @cute.jit
    def grid_barrier(self, counter: Int64, target: Int32, q: cutlass.Constexpr, site: cutlass.Constexpr, tid: Int32,
                     rank: Int32, record: Int64, timeout_ns: Int64):
        """``grid_barrier_late``; after a timeout every thread of the group traps."""
        if self.grid_barrier_late(counter, target, q, site, tid, rank, record, timeout_ns) != 0:
            ptx.trap()

    @cute.jit
    def grid_barrier_late(self, counter: Int64, target: Int32, q: cutlass.Constexpr, site: cutlass.Constexpr,
                          tid: Int32, rank: Int32, record: Int64, timeout_ns: Int64) -> Int32:
        """Barrier ``q`` over all CTAs: thread 0 of each adds 1 to the monotonic ``counter`` (gpu scope) and waits
        for ``target`` arrivals; after ``timeout_ns`` (0: never) it reports (``report``). Returns 1 in every thread
        of the group (the closing barrier's ``bar.red.or``) after a timeout, else 0: the caller traps (every thread).
        The trap stays out of thread 0's branch: there, ptxas takes the rest of the Mega MoE kernel for divergent code
        and its consumer mainloop loses the uniform datapath (the wgmma descriptors computed in regular registers,
        each moved by ``R2UR``)."""
        self.group_sync()
        late = Int32(0)
        if tid == 0:
            ptx.arrive(counter)
            seen = ptx.spin_until(counter, target, False, "gpu", timeout_ns, True)
            late = ptx.behind(seen, target)
            if late != 0:
                self.report(site, rank, record, Int32(q), target, seen)
        return ptx.barrier_any(0 if self.barrier_id is None else self.barrier_id, self.threads, late)

    @cute.jit
    def load_unit(self, src: Int64, num_vecs: cutlass.Constexpr, unit: Int32, lane: Int32):
        """This lane's 16-byte vectors ``v = unit * 32 * VECS_PER_LANE + i * 32 + lane`` of a row at ``src``
        (``i < VECS_PER_LANE``; none past ``num_vecs``): (their words, their in-row flags)."""
        words = []
        on = []
        for i in cutlass.range_constexpr(VECS_PER_LANE):
            v = unit * (WARP * VECS_PER_LANE) + i * WARP + lane
            ok = Int32(cutlass.select_(v < num_vecs, Int32(1), Int32(0)))
            on.append(ok)
            words.append(ptx.ld_cg_v4_if(src + Int64(v) * VEC, ok))
        return words, on

    @cute.jit
    def copy_unit(self, src: Int64, dst: Int64, num_vecs: cutlass.Constexpr, unit: Int32, lane: Int32):
        """A warp copies vectors ``[unit * 32 * VECS_PER_LANE, +32 * VECS_PER_LANE) ∩ [0, num_vecs)``
        of a row: all loads first, then the stores."""
        words, on = self.load_unit(src, num_vecs, unit, lane)
        for i in cutlass.range_constexpr(VECS_PER_LANE):
            v = unit * (WARP * VECS_PER_LANE) + i * WARP + lane
            ptx.st_global_v4(dst + Int64(v) * VEC, words[i], on[i])

    @cute.jit
    def pull_unit(self, x_src: Int64, sf_src: Int64, dst: Int64, unit: Int32, lane: Int32):
        """A warp dequantizes FP8 vectors ``[unit * 32 * VECS_PER_LANE, +32 * VECS_PER_LANE) ∩ [0, H/16)`` of
        a token row (``x_src``; packed UE8M0 scales at ``sf_src``) into BF16 at ``dst``: all loads first.
        Lane l < 16 loads the unit's scale word l; vector v (16 values) needs scale byte v // 2."""
        num_vecs = self.hidden // VEC
        words_per_unit = WARP * VECS_PER_LANE // 8
        wi = unit * words_per_unit + lane
        sf_word = ptx.ld_cg_u32_if(sf_src + Int64(wi) * 4,
                             Int32(cutlass.select_((lane < words_per_unit) & (wi < self.hidden // 128), Int32(1), Int32(0))))
        words, on = self.load_unit(x_src, num_vecs, unit, lane)
        shift = ((lane // 2) % 4) * 8  # byte of vector v = unit * 128 + i * 32 + lane in its scale word
        for i in cutlass.range_constexpr(VECS_PER_LANE):
            v = unit * (WARP * VECS_PER_LANE) + i * WARP + lane
            word = cute.arch.shuffle_sync(sf_word, i * (WARP // 8) + lane // 8)
            scale = dequant.ue8m0_code_to_f32((word >> shift) & Int32(0xFF))
            out = []
            for w in cutlass.range_constexpr(4):
                lo, hi = ptx.e4m3x4_to_bf16x4(words[i][w], scale)
                out += [lo, hi]
            ptx.st_global_v4(dst + Int64(v) * (2 * VEC), out[:4], on[i])
            ptx.st_global_v4(dst + Int64(v) * (2 * VEC) + VEC, out[4:], on[i])

    def units(self, num_vecs: int) -> int:
        """Copy units (one warp each) per row of ``num_vecs`` vectors."""
        return -(-num_vecs // (WARP * VECS_PER_LANE))

    def decode(self, code):
        """Source code -> (source rank, routing entry q = t * k + j)."""
        src = code // (self.t_max * self.topk)
        return src, code - src * (self.t_max * self.topk)

    @cute.jit
    def check_pool_code(self, code: Int32, row: Int32, rank: Int32, record: Int64):
        """Debug: a source code read from ``pool`` must be in ``[0, codes)``."""
        if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
            if (code < 0) | (code >= self.codes):
                self.fail(SITE_POOL, rank, record, row, Int32(self.codes), code)

    # ----------------------------------------------------------------------------------------------
    # Dispatch phases (module docstring, dispatch steps 1-4)

    @cute.jit
    def current_call(self, base: Int64) -> Int32:
        """``signals[0]``: the calls this rank has completed (read before any phase of a call)."""
        return ptx.ld_cg_u32(base + self.signals)

    @cute.jit
    def announce(self, me: Int32, num_tokens: Int32, peers: Int64, call: Int32, tid: Int32):
        """Step 1 (one CTA): ``ready[me] = (call + 1) << 32 | T`` into every rank."""
        ptx.fence_acq_rel_sys()
        for r in cutlass.range(tid, self.num_ranks, self.threads):
            flag = (Int64(call + 1) << 32) | Int64(num_tokens)
            ptx.st_release_sys(ptx.ld_cg_u64(peers + Int64(r) * 8) + (self.cfg.offset("ready") + Int64(me) * 8), flag, True)

    @cute.jit
    def scan(self, me: Int32, base: Int64, peers: Int64, call: Int32, t_src: cute.Tensor, tid: Int32, cta: Int32,
             num_ctas: Int32, record: Int64, timeout_ns: Int64):
        """Step 2: every source's routing entries that name a local expert go to that expert's pool
        (``t_src``: 2 int32 of shared memory)."""
        cfg, k = self.cfg, self.topk
        counts, pool = cfg.offset("expert_counts"), cfg.offset("pool")
        for s in cutlass.range(self.num_ranks):
            src = (me + cta + s) % self.num_ranks
            if tid == 0:
                flag = base + (cfg.offset("ready") + Int64(src) * 8)
                self.wait_flag(flag, call + 1, True, "sys", SITE_READY, src, me, record, timeout_ns)
                t_src[s % 2] = ptx.ld_cg_u32(flag)
            self.group_sync()
            entries = t_src[s % 2] * k
            idx = ptx.ld_cg_u64(peers + Int64(src) * 8) + cfg.offset("topk_idx")
            for q in cutlass.range(cta * self.threads + tid, entries, num_ctas * self.threads):
                expert = ptx.ld_cg_u64(idx + Int64(q) * 8)
                e = expert - Int64(me) * self.num_local
                if (e >= 0) & (e < self.num_local):
                    le = Int32(e)
                    pos = ptx.atom_add(base + (counts + Int64(le) * 4), 1, "relaxed")
                    if pos < self.pool_cap:
                        ptx.st_global_u32(base + (pool + (Int64(le) * self.pool_cap + pos) * 4), src * (self.t_max * k) + q)
                    else:
                        if cutlass.const_expr(self.debug):
                            self.fail(SITE_EXPERT, me, record, le, Int32(self.pool_cap), pos)
                        self.drop_row(src * (self.t_max * k) + q, peers)
                if (expert < -1) | (expert >= self.num_experts):  # counted; the slot is a masked one
                    ptx.red_or(base + self.cfg.errors_offset(), ERROR_BAD_ID, "gpu")

    @cute.jit
    def drop_row(self, code: Int32, peers: Int64):
        """A routing entry (source ``code``) beyond this rank's capacity -- only duplicate experts in a token's top-k
        exceed it -- is not computed: one thread zeroes its combine slot on its source rank, so that the slot adds
        nothing there instead of an earlier call's row, and sets ``ERROR_DUPLICATE_DROPPED`` in every rank's error word;
        then ``fence.acq_rel.sys`` (the zeros precede this rank's ``done``, as the rows of the L2 tiles do)."""
        src, q = self.decode(code)
        t = q // self.topk
        slot = ptx.ld_cg_u64(peers + Int64(src) * 8) + (
            self.cfg.offset("combine") + (Int64(q - t * self.topk) * self.t_max + Int64(t)) * (self.hidden * 2))
        for v in cutlass.range(self.hidden * 2 // VEC, unroll=1):
            ptx.st_global_v4(slot + Int64(v) * VEC, [Int32(0)] * 4, 1)
        for r in cutlass.range(self.num_ranks, unroll=1):
            ptx.red_or(ptx.ld_cg_u64(peers + Int64(r) * 8) + self.cfg.errors_offset(), ERROR_DUPLICATE_DROPPED, "sys")
        ptx.fence_acq_rel_sys()

    @cute.jit
    def expert_offsets(self, offs: cute.Tensor, base: Int64, peers: Int64, stats: Int64, tid: Int32, lane: Int32,
                       cta: Int32, num_ctas: Int32, store: cutlass.Constexpr, me: Int32, record: Int64) -> Int32:
        """Step 3 (after the scan's grid barrier): ``offs`` (shared, int32 [E_l + 1]) = the exclusive prefix of
        the counts (clamped to the pool), then clamped to ``row_limit``: the rows past it (expert order) are dropped
        (``drop_row``, every CTA's share); CTA 0 adds the counts to the recv stats (``cfg.has_stats``) and, with
        ``store``, writes ``expert_offsets``. Returns the rows to pull.

        A rank receives at most ``max_recv_rows`` rows (``R * T_max * k`` routing entries, at most ``R * T_max`` per
        expert), the bounded ring's ``row_limit``: no drop loop there. That matters beyond its size: the one-launch
        kernel runs this on every thread before its roles start, and this per-thread dynamic loop there makes ptxas take
        the rest of the kernel for divergent code (its consumer mainloop loses the uniform datapath, see
        ``grid_barrier``)."""
        cfg = self.cfg
        counts = cfg.offset("expert_counts")
        for e in cutlass.range(tid, self.num_local, self.threads):
            offs[e] = cutlass.min(ptx.ld_cg_u32(base + (counts + Int64(e) * 4)), self.pool_cap)
        self.group_sync()
        if tid < WARP:
            self.warp_exclusive_scan(offs, lane)
        self.group_sync()
        total = offs[self.num_local]
        if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
            if (cta == 0) & (tid == 0) & (total > self.row_limit):
                self.fail(SITE_ROWS, me, record, Int32(self.row_limit), total, total - self.row_limit)
        if cutlass.const_expr(self.row_limit < self.cfg.layout.max_recv_rows):
            for row in cutlass.range(self.row_limit + cta * self.threads + tid, total, num_ctas * self.threads, unroll=1):
                e = tiles.expert_of_block(row, offs, self.num_local, DSL_OPS)
                pool_entry = base + (cfg.offset("pool") + (Int64(e) * self.pool_cap + (row - offs[e])) * 4)
                self.drop_row(ptx.ld_cg_u32(pool_entry), peers)
        self.group_sync()  # every thread read the total before it is clamped
        for e in cutlass.range(tid, self.num_local + 1, self.threads):
            offs[e] = cutlass.min(offs[e], self.row_limit)
        self.group_sync()
        if cta == 0:
            for e in cutlass.range(tid, self.num_local + 1, self.threads):
                if cutlass.const_expr(store):
                    ptx.st_global_u32(base + (cfg.offset("expert_offsets") + Int64(e) * 4), offs[e])
                if cutlass.const_expr(cfg.has_stats):  # noqa: SIM102 (compile-time test, then the runtime one)
                    if e < self.num_local:
                        stat = stats + Int64(e) * 4
                        ptx.st_global_u32(stat, ptx.ld_cg_u32(stat) + ptx.ld_cg_u32(base + (counts + Int64(e) * 4)))
        return cutlass.min(total, self.row_limit)

    @cute.jit
    def fetch_unit(self, me: Int32, base: Int64, peers: Int64, e: Int32, entry: Int32, row: Int32, unit: Int32,
                   lane: Int32, record: Int64):
        """One warp: unit ``unit`` of local expert e's pool entry ``entry`` into ring row ``row`` (``l1_acts``); unit
        0's lane 0 also stores the row's routing weight (``l1_topk_weights``) and combine slot (``ring_dest``)."""
        cfg, k, hidden = self.cfg, self.topk, self.hidden
        code = ptx.ld_cg_u32(base + (cfg.offset("pool") + (Int64(e) * self.pool_cap + entry) * 4))
        self.check_pool_code(code, row, me, record)
        src, q = self.decode(code)
        t = q // k
        peer = ptx.ld_cg_u64(peers + Int64(src) * 8)
        self.ring_unit(base, peer, t, row, unit, lane)
        if (unit == 0) & (lane == 0):
            weight = ptx.ld_cg_u32(peer + (cfg.offset("topk_weights") + Int64(q) * 4))
            ptx.st_global_u32(base + (cfg.offset("l1_topk_weights") + Int64(row) * 4), weight)
            j = q - t * k
            slot = peer + (cfg.offset("combine") + (Int64(j) * self.t_max + Int64(t)) * (hidden * 2))
            ptx.st_global_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8), slot)

    @cute.jit
    def ring_unit(self, base: Int64, peer: Int64, t: Int32, row: Int32, unit: Int32, lane: Int32):
        """One warp: unit ``unit`` of token t's row on the rank at ``peer`` into ring row ``row`` of ``l1_acts``, in
        the BF16-operand ring: FP8 + packed UE8M0 dequantized exactly (``pull_unit``), or BF16 copied."""
        cfg, hidden = self.cfg, self.hidden
        dst = base + (cfg.offset("l1_acts") + Int64(row) * (hidden * 2))
        if cutlass.const_expr(self.fp8):
            self.pull_unit(peer + (cfg.offset("x") + Int64(t) * hidden),
                           peer + (cfg.offset("x_sf") + Int64(t) * (hidden // 32)), dst, unit, lane)
        else:
            self.copy_unit(peer + (cfg.offset("x") + Int64(t) * (hidden * 2)), dst, hidden * 2 // VEC, unit, lane)

    @cute.jit
    def pull(self, me: Int32, base: Int64, peers: Int64, offs: cute.Tensor, total: Int32, gw: Int32, num_warps: Int32,
             lane: Int32, record: Int64):
        """Step 4 (staged): warp ``gw`` of ``num_warps`` pulls units ``gw, gw + num_warps, ...`` of the ring's
        ``total`` rows (``row_units`` per row, rows in expert order, ring row = row)."""
        units = self.row_units
        for u in cutlass.range(gw, total * units, num_warps):
            row = u // units
            e = tiles.expert_of_block(row, offs, self.num_local, DSL_OPS)
            self.fetch_unit(me, base, peers, e, row - offs[e], row, u - row * units, lane, record)

    @cute.jit
    def pull_ring(self, me: Int32, base: Int64, peers: Int64, offs: cute.Tensor, firsts: cute.Tensor, total: Int32,
                  gw: Int32, num_warps: Int32, lane: Int32, record: Int64, tile_tokens: cutlass.Constexpr, period: Int32,
                  n_l2: Int32, pulled: Int64, l2_done: Int64, timeout_ns: Int64):
        """Step 4 into the one-launch kernel's bounded ring (``scheduler.tiles``): as ``pull``, rows in expert order,
        expert e's row i in pool block ``b = firsts[e] + i // tile_tokens`` (``firsts``: shared int32 [E_l + 1],
        the block prefix), at its ring row (``period`` 0: packed, the row itself); before a unit of a block
        that reuses ring rows, every lane waits (acquire) for ``l2_done[prior] >= n_l2``; each unit ends with a
        warp barrier and an arrival (``ptx.arrive``) on ``pulled[b]`` (int32 counters at ``pulled`` /
        ``l2_done``, 4 bytes per block)."""
        units = self.row_units
        for u in cutlass.range(gw, total * units, num_warps):
            row = u // units
            e = tiles.expert_of_block(row, offs, self.num_local, DSL_OPS)
            entry = row - offs[e]
            pool_row = firsts[e] * tile_tokens + entry
            block = pool_row // tile_tokens
            prior = tiles.prior_block(block, period, DSL_OPS)
            if prior >= 0:
                self.wait_flag(l2_done + Int64(prior) * 4, n_l2, False, "gpu", SITE_RING_FREE, prior, me, record,
                               timeout_ns)
            ring_row = tiles.ring_row(block, firsts[e], offs[e], period, tile_tokens, DSL_OPS) + (pool_row - block * tile_tokens)
            self.fetch_unit(me, base, peers, e, entry, ring_row, u - row * units, lane, record)
            cute.arch.sync_warp()
            if lane == 0:
                ptx.arrive(pulled + Int64(block) * 4)

    @cute.jit
    def warp_exclusive_scan(self, offs: cute.Tensor, lane: Int32):
        """In place: ``offs[0..E_l)`` counts -> exclusive prefix, ``offs[E_l]`` = total (one warp; lane
        l owns a contiguous chunk)."""
        chunk = -(-self.num_local // WARP)
        lo = cutlass.min(lane * chunk, self.num_local)
        hi = cutlass.min(lo + chunk, self.num_local)
        own = Int32(0)
        for e in cutlass.range(lo, hi):
            own = own + offs[e]
        incl = warp_inclusive_sum(own, lane)
        run = incl - own
        for e in cutlass.range(lo, hi):
            c = offs[e]
            offs[e] = run
            run = run + c
        if lane == WARP - 1:
            offs[self.num_local] = incl

    # ----------------------------------------------------------------------------------------------
    # Combine phases (module docstring, combine steps 2-4)

    @cute.jit
    def exchange_done(self, me: Int32, base: Int64, peers: Int64, call: Int32, tid: Int32, cta: Int32, record: Int64,
                      timeout_ns: Int64):
        """Step 2, after the grid barrier that follows every row store: CTA 0 publishes ``done[me] = call + 1``
        into every rank; every CTA waits for every rank's."""
        done = self.cfg.offset("done")
        if cta == 0:
            for d in cutlass.range(tid, self.num_ranks, self.threads):
                ptx.st_release_sys(ptx.ld_cg_u64(peers + Int64(d) * 8) + (done + Int64(me) * 4), call + 1, False)
        for d in cutlass.range(tid, self.num_ranks, self.threads):
            self.wait_flag(base + (done + Int64(d) * 4), call + 1, False, "sys", SITE_DONE, d, me, record, timeout_ns)
        self.group_sync()

    @cute.jit
    def sum_tokens(self, base: Int64, num_tokens: Int32, y: Int64, gw: Int32, num_warps: Int32, lane: Int32):
        """Step 3: ``y[t] = bf16(sum of the valid slots in slot order)``, warp ``gw`` of ``num_warps`` per
        (token, 32 vectors of 8) unit."""
        k, hidden, t_max = self.topk, self.hidden, self.t_max
        combine = self.cfg.offset("combine")
        out_vecs = self.y_hidden // 8  # combine rows hold kernel_hidden columns, y the real ones
        parts = -(-out_vecs // WARP)
        topk_idx = base + self.cfg.offset("topk_idx")
        for u in cutlass.range(gw, num_tokens * parts, num_warps):
            t = u // parts
            v = (u - t * parts) * WARP + lane
            if v < out_vecs:
                loaded = []
                for j in cutlass.range_constexpr(k):
                    e = ptx.ld_cg_u64(topk_idx + (Int64(t) * k + j) * 8)
                    valid = Int32(cutlass.select_((e >= 0) & (e < self.num_experts), Int32(1), Int32(0)))
                    src = base + (combine + (Int64(j) * t_max + Int64(t)) * (hidden * 2) + Int64(v) * VEC)
                    loaded.append(ptx.ld_cg_v4_if(src, valid))
                acc = [Float32(0.0)] * 8
                for words in loaded:
                    for w in cutlass.range_constexpr(4):
                        lo, hi = ptx.bf16x2_to_f32x2(words[w])
                        acc[2 * w] = acc[2 * w] + lo
                        acc[2 * w + 1] = acc[2 * w + 1] + hi
                out = [ptx.f32x2_to_bf16x2(acc[2 * w], acc[2 * w + 1]) for w in range(4)]
                ptx.st_global_v4(y + (Int64(t) * self.y_hidden + Int64(v) * 8) * 2, out, 1)

    @cute.jit
    def finish_call(self, base: Int64, call: Int32, tid: Int32):
        """Step 4 (the group's threads in one CTA, once every CTA has read ``call`` and the counts): zero
        ``expert_counts`` and store ``signals[0] = call + 1``."""
        for e in cutlass.range(tid, self.num_local, self.threads):
            ptx.st_global_u32(base + (self.cfg.offset("expert_counts") + Int64(e) * 4), 0)
        if tid == 0:
            ptx.st_global_u32(base + self.signals, call + 1)


class Fp8RingPhases(EpPhases):
    """``EpPhases`` whose pull fills the FP8-operand ring of recipe (1, 1, 128) (``symm_buffer``: ``l1_acts`` e4m3
    ``[ring, Hk]``, ``l1_acts_sf`` float32 ``[ring, Hk/128]``): each token row's FP8 bytes and its FP32 scale words
    copied verbatim (no dequantization: an FP8 value times a per-128 FP32 scale has no exact BF16 form), half the ring
    bytes of the BF16 ring. A unit is the same 2 KiB of FP8 as ``pull_unit``'s and carries the 16 scale words of its
    16 128-K blocks."""

    @cute.jit
    def ring_unit(self, base: Int64, peer: Int64, t: Int32, row: Int32, unit: Int32, lane: Int32):
        """One warp: FP8 vectors ``[unit * 32 * VECS_PER_LANE, +32 * VECS_PER_LANE) ∩ [0, Hk/16)`` of token t's row
        on the rank at ``peer`` into ring row ``row`` of ``l1_acts`` (``copy_unit``), and lane l < 16 the unit's
        scale word ``unit * 16 + l`` (where < Hk/128) into ``l1_acts_sf[row]``; every load before the stores."""
        cfg, hidden = self.cfg, self.hidden
        words_per_row = hidden // 128  # FP32 scales of a row
        ring_words = cfg.layout.section("l1_acts_sf").shape[1]  # their ring row: padded for TMA (symm_buffer)
        words_per_unit = WARP * VECS_PER_LANE * VEC // 128
        wi = unit * words_per_unit + lane
        on = Int32(cutlass.select_((lane < words_per_unit) & (wi < words_per_row), Int32(1), Int32(0)))
        word = ptx.ld_cg_u32_if(peer + (cfg.offset("x_sf") + (Int64(t) * words_per_row + Int64(wi)) * 4), on)
        self.copy_unit(peer + (cfg.offset("x") + Int64(t) * hidden), base + (cfg.offset("l1_acts") + Int64(row) * hidden),
                       hidden // VEC, unit, lane)
        if on != 0:
            ptx.st_global_u32(base + (cfg.offset("l1_acts_sf") + (Int64(row) * ring_words + Int64(wi)) * 4), word)
