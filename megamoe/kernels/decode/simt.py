"""Warp-decode MoE for small batches on one GPU holding every expert's weights (sm_90a, CuTe DSL).

The kernels are organized around outputs instead of experts: no token permutation, no
per-expert buffers, no shared memory, no cross-warp synchronization; 8 independent warps per CTA.
Every warp streams whole weight rows with 16-byte loads per lane (consecutive lanes read consecutive
16 bytes, so a warp reads 512 contiguous bytes per load); the per-lane loop over a row is fully
unrolled and its weight loads are issued before the arithmetic (ptxas keeps about two rounds of
vectors per row in flight per lane, no spills). Weight rows bypass L1
(``L1::no_allocate``, with a 256-byte L2 prefetch hint) so that the activations, which many warps
read, stay in L1.

Activations are read from a lane-interleaved copy (``_Format.interleaved_offset``): the 16-byte chunk q
of lane l's vector of round r sits at ``(r * chunks + q) * 32 + l``, so each activation load of a warp
is 512 contiguous bytes. In the natural layout every lane reads its own 64- or 128-byte span, and each
warp-wide load touches 16-32 cache lines: the L1 wavefronts of those loads, not HBM, bounded the
down kernel (ncu, H200: L1 80-86% busy, DRAM 16%).

* ``gate_up``: a warp owns one intermediate neuron ``i`` of one (token t, slot j) pair. It reads
  ``e = topk_idx[t, j]`` (ids outside ``[0, E)``, including -1, are masked: ``a = 0``), streams rows
  ``i`` (gate) and ``I + i`` (up) of ``W1[e]`` and ``x[t]`` (BF16, never quantized; interleaved by
  one gather, ``interleave_tokens``), decodes the weights to FP32 on the fly, accumulates both dot
  products in FP32, reduces across the warp with shuffles, applies the optional clamp and
  ``silu(gate) * up`` and writes ``a[t, j, i]`` (FP32, interleaved position). ``_GateUpMMA`` is the
  same step on tensor cores for FP4 L1 in the Mega MoE layout: a warp owns 8 neurons (16 rows, one
  ``mma.m16n8k16`` M side), exact BF16 weight decode, FP32 tensor-core sums; up to ``NATURAL_X_MAX_TOKENS``
  tokens it reads ``x`` itself, above it an MMA-ordered copy.
  Warps are numbered pair-fastest, so the warps that read the same neuron of one expert for
  different tokens run together (their repeated rows hit L1/L2, not HBM).
* ``down``: a warp owns ``DOWN_ROWS_PER_WARP`` consecutive outputs ``y[t, h:h+R]``: it loops over the
  token's k slots (top-k is compiled in), streams rows ``h:h+R`` of ``W2[e]`` and ``a[t, j, :]``
  (FP32, shared by the R rows), accumulates ``w_tj * dot`` in FP32 and writes ``y[t, h]`` as BF16
  once. The slot loop is unrolled and software-pipelined: the weight loads of the next slots (as
  many as ``DOWN_LOAD_REGS`` registers hold) are in flight while one slot computes; when the pipeline
  is shorter than k, lane s first starts a bulk L2 prefetch of slot s's R rows. Masked slots load no
  weights and add 0 (branch-free).

Numerics (BF16-activation decode path, not the FP8 contract of ``megamoe.numerics``): with ``W1``,
``W2`` dequantized exactly, ``g, u = x . W1[e]^T`` in FP32; ``g = min(g, c)``, ``u = clamp(u, -c, c)``
with the optional clamp ``c``; ``a = silu(g) * u`` in FP32 (``silu(g) = g / (1 + exp(-g))``, exp
approximate to a few ulps); ``y[t] = bf16_rne(sum_j w_tj * (a_j . W2[e_j]^T))`` in FP32, summation
order the kernels'. The only rounding beyond FP32 is the final BF16.

Weight decode: E2M1 nibbles are moved by bit operations into E4M3 bytes (exact, times 2**-6, the
factor folded into the row's FP32 result); E4M3 bytes widen exactly through ``cvt.rn.f16x2.e4m3x2``
and ``cvt.f32.f16``. Each lane multiplies its 16 or 32 products' partial sum by the block's UE8M0
scale once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import torch
from cutlass import Float32, Int32, Int64, cute
from cutlass._mlir.dialects import math as mlir_math
from cutlass.cutlass_dsl import T, dsl_user_op

from ...checks import check_multiple, check_range, check_tensor, fail
from ...layouts import PACKED_BLOCK_K
from ...layouts.weights import check_chunk_major_scales
from ...numerics import check_activation_clamp
from .. import ptx, runtime
from .. import dequant
from ..weight_layout import BF16_ACC_SHIFT, BF16_WORDS, CHUNK_BYTES, K_CHUNK, ROW_BLOCK

WARPS_PER_CTA = 8
"""Warps per CTA of the kernels (256 threads) but ``_GateUpMMA``; every warp works alone."""
DOWN_ROWS_PER_WARP = 2
"""Output elements y[t, h:h+R] per down warp; they share each lane's FP32 activation loads. Re-checked at one token
(H200, 2026-11-30, ``bench/results/decode/2026-11-30_decode_down_rows_t1_h200.txt``, MoEDecoder's path): R = 2 flash 31.4-32.4
us, pro 77.3-79.8; R = 4 42.6-43.5 and 101.7-102.9; R = 8 66.6-71.7 and 192.0-192.2 (fewer, longer warps)."""
DOWN_LOAD_REGS = 64
"""Registers per lane the down kernel spends on weight words in flight (sets its slot pipeline depth)."""
DOWN_MIN_CTAS_PER_SM = 2
"""Launch bound of the down kernel: 2 CTAs of 8 warps per SM, up to 128 registers per lane (no spills with
its slot pipeline; H200 sweep 2026-11-29: 2-8% faster than 3 CTAs with 32-64 load registers or no bound)."""
VEC_BYTES = 16
"""Bytes of weights each lane loads per vector (one ``ld.global.v4``)."""
WARP = 32
FP4_DECODE_BIAS = 2.0**6
"""The FP4 decode yields E2M1 values times 2**-6 (see ``_fp4x8``)."""
FORMATS = ("fp4", "fp8")
L1_LAYOUTS = ("canonical", "mega")
GATE_UP_MMA_DEPTH = 4
"""K chunks of weights (10 registers each) ``_GateUpMMA`` keeps in flight per lane (H200 sweep 2026-11-29:
depth 3-4 with 3 CTAs per SM fastest; depth 6 spills or drops to 2 CTAs per SM)."""
GATE_UP_MMA_WARPS_PER_CTA = 4
"""Warps per CTA of ``_GateUpMMA``: its warps are long (a whole K of 16 rows each) and few (8 neurons of a pair
each: 1536 at one token of flash, 192 CTAs of 8 warps on 132 SMs left 60 SMs with 16 warps, 72 with 8), so smaller
CTAs spread them more evenly. MoEDecoder at one token, H200, two alternated rounds (2026-11-30,
``bench/results/decode/2026-11-30_decode_gate_up_cta_ab_h200.json``): flash 32 / 128 experts 36.9-38.2 vs 37.9-39.2 us,
pro 48 / 192 86.1-86.8 vs 87.4-87.7 us (1-3% faster, every row checked)."""
GATE_UP_MMA_MIN_CTAS_PER_SM = 6
"""Launch bound of ``_GateUpMMA``: 6 CTAs of 4 warps per SM (80 registers, no spills at depth 4)."""
NATURAL_X_MAX_TOKENS = 8
"""Largest batch for which the tensor-core gate_ups read ``x`` in its natural order (``_ld_natural_chunk``, 16 4-byte
loads per chunk); larger batches gather it into MMA order first (``interleave_tokens(x, "mma")``, 4 16-byte loads
per chunk). The gather kernel costs 4.6-4.9 us per call; the natural loads cost instructions and, expert-major, L1
wavefronts (8 token rows per load). H200, 2026-11-30, all checked
(``bench/results/decode/2026-11-30_decode_natural_x_pdl_ab_h200.json``): natural vs gathered, one token (MoEDecoder) flash
31.5-31.9 vs 36.6-37.5 us, pro 77.5-81.9 vs 86.3-88.4; expert-major T = 2-8 1-4 us faster or equal; at T = 16-64
expert-major 6-40% slower (flash 32 experts 153.4 / 240.5 / 453.9 vs 135.2 / 180.7 / 323.0 us at 16 / 32 / 64
tokens)."""


# --------------------------------------------------------------------------------------------------
# PTX helpers


def _asm(results: list, args: list, text: str, constraints: str, loc=None, ip=None) -> list:
    """One pure inline-PTX block; returns its result values (i32 or f32 ``ir.Value``s)."""
    return ptx.inline_asm(results, args, text, constraints, loc, ip, side_effects=False)


WEIGHT_LOAD = ".nc.L1::no_allocate.L2::256B"
"""Weight rows: read-only path, not kept in L1 (the activations, read by many warps, stay there), 256-byte
L2 prefetch."""
ACT_LOAD = ".nc"
"""Activations: read-only path, kept in L1 (other warps read them too)."""


@dsl_user_op
def _ld16(addr: Int64, cache: str, floats: bool = False, *, loc=None, ip=None) -> list:
    """16 bytes at ``addr`` (``ld.global{cache}.v4``) as 4 words, or 4 floats when ``floats``."""
    ty, reg, kind, cls = (T.f32(), "f", "f32", Float32) if floats else (T.i32(), "r", "b32", Int32)
    vals = _asm([ty] * 4, [Int64(addr).ir_value(loc=loc, ip=ip)],
                f"ld.global{cache}.v4.{kind} {{$0, $1, $2, $3}}, [$4];", ",".join([f"={reg}"] * 4 + ["l"]), loc, ip)
    return [cls(v) for v in vals]


@dsl_user_op
def _ld_weights_if(addr: Int64, on: Int32, *, loc=None, ip=None) -> list:
    """A ``WEIGHT_LOAD`` of 16 bytes when ``on`` is nonzero, else four zero words (no memory access, no branch)."""
    text = (
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        f"@p ld.global{WEIGHT_LOAD}.v4.b32 {{$0, $1, $2, $3}}, [$4];\n}}"
    )
    args = [Int64(addr).ir_value(loc=loc, ip=ip), Int32(on).ir_value(loc=loc, ip=ip)]
    return [Int32(v) for v in _asm([T.i32()] * 4, args, text, "=r,=r,=r,=r,l,r", loc, ip)]


@dsl_user_op
def _prefetch_l2(addr: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """Start fetching ``nbytes`` (a multiple of 16, 16-byte aligned) at ``addr`` into L2; no registers, no wait."""
    ptx.inline_asm([], [Int64(addr).ir_value(loc=loc, ip=ip)], f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};", "l",
                   loc, ip, side_effects=True)


def _ld_mma_chunk(addr: Int64) -> list:
    """The lane's 16 words of one 128-wide chunk of an MMA-ordered bf16 row (kept in L1): 16 bytes at each of
    ``addr + 64 j``, j = 0..3 (``addr`` = chunk start + 16 q), so the 4 lanes of a column read 64 contiguous
    bytes per load."""
    return [word for j in range(4) for word in _ld16(addr + j * 64, ACT_LOAD)]


@dsl_user_op
def _ld16_shared(addr: Int32, *, loc=None, ip=None) -> list:
    """16 bytes at the shared-memory address ``addr`` as 4 words; volatile, so it stays after the copy's wait."""
    vals = ptx.inline_asm([T.i32()] * 4, [Int32(addr).ir_value(loc=loc, ip=ip)],
                          "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip, side_effects=True)
    return [Int32(v) for v in vals]


def _ld_mma_chunk_shared(addr: Int32) -> list:
    """``_ld_mma_chunk`` from a copy of the row in shared memory (``addr`` = chunk start + 16 q)."""
    return [word for j in range(4) for word in _ld16_shared(addr + j * 64)]


def _ld_natural_chunk(addr: Int64) -> list:
    """The lane's 16 words of one 128-wide chunk of a bf16 row in its natural order, in fragment order (those
    ``_ld_mma_chunk`` reads from the MMA-ordered copy): word j (elements ``16 j + 2 q``, ``+ 1`` of the chunk, see
    ``mma_position``) at ``addr + 16 j`` (``addr`` = chunk start + 4 q), so the 4 lanes of a column read 16
    contiguous bytes per load and no copy of the row is made."""
    return [_ld_word(addr + 16 * j) for j in range(16)]


@dsl_user_op
def _ld_word(addr: Int64, *, loc=None, ip=None) -> Int32:
    """One 32-bit word (packed scales) through the read-only path."""
    return Int32(_asm([T.i32()], [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.b32 $0, [$1];", "=r,l", loc, ip)[0])


@dsl_user_op
def _ue8m0_scale(packed: Int32, shift: Int32, *, loc=None, ip=None) -> Float32:
    """The FP32 scale ``2**(c - 127)`` of the UE8M0 code ``c = (packed >> shift) & 0xFF`` (exact, c = 0 too)."""
    text = (
        "{\n.reg .b32 c, f;\n.reg .pred z;\n"
        "shr.u32 c, $1, $2;\nand.b32 c, c, 255;\nsetp.eq.u32 z, c, 0;\nshl.b32 f, c, 23;\n"
        "selp.b32 f, 4194304, f, z;\nmov.b32 $0, f;\n}"
    )
    args = [Int32(packed).ir_value(loc=loc, ip=ip), Int32(shift).ir_value(loc=loc, ip=ip)]
    return Float32(_asm([T.f32()], args, text, "=f,r,r", loc, ip)[0])


def _e4m3x2_to_f32(src: str, lo: int, hi: int) -> str:
    """PTX: the two E4M3 bytes of the b16 register ``src`` -> FP32 outputs ``$lo``, ``$hi`` (exact, via f16x2)."""
    return f"cvt.rn.f16x2.e4m3x2 p, {src};\nmov.b32 {{l, h}}, p;\ncvt.f32.f16 ${lo}, l;\ncvt.f32.f16 ${hi}, h;\n"


_FP4_DECODE = """{
.reg .b32 a, b, t, p;
.reg .b16 a0, a1, b0, b1, l, h;
shl.b32 t, $8, 2;
and.b32 a, t, 0x1C1C1C1C;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
or.b32 a, a, t;
shr.u32 t, $8, 2;
and.b32 b, t, 0x1C1C1C1C;
and.b32 t, $8, 0x80808080;
or.b32 b, b, t;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
""" + "".join(_e4m3x2_to_f32(*r) for r in (("a0", 0, 2), ("a1", 4, 6), ("b0", 1, 3), ("b1", 5, 7))) + "}"


@dsl_user_op
def _fp4x8(word: Int32, *, loc=None, ip=None) -> list:
    """8 E2M1 codes (element 2j in the low nibble of byte j) -> 8 FP32 values times 2**-6, in order.

    Each nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 00 e1 e0 m 00`` (E2M1's value times 2**-6,
    its subnormal 0.5 an E4M3 subnormal), which ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16`` widen exactly.
    """
    vals = _asm([T.f32()] * 8, [Int32(word).ir_value(loc=loc, ip=ip)], _FP4_DECODE, ",".join(["=f"] * 8 + ["r"]), loc, ip)
    return [Float32(v) for v in vals]


@dsl_user_op
def _fp8x4(word: Int32, *, loc=None, ip=None) -> list:
    """4 E4M3 bytes (little-endian) -> 4 FP32 values (exact), in order."""
    text = (
        "{\n.reg .b16 b0, b1, l, h;\n.reg .b32 p;\nmov.b32 {b0, b1}, $4;\n"
        + _e4m3x2_to_f32("b0", 0, 1) + _e4m3x2_to_f32("b1", 2, 3) + "}"
    )
    vals = _asm([T.f32()] * 4, [Int32(word).ir_value(loc=loc, ip=ip)], text, "=f,=f,=f,=f,r", loc, ip)
    return [Float32(v) for v in vals]


@dsl_user_op
def _bf16x2(word: Int32, *, loc=None, ip=None) -> list:
    """Two BF16 (low half first) -> two FP32 (exact)."""
    text = "{\n.reg .b32 t;\nshl.b32 t, $2, 16;\nmov.b32 $0, t;\nand.b32 t, $2, 0xFFFF0000;\nmov.b32 $1, t;\n}"
    vals = _asm([T.f32()] * 2, [Int32(word).ir_value(loc=loc, ip=ip)], text, "=f,=f,r", loc, ip)
    return [Float32(v) for v in vals]


@dsl_user_op
def _fma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` with one rounding."""
    return Float32(mlir_math.fma(
        Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip), Float32(c).ir_value(loc=loc, ip=ip),
        loc=loc, ip=ip,
    ))


def _warp_sum(v: Float32) -> Float32:
    """Sum over the 32 lanes (butterfly shuffles; every lane gets the total)."""
    for offset in (16, 8, 4, 2, 1):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=offset)
    return v


@cute.jit
def _swiglu(gate: Float32, up: Float32, clamp: Float32, has_clamp: cutlass.Constexpr[bool]) -> Float32:
    """``silu(min(gate, c)) * clamp(up, -c, c)`` (no clamp when ``has_clamp`` is False), FP32."""
    if cutlass.const_expr(has_clamp):
        gate = cutlass.min(gate, clamp)
        up = cutlass.max(cutlass.min(up, clamp), -clamp)
    return gate / (Float32(1.0) + cute.math.exp(-gate, fastmath=True)) * up


@dsl_user_op
def _mma_bf16(acc: list, a: list, b: list, *, loc=None, ip=None) -> list:
    """``mma.sync.m16n8k16`` BF16 x BF16 + FP32: ``acc`` 4 floats, ``a`` 4 and ``b`` 2 bf16x2 words
    (the PTX fragment order)."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in acc] + [Int32(v).ir_value(loc=loc, ip=ip) for v in a + b]
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$8, $9, $10, $11}, "
            "{$12, $13}, {$4, $5, $6, $7};")
    vals = _asm([T.f32()] * 4, args, text, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r", loc, ip)
    return [Float32(v) for v in vals]


@dataclass(frozen=True)
class _Format:
    """How one weight format maps onto a lane's 16-byte vector of a row of K elements."""

    name: str
    elems_per_vec: int  # weight elements in 16 bytes
    decode_bias: float  # the decoded values are the weights divided by this

    def vectors(self, k: int) -> int:
        return k // self.elems_per_vec

    def row_bytes(self, k: int) -> int:
        return self.vectors(k) * VEC_BYTES

    def values(self, words: list) -> list:
        """The lane's 16 weight bytes -> FP32 values divided by ``decode_bias``, in element order."""
        out = []
        for w in words:
            out += _fp4x8(w) if self.name == "fp4" else _fp8x4(w)
        return out

    def interleaved_row(self, k: int) -> int:
        """Elements per row of the lane-interleaved activation layout (whole rounds of 32 vectors)."""
        return -(-self.vectors(k) // WARP) * WARP * self.elems_per_vec

    def interleaved_offset(self, i, per_chunk: int):
        """Position of element ``i`` of a row in the lane-interleaved layout with 16-byte chunks of
        ``per_chunk`` elements: chunk ``q`` of vector ``v = 32 r + l`` (the lane-l vector of round r)
        starts at ``((r * chunks + q) * 32 + l) * per_chunk``, so the 32 lanes' loads of one chunk read
        512 contiguous bytes (4 L1 wavefronts; 32 in the natural layout). Python or DSL integers."""
        v, e = i // self.elems_per_vec, i % self.elems_per_vec
        chunks = self.elems_per_vec // per_chunk
        return (((v >> 5) * chunks + e // per_chunk) * WARP + (v & (WARP - 1))) * per_chunk + e % per_chunk

    def scale(self, sf_row: Int64, vec: Int32) -> Float32:
        """Scale of the block holding vector ``vec`` of a row (FP4: one block per vector; FP8: half)."""
        block = vec if self.name == "fp4" else vec >> 1
        packed = _ld_word(sf_row + Int64(block >> 2) * 4)
        return _ue8m0_scale(packed, (block & 3) * 8)


_FMT = {"fp4": _Format("fp4", 32, 2.0**6), "fp8": _Format("fp8", 16, 1.0)}


# --------------------------------------------------------------------------------------------------
# Kernels
#
# Lane l of a warp handles the vectors l, l + 32, l + 64, ... of each row it streams. The loads of
# all full rounds of vectors are issued before any arithmetic, so each lane keeps the whole row
# slice in flight; a last partial round (K / elements-per-vector not a multiple of 32) is predicated.


class _GateUpLaunch:
    """The launch both gate_up kernels share: ``warps_per_pair`` warps per (token, slot) pair, ``a``
    written in the down kernel's interleaved layout ``a_fmt``, ``min_ctas`` CTAs per SM (0: no bound)."""

    warps_per_pair: int
    a_fmt: _Format
    min_ctas: int
    warps_per_cta: int = WARPS_PER_CTA

    @cute.jit
    def __call__(self, x: cute.Pointer, idx: cute.Pointer, w: cute.Pointer, sf: cute.Pointer, a: cute.Pointer,
                 tokens: Int32, topk: Int32, experts: Int32, clamp: Float32, stream):
        idx_t = slots_view(idx, tokens, topk)
        row = self.a_fmt.interleaved_row(self.inter)
        a_t = cute.make_tensor(a, cute.make_layout((tokens, topk, row), stride=(topk * row, row, 1)))
        grid = (tokens * topk * self.warps_per_pair + self.warps_per_cta - 1) // self.warps_per_cta
        self.kernel(x, idx_t, w, sf, a_t, experts, clamp).launch(
            grid=[grid, 1, 1], block=[self.warps_per_cta * WARP, 1, 1], stream=stream, smem=0,
            min_blocks_per_mp=self.min_ctas)


class _GateUp(_GateUpLaunch):
    """``a[t, j, i] = silu(g) * u`` for every (t, j, i); one warp per (i, pair), pairs fastest."""

    def __init__(self, hidden: int, inter: int, fmt: str, has_clamp: bool):
        self.hidden, self.inter, self.fmt, self.has_clamp = hidden, inter, _FMT[fmt], has_clamp
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
                out = _swiglu(_warp_sum(acc[0]) * fmt.decode_bias, _warp_sum(acc[1]) * fmt.decode_bias,
                              clamp, self.has_clamp)
            if lane == 0:
                a[t, j, fmt.interleaved_offset(neuron, 4)] = out

    def load(self, rows, vec) -> tuple:
        """Vector ``vec`` of the gate row and of the up row (``inter`` rows further)."""
        w_gate = rows[0] + Int64(vec) * VEC_BYTES
        return _ld16(w_gate, WEIGHT_LOAD), _ld16(w_gate + self.inter * self.fmt.row_bytes(self.hidden), WEIGHT_LOAD)

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
            for word in _ld16(x_row + Int64(fmt.interleaved_offset(vec * fmt.elems_per_vec + q * 8, 8)) * 2, ACT_LOAD):
                xs += _bf16x2(word)
        sf_up = rows[1] + self.inter * (self.hidden // PACKED_BLOCK_K * 4)
        for r, (row_words, sf_row) in enumerate(zip(words, (rows[1], sf_up))):
            vals = fmt.values(row_words)
            part = Float32(0.0)
            for n in range(fmt.elems_per_vec):
                part = _fma(vals[n], xs[n], part)
            acc[r] = _fma(part, fmt.scale(sf_row, vec), acc[r])


class _GateUpMMA(_GateUpLaunch):
    """``gate_up`` on tensor cores, for FP4 L1 weights in the Mega MoE layout (``transform_weights_for_mega_moe``:
    rows interleaved gate/up in runs of 8, BF16-mode SM90 layout ``int32 [E, 2I/64, H/128, 64, 16]``).

    A warp owns 8 neurons ``i0..i0+7`` of one (token, slot) pair: the 16 consecutive kernel-layout rows
    ``2*i0 .. 2*i0+15`` (gate rows of the 8 neurons, then their up rows) are the M = 16 rows of
    ``mma.m16n8k16``; the token's activations are column 0 of the N = 8 side (the other columns carry
    the same values and are ignored). Lane ``(g, q) = (lane / 4, lane % 4)`` loads, per 128-wide K chunk,
    its 16-byte segment q of rows g and g + 8 and decodes them (``decode_e2m1x8_bf16``: E2M1 x UE8M0
    scale -> BF16, exact, times ``2**-BF16_ACC_SHIFT``) straight into the A fragment; it reads the
    activations of its K positions from ``x`` itself up to ``NATURAL_X_MAX_TOKENS`` tokens (``_ld_natural_chunk``:
    16 4-byte loads per chunk), above it from the MMA-ordered copy ``interleave_tokens(x, "mma")`` (4 16-byte loads).
    Products are exact, sums FP32 (tensor-core accumulation). Lanes with q = 0 end with the gate and up
    sums of neuron ``i0 + g`` and write ``a``. The weight loads of the next ``GATE_UP_MMA_DEPTH`` chunks are
    in flight while one chunk computes. Versus ``_GateUp``, the FMAs and the FP32 widening of the
    weights leave the SIMT pipes (about 2.4 instead of 4 instructions per weight), but a warp streams 16
    rows instead of 2, so there are 8x fewer, longer warps. Whole layer, H200, top-6 (2026-11-29): flash
    1-14% faster than with ``_GateUp`` at every T; pro 4-18% slower at T <= 2, within 2% at T = 4, 1-16%
    faster at T >= 8. ``MoEDecoder`` runs the token- and expert-major kernels (both weights in the Mega MoE
    layout); this kernel stays the gate_up of ``moe_decode`` with Mega MoE L1 and canonical L2."""

    def __init__(self, hidden: int, inter: int, down_fmt: str, has_clamp: bool, x_order: str):
        self.hidden, self.inter, self.has_clamp, self.x_order = hidden, inter, has_clamp, x_order
        self.warps_per_pair, self.a_fmt, self.min_ctas = inter // 8, _FMT[down_fmt], GATE_UP_MMA_MIN_CTAS_PER_SM
        self.warps_per_cta = GATE_UP_MMA_WARPS_PER_CTA

    @cute.kernel
    def kernel(self, x: cute.Pointer, idx: cute.Tensor, w: cute.Pointer, sf: cute.Pointer, a: cute.Tensor,
               experts: Int32, clamp: Float32):
        hidden, inter = self.hidden, self.inter
        tidx = cute.arch.thread_idx()[0]
        lane = tidx % WARP
        gl, q = lane // 4, lane % 4
        topk = idx.shape[1]
        pairs = idx.shape[0] * topk
        warp = cute.arch.block_idx()[0] * self.warps_per_cta + tidx // WARP
        block = warp // pairs
        pair = warp - block * pairs
        if block < inter // 8:
            t = pair // topk
            j = pair - t * topk
            e = idx[t, j]
            out = Float32(0.0)
            if (e >= 0) & (e < experts):
                rows = mma_rows(w, sf, e, Int64(block) * 16, 2 * inter, hidden, lane)
                lane_x = b_lane(x.toint() + Int64(t) * (hidden * 2), q, self.x_order)
                acc = mma_stream(rows, hidden, [lane_x], b_order=self.x_order)
                gate = (acc[0] + acc[4]) * Float32(2.0**BF16_ACC_SHIFT)
                up = (acc[2] + acc[6]) * Float32(2.0**BF16_ACC_SHIFT)
                out = _swiglu(gate, up, clamp, self.has_clamp)
            if q == 0:
                a[t, j, self.a_fmt.interleaved_offset(block * 8 + gl, 4)] = out


def mma_rows(w: cute.Pointer, sf: cute.Pointer, e, first_row: Int64, n: int, k: int, lane) -> tuple:
    """Lane addresses for the 16 kernel-layout rows ``first_row .. first_row + 15`` (``first_row`` a multiple
    of 16: one row block) of expert ``e`` of a BF16-mode SM90 weight tensor with N = ``n``, K = ``k`` (``int32
    [E, N/64, K/128, 64, 16]`` + chunk-major scales ``int32 [E, K/128, N]``): lane ``(g, q) = (lane / 4, lane %
    4)`` reads 16-byte segment q of row ``first_row + g`` (and of the row 8 further) and that row's scale words.
    Returns (weight address, scale address, N): a chunk's scale words lie N words apart."""
    row = first_row + lane // 4
    in_block = row % ROW_BLOCK
    weights = w.toint() + (Int64(e) * n + row - in_block) * (k // 2) + in_block * CHUNK_BYTES + (lane % 4) * 16
    return weights, sf.toint() + (Int64(e) * (k // K_CHUNK) * n + row) * 4, n


def mma_load(rows: tuple, c: int) -> tuple:
    """K chunk ``c`` of ``mma_rows``: the lane's 4 words of row g and of row g + 8, and both rows' packed
    scale words."""
    wa = rows[0] + c * (ROW_BLOCK * CHUNK_BYTES)
    sf_c = rows[1] + c * rows[2] * 4
    return (_ld16(wa, WEIGHT_LOAD), _ld16(wa + 8 * CHUNK_BYTES, WEIGHT_LOAD), _ld_word(sf_c), _ld_word(sf_c + 8 * 4))


def mma_chunk(acc: list, loaded: tuple, bs: list) -> list:
    """Accumulate one 128-wide K chunk of the 16 rows into ``acc``: 4 words x 2 K blocks of 16 = 8
    ``mma.m16n8k16`` per B operand. ``bs``: for each B operand, the lane's 16 bf16x2 words of the chunk in
    fragment order (``_ld_mma_chunk``, ``_ld_natural_chunk``); ``acc``: 8 floats per B operand, two chains (K block
    parity) of the C fragment each (shorter MMA dependency chains)."""
    lo_words, hi_words, lo_sf, hi_sf = loaded
    lo_mult = [dequant.ue8m0_to_bf16_multiplier_pair(lo_sf, p) for p in range(2)]
    hi_mult = [dequant.ue8m0_to_bf16_multiplier_pair(hi_sf, p) for p in range(2)]
    for wd in range(4):  # word wd = 32-wide scale block wd of the chunk
        g = dequant.decode_e2m1x8_bf16(lo_words[wd], lo_mult[wd // 2], wd % 2)
        u = dequant.decode_e2m1x8_bf16(hi_words[wd], hi_mult[wd // 2], wd % 2)
        for kk in range(2):
            frag = [g[2 * kk], u[2 * kk], g[2 * kk + 1], u[2 * kk + 1]]
            for b, xs in enumerate(bs):
                base = 8 * b + 4 * kk
                part = _mma_bf16(acc[base: base + 4], frag, [xs[4 * wd + 2 * kk], xs[4 * wd + 2 * kk + 1]])
                acc = acc[:base] + part + acc[base + 4:]
    return acc


def hi_lo_column_sums(acc: list) -> list:
    """Sums of ``mma_stream``'s C fragments for one B operand whose even columns hold ``hi`` rows and odd columns the
    matching ``lo`` rows (lane column ``lane / 4``: ``hi`` where it is even): lane ``(g, q)``'s ``hi + lo`` of
    columns ``(2q, 2q + 1)`` for row g and for row g + 8, the ``hi`` chains then the ``lo`` chains (as two
    separate operands are summed, so the same bits)."""
    return [(acc[2 * r] + acc[4 + 2 * r]) + (acc[2 * r + 1] + acc[5 + 2 * r]) for r in range(2)]


def b_lane(row: Int64, q, b_order: str) -> Int64:
    """Lane ``(g, q)``'s address in the bf16 B row starting at ``row`` for ``mma_stream`` in ``b_order``."""
    return row + q * (4 if b_order == "natural" else 16)


def mma_stream(rows: tuple, k: int, b_lanes: list, depth: int = GATE_UP_MMA_DEPTH, b_order: str = "mma",
               b_shared: bool = False) -> list:
    """The 16 rows of ``mma_rows`` times B operands over the whole K: ``b_lanes`` holds, per operand, the lane's
    address in a bf16 row (``b_lane``), by ``b_order``: ``"mma"``, an MMA-ordered row (``mma_position``,
    ``_ld_mma_chunk``), or ``"natural"``, a row in its natural order (``_ld_natural_chunk``). The
    weight loads of the next ``depth`` chunks are in flight while one chunk computes. ``b_shared``: the B rows are
    MMA-ordered copies in shared memory (``b_lanes`` shared addresses). Returns the C fragments, 8 floats per operand
    (``mma_chunk``), times ``2**-BF16_ACC_SHIFT``."""
    chunks = k // K_CHUNK
    acc = [Float32(0.0)] * (8 * len(b_lanes))
    load_b = _ld_mma_chunk_shared if b_shared else _ld_natural_chunk if b_order == "natural" else _ld_mma_chunk
    loaded = [mma_load(rows, c) for c in range(min(depth, chunks))]
    for c in range(chunks):  # unrolled at trace time
        if c + depth < chunks:
            loaded.append(mma_load(rows, c + depth))
        acc = mma_chunk(acc, loaded[c], [load_b(b + c * (K_CHUNK * 2)) for b in b_lanes])
    return acc


def slots_view(ptr: cute.Pointer, tokens, topk) -> cute.Tensor:
    """A row-major ``[T, k]`` view (``topk_idx``, ``topk_weights``) for a launch."""
    return cute.make_tensor(ptr, cute.make_layout((tokens, topk), stride=(topk, 1)))


def token_rows(idx: cute.Pointer, wts: cute.Pointer, y: cute.Pointer, tokens, topk: int, hidden: int) -> tuple:
    """Row-major views for a down or combine launch: ``topk_idx`` ``[T, k]``, ``topk_weights`` ``[T, k]``,
    ``y`` ``[T, H]``."""
    return (slots_view(idx, tokens, topk), slots_view(wts, tokens, topk),
            cute.make_tensor(y, cute.make_layout((tokens, hidden), stride=(hidden, 1))))


class _Slot(NamedTuple):
    """One (token, slot) of the down kernel: its R weight rows' and scale rows' addresses, 1 if the slot
    is valid else 0, and its routing weight times the decode bias (0 when masked)."""

    w_row: Int64
    sf_row: Int64
    on: Int32
    weight: Float32


class _Down:
    """``y[t, h] = bf16(sum_j w_tj * a[t, j] . W2[e_j][h])``; one warp per (t, R rows), rows fastest.

    The slot loop is unrolled over the compile-time top-k and software-pipelined: the weight loads of
    the next ``depth`` slots are in flight while a slot computes (``depth`` from a register budget of
    ``DOWN_LOAD_REGS`` per lane), so a warp keeps several KiB of weight rows in flight instead of one
    slot's."""

    def __init__(self, hidden: int, inter: int, fmt: str, rows: int, topk: int):
        self.hidden, self.inter, self.fmt, self.rows, self.topk = hidden, inter, _FMT[fmt], rows, topk
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
                        _prefetch_l2(w.toint() + first * fmt.row_bytes(inter), rows * fmt.row_bytes(inter))
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
                    acc[r] = _fma(slots[j].weight, dot[r], acc[r])
            for r in cutlass.range_constexpr(rows):
                total = _warp_sum(acc[r])
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
            out.append((vec, [_ld_weights_if(slot.w_row + i * self.fmt.row_bytes(self.inter) + Int64(vec) * VEC_BYTES, on)
                              for i in range(self.rows)]))
        return out

    def accumulate(self, dot, vec, words, slot, a_row):
        """``dot[r] += scale_r * (w_r . a)`` over vector ``vec`` of the R rows (zero words add 0)."""
        fmt = self.fmt
        av = []
        for q in range(fmt.elems_per_vec // 4):  # lane-interleaved rows: each chunk load is warp-coalesced
            av += _ld16(a_row + Int64(fmt.interleaved_offset(vec * fmt.elems_per_vec + q * 4, 4)) * 4, ACT_LOAD, True)
        sf_row_bytes = self.inter // PACKED_BLOCK_K * 4
        for r, row_words in enumerate(words):
            vals = fmt.values(row_words)
            part = Float32(0.0)
            for n in range(fmt.elems_per_vec):
                part = _fma(vals[n], av[n], part)
            dot[r] = _fma(part, fmt.scale(slot.sf_row + r * sf_row_bytes, vec), dot[r])


# --------------------------------------------------------------------------------------------------
# Host side


def _ptr(dtype, address: int = 0):
    """A 16-byte aligned global-memory pointer argument (``address`` 0 stands in at compile time)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    return make_ptr(dtype, address, AddressSpace.gmem, assumed_align=16)


def compile_kernels(hidden: int, inter: int, weight_format: str, has_clamp: bool, topk: int,
                    down_rows: int = DOWN_ROWS_PER_WARP, l1_layout: str = "canonical", x_order: str = "natural"):
    """The compiled (gate_up, down) pair for one static configuration (cached; works without a GPU
    under ``CUTE_DSL_ARCH=sm_90a``). Token and expert counts stay runtime values; top-k is compiled into
    the down kernel (its slot loop is unrolled). ``l1_layout``: ``"canonical"`` (``_GateUp``) or ``"mega"``
    (FP4 L1 in the Mega MoE layout, ``_GateUpMMA``, reading ``x`` in ``x_order``: ``x_order_for``)."""
    from cutlass.cute.runtime import make_fake_stream

    if weight_format not in FORMATS:
        fail("weight_format", f"must be one of {FORMATS}, got {weight_format!r}")
    for name, k in (("hidden", hidden), ("inter", inter)):
        check_multiple(name, k, PACKED_BLOCK_K, "whole 16-byte vectors and packed UE8M0 scale words")
    check_multiple("hidden", hidden, down_rows, "down rows per warp")
    if l1_layout not in L1_LAYOUTS or (l1_layout == "mega" and weight_format != "fp4"):
        fail("l1_layout", f"must be one of {L1_LAYOUTS} ('mega' with FP4 weights), got {l1_layout!r} with {weight_format}")

    u8, i32, f32 = cutlass.Uint8, cutlass.Int32, cutlass.Float32
    sizes = (Int32(1), Int32(1), Int32(1))  # tokens, top-k, experts: runtime values of gate_up

    def build_gate_up():
        kernel = (_GateUpMMA(hidden, inter, weight_format, has_clamp, x_order) if l1_layout == "mega"
                  else _GateUp(hidden, inter, weight_format, has_clamp))
        return cute.compile(
            kernel, _ptr(cutlass.BFloat16), _ptr(cutlass.Int64), _ptr(u8),
            _ptr(i32), _ptr(f32), *sizes, Float32(0.0), make_fake_stream(),
        )

    def build_down():
        return cute.compile(
            _Down(hidden, inter, weight_format, down_rows, topk), _ptr(f32), _ptr(cutlass.Int64), _ptr(f32), _ptr(u8),
            _ptr(i32), _ptr(cutlass.BFloat16), Int32(1), Int32(1), make_fake_stream(),
        )

    mma_x = x_order if l1_layout == "mega" else None  # _GateUp reads its own interleaved copy
    gate_up = runtime.compiled(("warp_decode.gate_up", hidden, inter, weight_format, has_clamp, l1_layout, mma_x),
                               build_gate_up)
    down = runtime.compiled(("warp_decode.down", hidden, inter, weight_format, down_rows, topk), build_down)
    return gate_up, down


_GATHER: dict = {}


def x_order_for(tokens: int) -> str:
    """The order the tensor-core gate_ups read a batch of ``tokens``' ``x`` in (``NATURAL_X_MAX_TOKENS``)."""
    return "natural" if tokens <= NATURAL_X_MAX_TOKENS else "mma"


def mma_tokens(x: torch.Tensor, x_order: str) -> torch.Tensor:
    """``x`` as a tensor-core gate_up reads it in ``x_order``: itself, or its MMA-ordered copy."""
    return x if x_order == "natural" else interleave_tokens(x, "mma")


def run_planes_gate_up(gate_up, x: torch.Tensor, topk_idx: torch.Tensor, l1: tuple, activation_clamp: float | None,
                       x_order: str, stream) -> torch.Tensor:
    """Launch the compiled gate_up of the token- or expert-major path (``x`` read in ``x_order``, ``l1`` in the Mega
    MoE layout) into new ``a`` planes ``[2, T*k, I]`` BF16 (caching allocator, no sync) and return them."""
    tokens, topk = topk_idx.shape
    planes = torch.empty(2, tokens * topk, l1[1].shape[2] // 2, dtype=torch.bfloat16, device=x.device)
    clamp = 0.0 if activation_clamp is None else float(activation_clamp)
    bf16, i32 = cutlass.BFloat16, cutlass.Int32
    gate_up(_ptr(bf16, mma_tokens(x, x_order).data_ptr()), _ptr(cutlass.Int64, topk_idx.data_ptr()),
            _ptr(i32, l1[0].data_ptr()), _ptr(i32, l1[1].data_ptr()), _ptr(bf16, planes.data_ptr()), tokens, topk,
            l1[0].shape[0], clamp, stream)
    return planes


def mma_position(n):
    """Position of element ``n`` of a row in MMA order (``interleave_tokens(.., "mma")``; the expert-major gate_up
    stores ``a`` so, the down kernel reads it with ``_ld_mma_chunk``): element ``128c + 32w + 16kk + 8h + 2q + i`` sits at ``128c + 32w + 8q +
    4kk + 2h + i``. Python, torch or DSL integers."""
    r = n & 127
    return (n - r) + (r & 96) + (((r >> 1) & 3) << 3) + (((r >> 4) & 1) << 2) + (((r >> 3) & 1) << 1) + (r & 1)


def _token_source(hidden: int, layout: str) -> torch.Tensor:
    """For each position of an interleaved token row, the element of ``x`` it holds (int64 [Hp])."""
    elements = torch.arange(hidden)
    if layout == "mma":
        positions, row = mma_position(elements), hidden
    else:
        positions, row = _FMT[layout].interleaved_offset(elements, 8), _FMT[layout].interleaved_row(hidden)
    source = torch.zeros(row, dtype=torch.int64)
    source[positions] = elements
    return source


def interleave_tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` bfloat16 ``[T, H]`` -> ``[T, Hp]`` in the order a gate_up kernel reads: ``"fp4"``/``"fp8"`` the
    lane-interleaved layout of ``_GateUp`` (8-element chunks; ``Hp`` pads the last round of vectors, padding
    never read), ``"mma"`` the fragment order of the tensor-core gate_ups above ``NATURAL_X_MAX_TOKENS`` (``Hp =
    H``). One gather kernel."""
    key = (x.shape[1], layout, x.device)
    if key not in _GATHER:
        _GATHER[key] = _token_source(x.shape[1], layout).to(x.device)
    return x.index_select(1, _GATHER[key])


_WEIGHT_DTYPES = {"fp4": torch.uint8, "fp8": torch.float8_e4m3fn}


def _weight_format(w: object, name: str) -> str:
    check_tensor(name, w, dtype=tuple(_WEIGHT_DTYPES.values()))
    return "fp4" if w.dtype == torch.uint8 else "fp8"


def weight_layout_of(w: object) -> str:
    """``"mega"`` for int32 L1 or L2 weights (the Mega MoE layout), else ``"canonical"``."""
    return "mega" if isinstance(w, torch.Tensor) and w.dtype == torch.int32 else "canonical"


def _check_pair(name: str, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        fail(name, "must be a (weights, scales) tuple")
    return pair[0], pair[1]


def _check_scales(name: str, sf: torch.Tensor, experts: int, n: int, k: int, mega: bool) -> None:
    """Packed UE8M0 scales of ``[E, N, K]`` weights: canonical ``int32 [E, N, K/128]``, or with weights in the Mega MoE
    layout chunk-major (``layouts.weights.check_chunk_major_scales``)."""
    if mega:
        check_chunk_major_scales(name, sf, experts, n, k)
    else:
        check_tensor(name, sf, dtype=torch.int32, shape=(experts, n, k // PACKED_BLOCK_K), contiguous=True)


def check_decode_inputs(x, topk_idx, topk_weights, l1, l2, activation_clamp=None, out=None) -> tuple[str, int, int]:
    """Validate ``moe_decode``'s arguments without touching a GPU; returns (weight format, hidden, intermediate)."""
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2, contiguous=True)
    tokens, hidden = x.shape
    if tokens < 1:
        fail("x", f"must hold at least one token (T >= 1), got shape {list(x.shape)}")
    check_multiple("x.shape[1] (hidden)", hidden, PACKED_BLOCK_K, "16-byte weight vectors and packed UE8M0 scale words")
    check_tensor("topk_idx", topk_idx, dtype=torch.int64, ndim=2, contiguous=True)
    check_tensor("topk_idx", topk_idx, shape=(tokens, None))
    topk = topk_idx.shape[1]
    if topk < 1:
        fail("topk_idx", f"must have at least one slot per token, got shape {list(topk_idx.shape)}")
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(tokens, topk), contiguous=True)

    w1, s1 = _check_pair("l1", l1)
    w2, s2 = _check_pair("l2", l2)
    mega = weight_layout_of(w1) == "mega"
    mega2 = weight_layout_of(w2) == "mega"
    if mega2 and not mega:
        fail("l2[0]", "may be in the Mega MoE layout (int32) only when l1 is too")
    fmt = "fp4" if mega2 else _weight_format(w2, "l2[0]") if mega else _weight_format(w1, "l1[0]")
    if mega and fmt != "fp4":
        fail("l2[0]", "must be FP4 (uint8 or the int32 Mega MoE layout) when l1 is in the Mega MoE layout (int32)")
    per_byte = 2 if fmt == "fp4" else 1
    check_tensor("l1[0]", w1, ndim=5 if mega else 3, contiguous=True)
    experts, two_inter = w1.shape[0], w1.shape[1] * (ROW_BLOCK if mega else 1)
    if experts < 1:
        fail("l1[0]", f"must hold at least one expert, got shape {list(w1.shape)}")
    if two_inter % 2:
        fail("l1[0]", f"dim 1 must be 2 * intermediate (gate rows then up rows), got {two_inter}")
    inter = two_inter // 2
    check_multiple("intermediate (half the L1 rows)", inter, PACKED_BLOCK_K,
                   "16-byte weight vectors and packed UE8M0 scale words")
    if mega:
        check_multiple("x.shape[1] (hidden)", hidden, K_CHUNK, "the Mega MoE layout's 128-wide K chunks")
        check_tensor("l1[0]", w1, shape=(experts, two_inter // ROW_BLOCK, hidden // K_CHUNK, ROW_BLOCK, BF16_WORDS))
    else:
        check_tensor("l1[0]", w1, shape=(experts, two_inter, hidden // per_byte))
    _check_scales("l1[1]", s1, experts, two_inter, hidden, mega)
    if mega2:
        from .expert_major import MAX_EXPERTS

        check_range("l1[0].shape[0] (experts)", experts, 1, MAX_EXPERTS)
        check_tensor("l2[0]", w2, shape=(experts, hidden // ROW_BLOCK, inter // K_CHUNK, ROW_BLOCK, BF16_WORDS),
                     contiguous=True)
    else:
        check_tensor("l2[0]", w2, dtype=_WEIGHT_DTYPES[fmt], shape=(experts, hidden, inter // per_byte), contiguous=True)
    _check_scales("l2[1]", s2, experts, hidden, inter, mega2)
    if tokens * topk * inter >= 2**31:
        fail("topk_idx", f"T * k * intermediate = {tokens * topk * inter} must stay below 2**31 (32-bit warp ids)")

    check_activation_clamp(activation_clamp)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(tokens, hidden), contiguous=True)

    named = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "l1[0]": w1, "l1[1]": s1,
             "l2[0]": w2, "l2[1]": s2}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if t.device != x.device:
            fail(name, f"must be on x's device {x.device}, got {t.device}")
        if t.data_ptr() % 16:
            fail(name, "must start at a 16-byte aligned address (16-byte vector loads)")
    return fmt, hidden, inter


def moe_decode(x, topk_idx, topk_weights, l1, l2, activation_clamp=None, out=None, *, down_rows: int = DOWN_ROWS_PER_WARP):
    """MoE layer for small batches on one GPU that holds every expert: ``y [T, H]`` bfloat16.

    ``x`` bfloat16 ``[T, H]``; ``topk_idx`` int64 ``[T, k]`` (ids outside ``[0, E)``, e.g. -1, mark
    unused slots); ``topk_weights`` float32 ``[T, k]``; ``l1 = (w1, w1_sf)``, ``l2 = (w2, w2_sf)``:
    FP4 (uint8 ``[E, 2I, H/2]`` and ``[E, H, I/2]``) or FP8 (float8_e4m3fn ``[E, 2I, H]`` and
    ``[E, H, I]``) with packed UE8M0 scales int32 ``[E, 2I, H/128]`` and ``[E, H, I/128]``; H and I
    multiples of 128. ``l1`` may instead be FP4 L1 in the Mega MoE layout (``transform_weights_for_mega_moe``'s
    first result: int32 ``[E, 2I/64, H/128, 64, 16]`` with chunk-major scales int32 ``[E, H/128, 2I]`` in the BF16
    decode's exact range), with ``l2`` canonical
    FP4: gate_up then runs on tensor cores (``_GateUpMMA``); with ``l2`` in that layout too (the second result,
    int32 ``[E, H/64, I/128, 64, 16]``, scales ``[E, I/128, H]``; E <= 1024) both projections run on tensor cores:
    up to ``TOKEN_MAJOR_MAX_TOKENS`` (4) tokens, for shapes ``token_major_decode.supports`` accepts, the token-major
    kernels (``token_major_decode``: K split over a CTA's warps, slots combined in shared memory), else the
    expert-major ones (``expert_major_decode``: each routed expert's rows read once per batch). ``activation_clamp``
    c: ``gate <= c``, ``|up| <= c``. ``out``: optional bfloat16 ``[T, H]`` destination. ``down_rows``: outputs per
    down warp of the per-pair down kernel (tuning; divides H). Numerics: see the module docstring (FP32 throughout, one BF16 rounding of ``y``; the
    tensor-core downs read the activations as two BF16 terms, within 2**-17 of them).
    """
    fmt, hidden, inter = check_decode_inputs(x, topk_idx, topk_weights, l1, l2, activation_clamp, out)
    if down_rows not in (1, 2, 4, 8):
        fail("down_rows", f"must be 1, 2, 4 or 8, got {down_rows}")
    runtime.require_sm90(x, "x")
    tokens, topk = topk_idx.shape
    layout = weight_layout_of(l1[0])
    y = out if out is not None else torch.empty(tokens, hidden, dtype=torch.bfloat16, device=x.device)
    if weight_layout_of(l2[0]) == "mega":
        from .expert_major import moe_decode_by_expert
        from .token_major import TOKEN_MAJOR_MAX_TOKENS, moe_decode_by_token, supports

        if tokens <= TOKEN_MAJOR_MAX_TOKENS and supports(topk, inter):
            return moe_decode_by_token(x, topk_idx, topk_weights, l1, l2, activation_clamp, y)
        return moe_decode_by_expert(x, topk_idx, topk_weights, l1, l2, activation_clamp, y)
    order = x_order_for(tokens)
    gate_up, down = compile_kernels(hidden, inter, fmt, activation_clamp is not None, topk, down_rows, layout, order)
    a = torch.empty(tokens, topk, _FMT[fmt].interleaved_row(inter), dtype=torch.float32, device=x.device)
    experts = l1[0].shape[0]
    stream = runtime.current_stream()
    clamp = 0.0 if activation_clamp is None else float(activation_clamp)
    u8, i32, f32 = cutlass.Uint8, cutlass.Int32, cutlass.Float32
    idx, a_ptr = _ptr(cutlass.Int64, topk_idx.data_ptr()), _ptr(f32, a.data_ptr())
    xi = mma_tokens(x, order) if layout == "mega" else interleave_tokens(x, fmt)
    gate_up(_ptr(cutlass.BFloat16, xi.data_ptr()), idx, _ptr(u8, l1[0].data_ptr()), _ptr(i32, l1[1].data_ptr()), a_ptr,
            tokens, topk, experts, clamp, stream)
    down(a_ptr, idx, _ptr(f32, topk_weights.data_ptr()), _ptr(u8, l2[0].data_ptr()), _ptr(i32, l2[1].data_ptr()),
         _ptr(cutlass.BFloat16, y.data_ptr()), tokens, experts, stream)
    return y
