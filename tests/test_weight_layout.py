"""SM90 weight layouts and their in-kernel decode, emulated bit for bit on a CPU.

FP8-mode and BF16-mode layouts: round trips, one contiguous piece per row block and K chunk; Python models of the
kernels' decode instruction sequences reassemble the exact E2M1 values (times scale, folded or BF16-mode scales) in
wgmma fragment order; ``nonzero_blocks``, ``fold_fp8_scales``, why the BF16-mode layout needs one split register,
and ``prepare_fp4_weights``'s scale-range checks. CPU only.
"""

import itertools
import struct

import pytest
import torch
from helpers.weights import bf16_decode_case, foldable_weights

from megamoe.kernels.sm90 import prepare_fp4_weights
from megamoe.kernels.weight_layout import (
    BF16_ACC_SHIFT,
    BF16_CODE_BITS,
    BF16_MAX_SCALE_CODE,
    BF16_MIN_SCALE_CODE,
    BF16_SCALE_FIELD_OFFSET,
    E4M3_LUT_HI,
    E4M3_LUT_LO,
    FOLD_LUT_HI,
    FOLD_LUT_LO,
    FOLD_MAX_SHIFT,
    FOLD_MIN_SHIFT,
    fold_fp8_scales,
    from_sm90_bf16_weight_layout,
    from_sm90_weight_layout,
    nonzero_blocks,
    to_sm90_bf16_weight_layout,
    to_sm90_weight_layout,
    unfold_fp8_scales,
)
from megamoe.layouts import dequantize_fp4, pack_ue8m0, unpack_ue8m0
from megamoe.layouts.fp4 import e2m1_table, unpack_fp4_codes


def _row_major(bk: torch.Tensor) -> torch.Tensor:
    """A blocked kernel layout ``[E, N/64, K/128, 64, W]`` as ``[E, N, K/128, W]`` (row n = 64 * block + r)."""
    e, blocks, chunks, rows, width = bk.shape
    return bk.transpose(2, 3).reshape(e, blocks * rows, chunks, width)


def test_weight_layout_roundtrip():
    b = torch.randint(0, 256, (2, 128, 256), dtype=torch.uint8)
    bk = to_sm90_weight_layout(b)
    assert bk.shape == (2, 2, 4, 64, 64)
    assert torch.equal(from_sm90_weight_layout(bk), b)
    with pytest.raises(ValueError, match="blocks of 64"):
        to_sm90_weight_layout(b[:, :96])


def test_weight_layouts_keep_a_row_block_chunk_contiguous():
    """Both layouts: the 64 rows x 64 bytes of one row block and K chunk are one contiguous 4 KiB piece, rows
    in order, each row's chunk as in the row-major form (checked against the canonical bytes of row 70)."""
    b = torch.randint(0, 256, (1, 128, 256), dtype=torch.uint8)
    fp8 = to_sm90_weight_layout(b)
    piece = fp8[0, 1, 2].reshape(-1)  # block 1 (rows 64..127), chunk 2
    assert piece.numel() == 4096 and fp8[0, 1, 2].is_contiguous()
    one_row = torch.zeros_like(b)
    one_row[0, 70] = b[0, 70]
    assert torch.equal(piece[6 * 64: 7 * 64], to_sm90_weight_layout(one_row)[0, 1, 2, 6])
    assert torch.equal(to_sm90_bf16_weight_layout(b)[0, 1, 2, 6], to_sm90_bf16_weight_layout(one_row)[0, 1, 2, 6])


def _prmt(lo: int, hi: int, sel: int) -> int:
    src = lo.to_bytes(4, "little") + hi.to_bytes(4, "little")
    out = bytearray(4)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        out[i] = (0xFF if byte & 0x80 else 0) if nib & 8 else byte
    return int.from_bytes(out, "little")


def _decode_word(x: int, lut_lo: int = E4M3_LUT_LO, lut_hi: int = E4M3_LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of ``decode_e2m1x8`` (same instruction sequence)."""
    mag = x & 0x77777777
    lo = _prmt(lut_lo, lut_hi, mag)
    hi = _prmt(lut_lo, lut_hi, mag >> 16)
    shifted = (x << 4) & 0xFFFFFFFF
    return lo | (_prmt(shifted, x, 0x5140) & 0x80808080), hi | (_prmt(shifted, x, 0x7362) & 0x80808080)


def test_decode_emulation_matches_e2m1():
    """Kernel layout + per-thread decode reassemble the exact E2M1 values in wgmma A-fragment order:
    thread (warp w, lane l) owns rows 16w + l//4 (+8), k = 32kb + 16h + 4(l%4) + i."""
    torch.manual_seed(0)
    rows, k = 64, 256
    b = torch.randint(0, 256, (1, rows, k // 2), dtype=torch.uint8)
    words = _row_major(to_sm90_weight_layout(b)).view(torch.int32)[0]  # [rows, K/128, 16 words]
    expect = e2m1_table()[unpack_fp4_codes(b[0]).long()]  # [rows, K]
    got = torch.full((rows, k), float("nan"))
    for chunk in range(k // 128):
        for warp in range(4):
            for lane in range(32):
                g, q = lane // 4 + 16 * warp, lane % 4
                for r in range(2):
                    for kb in range(4):
                        word = int(words[g + 8 * r, chunk, 4 * q + kb]) & 0xFFFFFFFF
                        for h, reg in enumerate(_decode_word(word)):
                            vals = torch.tensor(list(struct.pack("<I", reg)), dtype=torch.uint8)
                            k0 = chunk * 128 + 32 * kb + 16 * h + 4 * q
                            got[g + 8 * r, k0 : k0 + 4] = vals.view(torch.float8_e4m3fn).float()
    assert torch.equal(got, expect), (got != expect).nonzero()[:10]


def _fold_luts(word: int, kb: int) -> tuple[int, int]:
    """Bit-exact Python model of the device ``fold_luts`` (permute, multiply-add)."""
    rep_lo = _prmt(word, 0, (kb << 12) | (kb << 8) | (kb << 4) | 4)
    rep_hi = _prmt(word, 0, kb * 0x1111)
    return (rep_lo * 8 + FOLD_LUT_LO) & 0xFFFFFFFF, (rep_hi * 8 + FOLD_LUT_HI) & 0xFFFFFFFF


def test_folded_decode_emulation_is_exact():
    """Folded FP8 mode: for every relative exponent d of the window, in every byte of the scale word, every
    E2M1 code (both signs) decodes to the E4M3 ``v * 2**d`` exactly (torch's E4M3 and E2M1 tables)."""
    table = e2m1_table().double()
    words = [0x12345678 & 0x0B0B0B0B]  # a mix of biased codes in the other bytes
    for d in range(FOLD_MIN_SHIFT, FOLD_MAX_SHIFT + 1):
        biased = d - FOLD_MIN_SHIFT
        for kb in range(4):
            word = (words[0] & ~(0xFF << (8 * kb))) | (biased << (8 * kb))
            lut_lo, lut_hi = _fold_luts(word, kb)
            for first in range(0, 16, 8):  # codes 0-7 then 8-15 as the word's 8 nibbles
                x = sum((first + i) << (4 * i) for i in range(8))
                regs = _decode_word(x, lut_lo, lut_hi)
                got = torch.tensor(list(struct.pack("<II", *regs)), dtype=torch.uint8).view(torch.float8_e4m3fn)
                want = table[first : first + 8] * 2.0**d
                assert torch.equal(got.double(), want), (d, kb, got, want)
                assert not torch.isnan(got.float()).any()


def test_nonzero_blocks():
    """``nonzero_blocks`` (one expert at a time) marks exactly the 32-blocks whose dequantized values are not all
    zero: random weights with ~3% all-zero blocks, over three experts."""
    gen = torch.Generator().manual_seed(11)
    b, b_sf = foldable_weights(3, 64, 512, gen)
    want = dequantize_fp4(b, b_sf).reshape(3, 64, 16, 32).ne(0).any(-1)
    assert 0 < int((~want).sum()) < want.numel()
    assert torch.equal(nonzero_blocks(b), want)


def test_fold_fp8_scales():
    """Folded scales round-trip on every nonzero block; the row scale is 2**(max - 6 - 127); a spread of 12
    binades or an all-zero row's default base behave as documented; ``prepare_fp4_weights``'s ``fold``."""
    gen = torch.Generator().manual_seed(5)
    b, b_sf = foldable_weights(2, 64, 512, gen)
    folded = fold_fp8_scales(b, b_sf)
    assert folded.shape == (2, 5, 64) and folded.dtype == torch.int32
    codes = unpack_ue8m0(b_sf).long()
    nonzero = (unpack_fp4_codes(b) & 7).reshape(2, 64, 16, 32).amax(-1) > 0
    assert torch.equal(unpack_ue8m0(unfold_fp8_scales(folded))[nonzero].long(), codes[nonzero])
    top = torch.where(nonzero, codes, -1).amax(-1)
    assert torch.equal(folded[:, -1].view(torch.float32).double().t(), torch.exp2(top - FOLD_MAX_SHIFT - 127.0).t())
    biased = unpack_ue8m0(folded[:, :-1].contiguous()).long()
    assert int(biased.max()) <= FOLD_MAX_SHIFT - FOLD_MIN_SHIFT
    assert int(biased.min()) == 0 and int(biased.max()) == FOLD_MAX_SHIFT - FOLD_MIN_SHIFT  # both window ends used
    # An all-zero row folds (scale 1); one block 12 binades below its row's top does not.
    zero_row = b.clone()
    zero_row[1, 7] = 0
    assert fold_fp8_scales(zero_row, b_sf)[1, -1, 7].view(torch.float32) == 1.0
    wide = codes.clone().to(torch.uint8)
    row_nonzero = nonzero[0, 3].nonzero().flatten()
    wide[0, 3, row_nonzero[0]] = int(top[0, 3]) - FOLD_MAX_SHIFT + FOLD_MIN_SHIFT - 1
    assert fold_fp8_scales(b, pack_ue8m0(wide)) is None
    bk, bk_sf = prepare_fp4_weights(b, pack_ue8m0(wide))  # fold=None: absolute scales
    assert torch.equal(bk_sf, pack_ue8m0(wide).transpose(1, 2))
    with pytest.raises(ValueError, match="`b_sf` cannot be folded"):
        prepare_fp4_weights(b, pack_ue8m0(wide), fold=True)
    assert torch.equal(prepare_fp4_weights(b, b_sf)[1], folded)
    assert torch.equal(prepare_fp4_weights(b, b_sf, fold=False)[1], b_sf.transpose(1, 2))
    with pytest.raises(ValueError, match="`fold` applies to mma='fp8' only"):
        prepare_fp4_weights(b, b_sf, mma="bf16", fold=True)


def test_bf16_weight_layout_roundtrip():
    b = torch.randint(0, 256, (2, 128, 256), dtype=torch.uint8)
    bk = to_sm90_bf16_weight_layout(b)
    assert bk.shape == (2, 2, 4, 64, 16) and bk.dtype == torch.int32
    assert torch.equal(from_sm90_bf16_weight_layout(bk), b)


def _bf16_half(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_rne(x: float) -> int:
    """float -> BF16 bits, round to nearest even (through FP32: exact for the products modelled here)."""
    f = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF


def _mul_bf16x2(a: int, b: int) -> int:
    """``mul.rn.bf16x2``: both halves, exact product rounded once (subnormals kept)."""
    lo = _to_bf16_rne(_bf16_half(a) * _bf16_half(b))
    hi = _to_bf16_rne(_bf16_half(a >> 16) * _bf16_half(b >> 16))
    return lo | (hi << 16)


def _bf16_multiplier(codes: list[int], kb: int) -> int:
    """Model of ``ue8m0_to_bf16_multiplier_pair`` on the packed scale word of ``codes`` (4 UE8M0 codes, byte i =
    code i) for block pair ``kb // 2``, then of ``decode_e2m1x8_bf16``'s broadcast of half ``kb % 2``."""
    word = sum(c << (8 * i) for i, c in enumerate(codes))
    sel = 0x4140 + 0x202 * (kb // 2)
    src = word.to_bytes(4, "little") + bytes(4)
    placed = int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")
    pair = (placed * 0x80 + BF16_SCALE_FIELD_OFFSET * 0x00800080) & 0xFFFFFFFF
    half = (pair >> (16 * (kb % 2))) & 0xFFFF
    return half | (half << 16)


def _decode_word_bf16(x: int, mult: int) -> tuple[int, int, int, int]:
    """Bit-exact Python model of ``decode_e2m1x8_bf16`` (same instruction sequence)."""
    m32 = 0xFFFFFFFF
    d0 = _mul_bf16x2((x << 6) & m32 & 0x81C081C0, mult)
    d1 = _mul_bf16x2((x << 2) & m32 & 0x81C081C0, mult)
    d2 = _mul_bf16x2(((x >> 4) | (x << 28)) & m32 & 0x81C081C0, mult)
    d3 = _mul_bf16x2((x & 0x81808180) | ((x >> 8) & 0x00400040), mult)
    return d0, d1, d2, d3


def test_bf16_layout_needs_one_split_register():
    """The BF16-mode layout's claim: no four rotations of one window (code bits m, e0, e1 at BF16 bits 6-8,
    the sign at 15, both halves) tile a 32-bit word, so at least one register needs a second window; three
    do tile part of it, as ``BF16_CODE_BITS`` uses, and its fourth register covers exactly the rest."""
    window = {6, 7, 8, 15, 22, 23, 24, 31}
    translates = [frozenset((p - r) % 32 for p in window) for r in range(32)]
    assert not any(
        len(a | b | c | d) == 32 for a, b, c, d in itertools.combinations(translates, 4)
    )
    layout = [frozenset((p + 16 * i) % 32 for p in bits for i in range(2)) for bits in BF16_CODE_BITS]
    assert all(layout[j] in translates for j in range(3)) and layout[3] not in translates
    assert len(frozenset().union(*layout)) == 32


def test_bf16_decode_emulation_matches_dequantize():
    """BF16-mode layout + per-thread decode + scale multiplier reassemble ``dequantize_fp4 * 2**-P`` bit for bit
    (every code, -0 included, every exact scale code) in wgmma bf16 A-fragment order: thread (warp w, lane l)
    owns rows 16w + l//4 (+8), k = 16kk + 8h + 2(l%4) + i, register (kk, h) holding i = 0, 1."""
    rows, k = 64, 256
    b, b_sf = bf16_decode_case(rows, k)
    words = _row_major(to_sm90_bf16_weight_layout(b))[0]  # [rows, K/128, 16]
    sf = unpack_ue8m0(b_sf[0])  # [rows, K/32] codes
    expect = (dequantize_fp4(b, b_sf)[0] * 2.0**-BF16_ACC_SHIFT).to(torch.bfloat16).view(torch.int16)
    got = torch.zeros(rows, k, dtype=torch.int32) - 1
    for chunk in range(k // 128):
        for warp in range(4):
            for lane in range(32):
                g, q = lane // 4 + 16 * warp, lane % 4
                for r in range(2):
                    row = g + 8 * r
                    for kb in range(4):
                        word = int(words[row, chunk, 4 * q + kb]) & 0xFFFFFFFF
                        mult = _bf16_multiplier(sf[row, 4 * chunk: 4 * chunk + 4].tolist(), kb)
                        for j, reg in enumerate(_decode_word_bf16(word, mult)):
                            k0 = chunk * 128 + 32 * kb + 16 * (j // 2) + 8 * (j % 2) + 2 * q
                            got[row, k0], got[row, k0 + 1] = reg & 0xFFFF, reg >> 16
    expect = expect.to(torch.int32) & 0xFFFF
    bad = (got != expect).nonzero()
    assert not bad.numel(), (
        f"{bad.shape[0]} mismatches; first (row, k, code, scale code, got, want): "
        + str([(r, c, int(unpack_fp4_codes(b[0])[r, c]), int(sf[r, c // 32]), hex(int(got[r, c])), hex(int(expect[r, c])))
               for r, c in bad[:8].tolist()])
    )


def test_bf16_prepare_checks_the_scale_range():
    b, b_sf = bf16_decode_case(64, 128, seed=1)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    assert torch.equal(bk, to_sm90_bf16_weight_layout(b)) and torch.equal(bk_sf, b_sf.transpose(1, 2))
    codes = unpack_ue8m0(b_sf).clone()
    codes[0, 3, 1] = BF16_MAX_SCALE_CODE + 1
    with pytest.raises(ValueError, match=r"`b_sf` has UE8M0 codes above .* \[0, 3, 1\]"):
        prepare_fp4_weights(b, pack_ue8m0(codes), mma="bf16")
    codes = unpack_ue8m0(b_sf).clone()
    nonzero = (unpack_fp4_codes(b) & 7).reshape(1, 64, 4, 32).amax(-1) > 0
    e, r, blk = nonzero.nonzero()[0].tolist()
    codes[e, r, blk] = BF16_MIN_SCALE_CODE - 1
    with pytest.raises(ValueError, match="`b_sf` has UE8M0 codes below"):
        prepare_fp4_weights(b, pack_ue8m0(codes), mma="bf16")
    with pytest.raises(ValueError, match="`mma` must be one of"):
        prepare_fp4_weights(b, b_sf, mma="bf8")

