"""Warp decode for a few tokens on tensor cores, split over K and slots inside a CTA (sm_90a, CuTe DSL).

At a few tokens nearly every routed expert is read by one (token, slot) pair, so the expert-major kernels
(``expert_major``) have one real MMA column per pass and too few warps: flash (H 4096, I 2048, top-6)
gives 1536 warps of 16 rows each, about 12 per SM. Here the same rows are split further and the partial
sums meet in shared memory, in a fixed order, inside one CTA:

* ``GateUpSplit`` over L1 in the Mega MoE layout (``mma.GateUpMMA``'s warp: 8 neurons of one pair, 16 kernel-layout
  rows as the M side of ``mma.m16n8k16``, ``x`` read in ``x_order``) with each warp's K range cut into ``split``
  consecutive parts streamed by ``split`` warps of one CTA; part 0's lanes add the parts' gate and up sums in part
  order, apply the optional clamp and ``silu(gate) * up`` (FP32) and store ``a`` as the two BF16 planes the
  expert-major down reads (``hi = bf16(a)``, ``lo = bf16(a - hi)``, ``[2, T*k, I]``, MMA order).
* ``DownSplit`` over L2 in the Mega MoE layout: a CTA owns 16 outputs ``y[t, h:h+16]`` of one token; its warps are
  (slot j, K part p), ``k * split`` of them, each copying its part of ``hi`` and ``lo`` into shared memory once
  (``cp.async``; B operands then come from ``ld.shared``: 77-86 registers instead of 141-144, so 24 warps per SM)
  and streaming rows ``h:h+16`` of ``W2[e_j]`` over its K part against them (one MMA per weight fragment, ``hi`` in
  the B operand's even columns and ``lo`` in its odd ones; exact products). After one barrier warp 0 sums, per
  output, the parts of each slot in part order and then ``w_tj * o_j`` over the valid slots in slot order (FP32)
  and stores ``y`` in BF16: no FP32 ``o`` in global memory and no combine launch.

Numerics: those of the expert-major path (exact weight products, FP32 sums, ``a`` read as ``hi + lo`` within
2**-17, one BF16 rounding of ``y``); with ``split = 1`` the sums are grouped exactly as there, so ``y`` is the
same bits. Masked slots (ids outside ``[0, E)``) load nothing and add nothing; a token without a valid slot
gets ``y = 0``.
"""

from __future__ import annotations

import cutlass
import cutlass.utils as utils
import torch
from cutlass import Float32, Int32, Int64, cute

from ...checks import fail
from .. import ptx, runtime
from ..weight_layout import BF16_ACC_SHIFT, CHUNK_BYTES, K_CHUNK, ROW_BLOCK
from .common import WARP, gmem_ptr, mma_position, run_planes_gate_up, slots_view, swiglu, token_rows, x_order_for
from .mma import b_lane, hi_lo_column_sums, mma_rows, mma_stream

GATE_UP_WARPS_PER_CTA = 4
"""Warps per gate_up CTA (``GATE_UP_WARPS_PER_CTA / split`` neuron blocks of 8, ``split`` K parts each)."""
GATE_UP_CTAS_PER_SM = 6
"""Launch bound of gate_up: 6 CTAs of 4 warps per SM (80 registers)."""
GATE_UP_MIN_PART_CHUNKS = 14
"""gate_up splits K into the most parts (4, 2 or 1) that leave each at least this many 128-wide chunks (flash, H 4096:
2 parts; pro, H 7168: 4): the faster split of each at one token (``bench/results/decode/``
``2026-11-30_decode_token_major_h200.txt``)."""
SMEM_BUDGET = runtime.H100_SMEM_PER_SM - 8 * 1024
"""Shared memory per SM the down CTAs may take (the SM's, less the 1 KiB the system reserves for each of up to 8)."""
TOKEN_MAJOR_MAX_TOKENS = 4
"""Largest batch ``api.moe_decode`` runs these kernels for (both weights in the Mega MoE layout, a shape ``supports``
accepts); larger batches take the expert-major kernels, which read each routed expert once per batch. At 2 to 4
tokens these kernels are as fast or faster (``bench/results/decode/2026-11-30_decode_token_major_t2_4_h200.txt``)."""
MAX_TOPK = 32
"""Most slots per token: the down CTA has a warp per slot (and K part), at most 1024 threads."""


# --------------------------------------------------------------------------------------------------
# Device helpers


def k_part(rows: tuple, b: Int64, part, chunks: int, b_bytes_per_chunk: int) -> tuple:
    """``mma_rows`` addresses and a B lane address moved to K chunk ``part * chunks``."""
    return ((rows[0] + Int64(part) * (chunks * ROW_BLOCK * CHUNK_BYTES), rows[1] + Int64(part) * (chunks * rows[2] * 4),
             rows[2]), b + Int64(part) * (chunks * b_bytes_per_chunk))


@cute.jit
def stage_rows(copies: list, nbytes: int, lane: Int32):
    """The warp copies ``nbytes`` (a multiple of 16) from global ``src`` to shared ``dst`` for every ``(dst, src)`` of
    ``copies`` and waits for them once (every copy issued before the wait; visible to the whole warp after it)."""
    vecs = nbytes // 16
    for dst, src in copies:
        for i in cutlass.range_constexpr((vecs + WARP - 1) // WARP):
            v = lane + i * WARP
            ptx.cp_async_16_if(dst + v * 16, src + Int64(v) * 16,
                               Int32(v < vecs) if (i + 1) * WARP > vecs else Int32(1))
    ptx.cp_async_wait_all()
    cute.arch.sync_warp()


class GateUpSplit:
    """``a`` planes of every valid pair from L1 in the Mega MoE layout (module docstring)."""

    def __init__(self, hidden: int, inter: int, has_clamp: bool, x_order: str, split: int, min_ctas: int):
        self.hidden, self.inter, self.has_clamp, self.x_order = hidden, inter, has_clamp, x_order
        self.split, self.min_ctas = split, min_ctas

    @cute.jit
    def __call__(self, x: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, sf: cute.Pointer, planes: cute.Pointer,
                 tokens: Int32, topk: Int32, experts: Int32, clamp: Float32, stream):
        idx_t = slots_view(idx, tokens, topk)
        units = tokens * topk * (self.inter // 8)
        per_cta = GATE_UP_WARPS_PER_CTA // self.split
        self.kernel(x, idx_t, w, sf, planes, experts, clamp).launch(
            grid=[(units + per_cta - 1) // per_cta, 1, 1], block=[GATE_UP_WARPS_PER_CTA * WARP, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, x: cute.Pointer, idx: cute.Tensor, w: cute.Pointer, sf: cute.Pointer, planes_ptr: cute.Pointer,
               experts: Int32, clamp: Float32):
        hidden, inter, split = self.hidden, self.inter, self.split
        chunks = hidden // K_CHUNK // split
        tidx = cute.arch.thread_idx()[0]
        lane, wi = tidx % WARP, tidx // WARP
        gl, q = lane // 4, lane % 4
        part = wi % split
        topk = idx.shape[1]
        pairs = idx.shape[0] * topk
        unit = cute.arch.block_idx()[0] * (GATE_UP_WARPS_PER_CTA // split) + wi // split
        block = unit // pairs
        pair = unit - block * pairs
        t = pair // topk
        e = Int64(-1)
        if block < inter // 8:
            e = idx[t, pair - t * topk]
        valid = (e >= 0) & (e < experts)
        sums = utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout((GATE_UP_WARPS_PER_CTA, 8, 2)),
                                                     byte_alignment=16)
        gate = Float32(0.0)
        up = Float32(0.0)
        if valid:
            rows = mma_rows(w, sf, e, Int64(block) * 16, 2 * inter, hidden, lane)
            rows, lane_x = k_part(rows, b_lane(x.toint() + Int64(t) * (hidden * 2), q, self.x_order), part, chunks,
                                  K_CHUNK * 2)
            acc = mma_stream(rows, chunks * K_CHUNK, [lane_x], b_order=self.x_order)
            gate = acc[0] + acc[4]
            up = acc[2] + acc[6]
        if q == 0:
            sums[wi, gl, 0] = gate
            sums[wi, gl, 1] = up
        cute.arch.sync_threads()
        if valid & (part == 0) & (q == 0):
            for p in cutlass.range_constexpr(1, split):
                gate = gate + sums[wi + p, gl, 0]
                up = up + sums[wi + p, gl, 1]
            val = swiglu(gate * Float32(2.0**BF16_ACC_SHIFT), up * Float32(2.0**BF16_ACC_SHIFT), clamp,
                         self.has_clamp)
            out = cute.make_tensor(planes_ptr, cute.make_layout((2 * pairs * inter,)))
            hi = val.to(cutlass.BFloat16)
            at = Int64(pair) * inter + mma_position(block * 8 + gl)
            out[at] = hi
            out[at + Int64(pairs) * inter] = (val - hi.to(Float32)).to(cutlass.BFloat16)


class DownSplit:
    """``y`` from the ``a`` planes and L2 in the Mega MoE layout, slots combined in the CTA (module docstring)."""

    def __init__(self, hidden: int, inter: int, topk: int, split: int, min_ctas: int):
        self.hidden, self.inter, self.topk, self.split, self.min_ctas = hidden, inter, topk, split, min_ctas

    @cute.jit
    def __call__(self, planes: cute.Pointer, idx: cute.Pointer, wts: cute.Pointer, w: cute.Pointer, sf: cute.Pointer,
                 y: cute.Pointer, tokens: Int32, experts: Int32, stream):
        idx_t, wts_t, y_t = token_rows(idx, wts, y, tokens, self.topk, self.hidden)
        self.kernel(planes, idx_t, wts_t, w, sf, y_t, experts).launch(
            grid=[tokens * (self.hidden // 16), 1, 1], block=[self.topk * self.split * WARP, 1, 1], stream=stream,
            min_blocks_per_mp=self.min_ctas)

    @cute.kernel
    def kernel(self, planes: cute.Pointer, idx: cute.Tensor, wts: cute.Tensor, w: cute.Pointer, sf: cute.Pointer,
               y: cute.Tensor, experts: Int32):
        hidden, inter, topk, split = self.hidden, self.inter, self.topk, self.split
        chunks = inter // K_CHUNK // split
        tidx = cute.arch.thread_idx()[0]
        lane, wi = tidx % WARP, tidx // WARP
        gl, q = lane // 4, lane % 4
        j, part = wi // split, wi % split
        blocks = hidden // 16
        t = cute.arch.block_idx()[0] // blocks
        block = cute.arch.block_idx()[0] - t * blocks
        pairs = idx.shape[0] * topk
        e = idx[t, j]
        smem = utils.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout((topk * split, 16)), byte_alignment=16)
        part_bytes = chunks * K_CHUNK * 2
        stage = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((topk * split * 2 * chunks * K_CHUNK,)),
                                     byte_alignment=16)
        row_g = Float32(0.0)
        row_g8 = Float32(0.0)
        if (e >= 0) & (e < experts):
            rows = mma_rows(w, sf, e, Int64(block) * 16, hidden, inter, lane)
            hi = planes.toint() + (Int64(t) * topk + j) * (inter * 2)
            rows, hi = k_part(rows, hi, part, chunks, K_CHUNK * 2)
            # this warp's hi and lo parts of a, copied to shared memory once: B loads of a few cycles
            hi_s = stage.iterator.toint() + wi * (2 * part_bytes)
            stage_rows([(hi_s, hi), (hi_s + part_bytes, hi + Int64(pairs) * (inter * 2))], part_bytes, lane)
            # one B operand, hi in the even columns and lo in the odd ones (lane q = 0 sums columns 0 and 1)
            acc = mma_stream(rows, chunks * K_CHUNK, [b_lane(hi_s + (gl % 2) * part_bytes, q, "mma")], b_shared=True)
            row_g, row_g8 = hi_lo_column_sums(acc)
        if q == 0:
            sums[wi, gl] = row_g
            sums[wi, gl + 8] = row_g8
        cute.arch.sync_threads()
        if wi == 0:
            if lane < 16:
                total = Float32(0.0)
                for s in cutlass.range_constexpr(topk):
                    v = sums[s * split, lane]
                    for p in cutlass.range_constexpr(1, split):
                        v = v + sums[s * split + p, lane]
                    es = idx[t, s]
                    if (es >= 0) & (es < experts):
                        total = ptx.fma(wts[t, s], v * Float32(2.0**BF16_ACC_SHIFT), total)
                y[t, block * 16 + lane] = total.to(cutlass.BFloat16)


# --------------------------------------------------------------------------------------------------
# Host side


def stage_bytes(topk: int, inter: int, split: int) -> int:
    """Shared memory of one down CTA of ``split`` K parts: its warps' staged ``a`` rows (hi and lo, BF16, every
    slot's whole K) and their partial sums."""
    return 4 * topk * inter + 4 * 16 * topk * split


def supports(topk: int, inter: int) -> bool:
    """Whether a down CTA fits: top-k at most ``MAX_TOPK`` and its staged rows within one SM's shared memory."""
    return topk <= MAX_TOPK and stage_bytes(topk, inter, 1) <= SMEM_BUDGET


def default_tuning(hidden: int, inter: int, topk: int) -> tuple:
    """(gate_up K parts, gate_up CTAs per SM, down K parts, down CTAs per SM) for a shape: gate_up by
    ``GATE_UP_MIN_PART_CHUNKS``; down at 24 warps per SM (77-86 registers) where shared memory allows: unsplit on 4
    CTAs per SM (flash), else split in two on 2 (pro), the faster of the two at one token
    (``bench/results/decode/2026-11-30_decode_token_major_smem_h200.txt``); else as many unsplit CTAs as fit."""
    chunks = hidden // K_CHUNK
    gate_up = next(p for p in (4, 2, 1) if p == 1 or (chunks % p == 0 and chunks // p >= GATE_UP_MIN_PART_CHUNKS))
    if 4 * stage_bytes(topk, inter, 1) <= SMEM_BUDGET:
        down = (1, 4)
    elif 2 * stage_bytes(topk, inter, 2) <= SMEM_BUDGET and (inter // K_CHUNK) % 2 == 0 and 2 * topk <= MAX_TOPK:
        down = (2, 2)
    else:
        down = (1, max(SMEM_BUDGET // stage_bytes(topk, inter, 1), 1))
    return (gate_up, GATE_UP_CTAS_PER_SM) + down


def compile_kernels(hidden: int, inter: int, has_clamp: bool, topk: int, tuning: tuple | None = None,
                    x_order: str = "natural"):
    """The compiled (gate_up, down) pair for one static configuration (cached; compiles without a GPU under
    ``CUTE_DSL_ARCH=sm_90a``); token and expert counts stay runtime values, top-k is compiled into down. ``tuning``:
    ``default_tuning``'s fields (its choice when None), checked by ``check_tuning``."""
    from cutlass.cute.runtime import make_fake_stream

    tuning = default_tuning(hidden, inter, topk) if tuning is None else tuning
    check_tuning(hidden, inter, topk, tuning)
    split_gu, ctas_gu, split_dn, ctas_dn = tuning
    i32, i64, bf16, f32 = cutlass.Int32, cutlass.Int64, cutlass.BFloat16, cutlass.Float32
    gate_up = runtime.compiled(
        ("decode.token_major.gate_up", hidden, inter, has_clamp, x_order, split_gu, ctas_gu),
        lambda: cute.compile(GateUpSplit(hidden, inter, has_clamp, x_order, split_gu, ctas_gu), gmem_ptr(bf16),
                             gmem_ptr(i64), gmem_ptr(i32), gmem_ptr(i32), gmem_ptr(bf16), Int32(1), Int32(1), Int32(1),
                             Float32(0.0), make_fake_stream()))
    down = runtime.compiled(
        ("decode.token_major.down", hidden, inter, topk, split_dn, ctas_dn),
        lambda: cute.compile(DownSplit(hidden, inter, topk, split_dn, ctas_dn), gmem_ptr(bf16), gmem_ptr(i64),
                             gmem_ptr(f32), gmem_ptr(i32), gmem_ptr(i32), gmem_ptr(bf16), Int32(1), Int32(1),
                             make_fake_stream()))
    return gate_up, down


def check_tuning(hidden: int, inter: int, topk: int, tuning: tuple) -> None:
    """``tuning`` = (gate_up K parts, CTAs per SM, down K parts, CTAs per SM): gate_up's 1, 2 or 4 (dividing its CTA's
    warps) and dividing H / 128, down's dividing I / 128 within 1024 threads, its CTAs' shared memory within an SM's."""
    split_gu, ctas_gu, split_dn, ctas_dn = tuning
    if split_gu not in (1, 2, 4) or (hidden // K_CHUNK) % split_gu:
        fail("tuning[0]", f"gate_up K parts must be 1, 2 or 4 and divide H / 128 = {hidden // K_CHUNK}, got {split_gu}")
    if split_dn < 1 or (inter // K_CHUNK) % split_dn or topk * split_dn * WARP > 1024:
        fail("tuning[2]", f"down K parts must divide I / 128 = {inter // K_CHUNK} with top-k x parts <= 32 warps, "
             f"got {split_dn} (top-k {topk})")
    for name, v in (("tuning[1]", ctas_gu), ("tuning[3]", ctas_dn)):
        if not 1 <= v <= 16:
            fail(name, f"CTAs per SM must be 1..16, got {v}")
    if ctas_dn * stage_bytes(topk, inter, split_dn) > SMEM_BUDGET:
        fail("tuning[3]", f"{ctas_dn} down CTAs of {stage_bytes(topk, inter, split_dn)} bytes of shared memory exceed "
             f"an SM's {SMEM_BUDGET}")


def moe_decode_by_token(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: tuple, l2: tuple,
                         activation_clamp: float | None, y: torch.Tensor, tuning: tuple | None = None) -> torch.Tensor:
    """``api.moe_decode``'s path up to ``TOKEN_MAJOR_MAX_TOKENS`` tokens with both weights in the Mega MoE
    layout (inputs validated there; ``y`` bfloat16 ``[T, H]``). Allocates the ``a`` planes ``[2, T*k, I]`` BF16
    (caching allocator, no sync). ``tuning``: as ``compile_kernels`` takes it."""
    tokens, topk = topk_idx.shape
    hidden, inter = x.shape[1], l1[1].shape[2] // 2  # chunk-major scales [E, H/128, 2I]
    order = x_order_for(tokens)
    gate_up, down = compile_kernels(hidden, inter, activation_clamp is not None, topk, tuning, order)
    stream = runtime.current_stream()
    planes = run_planes_gate_up(gate_up, x, topk_idx, l1, activation_clamp, order, stream)
    i32, i64, bf16, f32 = cutlass.Int32, cutlass.Int64, cutlass.BFloat16, cutlass.Float32
    down(gmem_ptr(bf16, planes.data_ptr()), gmem_ptr(i64, topk_idx.data_ptr()), gmem_ptr(f32, topk_weights.data_ptr()),
         gmem_ptr(i32, l2[0].data_ptr()), gmem_ptr(i32, l2[1].data_ptr()), gmem_ptr(bf16, y.data_ptr()), tokens,
         l1[0].shape[0], stream)
    return y
