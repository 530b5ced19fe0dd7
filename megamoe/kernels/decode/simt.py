"""The per-pair SIMT decode kernels (sm_90a, CuTe DSL): canonical FP4 or FP8 weights, one (token, slot) pair per warp.

Organized around outputs instead of experts: no token permutation, no per-expert buffers, no shared memory, no
cross-warp synchronization; 8 independent warps per CTA. Every warp streams whole weight rows with 16-byte loads per
lane (consecutive lanes read consecutive 16 bytes, so a warp reads 512 contiguous bytes per load): lane l handles the
vectors l, l + 32, l + 64, ... of each row; the loop over a row is unrolled and the loads of all full rounds are
issued before any arithmetic (ptxas keeps about two rounds per row in flight per lane, no spills); a last partial
round (K / elements-per-vector not a multiple of 32) is predicated. Weight rows bypass L1 (``WEIGHT_LOAD``) so that
the activations, which many warps read, stay in L1; activations are read from their lane-interleaved copy
(``common.VectorFormat.interleaved_offset``).

* ``GateUp``: a warp owns one intermediate neuron ``i`` of one (token t, slot j) pair. It reads ``e = topk_idx[t,
  j]`` (ids outside ``[0, E)``, including -1, are masked: ``a = 0``), streams rows ``i`` (gate) and ``I + i`` (up) of
  ``W1[e]`` and ``x[t]`` (BF16, never quantized; interleaved by one gather, ``interleave_tokens``), decodes the
  weights to FP32 on the fly, accumulates both dot products in FP32, reduces across the warp with shuffles, applies
  the optional clamp and ``silu(gate) * up`` and writes ``a[t, j, i]`` (FP32, interleaved position). Warps are
  numbered pair-fastest, so the warps that read the same neuron of one expert for different tokens run together
  (their repeated rows hit L1/L2, not HBM). With FP4 L1 in the Mega MoE layout ``mma.GateUpMMA`` takes its place.
* ``Down``: a warp owns ``DOWN_ROWS_PER_WARP`` consecutive outputs ``y[t, h:h+R]``: it loops over the token's k slots
  (top-k is compiled in), streams rows ``h:h+R`` of ``W2[e]`` and ``a[t, j, :]`` (FP32, shared by the R rows),
  accumulates ``w_tj * dot`` in FP32 and writes ``y[t, h]`` as BF16 once. The slot loop is unrolled and
  software-pipelined: the weight loads of the next slots (as many as ``DOWN_LOAD_REGS`` registers hold) are in flight
  while one slot computes; when the pipeline is shorter than k, lane s first starts a bulk L2 prefetch of slot s's R
  rows. Masked slots load no weights and add 0 (branch-free).

Weight decode: E2M1 nibbles are moved by bit operations into E4M3 bytes (exact, times 2**-6, the factor folded into
the row's FP32 result: ``common.fp4x8``); E4M3 bytes widen exactly through ``cvt.rn.f16x2.e4m3x2`` and
``cvt.f32.f16``. Each lane multiplies its 16 or 32 products' partial sum by the block's UE8M0 scale once.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import torch
from cutlass import Float32, Int32, Int64, cute

from ...checks import check_multiple, fail
from ...layouts import PACKED_BLOCK_K
from .. import ptx, runtime
from .common import (
    ACT_LOAD,
    FORMATS,
    VEC_BYTES,
    VECTOR_FORMATS,
    WARP,
    WARPS_PER_CTA,
    WEIGHT_LOAD,
    GateUpLaunch,
    gmem_ptr,
    interleave_tokens,
    mma_tokens,
    swiglu,
    token_rows,
    warp_sum,
    x_order_for,
)
from .mma import GateUpMMA

DOWN_ROWS_PER_WARP = 2
"""Output elements y[t, h:h+R] per down warp; they share each lane's FP32 activation loads. More rows make fewer,
longer warps: 2 is the fastest at one token (``bench/results/decode/2026-11-30_decode_down_rows_t1_h200.txt``)."""
DOWN_LOAD_REGS = 64
"""Registers per lane the down kernel spends on weight words in flight (sets its slot pipeline depth)."""
DOWN_MIN_CTAS_PER_SM = 2
"""Launch bound of the down kernel: 2 CTAs of 8 warps per SM, up to 128 registers per lane (no spills with its slot
pipeline; faster than 3 CTAs per SM or no bound)."""
L1_LAYOUTS = ("canonical", "mega")
"""L1 weights ``compile_kernels`` takes: canonical (``GateUp``) or FP4 in the Mega MoE layout (``mma.GateUpMMA``)."""


# --------------------------------------------------------------------------------------------------
# gate_up


class GateUp(GateUpLaunch):
    """``a[t, j, i] = silu(g) * u`` for every (t, j, i); one warp per (i, pair), pairs fastest."""

    def __init__(self, hidden: int, inter: int, fmt: str, has_clamp: bool):
        self.hidden, self.inter, self.fmt, self.has_clamp = hidden, inter, VECTOR_FORMATS[fmt], has_clamp
        self.warps_per_pair, self.a_fmt, self.min_ctas = inter, self.fmt, 0

    @cute.kernel
    def kernel(self, x: cute.Pointer, idx: cute.Tensor, w: cute.Pointer, sf: cute.Pointer, a: cute.Tensor,
               experts: Int32, clamp: Float32):
        fmt, hidden, inter = self.fmt, self.hidden, self.inter
        vecs = fmt.vectors(hidden)
        full = vecs // WARP
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % WARP
        topk = idx.shape[1]
        pairs = idx.shape[0] * topk
        g = cute.arch.block_idx()[0] * WARPS_PER_CTA + tidx // WARP
        neuron = g // pairs
        pair = g - neuron * pairs
        if neuron < inter:
            t = pair // topk
            j = pair - t * topk
            e = idx[t, j]
            out = Float32(0.0)
            if (e >= 0) & (e < experts):
                gate_row = Int64(e) * (2 * inter) + neuron
                rows = (w.toint() + gate_row * fmt.row_bytes(hidden),
                        sf.toint() + gate_row * (hidden // PACKED_BLOCK_K * 4))
                x_row = x.toint() + Int64(t) * (fmt.interleaved_row(hidden) * 2)
                acc = cute.make_rmem_tensor((2,), Float32)
                acc.fill(0.0)
                self.full_rounds(acc, lane, rows, x_row)
                if cutlass.const_expr(vecs % WARP != 0):  # noqa: SIM102 (compile-time test, then the lane's)
                    if lane + full * WARP < vecs:
                        self.accumulate(acc, lane + full * WARP, self.load(rows, lane + full * WARP), rows, x_row)
                out = swiglu(warp_sum(acc[0]) * fmt.decode_bias, warp_sum(acc[1]) * fmt.decode_bias,
                             clamp, self.has_clamp)
            if lane == 0:
                a[t, j, fmt.interleaved_offset(neuron, 4)] = out

    def load(self, rows, vec) -> tuple:
        """Vector ``vec`` of the gate row and of the up row (``inter`` rows further)."""
        w_gate = rows[0] + Int64(vec) * VEC_BYTES
        return (ptx.ld_v4(w_gate, WEIGHT_LOAD),
                ptx.ld_v4(w_gate + self.inter * self.fmt.row_bytes(self.hidden), WEIGHT_LOAD))

    def full_rounds(self, acc, lane, rows, x_row):
        vecs = [lane + r * WARP for r in range(self.fmt.vectors(self.hidden) // WARP)]
        loaded = [self.load(rows, v) for v in vecs]
        for v, words in zip(vecs, loaded):
            self.accumulate(acc, v, words, rows, x_row)

    def accumulate(self, acc, vec, words, rows, x_row):
        """``acc[0] += scale_g * (gate . x)``, ``acc[1] += scale_u * (up . x)`` over vector ``vec``."""
        fmt = self.fmt
        xs = []
        for q in range(fmt.elems_per_vec // 8):
            chunk = x_row + Int64(fmt.interleaved_offset(vec * fmt.elems_per_vec + q * 8, 8)) * 2
            for word in ptx.ld_v4(chunk, ACT_LOAD):
                xs += ptx.bf16x2_to_f32x2(word)
        sf_up = rows[1] + self.inter * (self.hidden // PACKED_BLOCK_K * 4)
        for r, (row_words, sf_row) in enumerate(zip(words, (rows[1], sf_up))):
            vals = fmt.values(row_words)
            part = Float32(0.0)
            for n in range(fmt.elems_per_vec):
                part = ptx.fma(vals[n], xs[n], part)
            acc[r] = ptx.fma(part, fmt.scale(sf_row, vec), acc[r])


# --------------------------------------------------------------------------------------------------
# down


class _Slot(NamedTuple):
    """One (token, slot) of the down kernel: its R weight rows' and scale rows' addresses, 1 if the slot
    is valid else 0, and its routing weight times the decode bias (0 when masked)."""

    w_row: Int64
    sf_row: Int64
    on: Int32
    weight: Float32


class Down:
    """``y[t, h] = bf16(sum_j w_tj * a[t, j] . W2[e_j][h])``; one warp per (t, R rows), rows fastest.

    The slot loop is unrolled over the compile-time top-k and software-pipelined: the weight loads of
    the next ``depth`` slots are in flight while a slot computes (``depth`` from a register budget of
    ``DOWN_LOAD_REGS`` per lane), so a warp keeps several KiB of weight rows in flight instead of one
    slot's."""

    def __init__(self, hidden: int, inter: int, fmt: str, rows: int, topk: int):
        self.hidden, self.inter, self.fmt, self.rows, self.topk = hidden, inter, VECTOR_FORMATS[fmt], rows, topk
        rounds = -(-self.fmt.vectors(inter) // WARP)
        self.depth = max(1, min(topk, DOWN_LOAD_REGS // (4 * rounds * rows)))

    @cute.jit
    def __call__(self, a: cute.Pointer, idx: cute.Pointer, wts: cute.Pointer, w: cute.Pointer, sf: cute.Pointer,
                 y: cute.Pointer, tokens: Int32, experts: Int32, stream):
        idx_t, wts_t, y_t = token_rows(idx, wts, y, tokens, self.topk, self.hidden)
        grid = (tokens * (self.hidden // self.rows) + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(a, idx_t, wts_t, w, sf, y_t, experts).launch(
            grid=[grid, 1, 1], block=[WARPS_PER_CTA * WARP, 1, 1], stream=stream, smem=0,
            min_blocks_per_mp=DOWN_MIN_CTAS_PER_SM)

    @cute.kernel
    def kernel(self, a: cute.Pointer, idx: cute.Tensor, wts: cute.Tensor, w: cute.Pointer, sf: cute.Pointer,
               y: cute.Tensor, experts: Int32):
        fmt, hidden, inter, rows, topk = self.fmt, self.hidden, self.inter, self.rows, self.topk
        row_blocks = hidden // rows
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % WARP
        g = cute.arch.block_idx()[0] * WARPS_PER_CTA + tidx // WARP
        t = g // row_blocks
        h0 = (g - t * row_blocks) * rows
        if t < idx.shape[0]:
            acc = cute.make_rmem_tensor((rows,), Float32)
            acc.fill(0.0)
            dot = cute.make_rmem_tensor((rows,), Float32)
            slots = [self.slot(idx, wts, w, sf, t, j, h0, experts) for j in range(topk)]
            if cutlass.const_expr(self.depth < topk):
                # Lane s starts pulling slot s's R rows (contiguous) and their scales into L2, so the
                # slots beyond the load pipeline stream from HBM from the start too.
                for s in cutlass.range(lane, topk, WARP):
                    e = idx[t, s]
                    if (e >= 0) & (e < experts):
                        first = Int64(e) * hidden + h0
                        ptx.prefetch_bulk_l2(w.toint() + first * fmt.row_bytes(inter), rows * fmt.row_bytes(inter))
            loaded = [self.load_slot(slots[j], lane) for j in range(self.depth)]
            for j in cutlass.range_constexpr(topk):
                if cutlass.const_expr(j + self.depth < topk):
                    loaded.append(self.load_slot(slots[j + self.depth], lane))
                a_row = a.toint() + (Int64(t) * topk + j) * (fmt.interleaved_row(inter) * 4)
                dot.fill(0.0)
                for r, (v, words) in enumerate(loaded[j]):
                    if cutlass.const_expr(r * WARP + WARP <= fmt.vectors(inter)):
                        self.accumulate(dot, v, words, slots[j], a_row)
                    elif v < fmt.vectors(inter):  # last partial round: only lanes inside the row
                        self.accumulate(dot, v, words, slots[j], a_row)
                for r in cutlass.range_constexpr(rows):
                    acc[r] = ptx.fma(slots[j].weight, dot[r], acc[r])
            for r in cutlass.range_constexpr(rows):
                total = warp_sum(acc[r])
                if lane == r:
                    y[t, h0 + r] = total.to(cutlass.BFloat16)

    def slot(self, idx, wts, w, sf, t, j, h0, experts) -> _Slot:
        """Slot ``j`` of token ``t``; a masked slot points at expert 0 and loads nothing."""
        e = idx[t, j]
        valid = (e >= 0) & (e < experts)
        first = Int64(cutlass.select_(valid, e, Int64(0))) * self.hidden + h0
        return _Slot(w.toint() + first * self.fmt.row_bytes(self.inter),
                     sf.toint() + first * (self.inter // PACKED_BLOCK_K * 4),
                     Int32(cutlass.select_(valid, Int32(1), Int32(0))),
                     Float32(cutlass.select_(valid, wts[t, j] * self.fmt.decode_bias, Float32(0.0))))

    def load_slot(self, slot, lane) -> list:
        """The lane's weight vectors of the R rows of one slot: [(vector, [words of each row])]."""
        vecs = self.fmt.vectors(self.inter)
        out = []
        for r in range(-(-vecs // WARP)):
            vec = lane + r * WARP
            on = slot.on
            if r * WARP + WARP > vecs:  # last partial round: lanes past the row load nothing
                on = on & Int32(cutlass.select_(vec < vecs, Int32(1), Int32(0)))
            out.append((vec, [ptx.ld_v4_if(slot.w_row + i * self.fmt.row_bytes(self.inter) + Int64(vec) * VEC_BYTES,
                                           on, WEIGHT_LOAD)
                              for i in range(self.rows)]))
        return out

    def accumulate(self, dot, vec, words, slot, a_row):
        """``dot[r] += scale_r * (w_r . a)`` over vector ``vec`` of the R rows (zero words add 0)."""
        fmt = self.fmt
        av = []
        for q in range(fmt.elems_per_vec // 4):  # lane-interleaved rows: each chunk load is warp-coalesced
            chunk = a_row + Int64(fmt.interleaved_offset(vec * fmt.elems_per_vec + q * 4, 4)) * 4
            av += ptx.ld_v4(chunk, ACT_LOAD, True)
        sf_row_bytes = self.inter // PACKED_BLOCK_K * 4
        for r, row_words in enumerate(words):
            vals = fmt.values(row_words)
            part = Float32(0.0)
            for n in range(fmt.elems_per_vec):
                part = ptx.fma(vals[n], av[n], part)
            dot[r] = ptx.fma(part, fmt.scale(slot.sf_row + r * sf_row_bytes, vec), dot[r])


# --------------------------------------------------------------------------------------------------
# Host side


def compile_kernels(hidden: int, inter: int, weight_format: str, has_clamp: bool, topk: int,
                    down_rows: int = DOWN_ROWS_PER_WARP, l1_layout: str = "canonical", x_order: str = "natural"):
    """The compiled (gate_up, down) pair for one static configuration (cached; works without a GPU
    under ``CUTE_DSL_ARCH=sm_90a``). Token and expert counts stay runtime values; top-k is compiled into
    the down kernel (its slot loop is unrolled). ``l1_layout``: ``"canonical"`` (``GateUp``) or ``"mega"``
    (FP4 L1 in the Mega MoE layout, ``mma.GateUpMMA``, reading ``x`` in ``x_order``: ``common.x_order_for``)."""
    from cutlass.cute.runtime import make_fake_stream

    if weight_format not in FORMATS:
        fail("weight_format", f"must be one of {FORMATS}, got {weight_format!r}")
    for name, k in (("hidden", hidden), ("inter", inter)):
        check_multiple(name, k, PACKED_BLOCK_K, "whole 16-byte vectors and packed UE8M0 scale words")
    check_multiple("hidden", hidden, down_rows, "down rows per warp")
    if l1_layout not in L1_LAYOUTS or (l1_layout == "mega" and weight_format != "fp4"):
        fail("l1_layout",
             f"must be one of {L1_LAYOUTS} ('mega' with FP4 weights), got {l1_layout!r} with {weight_format}")

    u8, i32, f32 = cutlass.Uint8, cutlass.Int32, cutlass.Float32
    sizes = (Int32(1), Int32(1), Int32(1))  # tokens, top-k, experts: runtime values of gate_up

    def build_gate_up():
        kernel = (GateUpMMA(hidden, inter, weight_format, has_clamp, x_order) if l1_layout == "mega"
                  else GateUp(hidden, inter, weight_format, has_clamp))
        return cute.compile(
            kernel, gmem_ptr(cutlass.BFloat16), gmem_ptr(cutlass.Int64), gmem_ptr(u8),
            gmem_ptr(i32), gmem_ptr(f32), *sizes, Float32(0.0), make_fake_stream(),
        )

    def build_down():
        return cute.compile(
            Down(hidden, inter, weight_format, down_rows, topk), gmem_ptr(f32), gmem_ptr(cutlass.Int64), gmem_ptr(f32),
            gmem_ptr(u8), gmem_ptr(i32), gmem_ptr(cutlass.BFloat16), Int32(1), Int32(1), make_fake_stream(),
        )

    mma_x = x_order if l1_layout == "mega" else None  # GateUp reads its own interleaved copy
    gate_up = runtime.compiled(("decode.simt.gate_up", hidden, inter, weight_format, has_clamp, l1_layout, mma_x),
                               build_gate_up)
    down = runtime.compiled(("decode.simt.down", hidden, inter, weight_format, down_rows, topk), build_down)
    return gate_up, down


def moe_decode_by_pair(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: tuple, l2: tuple,
                       activation_clamp: float | None, y: torch.Tensor, weight_format: str, l1_layout: str,
                       down_rows: int = DOWN_ROWS_PER_WARP) -> torch.Tensor:
    """The per-pair path of ``api.moe_decode`` (inputs validated there): canonical L2 in ``weight_format``, L1
    canonical or (FP4) in the Mega MoE layout (``l1_layout``); ``y`` bfloat16 ``[T, H]``. Allocates ``a`` FP32 ``[T,
    k, Ip]`` (interleaved rows; caching allocator, no sync)."""
    tokens, topk = topk_idx.shape
    hidden, inter = x.shape[1], l2[0].shape[2] * (2 if weight_format == "fp4" else 1)
    order = x_order_for(tokens)
    gate_up, down = compile_kernels(hidden, inter, weight_format, activation_clamp is not None, topk, down_rows,
                                    l1_layout, order)
    a = torch.empty(tokens, topk, VECTOR_FORMATS[weight_format].interleaved_row(inter), dtype=torch.float32,
                    device=x.device)
    experts = l1[0].shape[0]
    stream = runtime.current_stream()
    clamp = 0.0 if activation_clamp is None else float(activation_clamp)
    u8, i32, f32 = cutlass.Uint8, cutlass.Int32, cutlass.Float32
    idx, a_ptr = gmem_ptr(cutlass.Int64, topk_idx.data_ptr()), gmem_ptr(f32, a.data_ptr())
    xi = mma_tokens(x, order) if l1_layout == "mega" else interleave_tokens(x, weight_format)
    gate_up(gmem_ptr(cutlass.BFloat16, xi.data_ptr()), idx, gmem_ptr(u8, l1[0].data_ptr()),
            gmem_ptr(i32, l1[1].data_ptr()), a_ptr, tokens, topk, experts, clamp, stream)
    down(a_ptr, idx, gmem_ptr(f32, topk_weights.data_ptr()), gmem_ptr(u8, l2[0].data_ptr()),
         gmem_ptr(i32, l2[1].data_ptr()), gmem_ptr(cutlass.BFloat16, y.data_ptr()), tokens, experts, stream)
    return y
