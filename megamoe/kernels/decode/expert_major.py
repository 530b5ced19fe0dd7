"""Expert-major warp decode on tensor cores: each expert's weight rows are read once per batch (sm_90a, CuTe DSL).

The per-pair kernels (``simt``, ``mma.GateUpMMA``) give every (token t, slot j) pair its own warps, so an expert
routed by n pairs has its rows streamed n times: at T = 8, top-6 over 32 experts, 48 pair-reads of ~26 distinct
experts. Here a warp owns 16 weight rows of one expert and multiplies them with the activations of every pair
routed to that expert, 8 pairs at a time as the N = 8 columns of ``mma.m16n8k16`` (weights the M side, decoded
from the Mega MoE layout by ``mma.mma_stream``). Bytes read follow the distinct experts of the batch, like the
grouped path, while keeping warp decode's structure (no token permutation, no
shared memory, no cross-warp synchronization).

A warp finds its pairs itself: lanes compare 32 routing ids at a time with its expert (``vote.ballot``),
``popc`` counts them and ``fns`` gives each of lanes 0..7 the pair of one column; a warp whose expert has
no pair returns at once. Warps are numbered row-block fastest within an expert, so a CTA (8 warps) is
all idle or all busy. Ids outside ``[0, E)`` (-1: masked) match no expert.

Three kernels (up to ``NATURAL_X_MAX_TOKENS`` tokens ``x`` is read in its natural order, above it gathered into MMA
order first):

* ``GateUpByExpert`` over L1 in the Mega MoE layout (``int32 [E, 2I/64, H/128, 64, 16]``, gate/up rows interleaved by
  8): warp = (expert, 8 neurons); lane ``(g, q)`` ends with the gate and up sums of neuron ``8b + g`` for
  columns ``2q, 2q + 1``, applies the optional clamp and ``silu(gate) * up`` in FP32 and stores ``a`` for
  each real pair as two BF16 planes ``hi = bf16(a)``, ``lo = bf16(a - hi)`` (``a_planes`` ``[2, T*k, I]``,
  MMA order), so that ``hi + lo`` carries ``a`` to 2**-17 relative.
* ``DownByExpert`` over L2 in the same layout (``int32 [E, H/64, I/128, 64, 16]``): warp = (expert, 16 outputs); B
  operands ``hi`` and ``lo`` (two MMAs per weight fragment, exact products, FP32 sums), except for an expert
  routed by at most ``COLUMNS / 2`` pairs: one packed pass with pair p's ``hi`` and ``lo`` in columns 2p and
  2p + 1 of one operand (one MMA per fragment, the same sums, the same bits); stores ``o [T*k, H]`` FP32 for
  each real pair (the routing weight is not applied yet).
* ``Combine``: ``y[t, h] = bf16(sum_j w_tj * o[t*k + j, h])`` in FP32 over the valid slots in slot order
  (masked slots are skipped, whatever ``o`` holds for them).

Numerics: those of the family (exact weights, BF16 ``x``, FP32 sums, one BF16 rounding of ``y``),
except that the down projection reads ``a`` as ``hi + lo`` (relative error <= 2**-17 per element, far
below the final BF16 rounding) and FP32 summation order is the tensor cores'.

Both MMA kernels are latency bound (few resident warps, one eligible per scheduler; the pass loop needs ~125
registers, so 2 CTAs per SM). Alternatives measured slower and not kept (two row tiles per warp, 3 CTAs per SM,
programmatic dependent launch, B rows staged in shared memory): ``bench/findings/warp-decode-expert-major.md``.
"""

from __future__ import annotations

import cutlass
import cutlass.utils as utils
import torch
from cutlass import Float32, Int32, Int64, cute

from .. import ptx, runtime
from ..warp_ops import nth_set_bit, warp_inclusive_sum
from ..weight_layout import BF16_ACC_SHIFT
from .common import (
    ACT_LOAD,
    WARP,
    WARPS_PER_CTA,
    gmem_ptr,
    mma_position,
    run_planes_gate_up,
    swiglu,
    token_rows,
    x_order_for,
)
from .mma import b_lane, hi_lo_column_sums, mma_rows, mma_stream

COLUMNS = 8
"""Pairs per pass of a warp over its rows (the N side of ``mma.m16n8k16``); an expert routed by more pairs
streams its rows again (from L2) for each further 8."""
MIN_CTAS_PER_SM = 2
"""Launch bound of both expert-major kernels: 2 CTAs of 8 warps per SM, up to 128 registers (at 80, ptxas
spills ~1 KB per lane in the pass loop of gate_up; at 128 it needs ~121 and spills nothing)."""
DEPTH = 4
"""K chunks of weight loads in flight per lane (``mma_stream``)."""
MAX_EXPERTS = 1024
"""Most experts the expert-major kernels serve (their routed-expert bitmap: 32 words of shared memory)."""
BITMAP_WORDS = MAX_EXPERTS // 32
COMBINE_VEC = 4
"""Outputs per thread of the combine kernel (one 16-byte FP32 load per slot)."""


# --------------------------------------------------------------------------------------------------
# Roles: the routed expert and the pairs of a warp


@cute.jit
def find_routed(idx: cute.Tensor, e: Int32, lane: Int32, want: Int32) -> tuple:
    """Scan of the flat routing ``idx`` for expert ``e``: (the pair, a flat index into ``idx``, of rank ``want``
    among those routed to ``e``, lowest pair first, per lane, -1 when there are fewer; the number of pairs routed
    to ``e``, the same in every lane)."""
    count = Int32(0)
    found = Int32(-1)
    for base in cutlass.range(0, idx.shape[0], WARP, unroll=1):
        p = base + lane
        hit = False
        if p < idx.shape[0]:
            hit = idx[p] == Int64(e)
        mask = cute.arch.vote_ballot_sync(hit)
        c = cute.arch.popc(mask)
        inside = (want >= count) & (want < count + c)
        found = cutlass.select_(inside, base + nth_set_bit(mask, want - count), found)
        count = count + c
    return found, count


@cute.jit
def mark_routed_experts(idx: cute.Tensor, experts: Int32, bitmap: cute.Tensor, tidx: Int32):
    """Whole CTA: ``bitmap`` (32 words in shared memory) gets bit ``e`` set for every expert ``e`` in ``[0, E)``
    that some pair routes to."""
    if tidx < BITMAP_WORDS:
        bitmap[tidx] = Int32(0)
    cute.arch.sync_threads()
    for p in cutlass.range(tidx, idx.shape[0], WARPS_PER_CTA * WARP, unroll=1):
        e = idx[p]
        if (e >= 0) & (e < experts):
            word = Int32(e) >> 5
            cute.arch.atomic_or(bitmap.iterator + word, Int32(1) << (Int32(e) & 31))
    cute.arch.sync_threads()


@cute.jit
def nth_routed_expert(bitmap: cute.Tensor, lane: Int32, n: Int32) -> Int32:
    """The routed expert of rank ``n`` (0-based, lowest id first) in ``bitmap``, in every lane; -1 if fewer."""
    word = bitmap[lane]
    count = cute.arch.popc(word)
    inclusive = warp_inclusive_sum(count, lane)
    exclusive = inclusive - count
    owner = cute.arch.vote_ballot_sync((n >= exclusive) & (n < inclusive))
    candidate = lane * 32 + nth_set_bit(word, n - exclusive)
    e = cute.arch.shuffle_sync(candidate, nth_set_bit(owner, Int32(0)) & 31)
    return cutlass.select_(owner != 0, e, Int32(-1))


# --------------------------------------------------------------------------------------------------
# The pass loop and the kernels


class ByExpert:
    """The launch and pass loop both expert-major kernels share. Warp ``w`` of the grid serves the routed
    expert of rank ``w / blocks`` (rows ``16 * (w % blocks) ..`` of it, ``blocks = rows_per_expert / 16``, a
    multiple of 8 since H and I are multiples of 128: a CTA serves one expert); the grid covers ``min(E, T * k)``
    experts, the most a batch can route to, and warps beyond the distinct routed experts return at once. For each
    pass of up to ``COLUMNS`` routed pairs a warp streams its rows (``mma_stream``, K = ``k``) against
    ``self.b_lanes(..)`` and hands the C fragments to ``self.epilogue(..)``."""

    k: int
    rows_per_expert: int
    b_order: str  # of the B rows (``mma_stream``)
    tuning: tuple  # (chunks in flight, CTAs per SM)
    packed_pairs = 0  # experts routed by at most this many pairs take one packed pass (``DownByExpert``)

    @cute.jit
    def __call__(self, b: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, sf: cute.Pointer, out: cute.Pointer,
                 tokens: Int32, topk: Int32, experts: Int32, clamp: Float32, stream):
        idx_t = cute.make_tensor(idx, cute.make_layout((tokens * topk,)))
        ctas = cutlass.min(experts, tokens * topk) * (self.rows_per_expert // 16 // WARPS_PER_CTA)
        self.kernel(b, idx_t, w, sf, out, topk, experts, clamp).launch(
            grid=[ctas, 1, 1], block=[WARPS_PER_CTA * WARP, 1, 1], stream=stream,
            min_blocks_per_mp=self.tuning[1])

    @cute.kernel
    def kernel(self, b: cute.Pointer, idx: cute.Tensor, w: cute.Pointer, sf: cute.Pointer, out: cute.Pointer,
               topk: Int32, experts: Int32, clamp: Float32):
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % WARP
        q = lane % 4
        blocks = self.rows_per_expert // 16
        warp = cute.arch.block_idx()[0] * WARPS_PER_CTA + tidx // WARP
        rank = warp // blocks
        block = warp - rank * blocks
        bitmap = utils.SmemAllocator().allocate_tensor(Int32, cute.make_layout(BITMAP_WORDS), byte_alignment=16)
        mark_routed_experts(idx, experts, bitmap, tidx)
        e = nth_routed_expert(bitmap, lane, rank)
        if e >= 0:
            first_row = Int64(block) * 16
            _, count = find_routed(idx, e, lane, Int32(-1))
            if cutlass.const_expr(self.packed_pairs > 0):
                if count <= self.packed_pairs:  # one packed pass instead of the unpacked ones below
                    self.packed_pass(b, idx, w, sf, out, e, block, lane)
                    count = Int32(0)
            for start in cutlass.range(0, count, COLUMNS, unroll=1):
                # Addressed through an opaque copy made in the loop: otherwise the weight loads, invariant
                # across passes, are hoisted out of it all at once (hundreds of registers, spills).
                rows = mma_rows(w, sf, e, ptx.opaque_i64(first_row), self.rows_per_expert, self.k, lane)
                found, _ = find_routed(idx, e, lane, start + lane % COLUMNS)  # lane c < 8: column c's pair
                b_pair = cute.arch.shuffle_sync(found, lane // 4)
                b_lanes = self.b_lanes(b, cutlass.max(b_pair, Int32(0)), topk, idx.shape[0], q)
                acc = mma_stream(rows, self.k, b_lanes, self.tuning[0], self.b_order)
                pairs = (cute.arch.shuffle_sync(found, 2 * q), cute.arch.shuffle_sync(found, 2 * q + 1))
                self.epilogue(acc, pairs, out, idx.shape[0], block, lane, clamp)


class GateUpByExpert(ByExpert):
    """``a_planes`` for every routed pair from L1 in the Mega MoE layout (module docstring)."""

    def __init__(self, hidden: int, inter: int, has_clamp: bool, tuning: tuple, x_order: str):
        self.hidden, self.inter, self.has_clamp = hidden, inter, has_clamp
        self.k, self.rows_per_expert, self.tuning, self.b_order = hidden, 2 * inter, tuning, x_order

    def b_lanes(self, x: cute.Pointer, pair: Int32, topk: Int32, pairs: Int32, q: Int32) -> list:
        """The lane's address in its column's token row of ``x`` (in ``b_order``)."""
        return [b_lane(x.toint() + Int64(pair // topk) * (self.hidden * 2), q, self.b_order)]

    @cute.jit
    def epilogue(self, acc: list, pairs: tuple, a: cute.Pointer, total_pairs: Int32, block: Int32, lane: Int32,
                 clamp: Float32):
        """SwiGLU of neuron ``8 * block + lane / 4`` for the lane's two columns (C fragment: gate in values
        0, 1, up in 2, 3 of each chain); hi/lo planes of the real pairs."""
        planes = cute.make_tensor(a, cute.make_layout((2 * total_pairs * self.inter,)))
        pos = mma_position(block * 8 + lane // 4)
        for c in cutlass.range_constexpr(2):
            gate = (acc[c] + acc[4 + c]) * Float32(2.0**BF16_ACC_SHIFT)
            up = (acc[2 + c] + acc[6 + c]) * Float32(2.0**BF16_ACC_SHIFT)
            val = swiglu(gate, up, clamp, self.has_clamp)
            if pairs[c] >= 0:
                hi = val.to(cutlass.BFloat16)
                at = Int64(pairs[c]) * self.inter + pos
                planes[at] = hi
                planes[at + Int64(total_pairs) * self.inter] = (val - hi.to(Float32)).to(cutlass.BFloat16)


class DownByExpert(ByExpert):
    """``o [T*k, H]`` (FP32, routing weight not applied) for every routed pair from L2 in the Mega MoE layout."""

    packed_pairs = COLUMNS // 2

    def __init__(self, hidden: int, inter: int, tuning: tuple):
        self.hidden, self.inter = hidden, inter
        self.k, self.rows_per_expert, self.tuning, self.b_order = inter, hidden, tuning, "mma"

    def b_lanes(self, a: cute.Pointer, pair: Int32, topk: Int32, pairs: Int32, q: Int32) -> list:
        """The lane's addresses in its column's ``hi`` and ``lo`` rows."""
        hi = b_lane(a.toint() + Int64(pair) * (self.inter * 2), q, self.b_order)
        return [hi, hi + Int64(pairs) * (self.inter * 2)]

    def packed_b_lane(self, a: cute.Pointer, pair: Int32, pairs: Int32, lane: Int32) -> Int64:
        """Packed pass: column ``2p`` is pair p's ``hi`` row, column ``2p + 1`` its ``lo`` row (lane column
        ``lane / 4``)."""
        plane = (lane // 4) % 2
        return b_lane(a.toint() + (Int64(plane) * pairs + pair) * (self.inter * 2), lane % 4, self.b_order)

    @cute.jit
    def packed_pass(self, a: cute.Pointer, idx: cute.Tensor, w: cute.Pointer, sf: cute.Pointer, o: cute.Pointer,
                    e: Int32, block: Int32, lane: Int32):
        """Rows ``16 * block ..`` of expert ``e`` times the ``hi`` and ``lo`` rows of its (at most
        ``packed_pairs``) pairs in one pass: one MMA per weight fragment instead of two."""
        rows = mma_rows(w, sf, e, Int64(block) * 16, self.rows_per_expert, self.k, lane)
        found, _ = find_routed(idx, e, lane, lane % COLUMNS)  # lane c < 8: pair c
        b_pair = cute.arch.shuffle_sync(found, lane // 8)
        acc = mma_stream(rows, self.k, [self.packed_b_lane(a, cutlass.max(b_pair, Int32(0)), idx.shape[0], lane)],
                         self.tuning[0], self.b_order)
        self.packed_epilogue(acc, cute.arch.shuffle_sync(found, lane % 4), o, idx.shape[0], block, lane)

    @cute.jit
    def packed_epilogue(self, acc: list, pair: Int32, o: cute.Pointer, total_pairs: Int32, block: Int32,
                        lane: Int32):
        """Packed pass: lane q's columns ``2q``, ``2q + 1`` are pair q's ``hi`` and ``lo`` sums
        (``hi_lo_column_sums``: the bits of an unpacked pass)."""
        out = cute.make_tensor(o, cute.make_layout((total_pairs * self.hidden,)))
        row = block * 16 + lane // 4
        if pair >= 0:
            sums = hi_lo_column_sums(acc)
            for r in cutlass.range_constexpr(2):
                out[Int64(pair) * self.hidden + row + 8 * r] = sums[r] * Float32(2.0**BF16_ACC_SHIFT)

    @cute.jit
    def epilogue(self, acc: list, pairs: tuple, o: cute.Pointer, total_pairs: Int32, block: Int32, lane: Int32,
                 clamp: Float32):
        """Rows ``16 * block + lane / 4`` (values 0, 1 of each chain) and 8 further (values 2, 3), summed over
        the four chains (hi/lo x K-block parity), for the lane's two columns."""
        out = cute.make_tensor(o, cute.make_layout((total_pairs * self.hidden,)))
        row = block * 16 + lane // 4
        for c in cutlass.range_constexpr(2):
            if pairs[c] >= 0:
                for r in cutlass.range_constexpr(2):
                    v = (acc[2 * r + c] + acc[4 + 2 * r + c]) + (acc[8 + 2 * r + c] + acc[12 + 2 * r + c])
                    out[Int64(pairs[c]) * self.hidden + row + 8 * r] = v * Float32(2.0**BF16_ACC_SHIFT)


class Combine:
    """``y[t, h] = bf16(sum_j w_tj * o[t*k + j, h])`` over valid slots in slot order; ``COMBINE_VEC`` outputs
    per thread, top-k compiled in."""

    def __init__(self, hidden: int, topk: int):
        self.hidden, self.topk = hidden, topk

    @cute.jit
    def __call__(self, o: cute.Pointer, idx: cute.Pointer, wts: cute.Pointer, y: cute.Pointer, tokens: Int32,
                 experts: Int32, stream):
        idx_t, wts_t, y_t = token_rows(idx, wts, y, tokens, self.topk, self.hidden)
        threads = tokens * (self.hidden // COMBINE_VEC)
        self.kernel(o, idx_t, wts_t, y_t, experts).launch(
            grid=[(threads + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream, smem=0)

    @cute.kernel
    def kernel(self, o: cute.Pointer, idx: cute.Tensor, wts: cute.Tensor, y: cute.Tensor, experts: Int32):
        hidden, topk = self.hidden, self.topk
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        t = i // (hidden // COMBINE_VEC)
        h = (i - t * (hidden // COMBINE_VEC)) * COMBINE_VEC
        if t < idx.shape[0]:
            acc = [Float32(0.0)] * COMBINE_VEC
            for j in cutlass.range_constexpr(topk):
                e = idx[t, j]
                valid = (e >= 0) & (e < experts)
                vals = ptx.ld_v4(o.toint() + ((Int64(t) * topk + j) * hidden + h) * 4, ACT_LOAD, True)
                for v in cutlass.range_constexpr(COMBINE_VEC):
                    acc[v] = Float32(cutlass.select_(valid, ptx.fma(wts[t, j], vals[v], acc[v]), acc[v]))
            for v in cutlass.range_constexpr(COMBINE_VEC):
                y[t, h + v] = acc[v].to(cutlass.BFloat16)


# --------------------------------------------------------------------------------------------------
# Host side


def compile_kernels(hidden: int, inter: int, has_clamp: bool, topk: int, tuning: tuple = (DEPTH, MIN_CTAS_PER_SM),
                    x_order: str = "natural"):
    """The compiled (gate_up, down, combine) triple for one static configuration (cached; works without a
    GPU under ``CUTE_DSL_ARCH=sm_90a``); token and expert counts stay runtime values. ``tuning``: (chunks in
    flight, CTAs per SM) of gate_up and down; ``x_order``: the order gate_up reads ``x`` in (``x_order_for``)."""
    from cutlass.cute.runtime import make_fake_stream

    i32, bf16, f32 = cutlass.Int32, cutlass.BFloat16, cutlass.Float32
    sizes = (Int32(1), Int32(1), Int32(1))  # tokens, top-k, experts

    def build(kernel, b_dtype, out_dtype):
        return lambda: cute.compile(kernel, gmem_ptr(b_dtype), gmem_ptr(cutlass.Int64), gmem_ptr(i32), gmem_ptr(i32),
                                    gmem_ptr(out_dtype), *sizes, Float32(0.0), make_fake_stream())

    gate_up = runtime.compiled(("decode.expert_major.gate_up", hidden, inter, has_clamp, tuning, x_order),
                               build(GateUpByExpert(hidden, inter, has_clamp, tuning, x_order), bf16, bf16))
    down = runtime.compiled(("decode.expert_major.down", hidden, inter, tuning),
                            build(DownByExpert(hidden, inter, tuning), bf16, f32))
    combine = runtime.compiled(("decode.expert_major.combine", hidden, topk), lambda: cute.compile(
        Combine(hidden, topk), gmem_ptr(f32), gmem_ptr(cutlass.Int64), gmem_ptr(f32), gmem_ptr(bf16), Int32(1),
        Int32(1), make_fake_stream()))
    return gate_up, down, combine


def moe_decode_by_expert(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: tuple, l2: tuple,
                         activation_clamp: float | None, y: torch.Tensor,
                         tuning: tuple = (DEPTH, MIN_CTAS_PER_SM)) -> torch.Tensor:
    """The expert-major path of ``api.moe_decode`` (inputs already validated there: ``l1``, ``l2`` in
    the Mega MoE layout, ``y`` bfloat16 ``[T, H]``). Allocates ``a_planes`` ``[2, T*k, I]`` BF16 and
    ``o [T*k, H]`` FP32 (caching allocator, no sync)."""
    tokens, topk = topk_idx.shape
    hidden, inter = x.shape[1], l1[1].shape[2] // 2  # chunk-major scales [E, H/128, 2I]
    experts = l1[0].shape[0]
    order = x_order_for(tokens)
    gate_up, down, combine = compile_kernels(hidden, inter, activation_clamp is not None, topk, tuning, order)
    stream = runtime.current_stream()
    planes = run_planes_gate_up(gate_up, x, topk_idx, l1, activation_clamp, order, stream)
    o = torch.empty(tokens * topk, hidden, dtype=torch.float32, device=x.device)
    clamp = 0.0 if activation_clamp is None else float(activation_clamp)
    i32, bf16, f32 = cutlass.Int32, cutlass.BFloat16, cutlass.Float32
    idx = gmem_ptr(cutlass.Int64, topk_idx.data_ptr())
    down(gmem_ptr(bf16, planes.data_ptr()), idx, gmem_ptr(i32, l2[0].data_ptr()), gmem_ptr(i32, l2[1].data_ptr()),
         gmem_ptr(f32, o.data_ptr()), tokens, topk, experts, clamp, stream)
    combine(gmem_ptr(f32, o.data_ptr()), idx, gmem_ptr(f32, topk_weights.data_ptr()), gmem_ptr(bf16, y.data_ptr()),
            tokens, experts, stream)
    return y
