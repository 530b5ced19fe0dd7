"""FP4 (E2M1) weight decodes for Hopper register-sourced (RS) wgmma, and the weight layouts they read.

Hopper has no FP4 tensor cores, so the SM90 grouped GEMM decodes packed E2M1 weights in registers straight
into the wgmma A fragment (weights are the wgmma M side, swap-AB). Two modes, two layouts; in both, one
16-byte shared-memory load per weight row and 128-wide K chunk yields a thread's whole slice of that chunk
in fragment order (four 16-byte segments per chunk and row, segment ``q = lane % 4``; rows ``g`` and
``g + 8``, ``g = lane // 4 + 16 * warp``).

Both layouts store rows in blocks of ``ROW_BLOCK`` = 64: ``[E, N/64, K/128, 64, 64 bytes]``, so the 64 rows x
64 bytes of one block and K chunk -- what a kernel reads together (a TMA box of 64 or 128 rows, or a warp's
16 rows) -- are one contiguous 4 KiB piece of memory; row-major ``[E, N, K/128, 64 bytes]`` put those
64-byte pieces K/2 bytes apart. The grouped GEMM ran 0-7% faster with blocks (H200, checked A/B in
``sm90_grouped_gemm``).

FP8 mode (``to_sm90_weight_layout``, uint8 ``[E, N/64, K/128, 64, 64]``): E2M1 -> E4M3, exact (every E2M1 value is
an E4M3 value); the per-32 scales are applied outside the MMA, or, folded (``fold_fp8_scales``), relative to their
row's scale inside the decode: ``v * 2**d`` is exact in E4M3 for d in -5..6, the lookup table's nonzero bytes
moved by ``8 d`` (``fold_luts``: two byte permutes and two multiply-adds per row and 32-K block), the row's scale
applied once to the FP32 output. A thread owns, per 32-wide K block ``kb``,
``k = kb*32 + 16*h + 4*q + i`` (h in {0, 1}, i in 0..3): the PTX ``wgmma .e4m3`` A fragment, four registers
of four bytes, ``(row, h)`` major. Segment ``q`` holds words ``kb = 0..3`` whose low half is ``h = 0`` and
high half ``h = 1``; nibble order inside a byte is unchanged (even element in the low nibble). Decode of one
word: magnitudes through a byte-permute (``prmt``) table lookup, sign bits moved to bit 7 of each byte with
a second ``prmt``; -0 (code 8) becomes E4M3 -0 (0x80), never NaN.

BF16 mode (``to_sm90_bf16_weight_layout``, int32 ``[E, N/64, K/128, 64, 16]``): E2M1 times its UE8M0 scale ->
BF16, exact, so the MMA needs no scales at all. A thread owns, per 16-wide K block ``kk``, ``k = 16*kk +
8*h + 2*q + i`` (the ``wgmma .bf16`` A fragment: registers ``(row, h)``, element i = 0 in the low half).
Word ``w`` of segment ``q`` holds the 8 elements of K blocks ``kk = 2w, 2w + 1`` (one 32-wide scale block)
for one row; register ``j = 2 * (kk - 2w) + h`` of them is decoded from the word x as follows (bit
positions of its low-half element; the high-half element's are 16 higher, modulo 32):

    j  bits m, e0, e1, sign   window                                     BF16 bits of the low half
    0  0, 1, 2, 9             (x << 6) & 0x81C081C0                      sign 15, e1 e0 m at 8..6
    1  4, 5, 6, 13            (x << 2) & 0x81C081C0                      the same
    2  10, 11, 12, 19         rotr(x, 4) & 0x81C081C0                    the same (the high sign wraps to bit 3)
    3  14, 7, 8, 15           (x & 0x81808180) | ((x >> 8) & 0x00400040) the same

Registers 0-2 are whole windows of x (a shift or rotate and one mask); register 3 takes the 8 bits left
over, which no single window covers, so its mantissa bit comes from a second window. The window puts the
three magnitude bits ``e1 e0 m`` of both elements at BF16 bits 8..6 -- exponent bits 1..0 and the top
mantissa bit -- and the sign at bit 15, so the BF16 value of the window is exactly ``v * 2**-126`` for
every E2M1 value v (e = 0, code 1 = 0.5, lands on the BF16 subnormal 2**-127; -0 stays -0). One
``mul.rn.bf16x2`` by ``2**(126 + s - P)`` (s the UE8M0 exponent, ``P = BF16_ACC_SHIFT``) restores the value
and applies the scale in one exact rounding-free step: ``mul.bf16``/``.bf16x2`` have no ``.ftz`` form in
PTX, subnormal inputs and results are kept. 13 instructions per 8 weights (9 integer, 4 ``HMUL2``); the
previous layout (two whole windows, two registers with a separate sign window) took 15. No four rotations of
the window tile the 32 bits of a word (``tests/test_grouped_gemm.py::test_bf16_layout_needs_one_split_register``),
so one register always needs a second window. The multipliers cost one instruction per row and 32-K block: a
byte permute and a multiply-add put those of two blocks in the halves of one word
(``ue8m0_to_bf16_multiplier_pair``; an exponent field <= 254 cannot carry into the other half), and ``HMUL2``
broadcasts the half it needs (an operand swizzle). Measured on an H200 (``sm90_grouped_gemm``): the
13-instruction decode up to 10% faster GEMMs than 15 (most at 16-64 rows per expert), the paired multipliers
1-6% more at 19 of 24 points (most at 1 row per expert).

Exact range: the multiplier ``2**(126 + s - P)`` must be a finite BF16 (``s <= P + 1``) and the smallest
product ``0.5 * 2**(s - P)`` at least the smallest BF16 subnormal 2**-133 (``s >= P - 132``). With
``P = 16`` the decoded weights are ``w * 2**-16`` and the kernel multiplies its FP32 accumulator by ``2**16``
(exact) before the epilogue: UE8M0 codes ``BF16_MIN_SCALE_CODE..BF16_MAX_SCALE_CODE`` = 11..144
(scales ``2**-116 .. 2**17``, block maxima up to 786432) are exact; an all-zero block is exact for any code
<= 144 (``quantize_fp4`` gives it code 0). ``prepare_fp4_weights(..., mma="bf16")`` checks this once. The
FP32 accumulator then holds sums times 2**-16: (partial) sums below 2**-110 in magnitude are FP32-subnormal
inside the MMA (instead of below 2**-126), far from any real activation x weight product.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..checks import check_multiple, check_tensor, fail
from ..layouts.fp4 import pack_fp4_codes, unpack_fp4_codes
from ..layouts.ue8m0 import unpack_ue8m0

K_CHUNK = 128
"""K elements per kernel-layout chunk (one pipeline stage, one packed UE8M0 scale word)."""
CHUNK_BYTES = K_CHUNK // 2

# E4M3 bytes of the E2M1 magnitudes {0, 0.5, 1, 1.5} and {2, 3, 4, 6}, byte i = magnitude code i (mod 4).
E4M3_LUT_LO = 0x3C383000
E4M3_LUT_HI = 0x4C484440
_SIGN_BITS = 0x80808080

BF16_ACC_SHIFT = 16
"""P: BF16-mode weights are decoded as ``w * 2**-P``; the accumulator is multiplied by ``2**P``."""
BF16_MIN_SCALE_CODE = BF16_ACC_SHIFT - 5
"""Smallest UE8M0 code exact in BF16 mode for a block with a nonzero value (``0.5 * 2**(s - P) >= 2**-133``)."""
BF16_MAX_SCALE_CODE = BF16_ACC_SHIFT + 128
"""Largest UE8M0 code allowed in BF16 mode (the multiplier ``2**(126 + s - P)`` stays a finite BF16)."""
BF16_SCALE_FIELD_OFFSET = 126 - BF16_ACC_SHIFT
"""BF16 exponent field of the decode multiplier = UE8M0 code + this."""
BF16_WORDS = 16
"""int32 words per row and 128-wide K chunk in the BF16-mode layout."""
ROW_BLOCK = 64
"""Weight rows per block of both kernel layouts (``[E, N/ROW_BLOCK, K/128, ROW_BLOCK, chunk]``)."""
BF16_CODE_BITS = ((0, 1, 2, 9), (4, 5, 6, 13), (10, 11, 12, 19), (14, 7, 8, 15))
"""Per fragment register j of a word: where the E2M1 code bits (m, e0, e1, sign) of its low-half element
sit in the word; the high-half element's are 16 higher, modulo 32 (see the module docstring)."""


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """Row-major kernel chunks ``[E, N, K/128, W]`` -> the blocked layout ``[E, N/64, K/128, 64, W]``."""
    e, n, chunks, width = t.shape
    return t.view(e, n // ROW_BLOCK, ROW_BLOCK, chunks, width).transpose(2, 3).contiguous()


def _unblock_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_block_rows``."""
    e, blocks, chunks, rows, width = t.shape
    return t.transpose(2, 3).reshape(e, blocks * rows, chunks, width)


def check_blocked_layout(name: str, t: torch.Tensor, dtype: torch.dtype, width: int, what: str, **checks) -> None:
    """``t`` must be a blocked kernel layout ``[E, N/64, K/128, 64, width]`` of ``dtype`` (``what`` names it
    in the error); ``checks``: further ``check_tensor`` rules (device, contiguous)."""
    check_tensor(name, t, dtype=dtype, ndim=5, **checks)
    if t.shape[3] != ROW_BLOCK or t.shape[4] != width:
        fail(name, f"must be the {what} [E, N/{ROW_BLOCK}, K/128, {ROW_BLOCK}, {width}], got {list(t.shape)}")


def to_sm90_weight_layout(b: torch.Tensor) -> torch.Tensor:
    """Canonical packed FP4 ``uint8 [E, N, K/2]`` -> FP8-mode kernel layout ``uint8 [E, N/64, K/128, 64, 64]``
    (done once at weight-load time; N a multiple of 64). Byte ``kb*16 + h*8 + q*2 + p`` of a row's 64-byte
    chunk moves to ``q*16 + kb*4 + h*2 + p``."""
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    e, n, half_k = b.shape
    check_multiple("b.shape[2] * 2 (K)", 2 * half_k, K_CHUNK, "the kernel layout works in 128-wide K chunks")
    check_multiple("b.shape[1] (N)", n, ROW_BLOCK, "the kernel layout stores rows in blocks of 64")
    chunks = b.reshape(e, n, half_k // CHUNK_BYTES, 4, 2, 4, 2)  # (kb, h, q, p)
    return _block_rows(chunks.permute(0, 1, 2, 5, 3, 4, 6).reshape(e, n, half_k // CHUNK_BYTES, CHUNK_BYTES))


def from_sm90_weight_layout(bk: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_sm90_weight_layout``: ``uint8 [E, N/64, K/128, 64, 64]`` -> canonical ``uint8 [E, N, K/2]``."""
    check_blocked_layout("b", bk, torch.uint8, CHUNK_BYTES, "FP8-mode weight layout uint8")
    rows = _unblock_rows(bk)
    e, n, chunks, _ = rows.shape
    parts = rows.reshape(e, n, chunks, 4, 4, 2, 2)  # (q, kb, h, p)
    return parts.permute(0, 1, 2, 4, 5, 3, 6).reshape(e, n, chunks * CHUNK_BYTES).contiguous()


def _bf16_word_view(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[E, N, K]`` -> ``[E, N, K/128, q, w, kk', h, i]`` (k = 128c + 32w + 16kk' + 8h + 2q + i)."""
    e, n, k = codes.shape
    return codes.reshape(e, n, k // K_CHUNK, 4, 2, 2, 4, 2).permute(0, 1, 2, 6, 3, 4, 5, 7)


def _bf16_code_bit_positions(device) -> torch.Tensor:
    """int64 ``[kk', h, i, 4]``: the word bit of code bit (m, e0, e1, sign) of element i of register j = 2 kk' + h."""
    low = torch.tensor(BF16_CODE_BITS, device=device).view(2, 2, 1, 4)
    return (low + 16 * torch.arange(2, device=device).view(1, 1, 2, 1)) % 32


def to_sm90_bf16_weight_layout(b: torch.Tensor) -> torch.Tensor:
    """Canonical packed FP4 ``uint8 [E, N, K/2]`` -> BF16-mode kernel layout ``int32 [E, N/64, K/128, 64, 16]``
    (word ``4*q + w`` of a row's chunk: see the module docstring). Done once at weight-load time; N a
    multiple of 64."""
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    e, n, half_k = b.shape
    check_multiple("b.shape[2] * 2 (K)", 2 * half_k, K_CHUNK, "the kernel layout works in 128-wide K chunks")
    check_multiple("b.shape[1] (N)", n, ROW_BLOCK, "the kernel layout stores rows in blocks of 64")
    pos = _bf16_code_bit_positions(b.device)  # [kk', h, i, code bit]
    chunks = half_k // CHUNK_BYTES
    out = torch.empty(e, n // ROW_BLOCK, chunks, ROW_BLOCK, BF16_WORDS, dtype=torch.int32, device=b.device)
    for x in range(e):  # one expert at a time: the int64 temporaries are 16x the expert's bytes
        codes = _bf16_word_view(unpack_fp4_codes(b[x : x + 1]).to(torch.int64))  # [..., q, w, kk', h, i]
        bits = sum(((codes >> c) & 1) << pos[..., c] for c in range(4))  # disjoint bits: the sum is their OR
        words = bits.flatten(-3).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words)  # uint32 -> the same bits as int32
        out[x] = _block_rows(words.to(torch.int32).reshape(1, n, chunks, BF16_WORDS))[0]
    return out


def from_sm90_bf16_weight_layout(bk: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_sm90_bf16_weight_layout``: ``int32 [E, N/64, K/128, 64, 16]`` -> canonical
    ``uint8 [E, N, K/2]``."""
    check_blocked_layout("b", bk, torch.int32, BF16_WORDS, "BF16-mode weight layout int32")
    bk = _unblock_rows(bk)
    e, n, chunks, _ = bk.shape
    words = (bk.to(torch.int64) & 0xFFFFFFFF).reshape(e, n, chunks, 4, 4, 1, 1, 1, 1)  # [..., q, w]
    bits = (words >> _bf16_code_bit_positions(bk.device)) & 1  # [..., q, w, kk', h, i, code bit]
    codes = (bits << torch.arange(4, device=bk.device)).sum(-1)
    codes = codes.permute(0, 1, 2, 4, 5, 6, 3, 7)  # (w, kk', h, q, i): natural k order
    return pack_fp4_codes(codes.reshape(e, n, chunks * K_CHUNK).to(torch.uint8))


def nonzero_blocks(b: torch.Tensor) -> torch.Tensor:
    """Canonical FP4 weights ``uint8 [E, N, K/2]`` -> ``bool [E, N, K/32]``: whether each 32-block holds a nonzero
    value. One expert at a time: the unpacked codes are twice the expert's bytes."""
    e, n, half_k = b.shape
    out = torch.empty(e, n, half_k // 16, dtype=torch.bool, device=b.device)
    for x in range(e):
        out[x] = (unpack_fp4_codes(b[x]) & 7).reshape(n, half_k // 16, 32).amax(-1) > 0
    return out


def check_bf16_scale_range(b: torch.Tensor, b_sf: torch.Tensor) -> None:
    """Raise unless canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``) are exact in BF16
    mode: every UE8M0 code <= ``BF16_MAX_SCALE_CODE``, and >= ``BF16_MIN_SCALE_CODE`` where the 32-block
    holds a nonzero value. One host sync (weight-load time)."""
    codes = unpack_ue8m0(b_sf).to(torch.int32)  # [E, N, K/32]
    nonzero = nonzero_blocks(b)
    checks = (
        ("above", codes > BF16_MAX_SCALE_CODE, f"<= {BF16_MAX_SCALE_CODE} (scale 2**{BF16_MAX_SCALE_CODE - 127})"),
        ("below", nonzero & (codes < BF16_MIN_SCALE_CODE),
         f">= {BF16_MIN_SCALE_CODE} (scale 2**{BF16_MIN_SCALE_CODE - 127}) where the block holds a nonzero value"),
    )
    for name, bad, what in checks:
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            fail("b_sf", f"has UE8M0 codes {name} the exact range of the BF16 decode: codes must be {what}; "
                 f"first offending [expert, row, 32-block] = {at} (code {int(codes[tuple(at)])}); "
                 "use mma='fp8' for such weights (the Mega MoE path and MoEDecoder take BF16-mode weights only)")


FOLD_MIN_SHIFT = -5
"""Smallest relative exponent ``d`` a folded FP8-mode decode takes: ``0.5 * 2**d`` stays a normal E4M3 (>= 2**-6)."""
FOLD_MAX_SHIFT = 6
"""Largest ``d``: ``6 * 2**d`` = 384 stays a finite E4M3 (max 448)."""
FOLD_LUT_LO = E4M3_LUT_LO - (-FOLD_MIN_SHIFT) * 0x08080800
"""``E4M3_LUT_LO`` with every nonzero byte's exponent lowered by ``-FOLD_MIN_SHIFT`` (bytes 1-3 minus 8 each)."""
FOLD_LUT_HI = E4M3_LUT_HI - (-FOLD_MIN_SHIFT) * 0x08080808
"""``E4M3_LUT_HI`` likewise (all four bytes)."""


def fold_fp8_scales(b: torch.Tensor, b_sf: torch.Tensor) -> torch.Tensor | None:
    """FP8-mode folded scales of canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``), or None
    where a row's block scales span too many binades.

    Folded, the decode applies each 32-block's scale relative to its row's base: E2M1 ``v`` of a block with UE8M0
    code ``s`` decodes to the E4M3 ``v * 2**d`` (exact: d = s - base in ``[FOLD_MIN_SHIFT, FOLD_MAX_SHIFT]``; the
    lookup table's exponents move by d, ``FOLD_LUT_LO/HI``), and the kernel multiplies each FP32 output row by
    ``2**(base - 127)`` once, after the K loop, instead of every 32-K block's partial sums by the weight scale.
    base = the row's largest code of a block holding a nonzero value, minus ``FOLD_MAX_SHIFT``; an all-zero
    block takes any d (clamped). Returns ``int32 [E, K/128 + 1, N]``: chunk-major words of the biased codes
    ``d - FOLD_MIN_SHIFT`` (byte kb = 32-block kb of the chunk, as the packed scales), then one row of the FP32
    bits of ``2**(base - 127)``. None if some row has a nonzero block below ``base + FOLD_MIN_SHIFT`` (a spread
    of more than 11 binades) or a base below code 1 (the row scale would be an FP32 subnormal): such weights
    keep the absolute scales (``prepare_fp4_weights``). One host sync (weight-load time)."""
    codes = unpack_ue8m0(b_sf).to(torch.int32)  # [E, N, K/32]
    nonzero = nonzero_blocks(b)
    top = torch.where(nonzero, codes, torch.full_like(codes, -1)).amax(-1)  # [E, N]; -1: an all-zero row
    base = torch.where(top >= 0, top - FOLD_MAX_SHIFT, torch.full_like(top, 127))
    d = codes - base[..., None]
    if bool((nonzero & (d < FOLD_MIN_SHIFT)).any()) or bool((base < 1).any()):
        return None
    biased = (d.clamp(FOLD_MIN_SHIFT, FOLD_MAX_SHIFT) - FOLD_MIN_SHIFT).to(torch.uint8)
    words = biased.contiguous().view(torch.int32)  # [E, N, K/128], byte kb = block kb
    row_scale = (base << 23).view(torch.int32)[:, None, :]  # FP32 bits of 2**(base - 127), [E, 1, N]
    return torch.cat([words.transpose(1, 2), row_scale], dim=1).contiguous()


def unfold_fp8_scales(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fold_fp8_scales`` for the blocks it encodes: ``int32 [E, K/128 + 1, N]`` -> the canonical
    packed scales ``int32 [E, N, K/128]`` (an all-zero block's code is its clamped one)."""
    check_tensor("folded", folded, dtype=torch.int32, ndim=3)
    words = folded[:, :-1].transpose(1, 2).contiguous()  # [E, N, K/128]
    base = (folded[:, -1] >> 23) & 0xFF  # [E, N]
    codes = unpack_ue8m0(words).to(torch.int32) + FOLD_MIN_SHIFT + base[..., None]
    return codes.to(torch.uint8).view(torch.int32)


# ----------------------------------------------------------------------------------------------------
# Device helpers (CuTe DSL). Imported lazily by the kernel module so that importing this file for the
# host transform needs no cutlass.
# ----------------------------------------------------------------------------------------------------


def _device_helpers():
    import cutlass
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from .ptx import inline_asm

    def pure_asm(num_results: int, args: list, text: str, constraints: str, loc, ip) -> tuple:
        """One side-effect-free inline-PTX block with ``num_results`` 32-bit results, as ``Int32``s."""
        res = inline_asm([T.i32()] * num_results, args, text, constraints, loc, ip, side_effects=False)
        return tuple(Int32(r) for r in res)

    @dsl_user_op
    def prmt(lo, hi, selector, *, loc=None, ip=None) -> Int32:
        """``prmt.b32``: byte i of the result is byte ``selector.nibble[i]`` of ``{hi:lo}`` (pure op)."""
        args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (lo, hi, selector)]
        return pure_asm(1, args, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", loc, ip)[0]

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
        return pure_asm(
            1,
            [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
            "{.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi};}",
            "=r,f,f,f,f",
            loc,
            ip,
        )[0]

    @dsl_user_op
    def e4m3x4_to_bf16x4(word, scale, *, loc=None, ip=None):
        """Four E4M3 bytes (byte 0 first) times a float32 power-of-two ``scale`` -> two bf16x2 words (elements
        0-1, 2-3; low half first). Exact: an E4M3 value times 2**s is a BF16 value for every UE8M0 scale
        s whose products stay at or above 2**-133 (BF16's smallest subnormal)."""
        return pure_asm(
            2,
            [Int32(word).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)],
            "{.reg .b16 l, h, a0, a1, b0, b1;\n"
            ".reg .b32 a, b;\n"
            ".reg .f32 f0, f1, f2, f3;\n"
            "mov.b32 {l, h}, $2;\n"
            "cvt.rn.f16x2.e4m3x2 a, l;\n"
            "cvt.rn.f16x2.e4m3x2 b, h;\n"
            "mov.b32 {a0, a1}, a;\n"
            "mov.b32 {b0, b1}, b;\n"
            "cvt.f32.f16 f0, a0;\n"
            "cvt.f32.f16 f1, a1;\n"
            "cvt.f32.f16 f2, b0;\n"
            "cvt.f32.f16 f3, b1;\n"
            "mul.rn.f32 f0, f0, $3;\n"
            "mul.rn.f32 f1, f1, $3;\n"
            "mul.rn.f32 f2, f2, $3;\n"
            "mul.rn.f32 f3, f3, $3;\n"
            "cvt.rn.bf16x2.f32 $0, f1, f0;\n"
            "cvt.rn.bf16x2.f32 $1, f3, f2;}",
            "=r,=r,r,f",
            loc,
            ip,
        )

    @cutlass.cute.jit
    def ue8m0_code_to_f32(code: Int32) -> Float32:
        """UE8M0 code (0..254) -> ``2**(code - 127)`` as float32 (exact; code 0 is the subnormal 2**-127)."""
        bits = code << 23
        if code == 0:
            bits = Int32(0x00400000)
        return bits_to_f32(bits)

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
    def fold_luts(word: Int32, kb: cutlass.Constexpr[int]):
        """Folded FP8 mode: the decode tables (``decode_e2m1x8``'s ``lut_lo``, ``lut_hi``) of 32-block ``kb`` from
        its byte of a word of biased codes b = d - ``FOLD_MIN_SHIFT`` (``fold_fp8_scales``): b in the table's
        nonzero bytes (a byte permute), times 8 (exponent field) plus the lowered tables: two permutes, two
        multiply-adds. Every byte stays in 0x08..0x7C: no carry between bytes."""
        rep_lo = prmt(word, Int32(0), Int32((kb << 12) | (kb << 8) | (kb << 4) | 4))
        rep_hi = prmt(word, Int32(0), Int32(kb * 0x1111))
        return rep_lo * Int32(8) + Int32(FOLD_LUT_LO), rep_hi * Int32(8) + Int32(FOLD_LUT_HI)

    @dsl_user_op
    def decode_e2m1x8_bf16(x, multipliers, half: int, *, loc=None, ip=None):
        """One BF16-mode word (8 E2M1 elements) and its decode multiplier ``2**(126 + s - P)``, the BF16 in half
        ``half`` of ``multipliers`` (``ue8m0_to_bf16_multiplier_pair``) -> the four bf16x2 fragment registers
        j = 0..3 (``BF16_CODE_BITS``). The multiplier is broadcast to both halves (an operand swizzle of
        ``HMUL2``, no instruction)."""
        pick = "{ml, ml}" if half == 0 else "{mh, mh}"
        return pure_asm(
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

    @cutlass.cute.jit
    def ue8m0_to_bf16_multiplier_pair(word: Int32, pair: cutlass.Constexpr[int]) -> Int32:
        """UE8M0 codes in bytes ``2 * pair`` and ``2 * pair + 1`` of a packed scale word -> their BF16-mode decode
        multipliers ``2**(126 + s - P)`` (exponent field ``code + BF16_SCALE_FIELD_OFFSET``) in the low and the
        high half of one word: a byte permute and one multiply-add for two multipliers."""
        codes = prmt(word, Int32(0), Int32(0x4140 + 0x202 * pair))  # byte 2p at bit 0, byte 2p + 1 at bit 16
        return codes * Int32(0x80) + Int32(BF16_SCALE_FIELD_OFFSET * 0x00800080)

    @cutlass.cute.jit
    def ue8m0_to_f32(word: Int32, byte: cutlass.Constexpr[int]) -> Float32:
        """UE8M0 code in byte ``byte`` of a packed scale word -> ``2**(code - 127)`` as float32 (exact;
        code 0 is the subnormal 2**-127)."""
        return ue8m0_code_to_f32((word >> (8 * byte)) & Int32(0xFF))

    return SimpleNamespace(
        prmt=prmt, bits_to_f32=bits_to_f32, f32_bits=f32_bits, decode_e2m1x8=decode_e2m1x8,
        ue8m0_to_f32=ue8m0_to_f32, fold_luts=fold_luts, f32x4_to_e4m3x4=f32x4_to_e4m3x4, decode_e2m1x8_bf16=decode_e2m1x8_bf16,
        ue8m0_to_bf16_multiplier_pair=ue8m0_to_bf16_multiplier_pair, e4m3x4_to_bf16x4=e4m3x4_to_bf16x4,
        ue8m0_code_to_f32=ue8m0_code_to_f32,
    )


_HELPERS = None


def device_helpers():
    """The DSL device functions above as attributes of a namespace (built on first use)."""
    global _HELPERS
    if _HELPERS is None:
        _HELPERS = _device_helpers()
    return _HELPERS
