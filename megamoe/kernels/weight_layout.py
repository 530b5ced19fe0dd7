"""Kernel weight layouts of FP4 (E2M1) experts for Hopper, made once at weight-load time (host side, no DSL).

Hopper has no FP4 tensor cores: the SM90 kernels dequantize packed E2M1 weights in registers straight into a
wgmma / mma A fragment (``megamoe.kernels.dequant``). These layouts put each thread's slice of a 128-wide K chunk
where one 16-byte shared-memory load fetches it in fragment order (four 16-byte segments per chunk and row,
segment ``q = lane % 4``; rows ``g`` and ``g + 8``, ``g = lane // 4 + 16 * warp``).

Both layouts store rows in blocks of ``ROW_BLOCK`` = 64: ``[E, N/64, K/128, 64, 64 bytes]``, so the 64 rows x
64 bytes of one block and K chunk -- what a kernel reads together (a TMA box of 64 to 256 rows, or a warp's
16 rows) -- are one contiguous 4 KiB piece of memory.

FP8 layout (``to_sm90_weight_layout``, uint8 ``[E, N/64, K/128, 64, 64]``): E2M1 -> E4M3 is exact (every E2M1 value
is an E4M3 value). A thread owns, per 32-wide K block ``kb``, ``k = kb*32 + 16*h + 4*q + i`` (h in {0, 1}, i in
0..3): the PTX ``wgmma .e4m3`` A fragment, four registers of four bytes, ``(row, h)`` major. Segment ``q`` holds
words ``kb = 0..3`` whose low half is ``h = 0`` and high half ``h = 1``; nibble order inside a byte is unchanged
(even element in the low nibble). The per-32 scales are applied outside the MMA, or folded (``fold_fp8_scales``)
relative to their row's scale (or their row and 128-K chunk's: the fallback for rows spanning more than 11 binades)
inside the dequantization: ``v * 2**d`` is exact in E4M3 for d in -5..6. ``dequantize_sm90_fp8_weights`` reads any
of these formats back (exactly; the check of the fold).

BF16 layout (``to_sm90_bf16_weight_layout``, int32 ``[E, N/64, K/128, 64, 16]``): E2M1 times its UE8M0 scale is
exact in BF16, so the MMA needs no scales at all. A thread owns, per 16-wide K block ``kk``, ``k = 16*kk + 8*h +
2*q + i`` (the ``wgmma .bf16`` A fragment: registers ``(row, h)``, element i = 0 in the low half). Word ``w`` of
segment ``q`` holds the 8 elements of K blocks ``kk = 2w, 2w + 1`` (one 32-wide scale block) for one row;
register ``j = 2 * (kk - 2w) + h`` of them is decoded from the word x as follows (bit positions of its low-half
element; the high-half element's are 16 higher, modulo 32):

    j  bits m, e0, e1, sign   window                                     BF16 bits of the low half
    0  0, 1, 2, 9             (x << 6) & 0x81C081C0                      sign 15, e1 e0 m at 8..6
    1  4, 5, 6, 13            (x << 2) & 0x81C081C0                      the same
    2  10, 11, 12, 19         rotr(x, 4) & 0x81C081C0                    the same (the high sign wraps to bit 3)
    3  14, 7, 8, 15           (x & 0x81808180) | ((x >> 8) & 0x00400040) the same

Registers 0-2 are whole windows of x (a shift or rotate and one mask); register 3 takes the 8 bits left over,
which no single window covers, so its mantissa bit comes from a second window (no four rotations of the window
tile the 32 bits of a word: ``tests/test_weight_layout.py``). The window puts the three magnitude bits ``e1 e0 m``
of both elements at BF16 bits 8..6 -- exponent bits 1..0 and the top mantissa bit -- and the sign at bit 15, so
the BF16 value of the window is exactly ``v * 2**-126`` for every E2M1 value v (e = 0, code 1 = 0.5, lands on the
BF16 subnormal 2**-127; -0 stays -0). One ``mul.rn.bf16x2`` by ``2**(126 + s - P)`` (s the UE8M0 exponent,
``P = BF16_ACC_SHIFT``) restores the value and applies the scale in one exact step (``mul.bf16x2`` has no ``.ftz``
form: subnormal inputs and results are kept).

Exact range of the BF16 layout: the multiplier ``2**(126 + s - P)`` must be a finite BF16 (``s <= P + 1``) and the
smallest product ``0.5 * 2**(s - P)`` at least the smallest BF16 subnormal 2**-133 (``s >= P - 132``). With
``P = 16`` the decoded weights are ``w * 2**-16`` and the kernel multiplies its FP32 accumulator by ``2**16``
(exact) before the epilogue: UE8M0 codes ``BF16_MIN_SCALE_CODE..BF16_MAX_SCALE_CODE`` = 11..144 (scales
``2**-116 .. 2**17``, block maxima up to 786432) are exact; an all-zero block is exact for any code <= 144
(``quantize_fp4`` gives it code 0). ``check_bf16_scale_range`` checks this once. The FP32 accumulator then holds
sums times 2**-16: (partial) sums below 2**-110 in magnitude are FP32-subnormal inside the MMA (instead of below
2**-126), far from any real activation x weight product.
"""

from __future__ import annotations

from dataclasses import dataclass

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


FOLD_WINDOW = FOLD_MAX_SHIFT - FOLD_MIN_SHIFT
"""Binades (11) the nonzero 32-blocks of one folded row (or row chunk) may span: their UE8M0 codes within
``FOLD_WINDOW`` of each other."""
FOLD_FORMATS = ("row", "chunk")
"""Folded FP8-mode scale formats (``fold_fp8_scales``): one FP32 scale per weight row, or per row and 128-K chunk."""
FOLD_PER = ("row", "chunk", "auto")
_MIN_BASE = 1
"""Smallest base code: the FP32 scale ``2**(base - 127)`` stays a normal number (>= 2**-126)."""
_ZERO_BASE = 127
"""Base of a row (chunk) without a nonzero block: scale 1.0 (any base is exact there)."""


class FoldFallbackWarning(UserWarning):
    """Weights folded per (row, 128-K chunk) because some rows span more binades than one FP32 scale per row allows
    (``fold_fp8_scales(..., per="auto")``); the message names the rows (``FoldReport``)."""


@dataclass(frozen=True)
class FoldReport:
    """What folding the per-32 UE8M0 scales of one weight tensor ``[E, N, K]`` into exact E4M3 needed.

    ``format``: the folded format made (``"row"``, ``"chunk"``) or None (not folded: absolute scales, or raised).
    ``rows_per_row``: rows whose nonzero 32-blocks span at most ``FOLD_WINDOW`` binades (one FP32 scale per row
    suffices; all-zero rows count here). ``chunk_rows``: ``(expert, row, spread)`` of every row spanning more (they
    need one FP32 scale per 128-K chunk). ``unfoldable``: ``(expert, row, chunk, spread)`` of every 128-K chunk whose
    nonzero blocks alone span more (no exact fold exists). ``max_row_spread``: the widest row's span (-1: every row
    all zero). Rows are numbered as the caller's tensor (``prepare_fp4_weights_l1``: canonical L1 rows, ``[0, I)``
    gate_proj, ``[I, 2I)`` up_proj)."""

    experts: int
    rows: int
    k: int
    format: str | None
    rows_per_row: int
    max_row_spread: int
    chunk_rows: tuple[tuple[int, int, int], ...]
    unfoldable: tuple[tuple[int, int, int, int], ...]

    @property
    def fits_rows(self) -> bool:
        """Every row fits one FP32 scale (the row format exists)."""
        return not self.chunk_rows

    @property
    def fits_chunks(self) -> bool:
        """Every 128-K chunk fits one FP32 scale (the chunk format exists)."""
        return not self.unfoldable

    def summary(self, limit: int = 16) -> str:
        """The report in words: how many rows fit one scale per row, and which need per-chunk scales or cannot be
        folded (the first ``limit`` of each; the fields hold them all)."""
        total = self.experts * self.rows
        text = (f"[{self.experts}, {self.rows}, {self.k}] weights: {self.rows_per_row} of {total} rows fit one FP32 "
                f"scale per row (nonzero 32-blocks within {FOLD_WINDOW} binades; widest row {self.max_row_spread})")
        if self.chunk_rows:
            text += (f"; {len(self.chunk_rows)} rows need one FP32 scale per 128-K chunk: "
                     + _listing([f"expert {e} row {r} (spread {d})" for e, r, d in self.chunk_rows], limit))
        if self.unfoldable:
            text += (f"; {len(self.unfoldable)} 128-K chunks span more than {FOLD_WINDOW} binades even alone (no "
                     "exact E4M3 fold): "
                     + _listing([f"expert {e} row {r} chunk {c} (spread {d})" for e, r, c, d in self.unfoldable], limit))
        fmt = {"row": "one FP32 scale per row", "chunk": "one FP32 scale per row and 128-K chunk"}
        return text + f"; folded format: {fmt.get(self.format, 'none')}"


def _listing(items: list[str], limit: int) -> str:
    more = f" and {len(items) - limit} more (FoldReport lists them all)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _spread(codes: torch.Tensor, nonzero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top code, top - bottom) over the last dim's nonzero blocks; (-1, -1) where none is nonzero."""
    top = torch.where(nonzero, codes, torch.full_like(codes, -1)).amax(-1)
    bottom = torch.where(nonzero, codes, torch.full_like(codes, 1 << 16)).amin(-1)
    return top, torch.where(top >= 0, top - bottom, torch.full_like(top, -1))


def _base(top: torch.Tensor) -> torch.Tensor:
    """Base code of a row or chunk from its largest nonzero code: ``top - FOLD_MAX_SHIFT``, at least ``_MIN_BASE``
    (a normal FP32 scale; exact for any spread within the window since codes are >= 0), ``_ZERO_BASE`` if none."""
    return torch.where(top >= 0, (top - FOLD_MAX_SHIFT).clamp(min=_MIN_BASE), torch.full_like(top, _ZERO_BASE))


def _biased_words(codes: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Chunk-major words ``int32 [E, K/128, N]`` of the biased relative codes ``d - FOLD_MIN_SHIFT`` (byte kb =
    32-block kb of the chunk) for block codes ``[E, N, K/32]`` against ``base`` broadcast to them (all-zero blocks:
    d clamped into the window)."""
    d = codes - base
    biased = (d.clamp(FOLD_MIN_SHIFT, FOLD_MAX_SHIFT) - FOLD_MIN_SHIFT).to(torch.uint8)
    return biased.contiguous().view(torch.int32).transpose(1, 2)


def _scale_bits(base: torch.Tensor) -> torch.Tensor:
    """int32 FP32 bits of ``2**(base - 127)`` (base in [1, 254])."""
    return (base.to(torch.int32) << 23).view(torch.int32)


def _fold(b: torch.Tensor, b_sf: torch.Tensor, per: str, row_map: torch.Tensor | None):
    """``fold_fp8_scales``' work: ``(folded or None, FoldReport)``."""
    if per not in FOLD_PER:
        fail("per", f"must be one of {FOLD_PER}, got {per!r}")
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    e, n, half_k = b.shape
    check_multiple("b.shape[2] * 2 (K)", 2 * half_k, K_CHUNK, "scales are packed per 128-wide K chunk")
    check_tensor("b_sf", b_sf, dtype=torch.int32, shape=(e, n, 2 * half_k // K_CHUNK))
    codes = unpack_ue8m0(b_sf).to(torch.int32)  # [E, N, K/32]
    nonzero = nonzero_blocks(b)
    top, spread = _spread(codes, nonzero)  # [E, N]
    chunk_codes, chunk_nonzero = codes.unflatten(-1, (-1, 4)), nonzero.unflatten(-1, (-1, 4))
    chunk_top, chunk_spread = _spread(chunk_codes, chunk_nonzero)  # [E, N, K/128]
    names = torch.arange(n, device=b.device) if row_map is None else row_map.to(b.device)
    wide = (spread > FOLD_WINDOW).nonzero().tolist()
    bad = (chunk_spread > FOLD_WINDOW).nonzero().tolist()
    chunk_rows = tuple(sorted((x, int(names[r]), int(spread[x, r])) for x, r in wide))
    unfoldable = tuple(sorted((x, int(names[r]), c, int(chunk_spread[x, r, c])) for x, r, c in bad))
    fmt = None
    if not chunk_rows and per in ("row", "auto"):
        fmt = "row"
    elif not unfoldable and per in ("chunk", "auto"):
        fmt = "chunk"
    report = FoldReport(e, n, 2 * half_k, fmt, e * n - len(chunk_rows), int(spread.max()) if spread.numel() else -1,
                        chunk_rows, unfoldable)
    if fmt is None:
        return None, report
    if fmt == "row":
        base = _base(top)  # [E, N]
        return torch.cat([_biased_words(codes, base[..., None]), _scale_bits(base)[:, None, :]], 1).contiguous(), report
    base = _base(chunk_top)  # [E, N, K/128]
    words = _biased_words(codes, base.repeat_interleave(4, dim=-1))
    return torch.cat([words, _scale_bits(base).transpose(1, 2)], 1).contiguous(), report


def fold_fp8_scales(b: torch.Tensor, b_sf: torch.Tensor, per: str = "row") -> torch.Tensor | None:
    """FP8-mode folded scales of canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``), or None
    where no fold of the asked format exists.

    Folded, the decode applies each 32-block's scale relative to a base: E2M1 ``v`` of a block with UE8M0 code ``s``
    decodes to the E4M3 ``v * 2**d`` (exact: d = s - base in ``[FOLD_MIN_SHIFT, FOLD_MAX_SHIFT]``, a normal E4M3
    from 2**-6 to 384; the lookup table's exponents move by d, ``FOLD_LUT_LO/HI``), and the kernel multiplies the
    FP32 sums by the FP32 scale ``2**(base - 127)`` instead of every 32-K block's partial sums by the weight scale.
    base = the largest code of a block holding a nonzero value, minus ``FOLD_MAX_SHIFT``, and at least 1 (the scale
    stays a normal FP32; exact for any spread within the window, codes being >= 0); all-zero blocks do not count
    (their d is clamped into the window), an all-zero row or chunk gets base 127 (scale 1).

    ``per="row"`` (the format of the existing FP8-mode kernels): one base per weight row; ``int32 [E, K/128 + 1,
    N]``: chunk-major words of the biased codes ``d - FOLD_MIN_SHIFT`` (byte kb = 32-block kb of the chunk, as the
    packed scales), then one row of the FP32 bits of each row's scale. None if some row's nonzero blocks span more
    than ``FOLD_WINDOW`` = 11 binades. ``per="chunk"``: one base per (row, 128-K chunk); ``int32 [E, 2 * K/128,
    N]``: rows ``[0, K/128)`` the biased codes (chunk-major, as above, relative to their chunk's base), rows ``[K/128,
    2 * K/128)`` the FP32 bits of each (chunk, row) scale (chunk-major). None if the nonzero blocks of some 128-K
    chunk alone span more than 11 binades. ``per="auto"``: the row format where every row fits, else the chunk
    format, else None. Which rows needed what: ``fold_report`` (or ``fold_fp8_scales_with_report``). One host sync
    (weight-load time)."""
    return _fold(b, b_sf, per, None)[0]


def fold_fp8_scales_with_report(b: torch.Tensor, b_sf: torch.Tensor, per: str = "auto",
                                row_map: torch.Tensor | None = None) -> tuple[torch.Tensor | None, FoldReport]:
    """``fold_fp8_scales`` and its ``FoldReport``; ``row_map`` (int ``[N]``): the caller's name of each row in the
    report (e.g. canonical L1 rows before the gate/up interleave)."""
    return _fold(b, b_sf, per, row_map)


def fold_report(b: torch.Tensor, b_sf: torch.Tensor, row_map: torch.Tensor | None = None) -> FoldReport:
    """Which rows of canonical FP4 weights fold per row, which need per-chunk scales and which chunks cannot be
    folded (``FoldReport``; its ``format`` is the one ``per="auto"`` makes)."""
    return _fold(b, b_sf, "auto", row_map)[1]


def folded_scale_format(b_sf: torch.Tensor, chunks: int) -> str:
    """The format of FP8-mode kernel scales ``int32 [E, rows, N]`` of weights with ``chunks`` = K/128 chunks:
    ``"absolute"`` (rows = K/128, packed UE8M0), ``"row"`` (K/128 + 1) or ``"chunk"`` (2 * K/128; for K = 128 the
    two folded formats coincide and read as ``"row"``)."""
    check_tensor("b_sf", b_sf, dtype=torch.int32, ndim=3)
    formats = {chunks: "absolute", chunks + 1: "row", 2 * chunks: "chunk"}
    if b_sf.shape[1] not in formats:
        fail("b_sf", f"must hold K/128 = {chunks} chunk rows (absolute UE8M0 scales), {chunks + 1} (folded per row) "
             f"or {2 * chunks} (folded per row and 128-K chunk), got shape {list(b_sf.shape)}")
    return formats[b_sf.shape[1]]


def unfold_fp8_scales(folded: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """Inverse of ``fold_fp8_scales`` for the blocks it encodes: folded scales -> the canonical packed scales ``int32
    [E, N, K/128]`` (an all-zero block's code is its clamped one). ``chunks`` (K/128) tells the format; None reads
    the row format ``[E, K/128 + 1, N]``."""
    check_tensor("folded", folded, dtype=torch.int32, ndim=3)
    fmt = "row" if chunks is None else folded_scale_format(folded, chunks)
    if fmt == "absolute":
        fail("folded", "holds absolute UE8M0 scales (K/128 chunk rows), not folded ones")
    c = folded.shape[1] - 1 if fmt == "row" else folded.shape[1] // 2
    words = folded[:, :c].transpose(1, 2).contiguous()  # [E, N, K/128]
    base = ((folded[:, c:] >> 23) & 0xFF).transpose(1, 2)  # [E, N, 1] or [E, N, K/128]
    codes = unpack_ue8m0(words).to(torch.int32) + FOLD_MIN_SHIFT + base.repeat_interleave(4 if fmt == "chunk" else 1, -1)
    return codes.to(torch.uint8).view(torch.int32)


def dequantize_sm90_fp8_weights(bk: torch.Tensor, bk_sf: torch.Tensor) -> torch.Tensor:
    """FP8-mode kernel weights (``uint8 [E, N/64, K/128, 64, 64]``) with their scales (absolute ``[E, K/128, N]``,
    or folded per row / per row and chunk) -> float64 ``[E, N, K]``: what the kernel multiplies, exactly. Folded:
    each E2M1 value times ``2**d`` is checked to be an exact normal E4M3 (the kernel's decode), then times the FP32
    row (chunk) scale. Equal to ``layouts.dequantize_fp4`` of the canonical weights wherever the fold is exact."""
    from ..layouts.fp4 import e2m1_table
    from ..layouts.ue8m0 import code_to_scale

    chunks, fmt = _fp8_weight_format(bk, bk_sf)
    values = e2m1_table(bk.device).double()[unpack_fp4_codes(from_sm90_weight_layout(bk)).long()]  # [E, N, K]
    blocks = values.unflatten(-1, (-1, 32))  # [E, N, K/32, 32]
    if fmt == "absolute":
        scales = code_to_scale(unpack_ue8m0(bk_sf.transpose(1, 2).contiguous())).double()
        return (blocks * scales[..., None]).flatten(-2)
    decoded = _folded_e4m3_values(blocks, bk_sf, chunks)
    scale = bk_sf[:, chunks:].view(torch.float32).double().transpose(1, 2)  # [E, N, 1] or [E, N, K/128]
    if fmt == "chunk":
        scale = scale.repeat_interleave(4, -1)  # per 32-block
    return (decoded * scale[..., None]).flatten(-2)


def _fp8_weight_format(bk: torch.Tensor, bk_sf: torch.Tensor) -> tuple[int, str]:
    """K/128 of FP8-mode kernel weights ``bk`` and the format of their scales ``bk_sf`` (``folded_scale_format``),
    checked against each other."""
    check_tensor("bk", bk, dtype=torch.uint8, ndim=5)
    e, blocks, chunks = bk.shape[:3]
    check_tensor("bk_sf", bk_sf, dtype=torch.int32, ndim=3)
    if bk_sf.shape[0] != e or bk_sf.shape[2] != blocks * ROW_BLOCK:
        fail("bk_sf", f"must be chunk-major [E, rows, N] with E = {e}, N = {blocks * ROW_BLOCK}, got "
             f"{list(bk_sf.shape)}")
    return chunks, folded_scale_format(bk_sf, chunks)


def _folded_e4m3_values(blocks: torch.Tensor, bk_sf: torch.Tensor, chunks: int) -> torch.Tensor:
    """Folded FP8-mode weights: the E2M1 values ``blocks`` (float64 ``[E, N, K/32, 32]``) times ``2**d`` of their
    block (the biased codes of ``bk_sf``'s first ``chunks`` rows, either folded format) -- the E4M3 values the kernels'
    decode makes -- checked to be exact normal E4M3 numbers (or zero); float64 ``[E, N, K/32, 32]``."""
    words = bk_sf[:, :chunks].transpose(1, 2).contiguous()
    d = unpack_ue8m0(words).to(torch.int32) + FOLD_MIN_SHIFT  # [E, N, K/32]
    if int(d.max()) > FOLD_MAX_SHIFT:
        fail("bk_sf", f"holds a biased relative code above {FOLD_MAX_SHIFT - FOLD_MIN_SHIFT}: not folded scales")
    decoded = blocks * torch.exp2(d.double())[..., None]
    e4m3 = decoded.to(torch.float8_e4m3fn).double()
    tiny = (decoded != 0) & (decoded.abs() < 2.0**-6)  # E4M3 subnormal: the decode's table has normals only
    if not torch.equal(e4m3, decoded) or bool(tiny.any()):
        fail("bk_sf", "folds a block to values that are not exact normal E4M3 numbers")
    return decoded


def e4m3_weight_copy(bk: torch.Tensor, bk_sf: torch.Tensor) -> torch.Tensor:
    """The E4M3 copy of folded FP8-mode kernel weights that ``GemmConfig(decode="copy")`` reads instead of decoding:
    ``float8_e4m3fn [E, N, K]``, K-major, row n of expert e in the kernel's row order (that of ``bk``, e.g. L1's
    interleaved gate/up rows), each value exactly the E4M3 ``v * 2**d`` the kernels' decode makes from the E2M1
    value ``v`` and its block's relative code ``d`` (``fold_fp8_scales``), so that the FP32 scales of ``bk_sf`` still
    apply after the K loop: the kernels multiply ``copy[e, n, :]`` and then row n's scale (``per="row"``, the format
    the kernels take; a ``per="chunk"`` fold's copy is defined the same way, each chunk's values relative to that
    chunk's scale).

    ``bk``: ``uint8 [E, N/64, K/128, 64, 64]`` (``prepare_fp4_weights(..., mma="fp8", fold=True)``); ``bk_sf``: its
    folded scales ``int32 [E, K/128 + 1, N]`` (or ``[E, 2 * K/128, N]``). Absolute (unfolded) scales are rejected:
    without a fold the per-32 scales are not in the values. Why: a compute-bound call (thousands of token rows per
    expert) can afford one byte per weight instead of half a byte to take the decode out of the kernel's mainloop
    (``mainloop_fp8_copy``). Runs on ``bk``'s device, one expert at a time (float64 intermediates of one expert);
    weight-load time."""
    chunks, fmt = _fp8_weight_format(bk, bk_sf)
    if fmt == "absolute":
        fail("bk_sf", "holds absolute UE8M0 scales [E, K/128, N]; the E4M3 copy needs folded ones "
             "(prepare_fp4_weights(..., mma='fp8', fold=True)): the copy's values carry the block scales")
    from ..layouts.fp4 import e2m1_table

    table = e2m1_table(bk.device).double()
    e, blocks = bk.shape[:2]
    out = torch.empty(e, blocks * ROW_BLOCK, chunks * K_CHUNK, dtype=torch.float8_e4m3fn, device=bk.device)
    for i in range(e):
        values = table[unpack_fp4_codes(from_sm90_weight_layout(bk[i:i + 1])).long()]  # [1, N, K]
        out[i] = _folded_e4m3_values(values.unflatten(-1, (-1, 32)), bk_sf[i:i + 1], chunks).flatten(-2)[0].to(
            torch.float8_e4m3fn)
    return out
