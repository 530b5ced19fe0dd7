"""FP4 (E2M1) -> FP8 (E4M3) decode for Hopper register-sourced (RS) wgmma, and the weight layout it reads.

Hopper has no FP4 tensor cores, so the SM90 grouped GEMM decodes packed E2M1 weights into E4M3 (exact:
every E2M1 value is an E4M3 value) directly into the wgmma A fragment. The weights are the wgmma M side
(swap-AB), so each thread of a warpgroup owns, per 32-wide K block ``kb`` of a 64-row slab, the values

    rows  g and g + 8        (g = lane // 4 + 16 * warp)
    k     kb*32 + 16*h + 4*q + i,   h in {0, 1}, i in 0..3   (q = lane % 4)

(the PTX ``wgmma .e4m3`` A-fragment: four registers of four bytes, ``(row, h)`` major). The kernel weight
layout (``to_sm90_weight_layout``) stores every 128-wide K chunk of a row as four 16-byte segments, one per
``q``, each holding words ``kb = 0..3`` whose low half is ``h = 0`` and high half ``h = 1``; one 16-byte
shared-memory load per row then yields a thread's whole 128-K slice in fragment order. Nibble order inside
a byte is unchanged (even element in the low nibble), so a decoded 16-bit half maps to four consecutive K.

Decode of one 32-bit word (8 nibbles): magnitudes through a byte-permute (``prmt``) table lookup, sign bits
moved to bit 7 of each byte with a second ``prmt``; -0 (code 8) becomes E4M3 -0 (0x80), never NaN.
"""

from __future__ import annotations

import torch

from ..checks import check_multiple, check_tensor, fail

K_CHUNK = 128
"""K elements per kernel-layout chunk (one pipeline stage, one packed UE8M0 scale word)."""
CHUNK_BYTES = K_CHUNK // 2

# E4M3 bytes of the E2M1 magnitudes {0, 0.5, 1, 1.5} and {2, 3, 4, 6}, byte i = magnitude code i (mod 4).
E4M3_LUT_LO = 0x3C383000
E4M3_LUT_HI = 0x4C484440
_SIGN_BITS = 0x80808080


def to_sm90_weight_layout(b: torch.Tensor) -> torch.Tensor:
    """Canonical packed FP4 ``uint8 [E, N, K/2]`` -> kernel layout ``uint8 [E, N, K/128, 64]`` (done once
    at weight-load time). Byte ``kb*16 + h*8 + q*2 + p`` of a 64-byte chunk moves to ``q*16 + kb*4 + h*2 + p``."""
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    e, n, half_k = b.shape
    check_multiple("b.shape[2] * 2 (K)", 2 * half_k, K_CHUNK, "the kernel layout works in 128-wide K chunks")
    chunks = b.reshape(e, n, half_k // CHUNK_BYTES, 4, 2, 4, 2)  # (kb, h, q, p)
    return chunks.permute(0, 1, 2, 5, 3, 4, 6).reshape(e, n, half_k // CHUNK_BYTES, CHUNK_BYTES).contiguous()


def from_sm90_weight_layout(bk: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_sm90_weight_layout``: ``uint8 [E, N, K/128, 64]`` -> canonical ``uint8 [E, N, K/2]``."""
    check_tensor("b", bk, dtype=torch.uint8, ndim=4)
    e, n, chunks, width = bk.shape
    if width != CHUNK_BYTES:
        fail("b", f"must have {CHUNK_BYTES} bytes per 128-K chunk (shape [E, N, K/128, 64]), got {list(bk.shape)}")
    parts = bk.reshape(e, n, chunks, 4, 4, 2, 2)  # (q, kb, h, p)
    return parts.permute(0, 1, 2, 4, 5, 3, 6).reshape(e, n, chunks * CHUNK_BYTES).contiguous()


# ----------------------------------------------------------------------------------------------------
# Device helpers (CuTe DSL). Imported lazily by the kernel module so that importing this file for the
# host transform needs no cutlass.
# ----------------------------------------------------------------------------------------------------


def _device_helpers():
    import cutlass
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def prmt(lo, hi, selector, *, loc=None, ip=None) -> Int32:
        """``prmt.b32``: byte i of the result is byte ``selector.nibble[i]`` of ``{hi:lo}`` (pure op)."""
        res = llvm.inline_asm(
            T.i32(),
            [Int32(v).ir_value(loc=loc, ip=ip) for v in (lo, hi, selector)],
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
        return Int32(res)

    @dsl_user_op
    def bits_to_f32(bits, *, loc=None, ip=None) -> Float32:
        """Reinterpret an int32 bit pattern as float32."""
        return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    @dsl_user_op
    def f32_bits(x, *, loc=None, ip=None) -> Int32:
        """The int32 bit pattern of a float32."""
        return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    @dsl_user_op
    def f32x4_to_e4m3x4(v0, v1, v2, v3, *, loc=None, ip=None) -> Int32:
        """Four float32 -> four E4M3 bytes (v0 in the low byte), round to nearest even, saturating."""
        res = llvm.inline_asm(
            T.i32(),
            [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
            "{.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi};}",
            "=r,f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
        return Int32(res)

    @cutlass.cute.jit
    def decode_e2m1x8(x: Int32, lut_lo: Int32, lut_hi: Int32):
        """8 E2M1 nibbles (nibble j = element j) -> (E4M3 x4 of elements 0-3, E4M3 x4 of elements 4-7)."""
        mag = x & Int32(0x77777777)
        lo = prmt(lut_lo, lut_hi, mag)
        hi = prmt(lut_lo, lut_hi, mag >> 16)
        shifted = x << 4  # sign of even nibbles -> bit 7 of their byte; odd nibbles already there
        sign_lo = prmt(shifted, x, Int32(0x5140))
        sign_hi = prmt(shifted, x, Int32(0x7362))
        sign_mask = Int32(_SIGN_BITS - (1 << 32))
        return lo | (sign_lo & sign_mask), hi | (sign_hi & sign_mask)

    @cutlass.cute.jit
    def ue8m0_to_f32(word: Int32, byte: cutlass.Constexpr[int]) -> Float32:
        """UE8M0 code in byte ``byte`` of a packed scale word -> ``2**(code - 127)`` as float32 (exact;
        code 0 is the subnormal 2**-127)."""
        code = (word >> (8 * byte)) & Int32(0xFF)
        bits = code << 23
        if code == 0:
            bits = Int32(0x00400000)
        return bits_to_f32(bits)

    return prmt, bits_to_f32, f32_bits, decode_e2m1x8, ue8m0_to_f32, f32x4_to_e4m3x4


_HELPERS = None


def device_helpers():
    """``(prmt, bits_to_f32, f32_bits, decode_e2m1x8, ue8m0_to_f32, f32x4_to_e4m3x4)`` DSL device functions
    (built on first use)."""
    global _HELPERS
    if _HELPERS is None:
        _HELPERS = _device_helpers()
    return _HELPERS
