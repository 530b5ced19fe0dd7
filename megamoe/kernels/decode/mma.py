"""The tensor-core row stream of the decode kernels, and the per-pair tensor-core gate_up built on it (sm_90a).

Weights in the Mega MoE layout (``transform_weights_for_mega_moe``: BF16-mode SM90 layout ``int32 [E, N/64, K/128, 64,
16]``, chunk-major UE8M0 scales ``int32 [E, K/128, N]``) are streamed 16 rows at a time:

* roles: the 16 rows are the M side of ``mma.m16n8k16``; each B operand (a token's ``x``, a pair's ``a``) is one N
  column or several. Lane ``(g, q) = (lane / 4, lane % 4)`` owns 16-byte segment q of rows g and g + 8.
* loads (``mma_rows``, ``mma_load``): per 128-wide K chunk, the lane's 4 words of each of its two rows and their packed
  scale words; B words in fragment order, from an MMA-ordered row (``ld_mma_chunk``, ``common.mma_position``), from
  one in its natural order (``ld_natural_chunk``) or from a copy in shared memory (``ld_mma_chunk_shared``). The
  weight loads of the next ``depth`` chunks are in flight while one chunk computes (``mma_stream``).
* math (``mma_chunk``): E2M1 x UE8M0 scale -> BF16 in registers, exact, times ``2**-BF16_ACC_SHIFT``
  (``dequant.decode_e2m1x8_bf16``), straight into the A fragment; exact products, FP32 (tensor-core) sums, two
  chains per C fragment (K block parity) for shorter MMA dependency chains.
* epilogue: the caller's, from the C fragments (``hi_lo_column_sums`` for a ``hi``/``lo`` operand).

Three kernels stream so: ``GateUpMMA`` below (one (token, slot) pair per warp), ``token_major`` (K split over a
CTA's warps) and ``expert_major`` (up to 8 pairs of one expert per pass).
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, cute

from .. import dequant, ptx
from ..weight_layout import BF16_ACC_SHIFT, CHUNK_BYTES, K_CHUNK, ROW_BLOCK
from .common import ACT_LOAD, VECTOR_FORMATS, WARP, WEIGHT_LOAD, GateUpLaunch, swiglu

GATE_UP_MMA_DEPTH = 4
"""K chunks of weights (10 registers each) ``mma_stream`` keeps in flight per lane by default: ``GateUpMMA`` fits
80 registers at 6 CTAs per SM; deeper spills or lowers the CTAs per SM."""
GATE_UP_MMA_WARPS_PER_CTA = 4
"""Warps per CTA of ``GateUpMMA``: its warps are long (a whole K of 16 rows each) and few (8 neurons of a pair each:
1536 at one token of flash, which in 192 CTAs of 8 warps on 132 SMs left 60 SMs with 16 warps and 72 with 8), so
smaller CTAs spread them more evenly (``bench/results/decode/2026-11-30_decode_gate_up_cta_ab_h200.json``)."""
GATE_UP_MMA_MIN_CTAS_PER_SM = 6
"""Launch bound of ``GateUpMMA``: 6 CTAs of 4 warps per SM (80 registers, no spills at depth 4)."""


# --------------------------------------------------------------------------------------------------
# Loads


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
    return (ptx.ld_v4(wa, WEIGHT_LOAD), ptx.ld_v4(wa + 8 * CHUNK_BYTES, WEIGHT_LOAD), ptx.ld_nc_u32(sf_c),
            ptx.ld_nc_u32(sf_c + 8 * 4))


def b_lane(row: Int64, q, b_order: str) -> Int64:
    """Lane ``(g, q)``'s address in the bf16 B row starting at ``row`` for ``mma_stream`` in ``b_order``."""
    return row + q * (4 if b_order == "natural" else 16)


def ld_mma_chunk(addr: Int64) -> list:
    """The lane's 16 words of one 128-wide chunk of an MMA-ordered bf16 row (kept in L1): 16 bytes at each of
    ``addr + 64 j``, j = 0..3 (``addr`` = chunk start + 16 q), so the 4 lanes of a column read 64 contiguous
    bytes per load."""
    return [word for j in range(4) for word in ptx.ld_v4(addr + j * 64, ACT_LOAD)]


def ld_mma_chunk_shared(addr: Int32) -> list:
    """``ld_mma_chunk`` from a copy of the row in shared memory (``addr`` = chunk start + 16 q)."""
    return [word for j in range(4) for word in ptx.ld_shared_v4(addr + j * 64)]


def ld_natural_chunk(addr: Int64) -> list:
    """The lane's 16 words of one 128-wide chunk of a bf16 row in its natural order, in fragment order (those
    ``ld_mma_chunk`` reads from the MMA-ordered copy): word j (elements ``16 j + 2 q``, ``+ 1`` of the chunk, see
    ``mma_position``) at ``addr + 16 j`` (``addr`` = chunk start + 4 q), so the 4 lanes of a column read 16
    contiguous bytes per load and no copy of the row is made."""
    return [ptx.ld_nc_u32(addr + 16 * j) for j in range(16)]


# --------------------------------------------------------------------------------------------------
# Math


def mma_chunk(acc: list, loaded: tuple, bs: list) -> list:
    """Accumulate one 128-wide K chunk of the 16 rows into ``acc``: 4 words x 2 K blocks of 16 = 8
    ``mma.m16n8k16`` per B operand. ``bs``: for each B operand, the lane's 16 bf16x2 words of the chunk in
    fragment order (``ld_mma_chunk``, ``ld_natural_chunk``); ``acc``: 8 floats per B operand, two chains (K block
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
                part = ptx.mma_m16n8k16_bf16(acc[base: base + 4], frag, [xs[4 * wd + 2 * kk], xs[4 * wd + 2 * kk + 1]])
                acc = acc[:base] + part + acc[base + 4:]
    return acc


def mma_stream(rows: tuple, k: int, b_lanes: list, depth: int = GATE_UP_MMA_DEPTH, b_order: str = "mma",
               b_shared: bool = False) -> list:
    """The 16 rows of ``mma_rows`` times B operands over the whole K: ``b_lanes`` holds, per operand, the lane's
    address in a bf16 row (``b_lane``), by ``b_order``: ``"mma"``, an MMA-ordered row (``mma_position``,
    ``ld_mma_chunk``), or ``"natural"``, a row in its natural order (``ld_natural_chunk``). The
    weight loads of the next ``depth`` chunks are in flight while one chunk computes. ``b_shared``: the B rows are
    MMA-ordered copies in shared memory (``b_lanes`` shared addresses). Returns the C fragments, 8 floats per operand
    (``mma_chunk``), times ``2**-BF16_ACC_SHIFT``."""
    chunks = k // K_CHUNK
    acc = [Float32(0.0)] * (8 * len(b_lanes))
    load_b = ld_mma_chunk_shared if b_shared else ld_natural_chunk if b_order == "natural" else ld_mma_chunk
    loaded = [mma_load(rows, c) for c in range(min(depth, chunks))]
    for c in range(chunks):  # unrolled at trace time
        if c + depth < chunks:
            loaded.append(mma_load(rows, c + depth))
        acc = mma_chunk(acc, loaded[c], [load_b(b + c * (K_CHUNK * 2)) for b in b_lanes])
    return acc


# --------------------------------------------------------------------------------------------------
# Epilogue helper


def hi_lo_column_sums(acc: list) -> list:
    """Sums of ``mma_stream``'s C fragments for one B operand whose even columns hold ``hi`` rows and odd columns the
    matching ``lo`` rows (lane column ``lane / 4``: ``hi`` where it is even): lane ``(g, q)``'s ``hi + lo`` of
    columns ``(2q, 2q + 1)`` for row g and for row g + 8, the ``hi`` chains then the ``lo`` chains (as two
    separate operands are summed, so the same bits)."""
    return [(acc[2 * r] + acc[4 + 2 * r]) + (acc[2 * r + 1] + acc[5 + 2 * r]) for r in range(2)]


# --------------------------------------------------------------------------------------------------
# The per-pair tensor-core gate_up


class GateUpMMA(GateUpLaunch):
    """``gate_up`` on tensor cores, for FP4 L1 weights in the Mega MoE layout (rows interleaved gate/up in runs of 8,
    ``int32 [E, 2I/64, H/128, 64, 16]``), writing ``a`` FP32 for the SIMT down (``simt.Down``) of ``down_fmt``.

    A warp owns 8 neurons ``i0..i0+7`` of one (token, slot) pair: the 16 consecutive kernel-layout rows
    ``2*i0 .. 2*i0+15`` (gate rows of the 8 neurons, then their up rows) are the M = 16 rows of
    ``mma.m16n8k16``; the token's activations are column 0 of the N = 8 side (the other columns carry
    the same values and are ignored), read from ``x`` itself up to ``NATURAL_X_MAX_TOKENS`` tokens, above it from the
    MMA-ordered copy (``x_order``). Lanes with q = 0 end with the gate and up sums of neuron ``i0 + g`` and write
    ``a``. Versus ``simt.GateUp``, the FMAs and the FP32 widening of the weights leave the SIMT pipes (about 2.4
    instead of 4 instructions per weight), but a warp streams 16 rows instead of 2, so there are 8x fewer, longer
    warps. ``MoEDecoder`` runs the token- and expert-major kernels (both weights in the Mega MoE layout); this kernel
    stays the gate_up of ``moe_decode`` with Mega MoE L1 and canonical L2."""

    def __init__(self, hidden: int, inter: int, down_fmt: str, has_clamp: bool, x_order: str):
        self.hidden, self.inter, self.has_clamp, self.x_order = hidden, inter, has_clamp, x_order
        self.warps_per_pair, self.a_fmt = inter // 8, VECTOR_FORMATS[down_fmt]
        self.min_ctas = GATE_UP_MMA_MIN_CTAS_PER_SM
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
                out = swiglu(gate, up, clamp, self.has_clamp)
            if q == 0:
                a[t, j, self.a_fmt.interleaved_offset(block * 8 + gl, 4)] = out
