"""NVLink dispatch and combine kernels of the staged Mega MoE path (sm_90a, CuTe DSL).

Both kernels address every rank's SymmBuffer as ``peers[r] + section offset`` (``peers``: int64 [R]
device array of base addresses; the offsets are the layout's, identical on every rank) and use the
protocol sections of ``megamoe.symm_buffer``. ``call = signals[0]`` (calls completed on this rank).
Each runs ``num_ctas`` CTAs of ``THREADS`` threads, all resident at once (``num_ctas`` <= SMs, one CTA
per SM fits), so their grid barriers cannot deadlock.

dispatch:
  1. CTA 0 publishes ``ready[me] = (call + 1) << 32 | T`` into every rank (``st.release.sys``).
  2. scan: for every source rank (CTA c starts at ``me + c``), thread 0 waits ``ready[src] >= call + 1``
     (``ld.acquire.sys``); then the CTAs stride over that source's ``T_src * k`` routing entries
     (``topk_idx`` read over NVLink); an entry ``q = t * k + j`` naming local expert e takes
     ``pos = atomicAdd(expert_counts[e], 1)`` and stores its source code ``src * T_max * k + q`` at
     ``pool[e, pos]``.
  3. grid barrier 0; every CTA loads the counts and computes the exclusive prefix (smem); CTA 0 stores
     it as ``expert_offsets [E_l + 1]`` and adds the counts to the recv stats.
  4. pull: ring row ``r < offsets[E_l]`` belongs to expert ``e`` (binary search,
     ``scheduler.schedule.expert_of_block``) and holds pool entry ``r - offsets[e]``; one warp per
     (row, 2 KiB chunk of FP8) reads the chunk and its 64 packed UE8M0 scales from the source rank
     (16-byte loads, ``VECS_PER_LANE`` in flight per lane; half the lanes load one scale word each,
     shuffled to the lanes that need it) and stores it dequantized, exactly, as BF16 into
     ``l1_acts[r]`` (the BF16-mode GEMM operand); BF16 buffers (``mma_type="bf16"``) copy 2 KiB of
     BF16 per unit instead. Chunk 0's lane 0 also copies the routing weight into
     ``l1_topk_weights[r]`` and the address of the row's combine slot on its source rank
     (``peers[src] + combine[j, t]``) into ``ring_dest[r]``.

combine (after the L1 / L2 grouped GEMMs):
  1. push, unless the L2 GEMM already stored every row at ``ring_dest`` and fenced (``rows_stored``, the
     FP8 x FP4 path): one warp per (ring row, 2 KiB chunk) stores ``o[r]`` (BF16 rows ``[ring, H]``) at
     ``ring_dest[r]`` (16-byte stores over NVLink); every thread then ``fence.acq_rel.sys``.
  2. grid barrier 1; CTA 0 publishes ``done[me] = call + 1`` into every rank (``st.release.sys``);
     every CTA waits ``done[d] >= call + 1`` for all d (``ld.acquire.sys``).
  3. sum: one warp per (token, 256 columns): for each valid slot (``0 <= topk_idx < E``) in slot
     order, FP32 accumulation of ``combine[j, t]``; masked slots are never loaded (predicated loads:
     they hold stale data). ``y[t] = bf16_rne(sum)``.
  4. CTA 0 zeroes ``expert_counts`` and stores ``signals[0] = call + 1`` (every CTA read ``call``
     before arriving at barrier 1, so no final barrier is needed).

Grid barriers count on ``signals[1]``, never reset: barrier q of call c completes at
``(c * BARRIERS_PER_CALL + q + 1) * num_ctas`` arrivals. Every flag comparison is wrap-safe
(``(int32)(seen - expected) >= 0``, done in PTX), so 32-bit counters may wrap around.

Memory model: data bound for another agent is stored with weak stores, followed by ``fence.acq_rel``
at the agent's scope (sys for peers) or a CTA barrier before a release by one thread (flag store or
barrier arrival); readers acquire the flag in one thread, then ``bar.sync``; data that other agents
write is loaded with ``ld.global.cg`` (L2, never a stale L1 line). Every PTX block is volatile and
those that touch memory clobber it, so the compiler keeps their program order.

Debug mode (``debug=True``, a separate compile): every spin-wait times out after ``timeout_ns``
(``%globaltimer``) and the kernel checks the codes it reads from ``pool`` and the
expert / ring capacities; on a failure it printf's ``megamoe debug: rank, CTA (SM), role, site,
expected, seen``, writes the same record into host-mapped memory (``record``: int64 [num_ctas, 8],
one row per CTA, see ``format_record``) and traps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import cutlass
import torch
from cutlass import Float32, Int32, Int64, cute, utils
from cutlass.cutlass_dsl import T, dsl_user_op

from ..scheduler.schedule import expert_of_block
from ..symm_buffer import SymmBufferLayout
from . import ptx, runtime
from .sm90_fp4_decode import device_helpers
from .warp_ops import warp_inclusive_sum

THREADS = 512
"""Threads per CTA of both kernels (16 warps)."""
WARP = 32
WARPS = THREADS // WARP
VEC = 16
"""Bytes per vector load / store."""
VECS_PER_LANE = 4
"""16-byte vectors each lane moves per copy unit: a warp copies 2 KiB per unit."""
BARRIERS_PER_CALL = 2
"""Grid barriers per call on ``signals[1]``: dispatch's (q = 0) and combine's (q = 1)."""
MAX_LOCAL_EXPERTS = 8192
"""Local experts the kernels' shared-memory prefix holds (int32 each)."""
RECORD_WORDS = 8
"""int64 words of one CTA's debug record: site + 1, rank, CTA, SM, index, expected, seen, 0."""

SITES = (
    ("dispatch", "timed out: waits ready[src=%d] >= %d (call + 1), sees %d"),
    ("dispatch", "timed out: waits grid barrier %d: arrivals >= %d, sees %d"),
    ("dispatch", "pool code of ring row %d must be in [0, %d), got %d"),
    ("dispatch", "expert %d can take at most %d rows (pool row), got row %d: duplicate experts in a token's top-k?"),
    ("dispatch", "ring holds %d rows, this call routes %d rows here (%d too many): duplicate experts in a token's top-k?"),
    ("combine", "timed out: waits grid barrier %d: arrivals >= %d, sees %d"),
    ("combine", "timed out: waits done[dst=%d] >= %d (call + 1), sees %d"),
)
"""Debug diagnostics: (role, message with index, expected, seen), shared by the kernels' printf and
``format_record``."""
SITE_READY, SITE_D_BARRIER, SITE_POOL, SITE_EXPERT, SITE_RING, SITE_C_BARRIER, SITE_DONE = range(len(SITES))


def format_record(row: list[int]) -> str:
    """One CTA's debug record (``RECORD_WORDS`` ints, first nonzero) as the kernel printed it."""
    site, rank, cta, sm, index, expected, seen = row[0] - 1, *row[1:7]
    role, text = SITES[site]
    return f"megamoe debug: rank {rank} CTA {cta} (SM {sm}) role {role}: " + text % (index, expected, seen)


# --------------------------------------------------------------------------------------------------
# PTX: every block is volatile; the ones that touch memory also clobber it.


def _asm(results: list, args: list, text: str, constraints: str, loc=None, ip=None) -> list:
    """One volatile inline-PTX block; returns its results as ``ir.Value``s."""
    return ptx.inline_asm(results, args, text, constraints, loc, ip, side_effects=True)


@dsl_user_op
def _ld_v4(addr: Int64, on, *, loc=None, ip=None) -> list:
    """16 bytes at ``addr`` (L2, ``.cg``) as 4 words when ``on``, else 4 zero words (no access)."""
    text = (
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        "@p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];\n}"
    )
    args = [ptx.ir_arg(addr, Int64, loc, ip), ptx.ir_arg(on, Int32, loc, ip)]
    return [Int32(w) for w in _asm([T.i32()] * 4, args, text, "=r,=r,=r,=r,l,r,~{memory}", loc, ip)]


@dsl_user_op
def _ld_u32_if(addr: Int64, on, *, loc=None, ip=None) -> Int32:
    """The word at ``addr`` (L2, ``.cg``) when ``on``, else 0 (no access)."""
    text = "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.cg.b32 $0, [$1];\n}"
    args = [ptx.ir_arg(addr, Int64, loc, ip), ptx.ir_arg(on, Int32, loc, ip)]
    return Int32(_asm([T.i32()], args, text, "=r,l,r,~{memory}", loc, ip)[0])


@dsl_user_op
def _ld_u32(addr: Int64, *, loc=None, ip=None) -> Int32:
    return Int32(_asm([T.i32()], [ptx.ir_arg(addr, Int64, loc, ip)], "ld.global.cg.b32 $0, [$1];", "=r,l,~{memory}", loc, ip)[0])


@dsl_user_op
def _ld_u64(addr: Int64, *, loc=None, ip=None) -> Int64:
    return Int64(_asm([T.i64()], [ptx.ir_arg(addr, Int64, loc, ip)], "ld.global.cg.b64 $0, [$1];", "=l,l,~{memory}", loc, ip)[0])



@dsl_user_op
def _st_u64(addr: Int64, value, *, loc=None, ip=None) -> None:
    _asm([], [ptx.ir_arg(addr, Int64, loc, ip), ptx.ir_arg(value, Int64, loc, ip)], "st.global.b64 [$0], $1;", "l,l,~{memory}", loc, ip)





@dsl_user_op
def _ld_low_word(addr: Int64, *, loc=None, ip=None) -> Int32:
    """Low word of a 64-bit flag already acquired (the token count of ``ready``)."""
    return Int32(_asm([T.i32()], [ptx.ir_arg(addr, Int64, loc, ip)], "ld.global.cg.b32 $0, [$1];", "=r,l,~{memory}", loc, ip)[0])



@dsl_user_op
def _st_release_sys(addr: Int64, value, wide: bool, *, loc=None, ip=None) -> None:
    """Publish a flag to any rank: ``st.release.sys`` (64-bit when ``wide``)."""
    if wide:
        _asm([], [ptx.ir_arg(addr, Int64, loc, ip), ptx.ir_arg(value, Int64, loc, ip)], "st.release.sys.global.b64 [$0], $1;",
             "l,l,~{memory}", loc, ip)
    else:
        _asm([], [ptx.ir_arg(addr, Int64, loc, ip), ptx.ir_arg(value, Int32, loc, ip)], "st.release.sys.global.b32 [$0], $1;",
             "l,r,~{memory}", loc, ip)




@dsl_user_op
def _st_record(addr: Int64, words: list, *, loc=None, ip=None) -> None:
    """Store 8 int32 values as int64 words at ``addr`` (host-mapped memory), then ``fence.sc.sys``."""
    lines = [".reg .b64 w;"]
    for i in range(RECORD_WORDS):
        lines += [f"cvt.s64.s32 w, ${i + 1};", f"st.relaxed.sys.global.b64 [$0+{8 * i}], w;"]
    text = "{\n" + "\n".join(lines) + "\nfence.sc.sys;\n}"
    args = [ptx.ir_arg(addr, Int64, loc, ip)] + [ptx.ir_arg(w, Int32, loc, ip) for w in words]
    _asm([], args, text, "l" + ",r" * RECORD_WORDS + ",~{memory}", loc, ip)



@dsl_user_op
def _bf16x2_f32(word, *, loc=None, ip=None) -> list:
    """Two BF16 (low half first) -> two FP32 (exact)."""
    text = "{\n.reg .b32 t;\nshl.b32 t, $2, 16;\nmov.b32 $0, t;\nand.b32 t, $2, 0xFFFF0000;\nmov.b32 $1, t;\n}"
    return [Float32(v) for v in _asm([T.f32()] * 2, [ptx.ir_arg(word, Int32, loc, ip)], text, "=f,=f,r", loc, ip)]


@dsl_user_op
def _f32x2_bf16x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """Two FP32 -> two BF16 (round to nearest even), ``lo`` in the low half."""
    args = [ptx.ir_arg(hi, Float32, loc, ip), ptx.ir_arg(lo, Float32, loc, ip)]
    return Int32(_asm([T.i32()], args, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc, ip)[0])


DSL_OPS = SimpleNamespace(
    min=cutlass.min, max=cutlass.max, select=lambda c, a, b: Int32(cutlass.select_(c, Int32(a), Int32(b)))
)
"""``scheduler.schedule`` ops over DSL integers."""


# --------------------------------------------------------------------------------------------------
# Kernels


@dataclass(frozen=True)
class EpCommConfig:
    """Static configuration of one dispatch / combine pair: the buffer layout (sizes and section
    offsets, compile-time constants), the debug variant and whether dispatch updates recv stats."""

    layout: SymmBufferLayout
    debug: bool
    has_stats: bool = False
    rows_stored: bool = False
    """Combine only: the L2 GEMM already stored every ring row at ``ring_dest`` (its source rank's combine
    slot) and fenced, so combine skips its push (step 1)."""

    def offset(self, name: str) -> int:
        return self.layout.section(name).offset


class _EpKernel:
    """What dispatch and combine share: sizes, flag waits, the grid barrier, debug reports."""

    def __init__(self, cfg: EpCommConfig):
        lay = cfg.layout
        self.cfg = cfg
        self.debug = cfg.debug
        self.num_ranks = lay.num_ranks
        self.num_local = lay.num_local_experts
        self.num_experts = lay.num_experts
        self.topk = lay.num_topk
        self.hidden = lay.hidden
        self.t_max = lay.num_max_tokens_per_rank
        self.ring = lay.num_ring_tokens
        self.pool_cap = lay.num_ranks * lay.num_max_tokens_per_rank  # rows per expert in ``pool``
        self.codes = self.pool_cap * lay.num_topk  # source codes lie in [0, codes)
        self.signals = cfg.offset("signals")
        self.fp8 = lay.mma_type == "fp8xfp4"  # tokens FP8 + packed UE8M0 scales, else BF16

    @cute.jit
    def fail(self, site: cutlass.Constexpr, rank: Int32, record: Int64, index: Int32, expected: Int32, seen: Int32):
        """Debug report (printf + host-mapped record) and trap."""
        cta = cute.arch.block_idx()[0]
        sm = ptx.smid()
        role, text = SITES[site]
        cute.printf("megamoe debug: rank %d CTA %d (SM %d) role " + role + ": " + text, rank, cta, sm, index, expected, seen)
        if record != Int64(0):
            _st_record(record + Int64(cta) * (RECORD_WORDS * 8), [Int32(site + 1), rank, cta, sm, index, expected, seen, Int32(0)])
        ptx.trap()

    @cute.jit
    def wait_flag(self, addr: Int64, expected: Int32, wide: cutlass.Constexpr, scope: cutlass.Constexpr,
                  site: cutlass.Constexpr, index: Int32, rank: Int32, record: Int64, timeout_ns: Int64):
        """Spin until the flag's call part reaches ``expected`` (acquire); debug: time out and report."""
        seen = ptx.spin_until(addr, expected, wide, scope, timeout_ns, self.debug)
        if cutlass.const_expr(self.debug):
            if ptx.behind(seen, expected) != 0:
                self.fail(site, rank, record, index, expected, seen)

    @cute.jit
    def grid_barrier(self, base: Int64, call: Int32, q: cutlass.Constexpr, site: cutlass.Constexpr, rank: Int32,
                     record: Int64, timeout_ns: Int64):
        """Barrier ``q`` of call ``call`` over all CTAs (monotonic ``signals[1]``, gpu scope)."""
        cute.arch.sync_threads()
        if cute.arch.thread_idx()[0] == 0:
            counter = base + (self.signals + 4)
            ptx.arrive(counter)
            target = (call * BARRIERS_PER_CALL + (q + 1)) * cute.arch.grid_dim()[0]
            self.wait_flag(counter, target, False, "gpu", site, Int32(q), rank, record, timeout_ns)
        cute.arch.sync_threads()

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
            words.append(_ld_v4(src + Int64(v) * VEC, ok))
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
        dev = device_helpers()
        num_vecs = self.hidden // VEC
        words_per_unit = WARP * VECS_PER_LANE // 8
        wi = unit * words_per_unit + lane
        sf_word = _ld_u32_if(sf_src + Int64(wi) * 4,
                             Int32(cutlass.select_((lane < words_per_unit) & (wi < self.hidden // 128), Int32(1), Int32(0))))
        words, on = self.load_unit(x_src, num_vecs, unit, lane)
        shift = ((lane // 2) % 4) * 8  # byte of vector v = unit * 128 + i * 32 + lane in its scale word
        for i in cutlass.range_constexpr(VECS_PER_LANE):
            v = unit * (WARP * VECS_PER_LANE) + i * WARP + lane
            word = cute.arch.shuffle_sync(sf_word, i * (WARP // 8) + lane // 8)
            scale = dev.ue8m0_code_to_f32((word >> shift) & Int32(0xFF))
            out = []
            for w in cutlass.range_constexpr(4):
                lo, hi = dev.e4m3x4_to_bf16x4(words[i][w], scale)
                out += [lo, hi]
            ptx.st_global_v4(dst + Int64(v) * (2 * VEC), out[:4], on[i])
            ptx.st_global_v4(dst + Int64(v) * (2 * VEC) + VEC, out[4:], on[i])

    def units(self, num_vecs: int) -> int:
        """Copy units (one warp each) per row of ``num_vecs`` vectors."""
        return -(-num_vecs // (WARP * VECS_PER_LANE))


class Dispatch(_EpKernel):
    """The dispatch kernel (module docstring, steps 1-4)."""

    @cute.jit
    def check_pool_code(self, code: Int32, row: Int32, rank: Int32, record: Int64):
        """Debug: a source code read from ``pool`` must be in ``[0, codes)``."""
        if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
            if (code < 0) | (code >= self.codes):
                self.fail(SITE_POOL, rank, record, row, Int32(self.codes), code)

    def decode(self, code):
        """Source code -> (source rank, routing entry q = t * k + j)."""
        src = code // (self.t_max * self.topk)
        return src, code - src * (self.t_max * self.topk)

    @cute.jit
    def __call__(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(me, num_tokens, base, peers, stats, record, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
               timeout_ns: Int64):
        cfg = self.cfg
        num_ranks, num_local, k, hidden = self.num_ranks, self.num_local, self.topk, self.hidden
        ready, counts, pool = cfg.offset("ready"), cfg.offset("expert_counts"), cfg.offset("pool")
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        smem = utils.SmemAllocator()
        offs = smem.allocate_tensor(Int32, cute.make_layout(num_local + 1), 16)
        t_src = smem.allocate_tensor(Int32, cute.make_layout(2), 16)
        call = _ld_u32(base + self.signals)

        # 1. Announce this call's tokens to every rank.
        if cta == 0:
            ptx.fence_acq_rel_sys()
            for r in cutlass.range(tid, num_ranks, THREADS):
                flag = (Int64(call + 1) << 32) | Int64(num_tokens)
                _st_release_sys(_ld_u64(peers + Int64(r) * 8) + (ready + Int64(me) * 8), flag, True)

        # 2. Scan every source's routing; append local (token, slot) entries to the expert pools.
        for s in cutlass.range(num_ranks):
            src = (me + cta + s) % num_ranks
            if tid == 0:
                flag = base + (ready + Int64(src) * 8)
                self.wait_flag(flag, call + 1, True, "sys", SITE_READY, src, me, record, timeout_ns)
                t_src[s % 2] = _ld_low_word(flag)
            cute.arch.sync_threads()
            entries = t_src[s % 2] * k
            idx = _ld_u64(peers + Int64(src) * 8) + cfg.offset("topk_idx")
            for q in cutlass.range(cta * THREADS + tid, entries, num_ctas * THREADS):
                e = _ld_u64(idx + Int64(q) * 8) - Int64(me) * num_local
                if (e >= 0) & (e < num_local):
                    le = Int32(e)
                    pos = ptx.atom_add(base + (counts + Int64(le) * 4), 1, "relaxed")
                    if pos < self.pool_cap:
                        ptx.st_global_u32(base + (pool + (Int64(le) * self.pool_cap + pos) * 4), src * (self.t_max * k) + q)
                    if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
                        if pos >= self.pool_cap:
                            self.fail(SITE_EXPERT, me, record, le, Int32(self.pool_cap), pos)
        self.grid_barrier(base, call, 0, SITE_D_BARRIER, me, record, timeout_ns)

        # 3. Expert offsets in the ring: exclusive prefix of the counts (clamped to the pool and ring).
        for e in cutlass.range(tid, num_local, THREADS):
            offs[e] = cutlass.min(_ld_u32(base + (counts + Int64(e) * 4)), self.pool_cap)
        cute.arch.sync_threads()
        if tid < WARP:
            self.warp_exclusive_scan(offs, lane)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
            if (cta == 0) & (tid == 0) & (offs[num_local] > self.ring):
                self.fail(SITE_RING, me, record, Int32(self.ring), offs[num_local], offs[num_local] - self.ring)
        total = cutlass.min(offs[num_local], self.ring)
        if cta == 0:
            for e in cutlass.range(tid, num_local + 1, THREADS):
                ptx.st_global_u32(base + (cfg.offset("expert_offsets") + Int64(e) * 4), cutlass.min(offs[e], self.ring))
                if cutlass.const_expr(cfg.has_stats):  # noqa: SIM102 (compile-time test, then the runtime one)
                    if e < num_local:
                        stat = stats + Int64(e) * 4
                        ptx.st_global_u32(stat, _ld_u32(stat) + _ld_u32(base + (counts + Int64(e) * 4)))

        # 4. Pull every row of the ring from its source rank: FP8 rows dequantized to BF16, BF16 rows copied.
        units = self.units(hidden // VEC if self.fp8 else hidden * 2 // VEC)
        gw = cta * WARPS + tid // WARP
        for u in cutlass.range(gw, total * units, num_ctas * WARPS):
            row = u // units
            unit = u - row * units
            e = expert_of_block(row, offs, num_local, DSL_OPS)
            code = _ld_u32(base + (pool + (Int64(e) * self.pool_cap + (row - offs[e])) * 4))
            self.check_pool_code(code, row, me, record)
            src, q = self.decode(code)
            t = q // k
            peer = _ld_u64(peers + Int64(src) * 8)
            dst = base + (cfg.offset("l1_acts") + Int64(row) * (hidden * 2))
            if cutlass.const_expr(self.fp8):
                self.pull_unit(peer + (cfg.offset("x") + Int64(t) * hidden),
                               peer + (cfg.offset("x_sf") + Int64(t) * (hidden // 32)), dst, unit, lane)
            else:
                self.copy_unit(peer + (cfg.offset("x") + Int64(t) * (hidden * 2)), dst, hidden * 2 // VEC, unit, lane)
            if (unit == 0) & (lane == 0):
                weight = _ld_u32(peer + (cfg.offset("topk_weights") + Int64(q) * 4))
                ptx.st_global_u32(base + (cfg.offset("l1_topk_weights") + Int64(row) * 4), weight)
                j = q - t * k
                slot = peer + (cfg.offset("combine") + (Int64(j) * self.t_max + Int64(t)) * (hidden * 2))
                _st_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8), slot)

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


class Combine(_EpKernel):
    """The combine kernel (module docstring, steps 1-4)."""

    @cute.jit
    def __call__(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, rows: Int64, y: Int64, record: Int64,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(me, num_tokens, base, peers, rows, y, record, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, rows: Int64, y: Int64, record: Int64,
               timeout_ns: Int64):
        cfg = self.cfg
        num_ranks, k, hidden, t_max = self.num_ranks, self.topk, self.hidden, self.t_max
        combine = cfg.offset("combine")
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        gw = cta * WARPS + tid // WARP
        call = _ld_u32(base + self.signals)

        # 1. Push every ring row to its source rank's combine area (unless the L2 GEMM stored them).
        if cutlass.const_expr(not cfg.rows_stored):
            total = _ld_u32(base + (cfg.offset("expert_offsets") + self.num_local * 4))
            row_vecs = hidden * 2 // VEC
            units = self.units(row_vecs)
            for u in cutlass.range(gw, total * units, num_ctas * WARPS):
                row = u // units
                dst = _ld_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8))
                self.copy_unit(rows + Int64(row) * (hidden * 2), dst, row_vecs, u - row * units, lane)
            ptx.fence_acq_rel_sys()

        # 2. Rows are out: tell every rank, then wait until every rank's rows are in.
        self.grid_barrier(base, call, 1, SITE_C_BARRIER, me, record, timeout_ns)
        if cta == 0:
            for d in cutlass.range(tid, num_ranks, THREADS):
                _st_release_sys(_ld_u64(peers + Int64(d) * 8) + (cfg.offset("done") + Int64(me) * 4), call + 1, False)
        for d in cutlass.range(tid, num_ranks, THREADS):
            self.wait_flag(base + (cfg.offset("done") + Int64(d) * 4), call + 1, False, "sys", SITE_DONE, d, me,
                           record, timeout_ns)
        cute.arch.sync_threads()

        # 3. y[t] = bf16(sum of the valid slots in slot order), one warp per (token, 32 vectors of 8).
        out_vecs = hidden // 8
        parts = -(-out_vecs // WARP)
        topk_idx = base + cfg.offset("topk_idx")
        for u in cutlass.range(gw, num_tokens * parts, num_ctas * WARPS):
            t = u // parts
            v = (u - t * parts) * WARP + lane
            if v < out_vecs:
                loaded = []
                for j in cutlass.range_constexpr(k):
                    e = _ld_u64(topk_idx + (Int64(t) * k + j) * 8)
                    valid = Int32(cutlass.select_((e >= 0) & (e < self.num_experts), Int32(1), Int32(0)))
                    src = base + (combine + (Int64(j) * t_max + Int64(t)) * (hidden * 2) + Int64(v) * VEC)
                    loaded.append(_ld_v4(src, valid))
                acc = [Float32(0.0)] * 8
                for words in loaded:
                    for w in cutlass.range_constexpr(4):
                        lo, hi = _bf16x2_f32(words[w])
                        acc[2 * w] = acc[2 * w] + lo
                        acc[2 * w + 1] = acc[2 * w + 1] + hi
                out = [_f32x2_bf16x2(acc[2 * w], acc[2 * w + 1]) for w in range(4)]
                ptx.st_global_v4(y + (Int64(t) * hidden + Int64(v) * 8) * 2, out, 1)

        # 4. Ready for the next call.
        if cta == 0:
            for e in cutlass.range(tid, self.num_local, THREADS):
                ptx.st_global_u32(base + (cfg.offset("expert_counts") + Int64(e) * 4), 0)
            if tid == 0:
                ptx.st_global_u32(base + self.signals, call + 1)


# --------------------------------------------------------------------------------------------------
# Host side


def compile_dispatch(cfg: EpCommConfig):
    """The compiled dispatch kernel for ``cfg`` (cached; compiles on a CPU under ``CUTE_DSL_ARCH``)."""
    from cutlass.cute.runtime import make_fake_stream

    def build():
        z32, z64 = Int32(0), Int64(0)
        return cute.compile(Dispatch(cfg), z32, z32, z64, z64, z64, z64, z64, Int32(1), make_fake_stream())

    return runtime.compiled(("ep_comm.dispatch", cfg), build)


def compile_combine(cfg: EpCommConfig):
    """The compiled combine kernel for ``cfg`` (``has_stats`` plays no part)."""
    from cutlass.cute.runtime import make_fake_stream

    cfg = EpCommConfig(cfg.layout, cfg.debug, rows_stored=cfg.rows_stored)

    def build():
        z32, z64 = Int32(0), Int64(0)
        return cute.compile(Combine(cfg), z32, z32, z64, z64, z64, z64, z64, z64, Int32(1), make_fake_stream())

    return runtime.compiled(("ep_comm.combine", cfg), build)


def dispatch(cfg: EpCommConfig, me: int, num_tokens: int, base: int, peers: torch.Tensor, stats: torch.Tensor | None,
             record: int, timeout_ns: int, num_ctas: int) -> None:
    """Launch dispatch on the current stream (arguments as the kernel's; ``stats`` int32 [E_l] or None)."""
    kernel = compile_dispatch(cfg)
    kernel(me, num_tokens, base, peers.data_ptr(), 0 if stats is None else stats.data_ptr(), record, timeout_ns,
           num_ctas, runtime.current_stream())


def combine(cfg: EpCommConfig, me: int, num_tokens: int, base: int, peers: torch.Tensor,
            rows: torch.Tensor | None, y: torch.Tensor, record: int, timeout_ns: int, num_ctas: int) -> None:
    """Launch combine on the current stream: ``rows`` BF16 [ring, H] (L2 outputs; None with
    ``cfg.rows_stored``), ``y`` BF16 [T, H]."""
    if (rows is None) != cfg.rows_stored:
        raise ValueError("combine: pass rows exactly when the L2 GEMM did not store them (cfg.rows_stored)")
    kernel = compile_combine(cfg)
    kernel(me, num_tokens, base, peers.data_ptr(), 0 if rows is None else rows.data_ptr(), y.data_ptr(), record,
           timeout_ns, num_ctas, runtime.current_stream())
