"""What the decode kernels share: warp geometry and load policies, the weight-vector formats of the SIMT kernels and
their lane-interleaved activation layout, the FP4 and UE8M0 decode to FP32, the SwiGLU, launch views, and the host
side (pointer arguments, the MMA order of a row and the gathers of ``x`` into it, the planes gate_up launch).

Orders of a bf16 or FP32 row the kernels read (``x`` ``[T, H]``, the activations ``a``):

* natural: element n at n.
* lane-interleaved (``VectorFormat.interleaved_offset``; the SIMT kernels): the 16-byte chunk q of lane l's vector of
  round r sits at ``(r * chunks + q) * 32 + l`` chunks, so every warp-wide load is 512 contiguous bytes (4 L1
  wavefronts instead of 16-32 when each lane reads its own span: those wavefronts, not HBM, bounded the down kernel).
* MMA order (``mma_position``; the tensor-core kernels): lane q's words of a 128-wide chunk in ``m16n8k16`` B-fragment
  order, 64 contiguous bytes across the 4 lanes of a column per 16-byte load.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import torch
from cutlass import Float32, Int32, Int64, cute
from cutlass.cutlass_dsl import T, dsl_user_op

from .. import ptx

WARP = 32
WARPS_PER_CTA = 8
"""Warps per CTA (256 threads) of the SIMT kernels and the expert-major ones; every warp works alone."""
VEC_BYTES = 16
"""Bytes of weights each lane loads per vector (one ``ld.global.v4``)."""
FORMATS = ("fp4", "fp8")
"""Weight formats of the SIMT kernels (the tensor-core kernels read FP4 in the Mega MoE layout)."""
NATURAL_X_MAX_TOKENS = 8
"""Largest batch for which the tensor-core gate_ups read ``x`` in its natural order (``mma.ld_natural_chunk``, 16
4-byte loads per 128-wide chunk); larger batches gather it into MMA order first (``interleave_tokens(x, "mma")``, one
more launch; then 4 16-byte loads per chunk). Above 8 tokens the natural loads' instructions and, expert-major, L1
wavefronts (8 token rows per load) cost more than the gather (``bench/findings/warp-decode-natural-x.md``)."""

WEIGHT_LOAD = ".nc.L1::no_allocate.L2::256B"
"""Weight rows: read-only path, not kept in L1 (the activations, read by many warps, stay there), 256-byte L2
prefetch."""
ACT_LOAD = ".nc"
"""Activations: read-only path, kept in L1 (other warps read them too)."""


# --------------------------------------------------------------------------------------------------
# Weight decode to FP32 (SIMT kernels)


@dsl_user_op
def ue8m0_scale(packed: Int32, shift: Int32, *, loc=None, ip=None) -> Float32:
    """The FP32 scale ``2**(c - 127)`` of the UE8M0 code ``c = (packed >> shift) & 0xFF`` (exact, c = 0 too): the
    value of ``dequant.ue8m0_to_f32`` for a runtime byte, in one inline block."""
    text = (
        "{\n.reg .b32 c, f;\n.reg .pred z;\n"
        "shr.u32 c, $1, $2;\nand.b32 c, c, 255;\nsetp.eq.u32 z, c, 0;\nshl.b32 f, c, 23;\n"
        "selp.b32 f, 4194304, f, z;\nmov.b32 $0, f;\n}"
    )
    args = [Int32(packed).ir_value(loc=loc, ip=ip), Int32(shift).ir_value(loc=loc, ip=ip)]
    return Float32(ptx.inline_asm([T.f32()], args, text, "=f,r,r", loc, ip, side_effects=False)[0])


FP4_DECODE_PTX = """{
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
""" + "".join(ptx.e4m3x2_to_f32x2_ptx(*r) for r in (("a0", 0, 2), ("a1", 4, 6), ("b0", 1, 3), ("b1", 5, 7))) + "}"
"""``fp4x8``'s block: the even nibbles to E4M3 bytes ``a``, the odd ones to ``b``, then 4 widenings of 2."""


@dsl_user_op
def fp4x8(word: Int32, *, loc=None, ip=None) -> list:
    """8 E2M1 codes (element 2j in the low nibble of byte j) -> 8 FP32 values times 2**-6, in order.

    Each nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 00 e1 e0 m 00`` (E2M1's value times 2**-6,
    its subnormal 0.5 an E4M3 subnormal), which ``cvt.rn.f16x2.e4m3x2`` and ``cvt.f32.f16`` widen exactly.
    """
    vals = ptx.inline_asm([T.f32()] * 8, [Int32(word).ir_value(loc=loc, ip=ip)], FP4_DECODE_PTX,
                          ",".join(["=f"] * 8 + ["r"]), loc, ip, side_effects=False)
    return [Float32(v) for v in vals]


@dataclass(frozen=True)
class VectorFormat:
    """How one weight format maps onto a lane's 16-byte vector of a row of K elements (SIMT kernels)."""

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
            out += fp4x8(w) if self.name == "fp4" else ptx.e4m3x4_to_f32x4(w)
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
        packed = ptx.ld_nc_u32(sf_row + Int64(block >> 2) * 4)
        return ue8m0_scale(packed, (block & 3) * 8)


VECTOR_FORMATS = {"fp4": VectorFormat("fp4", 32, 2.0**6), "fp8": VectorFormat("fp8", 16, 1.0)}
"""FP4: E2M1 decoded times 2**-6 (``fp4x8``), the factor folded into each row's FP32 result; FP8: E4M3 exact."""


# --------------------------------------------------------------------------------------------------
# Math and launch pieces


def warp_sum(v: Float32) -> Float32:
    """Sum over the 32 lanes (butterfly shuffles; every lane gets the total)."""
    for offset in (16, 8, 4, 2, 1):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=offset)
    return v


@cute.jit
def swiglu(gate: Float32, up: Float32, clamp: Float32, has_clamp: cutlass.Constexpr[bool]) -> Float32:
    """``silu(min(gate, c)) * clamp(up, -c, c)`` (no clamp when ``has_clamp`` is False), FP32; ``silu(g) = g / (1 +
    exp(-g))`` with the approximate exp."""
    if cutlass.const_expr(has_clamp):
        gate = cutlass.min(gate, clamp)
        up = cutlass.max(cutlass.min(up, clamp), -clamp)
    return gate / (Float32(1.0) + cute.math.exp(-gate, fastmath=True)) * up


def slots_view(ptr: cute.Pointer, tokens, topk) -> cute.Tensor:
    """A row-major ``[T, k]`` view (``topk_idx``, ``topk_weights``) for a launch."""
    return cute.make_tensor(ptr, cute.make_layout((tokens, topk), stride=(topk, 1)))


def token_rows(idx: cute.Pointer, wts: cute.Pointer, y: cute.Pointer, tokens, topk: int, hidden: int) -> tuple:
    """Row-major views for a down or combine launch: ``topk_idx`` ``[T, k]``, ``topk_weights`` ``[T, k]``,
    ``y`` ``[T, H]``."""
    return (slots_view(idx, tokens, topk), slots_view(wts, tokens, topk),
            cute.make_tensor(y, cute.make_layout((tokens, hidden), stride=(hidden, 1))))


class GateUpLaunch:
    """The launch of the per-pair gate_up kernels (``simt.GateUp``, ``mma.GateUpMMA``): ``warps_per_pair`` warps per
    (token, slot) pair, ``a`` FP32 ``[T, k, row]`` written in the down kernel's interleaved layout ``a_fmt``,
    ``min_ctas`` CTAs per SM (0: no bound)."""

    warps_per_pair: int
    a_fmt: VectorFormat
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


def mma_position(n):
    """Position of element ``n`` of a row in MMA order (``interleave_tokens(.., "mma")``; the tensor-core gate_ups
    store ``a`` so, the tensor-core downs read it with ``mma.ld_mma_chunk``): element ``128c + 32w + 16kk + 8h + 2q +
    i`` sits at ``128c + 32w + 8q + 4kk + 2h + i``. Python, torch or DSL integers."""
    r = n & 127
    return (n - r) + (r & 96) + (((r >> 1) & 3) << 3) + (((r >> 4) & 1) << 2) + (((r >> 3) & 1) << 1) + (r & 1)


# --------------------------------------------------------------------------------------------------
# Host side


def gmem_ptr(dtype, address: int = 0):
    """A 16-byte aligned global-memory pointer argument (``address`` 0 stands in at compile time)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    return make_ptr(dtype, address, AddressSpace.gmem, assumed_align=16)


def x_order_for(tokens: int) -> str:
    """The order the tensor-core gate_ups read a batch of ``tokens``' ``x`` in (``NATURAL_X_MAX_TOKENS``)."""
    return "natural" if tokens <= NATURAL_X_MAX_TOKENS else "mma"


def token_source(hidden: int, layout: str) -> torch.Tensor:
    """For each position of an interleaved token row, the element of ``x`` it holds (int64 [Hp])."""
    elements = torch.arange(hidden)
    if layout == "mma":
        positions, row = mma_position(elements), hidden
    else:
        fmt = VECTOR_FORMATS[layout]
        positions, row = fmt.interleaved_offset(elements, 8), fmt.interleaved_row(hidden)
    source = torch.zeros(row, dtype=torch.int64)
    source[positions] = elements
    return source


_GATHER: dict = {}


def interleave_tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` bfloat16 ``[T, H]`` -> ``[T, Hp]`` in the order a gate_up kernel reads: ``"fp4"``/``"fp8"`` the
    lane-interleaved layout of ``simt.GateUp`` (8-element chunks; ``Hp`` pads the last round of vectors, padding never
    read), ``"mma"`` the fragment order of the tensor-core gate_ups above ``NATURAL_X_MAX_TOKENS`` (``Hp = H``). One
    gather kernel."""
    key = (x.shape[1], layout, x.device)
    if key not in _GATHER:
        _GATHER[key] = token_source(x.shape[1], layout).to(x.device)
    return x.index_select(1, _GATHER[key])


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
    gate_up(gmem_ptr(bf16, mma_tokens(x, x_order).data_ptr()), gmem_ptr(cutlass.Int64, topk_idx.data_ptr()),
            gmem_ptr(i32, l1[0].data_ptr()), gmem_ptr(i32, l1[1].data_ptr()), gmem_ptr(bf16, planes.data_ptr()),
            tokens, topk, l1[0].shape[0], clamp, stream)
    return planes
