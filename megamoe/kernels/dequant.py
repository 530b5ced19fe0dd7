"""Register dequantization of FP4 (E2M1) weights for the SM90 kernels (device side, CuTe DSL): E2M1 -> E4M3 through
byte-permute lookup tables (exact; folded block scales move the table's exponents), E2M1 times its UE8M0 scale ->
BF16 through bit windows and one exact multiply, and the UE8M0 scale conversions they need. The layouts they read
and the exactness arguments: ``megamoe.kernels.weight_layout``."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.cutlass_dsl import dsl_user_op

from . import ptx
from .weight_layout import BF16_SCALE_FIELD_OFFSET, FOLD_LUT_HI, FOLD_LUT_LO

SIGN_BITS = 0x80808080
"""Bit 7 of every byte: the E4M3 sign bits of four decoded values."""


@cute.jit
def ue8m0_code_to_f32(code: Int32) -> Float32:
    """UE8M0 code (0..254) -> ``2**(code - 127)`` as float32 (exact; code 0 is the subnormal 2**-127)."""
    bits = code << 23
    if code == 0:
        bits = Int32(0x00400000)
    return ptx.bits_to_f32(bits)


@cute.jit
def decode_e2m1x8(x: Int32, lut_lo: Int32, lut_hi: Int32):
    """8 E2M1 nibbles (nibble j = element j) -> (E4M3 x4 of elements 0-3, E4M3 x4 of elements 4-7)."""
    mag = x & Int32(0x77777777)
    lo = ptx.prmt(lut_lo, lut_hi, mag)
    hi = ptx.prmt(lut_lo, lut_hi, mag >> 16)
    shifted = x << 4  # sign of even nibbles -> bit 7 of their byte; odd nibbles already there
    sign_lo = ptx.prmt(shifted, x, Int32(0x5140))
    sign_hi = ptx.prmt(shifted, x, Int32(0x7362))
    sign_mask = Int32(SIGN_BITS - (1 << 32))
    return lo | (sign_lo & sign_mask), hi | (sign_hi & sign_mask)


@cute.jit
def fold_luts(word: Int32, kb: cutlass.Constexpr[int]):
    """Folded FP8 mode: the decode tables (``decode_e2m1x8``'s ``lut_lo``, ``lut_hi``) of 32-block ``kb`` from
    its byte of a word of biased codes b = d - ``FOLD_MIN_SHIFT`` (``fold_fp8_scales``): b in the table's
    nonzero bytes (a byte permute), times 8 (exponent field) plus the lowered tables: two permutes, two
    multiply-adds. Every byte stays in 0x08..0x7C: no carry between bytes."""
    rep_lo = ptx.prmt(word, Int32(0), Int32((kb << 12) | (kb << 8) | (kb << 4) | 4))
    rep_hi = ptx.prmt(word, Int32(0), Int32(kb * 0x1111))
    return rep_lo * Int32(8) + Int32(FOLD_LUT_LO), rep_hi * Int32(8) + Int32(FOLD_LUT_HI)


@dsl_user_op
def decode_e2m1x8_bf16(x, multipliers, half: int, *, loc=None, ip=None):
    """One BF16-mode word (8 E2M1 elements) and its decode multiplier ``2**(126 + s - P)``, the BF16 in half
    ``half`` of ``multipliers`` (``ue8m0_to_bf16_multiplier_pair``) -> the four bf16x2 fragment registers
    j = 0..3 (``BF16_CODE_BITS``). The multiplier is broadcast to both halves (an operand swizzle of
    ``HMUL2``, no instruction)."""
    pick = "{ml, ml}" if half == 0 else "{mh, mh}"
    return ptx.pure_asm(
        4,
        [Int32(v).ir_value(loc=loc, ip=ip) for v in (x, multipliers)],
        "{.reg .b32 t0, t1, t2, t3, u, m;\n"
        ".reg .b16 ml, mh;\n"
        "mov.b32 {ml, mh}, $5;\n"
        f"mov.b32 m, {pick};\n"
        "shl.b32 t0, $4, 6;\n"
        "and.b32 t0, t0, 0x81C081C0;\n"
        "shl.b32 t1, $4, 2;\n"
        "and.b32 t1, t1, 0x81C081C0;\n"
        "shf.r.wrap.b32 t2, $4, $4, 4;\n"
        "and.b32 t2, t2, 0x81C081C0;\n"
        "shr.u32 u, $4, 8;\n"
        "and.b32 u, u, 0x00400040;\n"
        "and.b32 t3, $4, 0x81808180;\n"
        "or.b32 t3, t3, u;\n"
        "mul.rn.bf16x2 $0, t0, m;\n"
        "mul.rn.bf16x2 $1, t1, m;\n"
        "mul.rn.bf16x2 $2, t2, m;\n"
        "mul.rn.bf16x2 $3, t3, m;}",
        "=r,=r,=r,=r,r,r",
        loc,
        ip,
    )


@cute.jit
def ue8m0_to_bf16_multiplier_pair(word: Int32, pair: cutlass.Constexpr[int]) -> Int32:
    """UE8M0 codes in bytes ``2 * pair`` and ``2 * pair + 1`` of a packed scale word -> their BF16-mode decode
    multipliers ``2**(126 + s - P)`` (exponent field ``code + BF16_SCALE_FIELD_OFFSET``) in the low and the
    high half of one word: a byte permute and one multiply-add for two multipliers."""
    codes = ptx.prmt(word, Int32(0), Int32(0x4140 + 0x202 * pair))  # byte 2p at bit 0, byte 2p + 1 at bit 16
    return codes * Int32(0x80) + Int32(BF16_SCALE_FIELD_OFFSET * 0x00800080)


@cute.jit
def ue8m0_to_f32(word: Int32, byte: cutlass.Constexpr[int]) -> Float32:
    """UE8M0 code in byte ``byte`` of a packed scale word -> ``2**(code - 127)`` as float32 (exact;
    code 0 is the subnormal 2**-127)."""
    return ue8m0_code_to_f32((word >> (8 * byte)) & Int32(0xFF))
