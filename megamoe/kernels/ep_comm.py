"""NVLink dispatch and combine of the Mega MoE protocol (sm_90a, CuTe DSL): the phases as device functions
(``EpPhases``), which the one-launch FP8 x FP4 kernel (``sm90_grouped_gemm.mega_moe_sm90``) runs around its GEMM
tiles, and two kernels made of them for the staged BF16 path (``bf16_mega_moe``): dispatch, then torch's
grouped GEMMs, then combine.

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
     ``scheduler.tiles.expert_of_block``) and holds pool entry ``r - offsets[e]``; one warp per
     (row, 2 KiB chunk of FP8) reads the chunk and its 64 packed UE8M0 scales from the source rank
     (16-byte loads, ``VECS_PER_LANE`` in flight per lane; half the lanes load one scale word each,
     shuffled to the lanes that need it) and stores it dequantized, exactly, as BF16 into
     ``l1_acts[r]`` (the BF16-mode GEMM operand); BF16 buffers (``mma_type="bf16"``) copy 2 KiB of
     BF16 per unit instead. Chunk 0's lane 0 also copies the routing weight into
     ``l1_topk_weights[r]`` and the address of the row's combine slot on its source rank
     (``peers[src] + combine[j, t]``) into ``ring_dest[r]``. The one-launch kernel pulls into its bounded
     ring instead (``pull_ring``: rows at their pool block's ring rows, ``scheduler.tiles``).

combine (after the L1 / L2 grouped GEMMs):
  1. push (the staged kernel; the one-launch kernel's L2 tiles store their rows there themselves): one warp
     per (ring row, 2 KiB chunk) stores ``o[r]`` (BF16 rows ``[ring, H]``) at ``ring_dest[r]`` (16-byte
     stores over NVLink); every thread then ``fence.acq_rel.sys``.
  2. grid barrier 1; CTA 0 publishes ``done[me] = call + 1`` into every rank (``st.release.sys``);
     every CTA waits ``done[d] >= call + 1`` for all d (``ld.acquire.sys``).
  3. sum: one warp per (token, 256 columns): for each valid slot (``0 <= topk_idx < E``) in slot
     order, FP32 accumulation of ``combine[j, t]``; masked slots are never loaded (predicated loads:
     they hold stale data). ``y[t] = bf16_rne(sum)``.
  4. CTA 0 zeroes ``expert_counts`` and stores ``signals[0] = call + 1`` (every CTA read ``call``
     before arriving at barrier 1, so no final barrier is needed).

The staged kernels' grid barriers count on ``signals[1]``, never reset: barrier q of call c completes at
``(c * BARRIERS_PER_CALL + q + 1) * num_ctas`` arrivals (the one-launch kernel counts on its own counter,
zeroed at its end). Every flag comparison is wrap-safe
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

from ..checks import fail
from ..scheduler import tiles
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
    ("dispatch", "a rank takes at most %d rows, this call routes %d rows here (%d too many): duplicate experts in a token's top-k?"),
    ("combine", "timed out: waits grid barrier %d: arrivals >= %d, sees %d"),
    ("combine", "timed out: waits done[dst=%d] >= %d (call + 1), sees %d"),
    ("dispatch", "timed out: pull waits its ring block free: L2 tiles done of pool block %d >= %d, sees %d"),
)
"""Debug diagnostics: (role, message with index, expected, seen), shared by the kernels' printf and
``format_record``."""
SITE_READY, SITE_D_BARRIER, SITE_POOL, SITE_EXPERT, SITE_ROWS, SITE_C_BARRIER, SITE_DONE, SITE_RING_FREE = range(len(SITES))


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
"""``scheduler.tiles`` ops over DSL integers."""


# --------------------------------------------------------------------------------------------------
# Kernels


@dataclass(frozen=True)
class EpCommConfig:
    """Static configuration of one dispatch / combine pair: the buffer layout (sizes and section
    offsets, compile-time constants), the debug variant and whether dispatch updates recv stats. ``trace``: the
    one-launch Mega MoE kernel's trace build (release waits, phase timestamps into ``record``: ``megamoe.timeline``)."""

    layout: SymmBufferLayout
    debug: bool
    has_stats: bool = False
    trace: bool = False

    def __post_init__(self):
        if self.trace and self.debug:
            fail("trace", "a trace build times the release kernel: it cannot also be the debug build")

    def offset(self, name: str) -> int:
        return self.layout.section(name).offset


class EpPhases:
    """The protocol's phases as device functions over a group of ``threads`` threads per CTA (every CTA of
    the grid takes part): the staged dispatch / combine kernels run them with all ``THREADS`` threads, the
    one-launch Mega MoE kernel (``sm90_grouped_gemm``) with its own CTA's threads. ``barrier_id``: None when
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
        self.hidden = lay.hidden
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
    def group_sync(self):
        """Barrier over the group's threads."""
        if cutlass.const_expr(self.barrier_id is None):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.threads)

    @cute.jit
    def grid_barrier(self, counter: Int64, target: Int32, q: cutlass.Constexpr, site: cutlass.Constexpr, tid: Int32,
                     rank: Int32, record: Int64, timeout_ns: Int64):
        """Barrier ``q`` over all CTAs: thread 0 of each adds 1 to the monotonic ``counter`` (gpu scope) and waits
        for ``target`` arrivals."""
        self.group_sync()
        if tid == 0:
            ptx.arrive(counter)
            self.wait_flag(counter, target, False, "gpu", site, Int32(q), rank, record, timeout_ns)
        self.group_sync()

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
        return _ld_u32(base + self.signals)

    @cute.jit
    def announce(self, me: Int32, num_tokens: Int32, peers: Int64, call: Int32, tid: Int32):
        """Step 1 (one CTA): ``ready[me] = (call + 1) << 32 | T`` into every rank."""
        ptx.fence_acq_rel_sys()
        for r in cutlass.range(tid, self.num_ranks, self.threads):
            flag = (Int64(call + 1) << 32) | Int64(num_tokens)
            _st_release_sys(_ld_u64(peers + Int64(r) * 8) + (self.cfg.offset("ready") + Int64(me) * 8), flag, True)

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
                t_src[s % 2] = _ld_low_word(flag)
            self.group_sync()
            entries = t_src[s % 2] * k
            idx = _ld_u64(peers + Int64(src) * 8) + cfg.offset("topk_idx")
            for q in cutlass.range(cta * self.threads + tid, entries, num_ctas * self.threads):
                e = _ld_u64(idx + Int64(q) * 8) - Int64(me) * self.num_local
                if (e >= 0) & (e < self.num_local):
                    le = Int32(e)
                    pos = ptx.atom_add(base + (counts + Int64(le) * 4), 1, "relaxed")
                    if pos < self.pool_cap:
                        ptx.st_global_u32(base + (pool + (Int64(le) * self.pool_cap + pos) * 4), src * (self.t_max * k) + q)
                    if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
                        if pos >= self.pool_cap:
                            self.fail(SITE_EXPERT, me, record, le, Int32(self.pool_cap), pos)

    @cute.jit
    def expert_offsets(self, offs: cute.Tensor, base: Int64, stats: Int64, tid: Int32, lane: Int32, cta: Int32,
                       store: cutlass.Constexpr, me: Int32, record: Int64) -> Int32:
        """Step 3 (after the scan's grid barrier): ``offs`` (shared, int32 [E_l + 1]) = the exclusive prefix of
        the counts (clamped to the pool), then clamped to ``row_limit``; CTA 0 adds the counts to the recv stats
        (``cfg.has_stats``) and, with ``store``, writes ``expert_offsets``. Returns the rows to pull."""
        cfg = self.cfg
        counts = cfg.offset("expert_counts")
        for e in cutlass.range(tid, self.num_local, self.threads):
            offs[e] = cutlass.min(_ld_u32(base + (counts + Int64(e) * 4)), self.pool_cap)
        self.group_sync()
        if tid < WARP:
            self.warp_exclusive_scan(offs, lane)
        self.group_sync()
        total = offs[self.num_local]
        if cutlass.const_expr(self.debug):  # noqa: SIM102 (compile-time test, then the runtime one)
            if (cta == 0) & (tid == 0) & (total > self.row_limit):
                self.fail(SITE_ROWS, me, record, Int32(self.row_limit), total, total - self.row_limit)
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
                        ptx.st_global_u32(stat, _ld_u32(stat) + _ld_u32(base + (counts + Int64(e) * 4)))
        return cutlass.min(total, self.row_limit)

    @cute.jit
    def fetch_unit(self, me: Int32, base: Int64, peers: Int64, e: Int32, entry: Int32, row: Int32, unit: Int32,
                   lane: Int32, record: Int64):
        """One warp: unit ``unit`` of local expert e's pool entry ``entry`` into ring row ``row`` (``l1_acts``); unit
        0's lane 0 also stores the row's routing weight (``l1_topk_weights``) and combine slot (``ring_dest``)."""
        cfg, k, hidden = self.cfg, self.topk, self.hidden
        code = _ld_u32(base + (cfg.offset("pool") + (Int64(e) * self.pool_cap + entry) * 4))
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
            ptx.st_global_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8), slot)

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
                _st_release_sys(_ld_u64(peers + Int64(d) * 8) + (done + Int64(me) * 4), call + 1, False)
        for d in cutlass.range(tid, self.num_ranks, self.threads):
            self.wait_flag(base + (done + Int64(d) * 4), call + 1, False, "sys", SITE_DONE, d, me, record, timeout_ns)
        self.group_sync()

    @cute.jit
    def sum_tokens(self, base: Int64, num_tokens: Int32, y: Int64, gw: Int32, num_warps: Int32, lane: Int32):
        """Step 3: ``y[t] = bf16(sum of the valid slots in slot order)``, warp ``gw`` of ``num_warps`` per
        (token, 32 vectors of 8) unit."""
        k, hidden, t_max = self.topk, self.hidden, self.t_max
        combine = self.cfg.offset("combine")
        out_vecs = hidden // 8
        parts = -(-out_vecs // WARP)
        topk_idx = base + self.cfg.offset("topk_idx")
        for u in cutlass.range(gw, num_tokens * parts, num_warps):
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

    @cute.jit
    def finish_call(self, base: Int64, call: Int32, tid: Int32):
        """Step 4 (the group's threads in one CTA, once every CTA has read ``call`` and the counts): zero
        ``expert_counts`` and store ``signals[0] = call + 1``."""
        for e in cutlass.range(tid, self.num_local, self.threads):
            ptx.st_global_u32(base + (self.cfg.offset("expert_counts") + Int64(e) * 4), 0)
        if tid == 0:
            ptx.st_global_u32(base + self.signals, call + 1)


class Dispatch(EpPhases):
    """The dispatch kernel (module docstring, steps 1-4)."""

    @cute.jit
    def __call__(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
                 timeout_ns: Int64, num_ctas: Int32, stream):
        self.kernel(me, num_tokens, base, peers, stats, record, timeout_ns).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, me: Int32, num_tokens: Int32, base: Int64, peers: Int64, stats: Int64, record: Int64,
               timeout_ns: Int64):
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        smem = utils.SmemAllocator()
        offs = smem.allocate_tensor(Int32, cute.make_layout(self.num_local + 1), 16)
        t_src = smem.allocate_tensor(Int32, cute.make_layout(2), 16)
        call = self.current_call(base)
        if cta == 0:
            self.announce(me, num_tokens, peers, call, tid)
        self.scan(me, base, peers, call, t_src, tid, cta, num_ctas, record, timeout_ns)
        self.grid_barrier(base + (self.signals + 4), (call * BARRIERS_PER_CALL + 1) * num_ctas, 0, SITE_D_BARRIER, tid,
                          me, record, timeout_ns)
        total = self.expert_offsets(offs, base, stats, tid, lane, cta, True, me, record)
        self.pull(me, base, peers, offs, total, cta * WARPS + tid // WARP, num_ctas * WARPS, lane, record)


class Combine(EpPhases):
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
        hidden = self.hidden
        tid = cute.arch.thread_idx()[0]
        lane = tid % WARP
        cta = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        gw = cta * WARPS + tid // WARP
        call = self.current_call(base)

        # 1. Push every ring row to its source rank's combine area.
        total = _ld_u32(base + (cfg.offset("expert_offsets") + self.num_local * 4))
        row_vecs = hidden * 2 // VEC
        units = self.units(row_vecs)
        for u in cutlass.range(gw, total * units, num_ctas * WARPS):
            row = u // units
            dst = _ld_u64(base + (cfg.offset("ring_dest") + Int64(row) * 8))
            self.copy_unit(rows + Int64(row) * (hidden * 2), dst, row_vecs, u - row * units, lane)
        ptx.fence_acq_rel_sys()

        # 2-4. Rows are out: tell every rank, wait until every rank's rows are in, sum, reset.
        self.grid_barrier(base + (self.signals + 4), (call * BARRIERS_PER_CALL + 2) * num_ctas, 1, SITE_C_BARRIER, tid,
                          me, record, timeout_ns)
        self.exchange_done(me, base, peers, call, tid, cta, record, timeout_ns)
        self.sum_tokens(base, num_tokens, y, gw, num_ctas * WARPS, lane)
        if cta == 0:
            self.finish_call(base, call, tid)


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

    cfg = EpCommConfig(cfg.layout, cfg.debug)

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


def combine(cfg: EpCommConfig, me: int, num_tokens: int, base: int, peers: torch.Tensor, rows: torch.Tensor,
            y: torch.Tensor, record: int, timeout_ns: int, num_ctas: int) -> None:
    """Launch combine on the current stream: ``rows`` BF16 [ring, H] (L2 outputs), ``y`` BF16 [T, H]."""
    kernel = compile_combine(cfg)
    kernel(me, num_tokens, base, peers.data_ptr(), rows.data_ptr(), y.data_ptr(), record, timeout_ns, num_ctas,
           runtime.current_stream())
