"""SM90 (Hopper) grouped GEMM: FP4 E2M1 expert weights with exact UE8M0 block scales, two MMA modes.

``acc[m, n] = sum_k dequant(a)[m, k] * dequant(b[e])[n, k]`` for every row m of expert e's group in FP32
(``megamoe.numerics`` steps 1 / 6), then one of four epilogues:

* ``bf16``: ``out[m, n] = bf16(acc)`` (R1 / R3) -- ``grouped_gemm_fp8_fp4_{contiguous,masked}``;
* ``bf16_scatter``: the same values, row m stored at the address ``out_row_ptrs[m]`` (e.g. a peer rank's
  combine slot), staged per tile in shared memory so each row leaves as whole 128-byte lines -- the
  contiguous entry with ``out_row_ptrs``;
* ``swiglu_fp8``: L1 steps 2-5 on interleaved gate/up rows (``prepare_fp4_weights_l1``): FP8 ``[M, I]`` +
  packed UE8M0 ``[M, I/128]``, the layout FP8-mode L2 consumes -- ``grouped_gemm_fp8_fp4_swiglu_{contiguous,masked}``;
* ``swiglu_fp8_bf16``: the same FP8-quantized values stored dequantized (exactly) as BF16 ``[M, I]``, the
  operand BF16-mode L2 consumes -- the same entries with ``out_dtype=torch.bfloat16``.

MMA modes (``GemmConfig.mma``), fixed by how the weights were prepared (``prepare_fp4_weights(..., mma=)``):

* ``"bf16"`` (recommended): tokens BF16 ``[M, K]`` (FP8 tokens dequantized by the caller,
  ``layouts.dequantize_fp8(a, a_sf, torch.bfloat16)``, exact) and ``a_sf=None``; weights decoded with their
  per-32 scale folded in to exact BF16 (``sm90_fp4_decode``), RS wgmma ``m64 x tile_tokens x k16`` bf16 x bf16
  -> f32 into one FP32 accumulator over the whole K: no promotion, wgmmas back to back.
* ``"fp8"``: tokens FP8 E4M3 + packed UE8M0 ``a_sf``; weights decoded to E4M3, RS wgmma ``k32`` e4m3 into a
  fresh accumulator per 32-K block, then promoted in FP32. Folded weight scales (the default where every row's
  fit, ``sm90_fp4_decode.fold_fp8_scales``): the decode applies each block's scale relative to its row's (a
  shifted lookup table, exact in E4M3), ``acc += tmp * 2^sa[m, kb]``, and the epilogue multiplies each row by its
  scale; absolute scales: ``acc += tmp * (2^sb[n, kb] * 2^sa[m, kb])``. Two temporaries alternate so the
  promotion of block kb overlaps the wgmma of kb+1; 8-row token tiles give each of a chunk's four blocks its own
  temporary and wait once per chunk (``DEFERRED_MAX_TILE_TOKENS``); 128-row tiles (``WIDE_FP8_TILE_TOKENS``) run
  each block as two 64-token wgmmas, one promoted while the other runs, with the tokens' scales converted to FP32
  once per chunk into shared memory. One FP32 multiply-add per accumulator and 32-K block is the floor of any
  exact per-32 promotion: at the FP8 rate about as many as the SM can issue, so FP8 mode (407-469 TFLOP/s from 256
  rows per expert, H200) stays below BF16 mode there.

Both are exact up to FP32 summation order (every product is exact) and the final rounding.

Both group layouts run the same kernel: contiguous (``offsets`` [E+1], optional ``counts``) and masked
(``[E, max_m]`` slabs viewed as contiguous rows with group e at ``e * max_m``, ``masked_m`` rows long).

Design:

* Swap-AB: weights are the wgmma M side (64 rows per consumer warpgroup, ``tile_n`` = 64, 128 or 256 rows per
  CTA) and tokens the N side (``tile_tokens`` = 8..128 rows), so a decode-sized group (a
  few tokens) wastes no tensor-core work on padding beyond the wgmma N granularity of 8. BF16 mode, token tiles
  of 64 and 128 rows: a tile with fewer rows runs wgmmas only 32, 64 or 96 wide (``token_widths``: one K loop
  per width, picked per tile); flash EP2 Mega MoE, 96 rows per expert on 128-row tiles, ran 3-7% faster
  (2048 tokens/rank) and 3-4% (8192). Likewise 16-row tiles run 8- or 16-wide: chosen where groups of more than
  8 rows are likely (``select_config``), they read such a group's weights once; flash EP2 Mega MoE at 128
  tokens/rank (6 rows per expert) ran 4-8% faster than on 8-row tiles. Mega MoE calls of a few tokens whose
  128-row L1 tiles would leave CTA slots idle run 64-row tiles on three CTAs per SM (``mega.tile_config``).
* Four consumer warpgroups (``tile_n`` = 256, BF16 mode, token tiles up to ``FOUR_WG_MAX_TILE_TOKENS``; separate
  launches, where ``select_config`` picks them, and the Mega MoE kernel, where ``mega.tile_config`` does from one
  expected row per expert: 1.04-1.14x at 128 and 512 tokens/rank on 2 x H200): one CTA per SM with 16 consumer
  warps on one token tile instead of two CTAs that each hold their own; in separate launches 1.03-1.15x faster at
  1-64 rows per expert, 89-103% of the measured HBM read
  bandwidth at 1-4 rows on all flash / pro L1 / L2 shapes but flash L2 EP8 (78-79%). The consumers raise their
  registers (setmaxnreg) from the pool the producer warpgroup gives back, never more: an increase beyond it waits
  forever. Named barriers: ``named_barriers``.
* Persistent, warp-specialized CTA of 1 + tile_n/64 warpgroups: warpgroup 0's first warp issues TMA loads
  (tokens [tile_tokens, 128] 128B-swizzled; packed weights [tile_n, 64 B], one to four contiguous 4 KiB
  row blocks of the blocked layout; the packed weight scale words of the stage's chunks, one contiguous
  (tile_n, chunks) box of the chunk-major scales ``[E, K/128, N]``, whole 32-byte sectors; in FP8 mode the
  token scale words, a 4-word box covering K/128 chunks 4j..4j+3) into a ``stages``-deep mbarrier pipeline,
  one or two 128-K chunks per stage (``GemmConfig.chunks_per_stage``). The consumer warpgroups decode FP4
  straight into the register A fragment (weights pre-permuted once per mode) and issue RS wgmma.
* BF16 mode pipeline: one wgmma group per 32-K block (two k16 wgmmas), up to three groups in flight while
  the next block is decoded: block kb's fragment registers are rewritten after ``wait_group(3)`` retires the
  previous chunk's block-kb group, and chunk kt-1's stage is released inside chunk kt once its last group
  has retired (chunk 0 of a tile is peeled: a data-dependent branch between wgmmas makes ptxas serialize
  them). The decoded weights carry a factor 2**-16 (``BF16_ACC_SHIFT``); the FP32 accumulator is multiplied
  by 2**16 (exact) before the epilogue.
* Groups: tile work items are (expert, token tile, weight tile), token tiles fastest (CTAs working at the
  same time share the weight tile in L2; ``scheduler.tiles`` holds this order and the fused waits' targets,
  shared with the protocol model); group bounds are read on device (no host sync, CUDA-graph safe).
  Token tiles start at the group's first row, any alignment; rows past the group are loaded (TMA zero-fills
  past the tensor) but never stored: the epilogues store with a per-row predicate.
* Tile handout: separate launches take their tiles in that order from a counter (``tile_counters``: per
  stream, made with the weights, left zero by every launch; the producer warp claims a tile and publishes it to
  the consumer warpgroups), so CTAs that run faster take more tiles. Against CTA c taking tiles c, c + grid, ...:
  1.00-1.13x (median 1.05x) at 1-64 rows/expert in BF16 mode except flash L2 EP8 at 1-4 rows (0.94-0.99x), 1.03-1.10x at every
  FP8-mode point (``bench/results/2026-12-01_gemm_dynamic_tiles_ab_h200.json``). The one-launch L1/L2 kernel
  keeps the fixed order (not measured with the counter); the Mega MoE kernel has its own (``fetch_tile``).
* Every launch is a programmatic dependent (PDL): a CTA sets up its shared memory, then waits for the previous
  grid on the stream (``griddepcontrol.wait``) before it touches global memory, and lets the next grid launch,
  whose CTAs start as these exit. Before the wait, a separate launch's producer warp prefetches into L2 (TMA)
  the weights of its first tile's first stages (``prefetch_first_tile``). Against plain launches, each build
  in turns (BF16 mode, flash and pro, L1 and L2, EP8 and EP2, 1-64 rows/expert; FP8 mode at EP2): 0-3% faster
  at 1-16 rows/expert (flash L2 EP8 1 row 41.3-42.1 vs 41.7-43.1 us, pro L2 EP8 1 row 138.2-139.9 vs
  141.4-143.7), within the run-to-run spread elsewhere; the one-GPU MoE layer unchanged within it
  (``bench/results/2026-12-01_gemm_pdl_prefetch_ab_h200.json``).
* L1 and L2 in one launch (``grouped_gemm_fp8_fp4_l1_l2_contiguous``, epilogue "l1_l2", BF16 mode): the tile
  list is L1's tiles then L2's, so every CTA finishes its L1 tiles first (deadlock-free with all CTAs
  resident). Warp 1 (idle otherwise) meets each consumer warpgroup on a named barrier after an L1 tile's
  stores and adds 1 (``fence.acq_rel.gpu`` + release add) to the expert's counter and to an all-tiles
  counter, so the consumers never wait on a fence. An L2 tile's producer checks (acquire) the all-tiles
  counter, then the expert's: if not ready it TMA-loads the weights of up to ``stages`` chunks, spins, and
  loads the tokens after a ``fence.proxy.async.global``; once all L1 tiles are seen done it checks no more.
  The last CTA out zeroes the counters. Both epilogues' staging tiles share one shared-memory region. Only
  the debug build (``timeout_ns`` > 0) times the wait and printf's: a function call anywhere in a kernel
  makes ptxas serialize all its wgmmas (C7510), which had cost the release build up to 10% (CPU tests check
  every release variant's PTX for calls).
* The Mega MoE kernel (``mega_moe_sm90``: "l1_l2" compiled with an ``ep_comm.EpCommConfig``) adds the
  protocol around those tiles: all threads run dispatch steps 1-3 (the expert offsets and the pool-block
  prefix land in shared memory and replace ``offsets``), warps 2 and 3 pull the token rows while the tiles
  run, and the consumer warpgroups run combine after their last tile; the last CTA out also ends the call.
  Its tiles follow ``scheduler.tiles`` over a bounded ring: per pool block (token tile) counters of pulled
  units, L1 tiles and (when the call's rows exceed the ring and ring blocks are reused) L2 tiles; an L1 tile
  waits on its block's pulls, an L2 tile on its block's L1 tiles, a pull into a reused ring block on the L2
  tiles of the block before it there. Tiles are handed out in that order to whichever CTA asks (CTA c starts
  at tile c, then a shared counter, ``fetch_tile``), so CTAs that run faster take more. The producer warp
  finds tile t in closed form (phase arithmetic and a binary search over the block prefix, ``mega_tile``,
  skipped while tiles stay in one expert) and publishes it to the consumer warpgroups and the signal warp
  through shared memory (``publish_tile``), so the consumers hold no cursor across their mainloop (with two
  CTAs per SM that costs the registers the wgmmas need: ptxas C7512) and spend no time between two mainloops
  on the search.

What bounds small token tiles (H200, ncu, flash L1 EP8, 16 rows/expert, BF16 mode, before the changes
below): instruction issue and memory together. A consumer warp spent ~217 SASS instructions per 128-K
chunk, 136 of them decoding (15 per word of 8 weights plus 2 per scale multiplier); issue slots 70% busy,
DRAM 58-60%. Changes measured on 2026-11-30 (2 x H200, builds timed in one session, outputs checked, flash
and pro, EP8 and EP2, 1-1024 rows/expert; ``bench/results/2026-11-30_gemm_decode_layout_ab_h200.json``):
the word decode of ``sm90_fp4_decode`` in 13 instructions (three whole windows and one split register;
~198 per chunk) made the kernel up to 10% faster (most at 16-64 rows/expert, within 1.5% at 1 row), and
the blocked weight layout (each 64-row x 128-K tile one contiguous 4 KiB piece) another 0-7% (e.g. pro L2
EP2 64 rows/expert 1331.7 -> 1254.0 -> 1171.2 us; flash L1 EP8 16 rows 99.3 -> 96.8 -> 95.1 us). Then the
decode multipliers in pairs (one instruction per row and 32-K block instead of two; ~185 per chunk): 1-6%
faster at 19 of 24 points, most at 1 row/expert (pro L1 EP2 1 row 1470.8 -> 1392.0 us, flash L2 EP2 1 row
180.2 -> 170.9 us), within the run-to-run spread at the others (pro L2 EP2 64 rows: 1078/1268 -> 1226/1236
us; ``bench/results/2026-11-30_gemm_multiplier_pair_ab_h200.json``). Unrolling the chunk loop by two leaves
~198 instructions per chunk (ptxas shares nothing between the copies). Tried on 2026-11-30 and kept out,
each A/B-timed in one process with checked outputs: a one-warp producer with 3 CTAs per SM (24 consumer
warps: L1 1 row/expert 92.5 -> 99.3 us); alternating accumulators for odd k16 blocks (1-3% slower, also
with a lone tile per CTA); programmatic dependent launch of dispatch, GEMMs and combine (within the
run-to-run spread; the GEMMs are programmatic dependents since 2026-12-01, above).

Constraints: K % 512 == 0 (packed scale rows must be 16-byte aligned for TMA), N % 64 == 0 (SwiGLU: N = 2I,
I % 128 == 0). BF16 mode: weight scale codes within the decode's exact range (``sm90_fp4_decode``), checked
by ``prepare_fp4_weights``.
"""

import math
from dataclasses import dataclass

import torch

from ..checks import check_multiple, check_range, check_tensor, fail
from ..layouts.weights import check_chunk_major_scales
from ..numerics import check_activation_clamp, check_fast_math
from . import runtime
from .sm90_fp4_decode import (
    BF16_ACC_SHIFT,
    BF16_WORDS,
    CHUNK_BYTES,
    E4M3_LUT_HI,
    E4M3_LUT_LO,
    K_CHUNK,
    ROW_BLOCK,
    FOLD_MAX_SHIFT,
    FOLD_MIN_SHIFT,
    check_bf16_scale_range,
    check_blocked_layout,
    fold_fp8_scales,
    from_sm90_bf16_weight_layout,
    from_sm90_weight_layout,
    to_sm90_bf16_weight_layout,
    to_sm90_weight_layout,
)

__all__ = [
    "GemmConfig",
    "select_config",
    "grouped_gemm_fp8_fp4_contiguous",
    "grouped_gemm_fp8_fp4_masked",
    "grouped_gemm_fp8_fp4_swiglu_contiguous",
    "grouped_gemm_fp8_fp4_swiglu_masked",
    "grouped_gemm_fp8_fp4_l1_l2_contiguous",
    "mega_moe_sm90",
    "prepare_fp4_weights",
    "prepare_fp4_weights_l1",
    "to_sm90_weight_layout",
    "from_sm90_weight_layout",
    "to_sm90_bf16_weight_layout",
    "from_sm90_bf16_weight_layout",
    "compile_grouped_gemm",
    "K_MULTIPLE",
    "N_MULTIPLE",
    "MMA_MODES",
    "MAX_CTAS_PER_SM",
]

NUM_SMS_H200 = 132
SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
K_MULTIPLE = 512
N_MULTIPLE = ROW_BLOCK  # weight rows: whole row blocks of the kernel layouts (64 per warpgroup tile)
MMA_MODES = ("bf16", "fp8")
TILE_TOKENS_CHOICES = {"bf16": (8, 16, 32, 64, 128), "fp8": (8, 16, 32, 64, 128)}
TILE_N_CHOICES = (64, 128, 256)
FOUR_WG_MAX_TILE_TOKENS = 64
"""BF16 mode, 256-row weight tiles (four consumer warpgroups, one CTA per SM, 104-112 registers per consumer thread):
the largest token tile whose accumulator fits them. Separate launches and the Mega MoE kernel (``named_barriers``);
the one-launch L1/L2 kernel without communication keeps two consumer warpgroups (not run with four)."""
TWO_CTA_TILE_TOKENS = {"bf16": 32, "fp8": 16}
"""Largest token tile that may run two CTAs per SM (``GemmConfig.ctas_per_sm``), per MMA mode."""
DEFERRED_MAX_TILE_TOKENS = 8
"""FP8 mode: token tiles up to this many rows issue a 128-K chunk's four k32 wgmmas into four temporaries and
promote them after one wait. H200, 2026-11-30, A/B in turns, all checked (``bench/results/``
``2026-11-30_gemm_fp8_deferred_promotion_h200.json``): 8-row tiles 2-6% faster on flash / pro L1 / L2 at EP8 and
EP128 (flash L1 EP8 one row 106.6-106.9 vs 109.9-111.3 us); 16-row tiles (8 registers per temporary, spilling)
2-3% faster at EP8, 3% slower in one round of tiles (EP128), so they keep the alternating pair."""
THREE_CTA_TILE_TOKENS = 8
"""Three CTAs per SM: BF16 mode, 64-row weight tiles (one consumer warpgroup) and token tiles of this many rows
(80 registers per thread, 256 threads per CTA)."""
MAX_CTAS_PER_SM = 3
"""Most CTAs per SM any config runs (``GemmConfig.ctas_per_sm``): host buffers with one row per CTA are sized by it."""
WIDE_FP8_TILE_TOKENS = 128
"""FP8 mode, token tiles of this many rows (one per thread of a consumer warpgroup): each 32-K block as two wgmmas
``m64 n64 k32`` into their own temporaries (with the accumulator, 128 registers), one promoted while the other runs;
the tokens' scales as FP32 in shared memory, converted once per chunk (``GemmConfig.scale_table_bytes``). 1.87-1.98x
faster than 64-row tiles at 256-1024 rows per expert (H200, 2026-12-01)."""
MIN_WIDE_STAGES = 3
"""One-CTA BF16-mode tiles load two 128-K chunks per stage where at least this many such stages fit."""
GROUP_MODES = ("offsets", "offsets_counts", "masked")
EPILOGUES = ("bf16", "swiglu_fp8", "swiglu_fp8_bf16", "bf16_scatter", "l1_l2")
SWIGLU_EPILOGUES = ("swiglu_fp8", "swiglu_fp8_bf16", "l1_l2")
"""The epilogues that compute silu (``fast_math`` selects how)."""
SCATTER_PAD = 8
"""BF16 elements of padding per staged row of the scatter epilogue (rows stay 16-byte aligned)."""


def named_barriers(consumer_warpgroups: int) -> tuple[int, int, int]:
    """Named barrier ids of a kernel with ``consumer_warpgroups`` consumer warpgroups (0 is ``sync_threads``):
    (first epilogue barrier, first signal barrier, combine barrier). Consumer warpgroup w's epilogue (and the wide
    FP8 tiles' token scales) meets on epilogue + w, with the signal warp on signal + w; the Mega MoE kernel's consumer
    warpgroups meet for combine on the last: 1, 3, 5 up to two consumer warpgroups, 1, 5, 9 at four (of 16)."""
    slots = max(consumer_warpgroups, 2)
    return 1, 1 + slots, 1 + 2 * slots

SWIGLU_GRANULARITY = 8
"""``interleave_gate_up`` granularity of L1 weights for the SwiGLU epilogue: the rows a thread holds in the
wgmma accumulator, g and g + 8 of each 16-row group, are then gate and up of the same intermediate column."""


@dataclass(frozen=True)
class GemmConfig:
    """Static kernel configuration (one compiled kernel per config, group mode and epilogue).

    tile_tokens: tokens per CTA tile (wgmma N): 8, 16, 32, 64 or 128.
    tile_n: weight rows per CTA tile, 64 per consumer warpgroup (64, 128, or 256: BF16 mode, one CTA per SM, token
        tiles up to ``FOUR_WG_MAX_TILE_TOKENS``; separate launches and the Mega MoE kernel).
    stages: TMA pipeline depth (stages of ``chunks_per_stage(epilogue)`` x 128 K); ``None`` = as many as shared memory holds
        (max 16).
    ctas_per_sm: 1, or 2 for token tiles up to ``TWO_CTA_TILE_TOKENS`` (two co-resident CTAs, each with half the shared memory and
        no register rebalancing, hide each other's waits), or 3 for BF16-mode 64-row weight tiles of
        ``THREE_CTA_TILE_TOKENS`` tokens (finer work for the Mega MoE's decode-sized calls: ``mega.tile_config``).
    mma: "bf16" (BF16 tokens, weights from ``prepare_fp4_weights(..., mma="bf16")``) or "fp8" (FP8 tokens +
        UE8M0 scales, FP8-mode weights); see the module docstring.
    """

    tile_tokens: int = 64
    tile_n: int = 128
    stages: int | None = None
    ctas_per_sm: int = 1
    mma: str = "bf16"

    def __post_init__(self):
        if self.mma not in MMA_MODES:
            fail("config.mma", f"must be one of {MMA_MODES}, got {self.mma!r}")
        allowed = {
            1: True,
            2: self.tile_tokens <= TWO_CTA_TILE_TOKENS[self.mma],
            3: self.mma == "bf16" and self.tile_n == 64 and self.tile_tokens == THREE_CTA_TILE_TOKENS,
        }
        if not allowed.get(self.ctas_per_sm, False):
            fail("config.ctas_per_sm", f"must be 1, 2 with tile_tokens <= {TWO_CTA_TILE_TOKENS[self.mma]} in "
                 f"{self.mma} mode, or 3 with tile_n=64 and tile_tokens={THREE_CTA_TILE_TOKENS} in bf16 mode; got "
                 f"{self.ctas_per_sm} with tile_tokens={self.tile_tokens}, tile_n={self.tile_n}, mma={self.mma}")
        if self.tile_tokens not in TILE_TOKENS_CHOICES[self.mma]:
            fail("config.tile_tokens", f"must be one of {TILE_TOKENS_CHOICES[self.mma]} in {self.mma} mode, "
                 f"got {self.tile_tokens}")
        if self.tile_n not in TILE_N_CHOICES:
            fail("config.tile_n", f"must be one of {TILE_N_CHOICES}, got {self.tile_n}")
        if self.tile_n == 256 and not (self.mma == "bf16" and self.ctas_per_sm == 1
                                       and self.tile_tokens <= FOUR_WG_MAX_TILE_TOKENS):
            fail("config.tile_n", f"256 needs mma='bf16', ctas_per_sm=1 and tile_tokens <= {FOUR_WG_MAX_TILE_TOKENS}; "
                 f"got mma={self.mma}, ctas_per_sm={self.ctas_per_sm}, tile_tokens={self.tile_tokens}")
        if self.stages is not None:
            check_range("config.stages", self.stages, 2, self.max_stages())

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_n // 64

    def chunks_per_stage(self, epilogue: str = "bf16") -> int:
        """128-K chunks per pipeline stage, in BF16 mode 2 (one barrier wait and release, one loop step per 256 K:
        172.5 instead of 183-186 SASS instructions per chunk and warp at 8-16 rows) for the one-launch L1/L2
        kernels ("l1_l2") with token tiles of up to 32 rows, and for one-CTA tiles where ``MIN_WIDE_STAGES`` such
        stages fit; else 1 (the separate launches' two-CTA variants would run out of registers for their
        wgmmas, ptxas C7512)."""
        if self.mma != "bf16":
            return 1
        if epilogue == "l1_l2" and self.tile_tokens <= 32:
            return 2
        return 2 if self.ctas_per_sm == 1 and self._fitting_stages(epilogue, 0, 2) >= MIN_WIDE_STAGES else 1

    def stage_bytes(self, epilogue: str = "bf16") -> int:
        """Shared memory of one pipeline stage: tokens, packed weights and the weights' packed scale words (4 bytes
        per row) of each chunk; FP8 mode: plus the tokens' 4-chunk scale box (16 bytes per row)."""
        return self._stage_bytes(self.chunks_per_stage(epilogue))

    def _stage_bytes(self, chunks: int) -> int:
        if self.mma == "bf16":
            return chunks * (self.tile_tokens * K_CHUNK * 2 + self.tile_n * (CHUNK_BYTES + 4))
        return self.tile_tokens * K_CHUNK + self.tile_n * (CHUNK_BYTES + 4) + 16 * self.tile_tokens

    def epilogue_bytes(self, epilogue: str = "bf16") -> int:
        """Shared memory the epilogue needs besides the pipeline (SwiGLU: FP32 activations of one tile;
        scatter: the BF16 tile, rows padded by 16 bytes; "l1_l2": one region for both)."""
        swiglu = self.tile_tokens * (self.tile_n // 2 + 4) * 4
        scatter = self.tile_tokens * (self.tile_n + SCATTER_PAD) * 2
        if epilogue == "l1_l2":  # one region serves both (equal sizes): see the kernel
            return swiglu
        if epilogue.startswith("swiglu"):
            return swiglu
        return scatter if epilogue == "bf16_scatter" else 0

    def max_stages(self, epilogue: str = "bf16", extra_bytes: int = 0) -> int:
        """Stages that fit beside the epilogue's and ``extra_bytes`` of other shared memory."""
        return self._fitting_stages(epilogue, extra_bytes, self.chunks_per_stage(epilogue))

    @property
    def wide_fp8(self) -> bool:
        """FP8 mode with ``WIDE_FP8_TILE_TOKENS``-row token tiles: two 64-token wgmmas per 32-K block, the tokens'
        per-32 scales converted to FP32 once per chunk into shared memory (``scale_table_bytes``)."""
        return self.mma == "fp8" and self.tile_tokens >= WIDE_FP8_TILE_TOKENS

    def scale_table_bytes(self) -> int:
        """Wide FP8 tiles: per consumer warpgroup two chunks' FP32 token scales, 4 blocks x 4 lane quads x
        (tile_tokens / 4 + 4 padding) floats each."""
        return self.consumer_warpgroups * 2 * 16 * (self.tile_tokens // 4 + 4) * 4 if self.wide_fp8 else 0

    def _fitting_stages(self, epilogue: str, extra_bytes: int, chunks: int) -> int:
        budget = (SMEM_CAPACITY // self.ctas_per_sm - 1024 - 4096 - self.epilogue_bytes(epilogue) - extra_bytes
                  - self.scale_table_bytes())
        return min(16, budget // self._stage_bytes(chunks))

    def num_stages(self, epilogue: str = "bf16", extra_bytes: int = 0) -> int:
        if self.stages is None:
            return self.max_stages(epilogue, extra_bytes)
        check_range("config.stages", self.stages, 2, self.max_stages(epilogue, extra_bytes))
        return self.stages

    def describe(self, epilogue: str = "bf16") -> str:
        return (
            f"sm90 fp4 swapAB mma={self.mma} tile_tokens={self.tile_tokens} tile_n={self.tile_n} "
            f"stages={self.num_stages(epilogue)}x{K_CHUNK * self.chunks_per_stage(epilogue)}K ctas/SM={self.ctas_per_sm} "
            f"epilogue={epilogue}"
        )


def mega_comm_words(comm) -> int:
    """int32 words of the Mega MoE kernel's ``sComm`` (``comm``: its ``ep_comm.EpCommConfig``, or None): the expert
    offsets (int32 [E_l + 1]), the scan's two source token counts, the pool-block prefix (int32 [E_l + 1]), the
    ring geometry (``Sm90Fp4GroupedGemm.ring_geometry``: 4 int32) and the last-CTA flag."""
    return 0 if comm is None else -(-(2 * comm.layout.num_local_experts + 9) // 4) * 4


def mega_smem_bytes(comm) -> int:
    """Shared memory the Mega MoE kernel adds: ``sComm``, the published tiles and their mbarriers."""
    return 0 if comm is None else 4 * mega_comm_words(comm) + TILE_SLOTS * (4 * TILE_WORDS + 16)


MEGA_HEADER = 4
"""Mega MoE ``sync`` words before the per-block counters: finished CTAs, L1 tiles done, grid-barrier arrivals,
tiles handed out."""
L1_DONE, FINISHED, ALL_L1, GRID, PULLED, L2_DONE, NEXT_TILE = range(7)
"""The fused launch's counters (``Sm90Fp4GroupedGemm.word``)."""
TILE_SLOTS = 4
"""Mega MoE: tiles the producer warp may publish ahead of the consumer warpgroups (``publish_tile``)."""
TILE_WORDS = 8
"""int32 words of a published tile: phase, valid, row0, row_end, n_tile, pool block (padded)."""


def mega_max_blocks(layout, tile_tokens: int) -> int:
    """Most pool blocks of a Mega MoE call on ``layout`` (a ``SymmBufferLayout``) with ``tile_tokens``-row blocks."""
    from ..scheduler import tiles

    return tiles.max_blocks(layout.max_recv_rows, tile_tokens, layout.num_local_experts)


def sync_words(num_groups: int, layout=None) -> int:
    """int32 counters of the fused launch's ``sync``: per group L1 tiles done [E], finished CTAs, L1 tiles done.
    Mega MoE (``layout``: its ``SymmBufferLayout``): ``MEGA_HEADER`` words, then per pool block L1 tiles done,
    pulled row units and L2 tiles done, each ``[mega_max_blocks]`` for the smallest token tile."""
    if layout is None:
        return num_groups + 2
    return MEGA_HEADER + 3 * mega_max_blocks(layout, min(TILE_TOKENS_CHOICES["bf16"]))


TOKEN_WIDTH_STEP = 32
"""BF16 mode, token tiles of 64 rows or more: a tile whose rows fit in fewer multiples of this many rows runs its
wgmmas only that wide (N), not the whole tile. 16- and 32-row tiles step by half the tile."""


def token_widths(tile_tokens: int) -> tuple[int, ...]:
    """The wgmma token widths (N) a BF16-mode kernel with ``tile_tokens`` compiles, narrowest first, equal steps
    (the first width): the multiples of ``TOKEN_WIDTH_STEP`` up to the tile from 64 rows, else half the tile and the
    tile (8 rows, the wgmma N granularity: the tile alone)."""
    if tile_tokens >= 2 * TOKEN_WIDTH_STEP:
        return tuple(range(TOKEN_WIDTH_STEP, tile_tokens + 1, TOKEN_WIDTH_STEP))
    return (tile_tokens,) if tile_tokens == 8 else (tile_tokens // 2, tile_tokens)


def select_config(expected_rows_per_expert: float, n: int, k: int, mma: str = "bf16",
                  four_warpgroups: bool = True) -> GemmConfig:
    """Heuristic config for ``mma`` mode from the expected rows per expert (tokens) and the problem's N, K.

    Token tile: the smallest tile_tokens choice covering the expected group (the largest beyond); in BF16 mode, up
    to ``TWO_CTA_TILE_TOKENS`` rows, the smallest covering the expected group plus two standard deviations of a
    Poisson count (16 rather than 8 rows from 4.5 expected, 32 rather than 16 from 10): the wider tile runs narrower
    K loops for smaller groups (``token_widths``) and reads the weights of a larger group once instead of twice.
    Weight tile 128 rows (two consumer warpgroups) when N allows it, else 64; in BF16 mode with token tiles up to
    ``FOUR_WG_MAX_TILE_TOKENS`` rows 256 (four consumer warpgroups, one CTA per SM) where N allows it and
    ``four_warpgroups`` (False for the one-launch L1/L2 kernel without communication, which takes two at most;
    ``mega.tile_config`` sets it for the Mega MoE kernel by measurement): 16 consumer
    warps per SM share one token tile in shared memory, where two CTAs of 128-row tiles each load and hold their own;
    H200, 2026-12-01, flash and pro L1 / L2 at EP8 and EP2, every point checked
    (``bench/results/2026-12-01_gemm_four_consumer_wg_h200.json``): against the 128-row tiles
    1.08-1.14x at 1 row per expert (flash L2 EP8 47.8 -> 42.1 us, pro L1 EP8 286.7 -> 259.8), 1.07-1.12x at 4,
    1.04-1.12x at 16 (32-row token tiles), 1.03-1.15x at 64. Otherwise two CTAs per SM up to
    ``TWO_CTA_TILE_TOKENS``: measured on an H200 (flash L1/L2, EP8, 2026-11-29), 1 and 16 rows per expert ran 8-16%
    faster in BF16 mode (e.g. L1 1 row/expert 91.9 vs 106.9 us) and faster in FP8 mode (hiding per-k32 promotion
    waits); 32-row BF16 tiles on two CTAs per SM: pro EP2 Mega MoE at 512 tokens/rank (16 rows/expert) 2623-2626
    vs 2994-3004 us on 16-row tiles (2026-11-30). FP8 mode's 128-row tiles (from 65 expected rows) ran 1.87-1.98x
    faster than main's 64-row tiles at 256 and 1024 rows per expert (flash, pro, L1, L2, EP8; 2026-12-01)."""
    del k  # the stage count is chosen from shared memory alone
    if mma not in MMA_MODES:
        fail("mma", f"must be one of {MMA_MODES}, got {mma!r}")
    tiles = TILE_TOKENS_CHOICES[mma]
    tile_tokens = next((t for t in tiles if t >= expected_rows_per_expert), tiles[-1])
    if mma == "bf16" and tile_tokens <= TWO_CTA_TILE_TOKENS["bf16"]:
        margin = min(expected_rows_per_expert + 2 * math.sqrt(expected_rows_per_expert), TWO_CTA_TILE_TOKENS["bf16"])
        tile_tokens = next(t for t in tiles if t >= margin)
    tile_n = 128 if n % 128 == 0 else 64
    ctas = 2 if tile_tokens <= TWO_CTA_TILE_TOKENS[mma] else 1
    if mma == "bf16" and four_warpgroups and tile_tokens <= FOUR_WG_MAX_TILE_TOKENS and n % 256 == 0:
        tile_n, ctas = 256, 1
    return GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, mma=mma)


def prepare_fp4_weights(b: torch.Tensor, b_sf: torch.Tensor, mma: str = "fp8",
                        fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical FP4 weights (``uint8 [E, N, K/2]``, ``int32 [E, N, K/128]``) -> the kernel's operands for
    ``mma`` mode; scales chunk-major, ``int32 [E, K/128, N]`` (a 128-K chunk's words of a tile's rows are one
    contiguous piece: a stage loads whole 32-byte sectors, once). Run once at weight-load time.

    "fp8" (default, the layout existing callers pass FP8 tokens with): ``uint8 [E, N/64, K/128, 64, 64]``, nibbles
    reordered into the e4m3 fragment order; scales folded into the decode where every row's fit
    (``sm90_fp4_decode.fold_fp8_scales``: ``int32 [E, K/128 + 1, N]``, the kernel then multiplies by the token
    scales alone per 32-K block), else absolute. ``fold``: None = folded where possible, True = folded or raise,
    False = absolute. "bf16" (recommended; BF16 tokens): ``int32 [E, N/64, K/128, 64, 16]``
    (``to_sm90_bf16_weight_layout``); raises if a scale code is outside the exact range of the BF16 decode.
    One host sync either way."""
    if mma not in MMA_MODES:
        fail("mma", f"must be one of {MMA_MODES}, got {mma!r}")
    check_tensor("b", b, dtype=torch.uint8, ndim=3)
    make_tile_counters(b.device)
    e, n, half_k = b.shape
    check_tensor("b_sf", b_sf, dtype=torch.int32, shape=(e, n, 2 * half_k // K_CHUNK))
    if mma == "bf16":
        if fold:
            fail("fold", "applies to mma='fp8' only (BF16 mode always applies the scales in the decode)")
        check_bf16_scale_range(b, b_sf)
        return to_sm90_bf16_weight_layout(b), b_sf.transpose(1, 2).contiguous()
    folded = None if fold is False else fold_fp8_scales(b, b_sf)
    if folded is None and fold:
        fail("b_sf", f"cannot be folded (fold=True): a row's nonzero blocks span more than "
             f"{FOLD_MAX_SHIFT - FOLD_MIN_SHIFT} binades below its largest scale, or its base code is below 1; "
             "pass fold=None to keep absolute scales for such weights")
    return to_sm90_weight_layout(b), b_sf.transpose(1, 2).contiguous() if folded is None else folded


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.nvgpu import cpasync, warpgroup

    from .. import timeline
    from ..scheduler import tiles
    from . import ep_comm, ptx
    from .sm90_fp4_decode import device_helpers
    from .warp_ops import nth_set_bit, warp_inclusive_sum

    dev = device_helpers()

    class Sm90Fp4GroupedGemm:
        """One compiled variant: ``GemmConfig`` (incl. the MMA mode) x group mode ("offsets", "offsets_counts",
        "masked") x epilogue ("bf16": D [M, N] BF16; "swiglu_fp8": SwiGLU of interleaved gate/up rows, FP8
        [M, N/2] + UE8M0; "swiglu_fp8_bf16": those FP8 values as BF16 [M, N/2]; "bf16_scatter": BF16 rows to
        per-row addresses; "l1_l2": "swiglu_fp8_bf16" into the second GEMM's tokens, then that GEMM with
        "bf16_scatter", in one launch) x debug ("l1_l2": the wait is timed and reports with printf; any
        function call in a kernel makes ptxas serialize all its wgmmas, C7510, so only debug builds have one) x
        fast_math (the SwiGLU epilogues' silu: approximate exp and reciprocal, or IEEE exp and division)."""

        def __init__(self, config: GemmConfig, group_mode: str, epilogue: str = "bf16", debug: bool = False,
                     comm=None, folded: bool = False, fast_math: bool = True):
            self.cfg = config
            self.fast_math = fast_math
            # FP8 mode, folded weight scales (``sm90_fp4_decode.fold_fp8_scales``): the decode applies each block's
            # scale relative to its row's, the promotion multiplies by the token's scale alone, the epilogue by the
            # row's scale.
            self.folded = folded
            self.wide = config.wide_fp8
            self.comm = comm  # "l1_l2" + ep_comm.EpCommConfig: the one-launch Mega MoE kernel (see mega_moe_sm90)
            self.trace = comm is not None and comm.trace  # phase timestamps into record (megamoe.timeline)
            self.debug = debug
            self.bf16 = config.mma == "bf16"
            # FP8 mode, 8-row token tiles: a chunk's four k32 wgmmas into four temporaries, one wait, four promotions.
            self.deferred = not self.bf16 and config.tile_tokens <= DEFERRED_MAX_TILE_TOKENS
            self.group_mode = group_mode
            self.epilogue = epilogue
            self.fused = epilogue == "l1_l2"  # L1 tiles (swiglu_fp8_bf16), then L2 tiles (bf16_scatter)
            # Separate launches (not "l1_l2", not Mega MoE) take their tiles from a counter (``fetch_tile``; ``sync``:
            # ``tile_counters``), so CTAs that run faster take more tiles; the producer warp publishes each tile.
            self.dynamic = comm is None and not self.fused
            self.published = comm is not None or self.dynamic
            assert self.dynamic or not folded  # compile_grouped_gemm: folded scales in separate launches only
            self.swiglu = epilogue.startswith("swiglu") or self.fused
            self.swiglu_bf16 = epilogue == "swiglu_fp8_bf16" or self.fused
            self.scatter = epilogue == "bf16_scatter" or self.fused
            self.out_stride = config.tile_n + SCATTER_PAD  # BF16 elements per staged row (scatter)
            self.tile_tokens = config.tile_tokens
            self.tile_n = config.tile_n
            self.num_consumer_wg = config.consumer_warpgroups
            self.stages = config.num_stages(epilogue, mega_smem_bytes(comm))
            self.cps = config.chunks_per_stage(epilogue)  # 128-K chunks per stage: chunk c of stage s lies in slot s * cps + c % cps
            self.act_stride = config.tile_n // 2 + 4  # FP32 activations per token row in smem (padded)
            self.threads = 128 * (1 + self.num_consumer_wg)
            # One CTA per SM: move registers from the producer warpgroup to the consumers (setmaxnreg).
            # Two CTAs per SM: every warp keeps the launch allocation (<= 64K / (2 * threads)); an
            # increase could wait forever for registers the other CTA holds.
            self.rebalance_registers = config.ctas_per_sm == 1
            # setmaxnreg.inc draws on the registers the CTA's other warps released (the pool is the launch
            # allocation, 64K / threads per thread, multiples of 8): the consumers get the launch count plus their
            # share of what the producer warpgroup gives back (1 / 2 consumer warpgroups: 240 / 232; 4: 112 with a
            # 32-register producer up to 32-row token tiles, 104 with 40 at 64 rows -- ptxas of CUDA 13.0 serializes
            # the wgmmas (C7512) of 32-row tiles at 104 and of 64-row tiles at 112).
            four_small = self.num_consumer_wg == 4 and config.tile_tokens <= 32
            self.producer_regs = 32 if four_small else 40
            launch_regs = min(65536 // self.threads, 255) // 8 * 8
            self.consumer_regs = min(240, (launch_regs + (launch_regs - self.producer_regs) // self.num_consumer_wg) // 8 * 8)
            if comm is not None:
                # Dispatch runs on every thread of the CTA; combine on the consumer warpgroups (named barrier).
                self.ep_all = ep_comm.EpPhases(comm, self.threads, bounded_ring=True)
                self.max_blocks = mega_max_blocks(comm.layout, self.tile_tokens)
                self.ep_cons = ep_comm.EpPhases(comm, 128 * self.num_consumer_wg,
                                                barrier_id=named_barriers(self.num_consumer_wg)[2])

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (M, K) bf16 or fp8, K-major
            mSFA,  # FP8 mode: (M, K/128) int32; BF16 mode: None
            mW: cute.Tensor,  # (64 rows, N/64, 64 bytes, K/128, E) uint8 view of the mode's blocked kernel layout
            mSFW: cute.Tensor,  # (N, K/128, E) int32
            mD: cute.Tensor,  # (M, N) bf16; "swiglu_fp8": (M, N/8) int32 view of FP8 [M, N/2]; "swiglu_fp8_bf16": (M, N/4) of BF16
            mDSF: cute.Tensor,  # "swiglu_fp8": (M, N/64) uint8 view of the packed UE8M0 scales; else unused
            mRowW: cute.Tensor,  # swiglu: (M,) float32 routing weight; "bf16_scatter": (M,) int64 row address
            mGroupA: cute.Tensor,  # offsets [E+1] ("offsets*") or masked_m [E] ("masked")
            mGroupB: cute.Tensor,  # counts [E] ("offsets_counts"), else any int32 tensor (unused)
            mA2,  # "l1_l2": (M, I) bf16, the second GEMM's tokens (= mD's memory); else None
            mW2,  # "l1_l2": the second GEMM's weights, as mW; else None
            mSFW2,  # "l1_l2": (H, I/128, E) int32; else None
            mRowAddr,  # "l1_l2": (M,) int64 row addresses of the second GEMM's scatter; else None
            mRowScale,  # FP8 mode, folded scales: (N, E) float32 weight-row scales; else None
            num_groups: Int32,
            max_m: Int32,  # rows per group slab ("masked"), else unused
            clamp: Float32,  # "swiglu_fp8" with clamp: gate <= clamp, |up| <= clamp; +inf = no clamp
            sync: Int64,  # zeroed int32 counters, left zeroed: "l1_l2" ``sync_words``, separate launches ``tile_counters``
            timeout_ns: Int64,  # "l1_l2", debug build: spin-wait limit (0: none), then printf + trap
            me: Int32,  # Mega MoE (``comm``): this rank, its tokens, its SymmBuffer base, the peers' bases (int64
            num_tokens: Int32,  # [R] device array), the recv stats (int32 [E], 0: none), the debug record
            base: Int64,  # (host-mapped int64 [CTAs, 8]) and y (bf16 [T, H]); else unused
            peers: Int64,
            stats: Int64,
            record: Int64,
            y: Int64,
            num_ctas: Int32,
            stream,
        ):
            tt, tn, st = self.tile_tokens, self.tile_n, self.stages
            slots = st * self.cps  # token, weight and weight-scale chunk slots
            a_dtype = cutlass.BFloat16 if cutlass.const_expr(self.bf16) else cutlass.Float8E4M3FN
            a_layout = cute.tile_to_shape(
                warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, a_dtype),
                (tt, K_CHUNK, slots),
                order=(0, 1, 2),
            )
            w_layout = cute.make_layout((tn, CHUNK_BYTES, slots), stride=(CHUNK_BYTES, 1, tn * CHUNK_BYTES))
            sfw_layout = cute.make_layout((tn, self.cps, st), stride=(1, tn, tn * self.cps))  # chunk-major, as in global
            sfa_layout = cute.make_layout((tt, 4, st), stride=(4, 1, tt * 4))

            g2s = cpasync.CopyBulkTensorTileG2SOp()
            tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(a_layout, (None, None, 0)), (tt, K_CHUNK))
            tma_w, tW = self.weight_tma(g2s, mW, w_layout)
            tma_sfw, tSFW = cpasync.make_tiled_tma_atom(g2s, mSFW, cute.slice_(sfw_layout, (None, None, 0)), (tn, self.cps))
            second = (None,) * 6
            if cutlass.const_expr(self.fused):
                tma_a2, tA2 = cpasync.make_tiled_tma_atom(g2s, mA2, cute.slice_(a_layout, (None, None, 0)), (tt, K_CHUNK))
                tma_w2, tW2 = self.weight_tma(g2s, mW2, w_layout)
                tma_sfw2, tSFW2 = cpasync.make_tiled_tma_atom(
                    g2s, mSFW2, cute.slice_(sfw_layout, (None, None, 0)), (tn, self.cps)
                )
                second = (tma_a2, tA2, tma_w2, tW2, tma_sfw2, tSFW2)
            tma_sfa, tSFA = None, None
            if cutlass.const_expr(not self.bf16):
                tma_sfa, tSFA = cpasync.make_tiled_tma_atom(
                    g2s, mSFA, cute.slice_(sfa_layout, (None, None, 0)), (tt, 4)
                )

            tiled_mma = self.make_tiled_mma(a_dtype, tt)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, st * 2]
                tile_mbar: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS if self.published else 1]
                sTile: cute.struct.Align[cute.struct.MemRange[Int32, TILE_SLOTS * TILE_WORDS if self.published else 1], 16]
                sA: cute.struct.Align[cute.struct.MemRange[a_dtype, cute.cosize(a_layout)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(w_layout)], 1024]
                sSFW: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(sfw_layout)], 128]
                sSFA: cute.struct.Align[cute.struct.MemRange[Int32, 1 if self.bf16 else cute.cosize(sfa_layout)], 128]
                sScale: cute.struct.Align[cute.struct.MemRange[Float32, max(self.cfg.scale_table_bytes() // 4, 1)], 16]
                sAct: cute.struct.Align[cute.struct.MemRange[Float32, tt * self.act_stride if self.swiglu else 1], 16]
                sOut: cute.struct.Align[  # "l1_l2": shares sAct's bytes (see kernel())
                    cute.struct.MemRange[cutlass.BFloat16, tt * self.out_stride if self.scatter and not self.fused else 8], 16
                ]
                sComm: cute.struct.Align[cute.struct.MemRange[Int32, max(mega_comm_words(self.comm), 1)], 16]

            self.shared_storage = SharedStorage
            self.tx_bytes = self.cps * (tt * K_CHUNK * a_dtype.width // 8 + tn * (CHUNK_BYTES + 4)) + (0 if self.bf16 else 16 * tt)

            self.kernel(
                tma_a, tA, tma_w, tW, tma_sfw, tSFW, tma_sfa, tSFA, *second,
                mD, mDSF, mRowW, mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, sync, timeout_ns,
                me, num_tokens, base, peers, stats, record, y,
                tiled_mma, a_layout, w_layout, sfw_layout, sfa_layout,
            ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=self.cfg.ctas_per_sm,
                     stream=stream, use_pdl=True)

        def make_tiled_mma(self, a_dtype, tokens: int):
            """The consumer warpgroups' RS wgmma: 64 weight rows per warpgroup (A from registers) x ``tokens``
            token columns (B from shared memory), both K-major, FP32 accumulator."""
            return sm90_utils.make_trivial_tiled_mma(
                a_dtype, a_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
                (self.num_consumer_wg, 1, 1), (64, tokens), a_source=warpgroup.OperandSource.RMEM,
            )

        def weight_tma(self, g2s, mW: cute.Tensor, w_layout: cute.Layout):
            """TMA atom and coordinate tensor of blocked kernel-layout weights (``mW``: (64 rows, N/64, 64 bytes,
            K/128, E) uint8): logical (N, K/2, E) = ((64, N/64), (64, K/128), E), so the 64-row box of one K
            chunk is contiguous (static 64s: the TMA box must map onto static modes)."""
            mW = cute.make_tensor(mW.iterator, cute.make_layout(
                ((ROW_BLOCK, mW.shape[1]), (CHUNK_BYTES, mW.shape[3]), mW.shape[4]),
                stride=((CHUNK_BYTES, mW.stride[1]), (1, ROW_BLOCK * CHUNK_BYTES), mW.stride[4]),
            ))
            return cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(w_layout, (None, None, 0)), (self.tile_n, CHUNK_BYTES))

        # ------------------------------------------------------------------------------------------
        # Work decomposition, shared by the producer warp and the consumer warpgroups.
        # ------------------------------------------------------------------------------------------

        @cute.jit
        def group_bounds(self, e: Int32, mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
            """Rows [start, end) of group e, clamped into [0, total_rows)."""
            start = Int32(0)
            end = Int32(0)
            if cutlass.const_expr(self.group_mode == "masked"):
                start = e * max_m
                end = start + cutlass.min(cutlass.max(Int32(mGroupA[e]), Int32(0)), max_m)
            else:
                start = cutlass.min(cutlass.max(Int32(mGroupA[e]), Int32(0)), total_rows)
                if cutlass.const_expr(self.group_mode == "offsets_counts"):
                    end = start + cutlass.max(Int32(mGroupB[e]), Int32(0))
                else:
                    end = Int32(mGroupA[e + 1])
                end = cutlass.min(cutlass.max(end, start), total_rows)
            return start, end

        @cute.jit
        def find_tile(self, t: Int32, e: Int32, base: Int32, n_tiles: Int32, num_groups: Int32,
                      mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
            """Advance the (group e, first tile id ``base`` of e) cursor to linear tile ``t``.

            Returns (e, base, valid, row0, row_end, n_tile): token rows [row0, min(row0+tile_tokens, row_end))
            against weight rows [n_tile*tile_n, +tile_n) of expert e. ``t`` must not decrease between calls.
            Warp-cooperative (every lane, the same ``t``): lane l sizes group e + l, a prefix sum over the lanes
            finds the group holding ``t`` -- 32 groups per round of loads, not one (a call that skips many
            empty or small groups, as few-token decode makes them, costs a few rounds instead of a chain of
            dependent loads per group)."""
            lane = cute.arch.lane_idx()
            searching = e < num_groups
            while searching:
                g = e + lane
                tiles_g = Int32(0)
                if g < num_groups:
                    start, end = self.group_bounds(g, mGroupA, mGroupB, max_m, total_rows)
                    tiles_g = tiles.token_tiles(end - start, self.tile_tokens) * n_tiles
                incl = warp_inclusive_sum(tiles_g, lane)
                # Lanes past the last group add no tiles, so the lowest hit is always a real group.
                hit = cute.arch.vote_ballot_sync(t < base + incl)
                if hit != 0:
                    first = nth_set_bit(hit, Int32(0))
                    e = e + first
                    base = base + cute.arch.shuffle_sync(incl - tiles_g, first)
                    searching = False
                else:
                    base = base + cute.arch.shuffle_sync(incl, 31)
                    e = e + 32
                    searching = e < num_groups
            valid = e < num_groups
            row0 = Int32(0)
            row_end = Int32(0)
            n_tile = Int32(0)
            if valid:
                start, end = self.group_bounds(e, mGroupA, mGroupB, max_m, total_rows)
                m, n_tile = tiles.tile_coords(t - base, tiles.token_tiles(end - start, self.tile_tokens))
                row0 = start + m * self.tile_tokens
                row_end = end
            return e, base, valid, row0, row_end, n_tile

        @cute.jit
        def geometry_words(self, firsts: cute.Tensor):
            """Mega MoE: the 4 shared int32 after the block prefix ``firsts`` (pool blocks, window, ring period,
            windows)."""
            return cute.make_tensor(firsts.iterator + (self.ep_all.num_local + 1), cute.make_layout(4))

        @cute.jit
        def store_ring_geometry(self, offs: cute.Tensor, firsts: cute.Tensor, total_rows: Int32):
            """Mega MoE, one thread, once the block prefix is complete: this call's ring geometry
            (``scheduler.tiles.ring_layout`` for a ring of ``total_rows`` rows) into shared memory,
            where the tile loops read it at each tile (values held in registers across the mainloop would cost
            the consumer warps registers they do not have with two CTAs per SM)."""
            geo = self.geometry_words(firsts)
            num_blocks = Int32(firsts[self.ep_all.num_local])
            window, period = tiles.ring_layout(Int32(offs[self.ep_all.num_local]), num_blocks, total_rows, self.tile_tokens,
                                               ep_comm.DSL_OPS)
            geo[0] = num_blocks
            geo[1] = window
            geo[2] = period
            geo[3] = tiles.num_windows(num_blocks, window)

        @cute.jit
        def ring_geometry(self, firsts: cute.Tensor):
            """Mega MoE: (pool blocks, window, ring period, windows) of this call (``store_ring_geometry``)."""
            geo = self.geometry_words(firsts)
            return Int32(geo[0]), Int32(geo[1]), Int32(geo[2]), Int32(geo[3])

        @cute.jit
        def ring_reused(self, firsts: cute.Tensor):
            """Mega MoE: this call reuses ring blocks (more blocks than a window): L2 tiles signal too."""
            geo = self.geometry_words(firsts)
            return Int32(geo[1]) < Int32(geo[0])

        @cute.jit
        def mega_tile(self, t: Int32, e: Int32, dims, offs: cute.Tensor, firsts: cute.Tensor):
            """Mega MoE: tile ``t`` of the bounded-ring order (``scheduler.tiles``: phase p = window p's L1 tiles,
            then window p - 1's L2 tiles; the phase in closed form). Returns (GEMM 0 / 1, expert e, valid, row0,
            row_end, n_tile, block): ring rows [row0, row_end) of e's pool block ``block`` (``tiles.window_tile``). The
            only cursor is ``e``, the previous tile's expert: values held across the consumers' mainloop cost
            registers they do not have with two CTAs per SM."""
            ops = ep_comm.DSL_OPS
            n1, n2 = dims[1], dims[3]
            nb, window, period, last = self.ring_geometry(firsts)
            p = tiles.phase_of(t, window, nb, n1, n2, ops)
            local = t - tiles.phase_start(p, window, nb, n1, n2, ops)
            l1n = n1 * tiles.window_blocks(p, window, nb, ops)
            gemm = Int32(cutlass.select_(local < l1n, Int32(0), Int32(1)))
            n_tiles = Int32(cutlass.select_(gemm == 0, n1, n2))
            local = local - gemm * l1n
            w0 = (p - gemm) * window
            # The expert: the previous tile's (``e``, any index < E: a tile loop's tiles mostly stay in one
            # expert), else a binary search over the block prefix.
            owned = tiles.window_block(local, n_tiles, w0)
            if (owned < Int32(firsts[e])) | (owned >= Int32(firsts[e + 1])):
                e = Int32(tiles.expert_of_block(owned, firsts, self.ep_all.num_local, ops))
            block, n_tile = tiles.window_tile(local, n_tiles, w0, cutlass.min(w0 + window, nb), firsts, e, ops)
            valid = p <= last
            f0 = Int32(firsts[e])
            start = Int32(offs[e])
            row0 = tiles.ring_row(block, f0, start, period, self.tile_tokens, ops)
            row_end = row0 + tiles.block_rows(block, f0, Int32(offs[e + 1]) - start, self.tile_tokens, ops)
            return gemm, e, valid, row0, row_end, n_tile, block

        # ------------------------------------------------------------------------------------------

        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom,
            tA: cute.Tensor,
            tma_w: cute.CopyAtom,
            tW: cute.Tensor,
            tma_sfw: cute.CopyAtom,
            tSFW: cute.Tensor,
            tma_sfa,  # FP8 mode: cute.CopyAtom; BF16 mode: None
            tSFA,  # FP8 mode: cute.Tensor; BF16 mode: None
            tma_a2,  # "l1_l2": the second GEMM's token, weight and scale atoms and tensors; else None
            tA2,
            tma_w2,
            tW2,
            tma_sfw2,
            tSFW2,
            mD: cute.Tensor,
            mDSF: cute.Tensor,
            mRowW: cute.Tensor,
            mRowAddr,
            mRowScale,
            mGroupA: cute.Tensor,
            mGroupB: cute.Tensor,
            num_groups: Int32,
            max_m: Int32,
            clamp: Float32,
            sync: Int64,
            timeout_ns: Int64,
            me: Int32,
            num_tokens: Int32,
            base: Int64,
            peers: Int64,
            stats: Int64,
            record: Int64,
            y: Int64,
            tiled_mma: cute.TiledMma,
            a_layout: cute.ComposedLayout,
            w_layout: cute.Layout,
            sfw_layout: cute.Layout,
            sfa_layout: cute.Layout,
        ):
            tn = self.tile_n
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()

            if warp_idx == 0:  # the descriptors are kernel parameters: no memory of an earlier grid
                for atom in (tma_a, tma_w, tma_sfw) if cutlass.const_expr(self.bf16) else (tma_a, tma_w, tma_sfw, tma_sfa):
                    cpasync.prefetch_descriptor(atom)

            smem = utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipeline = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
                tx_count=self.tx_bytes,
            )
            tiles_pub = None  # the tiles the producer warp publishes to the consumer warpgroups (Mega MoE: and the signal warp)
            if cutlass.const_expr(self.published):
                tiles_pub = (
                    pipeline.PipelineAsync.create(
                        barrier_storage=storage.tile_mbar.data_ptr(),
                        num_stages=TILE_SLOTS,
                        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                 128 * self.num_consumer_wg + (32 if self.fused else 0)),
                    ),
                    storage.sTile.get_tensor(cute.make_layout((TILE_SLOTS, TILE_WORDS), stride=(TILE_WORDS, 1))),
                )

            # (k_tiles, n_tiles) of each GEMM; the second is the first's unless fused.
            k_tiles = Int32(tA.shape[1]) // K_CHUNK
            n_tiles = Int32(cute.size(tW, mode=[0])) // tn
            dims = (k_tiles, n_tiles, k_tiles, n_tiles)
            if cutlass.const_expr(self.fused):
                dims = (k_tiles, n_tiles, Int32(tA2.shape[1]) // K_CHUNK, Int32(cute.size(tW2, mode=[0])) // tn)
            total_rows = Int32(tA.shape[0])
            sW = storage.sW.get_tensor(w_layout)
            sSFW = storage.sSFW.get_tensor(sfw_layout)
            if cutlass.const_expr(self.dynamic):
                if warp_idx == 0:
                    self.prefetch_first_tile((tma_a, tA, tma_w, tW, tma_sfw, tSFW), sW, sSFW, mGroupA, mGroupB,
                                             num_groups, max_m, total_rows, dims, bidx)
            # Launched as a programmatic dependent (use_pdl): the CTA's start, its shared-memory setup and the
            # prefetch above may overlap the previous grid on the stream; nothing below runs before that grid has
            # finished and its memory is visible. The next grid may launch now: its CTAs start as these exit.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            self.trace_start(record, gdim, bidx, tidx)
            sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
            sSFA = None
            if cutlass.const_expr(not self.bf16):
                sSFA = storage.sSFA.get_tensor(sfa_layout)
            sScale = None
            if cutlass.const_expr(self.wide):
                # (4 values, column pair jp, lane quad q, 32-K block, chunk parity, warpgroup): the FP32 scales of
                # token columns 8 * (2 jp + v // 2) + 2 q + v % 2; a quad's row padded by 4 floats (no bank conflicts
                # between the quads' 16-byte loads).
                row = self.tile_tokens // 4 + 4
                sScale = storage.sScale.get_tensor(cute.make_layout(
                    (4, self.tile_tokens // 16, 4, 4, 2, self.num_consumer_wg),
                    stride=(1, 4, row, 4 * row, 16 * row, 32 * row),
                ))
            sAct = None
            if cutlass.const_expr(self.swiglu):
                sAct = storage.sAct.get_tensor(
                    cute.make_layout((self.tile_tokens, self.act_stride), stride=(self.act_stride, 1))
                )
            sOut = None
            if cutlass.const_expr(self.scatter):  # the staged tile, (token, column) BF16
                out_layout = cute.make_layout((self.tile_tokens, self.out_stride), stride=(self.out_stride, 1))
                if cutlass.const_expr(self.fused):
                    # Rows of both staging tiles are 2 * tile_n + 16 bytes, and consumer warpgroup w touches only
                    # bytes [128w, 128w + 128) of each row in both epilogues, which it runs one after the other:
                    # one region serves both (a pipeline stage more at large tiles).
                    assert self.act_stride * 4 == self.out_stride * 2
                    sOut = cute.make_tensor(cute.recast_ptr(sAct.iterator, dtype=cutlass.BFloat16), out_layout)
                else:
                    sOut = storage.sOut.get_tensor(out_layout)

            call = Int32(0)
            flag = None
            if cutlass.const_expr(self.comm is not None):
                # Mega MoE dispatch steps 1-3 on every thread (ep_comm): the expert offsets come from the counts in
                # shared memory (they replace mGroupA), then the pool-block prefix (replaces mGroupB); the pull
                # (step 4) overlaps the tiles (warps 2 and 3).
                num_local = self.ep_all.num_local
                offs = storage.sComm.get_tensor(cute.make_layout(num_local + 1))
                t_src = cute.make_tensor(offs.iterator + (num_local + 1), cute.make_layout(2))
                firsts = cute.make_tensor(offs.iterator + (num_local + 3), cute.make_layout(num_local + 1))
                flag = cute.make_tensor(offs.iterator + (2 * num_local + 8), cute.make_layout(1))
                lane = cute.arch.lane_idx()
                call = self.ep_all.current_call(base)
                if bidx == 0:
                    self.ep_all.announce(me, num_tokens, peers, call, tidx)
                self.ep_all.scan(me, base, peers, call, t_src, tidx, bidx, gdim, record, timeout_ns)
                self.stamp(record, gdim, bidx, tidx, "scanned")
                self.ep_all.grid_barrier(self.word(sync, num_groups, GRID), gdim, 0, ep_comm.SITE_D_BARRIER, tidx, me,
                                         record, timeout_ns)
                total = self.ep_all.expert_offsets(offs, base, stats, tidx, lane, bidx, False, me, record)
                for g in cutlass.range(tidx, num_local, self.threads):
                    firsts[g] = tiles.token_tiles(offs[g + 1] - offs[g], self.tile_tokens)
                cute.arch.sync_threads()
                if tidx < 32:
                    self.ep_all.warp_exclusive_scan(firsts, lane)
                cute.arch.sync_threads()
                if tidx == 0:
                    self.store_ring_geometry(offs, firsts, total_rows)
                cute.arch.sync_threads()
                self.stamp(record, gdim, bidx, tidx, "offsets")
                mGroupA = offs
                mGroupB = firsts
            if warp_idx < 4:
                if cutlass.const_expr(self.rebalance_registers):
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.producer(
                        ab_pipeline, (tma_a, tA, tma_w, tW, tma_sfw, tSFW), (tma_a2, tA2, tma_w2, tW2, tma_sfw2, tSFW2),
                        tma_sfa, tSFA, sA, sW, sSFW, sSFA, mGroupA, mGroupB, num_groups, max_m,
                        total_rows, dims, sync, timeout_ns, bidx, gdim, tiles_pub,
                    )
                if cutlass.const_expr(self.fused):
                    if warp_idx == 1:
                        self.signaller(mGroupA, mGroupB, num_groups, max_m, total_rows, dims, sync, bidx, gdim, tiles_pub)
                if cutlass.const_expr(self.comm is not None):
                    if warp_idx >= 2:
                        # Mega MoE pull: every unit counted on its pool block's counter, for the L1 tiles' producers.
                        # They all finish before combine's grid barrier: every pulled row's block has L1 tiles,
                        # each of which waited for all of its block's units.
                        self.ep_all.pull_ring(me, base, peers, mGroupA, mGroupB, total, bidx * 2 + (warp_idx - 2), gdim * 2,
                                              cute.arch.lane_idx(), record, self.tile_tokens,
                                              self.ring_geometry(mGroupB)[2], dims[3],
                                              self.word(sync, num_groups, PULLED), self.word(sync, num_groups, L2_DONE),
                                              timeout_ns)
                        self.stamp(record, gdim, bidx, cute.arch.lane_idx(), "pull warp 0 done", warp_idx - 2)
            else:
                if cutlass.const_expr(self.rebalance_registers):
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consumer(
                    ab_pipeline, tiled_mma, tidx - 128, sA, sW, sSFW, sSFA, sScale, sAct, sOut, mD, mDSF, mRowW,
                    mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, total_rows, dims, sync, bidx,
                    gdim, tiles_pub, record,
                )
                if cutlass.const_expr(self.comm is not None):
                    # Mega MoE combine on the consumer warpgroups (ep_comm steps 2-3): every row of every CTA is
                    # stored and fenced (sys) by its thread once all CTAs pass this barrier.
                    ctidx = tidx - 128
                    num_warps = self.ep_cons.warps
                    self.stamp(record, gdim, bidx, ctidx, "tiles done")
                    self.ep_cons.grid_barrier(self.word(sync, num_groups, GRID), 2 * gdim, 1, ep_comm.SITE_C_BARRIER,
                                              ctidx, me, record, timeout_ns)
                    self.stamp(record, gdim, bidx, ctidx, "combine barrier")
                    self.ep_cons.exchange_done(me, base, peers, call, ctidx, bidx, record, timeout_ns)
                    self.stamp(record, gdim, bidx, ctidx, "done exchanged")
                    self.ep_cons.sum_tokens(base, num_tokens, y, bidx * num_warps + ctidx // 32, gdim * num_warps,
                                            cute.arch.lane_idx())
                    self.stamp(record, gdim, bidx, ctidx, "end")
            if cutlass.const_expr(self.fused):
                self.reset_counters(sync, num_groups, tidx, warp_idx, gdim, base, call, mGroupB, flag)

        def trace_word(self, record: Int64, gdim: Int32, bidx: Int32, word) -> Int64:
            """Address of word ``word`` of this CTA's timeline row (after the ``gdim`` debug-record rows)."""
            return record + (Int64(gdim) * ep_comm.RECORD_WORDS + Int64(bidx) * timeline.TRACE_WORDS + word) * 8

        @cute.jit
        def stamp(self, record: Int64, gdim: Int32, bidx: Int32, who: Int32, event: cutlass.Constexpr, offset=0):
            """Trace build, the thread whose index ``who`` in its group is 0: ``%globaltimer`` into this CTA's
            timeline row at ``event`` (``timeline.EVENTS``) + ``offset``; nothing in other builds."""
            if cutlass.const_expr(self.trace):
                if who == 0:
                    ptx.st_global_u64(self.trace_word(record, gdim, bidx, timeline.EVENT[event] + offset), ptx.globaltimer())

        @cute.jit
        def trace_start(self, record: Int64, gdim: Int32, bidx: Int32, tidx: Int32):
            """Trace build, thread 0 at the kernel's start: stamp "start" and zero the words a call may leave
            unwritten (the tile counts; "last l1 tile" of a CTA without L1 tiles); two CTA barriers order these
            stores before the consumers' updates."""
            self.stamp(record, gdim, bidx, tidx, "start")
            if cutlass.const_expr(self.trace):
                if tidx == 0:
                    for word in (timeline.EVENT["last l1 tile"], timeline.COUNT["l1 tiles"], timeline.COUNT["l2 tiles"]):
                        for half in range(2):
                            ptx.st_global_u32(self.trace_word(record, gdim, bidx, word) + half * 4, 0)

        @cute.jit
        def trace_tile(self, record: Int64, gdim: Int32, bidx: Int32, ctidx: Int32, phase: Int32):
            """Trace build, the first consumer thread after each tile: count it (per GEMM), stamp "last l1 tile"."""
            if cutlass.const_expr(self.trace):
                if ctidx == 0:
                    if phase == 0:
                        self.stamp(record, gdim, bidx, ctidx, "last l1 tile")
                    ptx.count_u64(self.trace_word(record, gdim, bidx, timeline.COUNT["l1 tiles"] + phase))

        @cute.jit
        def next_tile(self, t: Int32, phase: Int32, e: Int32, base: Int32, t_off: Int32, dims, num_groups: Int32,
                      mGroupA: cute.Tensor, mGroupB: cute.Tensor, max_m: Int32, total_rows: Int32):
            """``find_tile`` over the launch's tiles: those of the first GEMM (``phase`` 0), then, when fused,
            those of the second (phase 1, tile ids from ``t_off`` = the first GEMM's tile count on); Mega MoE:
            ``mega_tile`` (its cursor: e; base and t_off pass through; ``mGroupB``: the block prefix).
            Returns (phase, e, base, t_off, valid, row0, row_end, n_tile, block); ``t`` must not decrease."""
            block = Int32(0)
            if cutlass.const_expr(self.comm is not None):
                phase, e, valid, row0, row_end, n_tile, block = self.mega_tile(t, e, dims, mGroupA, mGroupB)
            else:
                n_tiles = dims[1]
                if cutlass.const_expr(self.fused):
                    n_tiles = Int32(cutlass.select_(phase == 0, dims[1], dims[3]))
                e, base, valid, row0, row_end, n_tile = self.find_tile(
                    t - t_off, e, base, n_tiles, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
                if cutlass.const_expr(self.fused):
                    if phase == 0:
                        if e >= num_groups:  # past the first GEMM's tiles; base: their count
                            phase = Int32(1)
                            t_off = t_off + base
                            e, base, valid, row0, row_end, n_tile = self.find_tile(
                                t - t_off, Int32(0), Int32(0), dims[3], num_groups, mGroupA, mGroupB, max_m, total_rows
                            )
                if cutlass.const_expr(self.dynamic):
                    block = e  # published in the block word: the consumers' group (folded row scales)
            return phase, e, base, t_off, valid, row0, row_end, n_tile, block

        @cute.jit
        def publish_tile(self, tiles_pub, pub, phase: Int32, valid, row0: Int32, row_end: Int32, n_tile: Int32,
                         block: Int32):
            """Mega MoE and separate launches, the producer warp (every lane): publish the next tile (or, ``valid``
            false, the end) to the consumer warpgroups (Mega MoE: and the signal warp) in a free slot of ``tiles_pub``
            (PipelineAsync, shared words; the block word: Mega MoE's pool block, else the group); returns ``pub``
            advanced.
            The consumers then compute nothing per tile: the search over the tile order costs the producer warp
            time it hides behind the loads in flight, but the consumers time between two mainloops."""
            tiles_pub[0].producer_acquire(pub)
            slot = tiles_pub[1]
            i = pub.index
            slot[i, 0] = phase
            slot[i, 1] = Int32(cutlass.select_(valid, Int32(1), Int32(0)))
            slot[i, 2] = row0
            slot[i, 3] = row_end
            slot[i, 4] = n_tile
            slot[i, 5] = block
            tiles_pub[0].producer_commit(pub)
            pub.advance()
            return pub  # the caller assigns it: a state advanced in a callee is loop-carried only when assigned

        @cute.jit
        def fetch_tile(self, sync: Int64, num_groups: Int32, gdim: Int32) -> Int32:
            """Mega MoE and separate launches, the producer warp (every lane): the CTA's next tile id, handed out in
            tile order to whichever CTA asks first (CTA c's first tile is c; then ``gdim`` + a relaxed add to
            ``NEXT_TILE``, zeroed at the end of the launch): CTAs that run faster take more tiles, so they finish
            closer together."""
            taken = Int32(0)
            if cute.arch.lane_idx() == 0:
                taken = ptx.atom_add(self.word(sync, num_groups, NEXT_TILE), 1, "relaxed")
            return gdim + cute.arch.shuffle_sync(taken, 0)

        @cute.jit
        def take_tile(self, tiles_pub, taken):
            """Mega MoE and separate launches, the consumer warpgroups (and the signal warp): wait for the tile published in ``taken``'s slot
            (released by the caller after the tile) -> (phase, valid, row0, row_end, n_tile, block)."""
            tiles_pub[0].consumer_wait(taken)
            slot = tiles_pub[1]
            i = taken.index
            return (Int32(slot[i, 0]), Int32(slot[i, 1]) != 0, Int32(slot[i, 2]), Int32(slot[i, 3]), Int32(slot[i, 4]),
                    Int32(slot[i, 5]))

        def word(self, sync: Int64, num_groups: Int32, which: int, i=0) -> Int64:
            """Address of a counter in ``sync``: a fused launch's (``sync_words``), ``which`` one of ``L1_DONE`` (of
            group i; Mega MoE: of pool block i), ``FINISHED`` (CTAs), ``ALL_L1`` (L1 tiles done), and Mega MoE
            only ``GRID`` (barrier arrivals), ``NEXT_TILE`` (tiles handed out), ``PULLED`` and ``L2_DONE`` (of pool
            block i); a separate launch's (``tile_counters``): ``NEXT_TILE`` and ``FINISHED``."""
            if self.dynamic:
                index = {NEXT_TILE: 0, FINISHED: 1}[which]
            elif self.comm is None:
                index = {L1_DONE: i, FINISHED: num_groups, ALL_L1: num_groups + 1}[which]
            elif which in (FINISHED, ALL_L1, GRID, NEXT_TILE):
                index = {FINISHED: 0, ALL_L1: 1, GRID: 2, NEXT_TILE: 3}[which]
            else:
                index = MEGA_HEADER + {L1_DONE: 0, PULLED: 1, L2_DONE: 2}[which] * self.max_blocks + i
            return sync + Int64(index) * 4

        @cute.jit
        def first_gemm_count(self, sync: Int64, e: Int32, block: Int32, dims, num_groups, mGroupA, mGroupB, max_m,
                             total_rows):
            """Fused: (address, target) of the counter an L2 tile of group e waits on: each first-GEMM tile of the
            group adds 1 (release) once its rows are stored (``signaller``); Mega MoE: of pool block ``block``."""
            addr = self.word(sync, num_groups, L1_DONE, e)
            target = dims[1]
            if cutlass.const_expr(self.comm is not None):
                addr = self.word(sync, num_groups, L1_DONE, block)
            else:
                start, end = self.group_bounds(e, mGroupA, mGroupB, max_m, total_rows)
                target = tiles.token_tiles(end - start, self.tile_tokens) * dims[1]
            return addr, target

        @cute.jit
        def wait_counter(self, addr: Int64, target: Int32, index: Int32, timeout_ns: Int64, what: cutlass.Constexpr):
            """Fused: spin until the counter at ``addr`` (``what`` it counts, of group / block ``index``) reaches ``target`` (acquire),
            then order the async proxy (TMA) after it. Debug build: with ``timeout_ns`` > 0, expiry printf's the
            wait and traps."""
            seen = ptx.spin_until(addr, target, False, "gpu", timeout_ns, self.debug)
            if cutlass.const_expr(self.debug):
                if ptx.behind(seen, target) != 0:
                    cute.printf(
                        "megamoe debug: fused grouped GEMM CTA %d (SM %d) role producer: timed out: waits "
                        + what + " %d: count >= %d, sees %d",
                        cute.arch.block_idx()[0], ptx.smid(), index, target, seen,
                    )
                    ptx.trap()
            cute.arch.fence_proxy("async.global")

        def k_steps(self, chunks):
            """K steps (pipeline stages) of a tile of ``chunks`` 128-K chunks (``cps`` divides every K: 512 | K)."""
            return chunks if cutlass.const_expr(self.cps == 1) else chunks // self.cps

        @cute.jit
        def chunks_ahead(self, addr: Int64, target: Int32, k_tiles: Int32) -> Int32:
            """Fused: the K steps (``k_tiles`` stages of ``cps`` chunks) a tile whose token rows other CTAs produce
            loads the weights of before it waits (``load_tile``'s ``ahead``): none if the counter at ``addr`` already
            reached ``target`` (acquired; the async proxy then ordered after it), else up to ``stages``."""
            ahead = Int32(0)
            if ptx.behind(ptx.ld_acquire(addr, False, "gpu"), target) != 0:
                ahead = cutlass.min(k_tiles, Int32(self.stages))
            else:
                cute.arch.fence_proxy("async.global")
            return ahead

        @cute.jit
        def load_tile(self, ab_pipeline, state, ops, parts, e: Int32, n_tile: Int32, k_tiles: Int32, ahead: Int32,
                      addr: Int64, target: Int32, timeout_ns: Int64, index: Int32, what: cutlass.Constexpr):
            """Fused: the TMA loads of a tile whose token rows other CTAs produce in this launch. The first ``ahead``
            chunks (at most ``stages``: they need no stage of this tile released) load their weights, then the wait
            for the counter (``wait_counter``; ``index``, ``what``: its name in the debug report), then their tokens; the rest load both. ``ahead`` = 0: the
            rows are known ready (acquired, proxy-fenced). ``ops``: the GEMM's TMA atoms and tensors, ``parts``: its
            (tAg, tAs, tWg, tWs, tSFWg, tSFWs) partitions. Returns the advanced pipeline state."""
            tAg, tAs, tWg, tWs, tSFWg, tSFWs = parts
            pending = state.clone()
            for kt in cutlass.range(ahead, unroll=1):
                ab_pipeline.producer_acquire(state)
                self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, False, True)
                ab_pipeline.producer_commit(state)
                state.advance()
            if ahead > 0:
                self.wait_counter(addr, target, index, timeout_ns, what)
            for kt in cutlass.range(ahead, unroll=1):
                self.load_chunk(ab_pipeline, pending, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, True, False)
                pending.advance()
            for kt in cutlass.range(ahead, k_tiles, unroll=1):
                ab_pipeline.producer_acquire(state)
                self.load_chunk(ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile, True, True)
                ab_pipeline.producer_commit(state)
                state.advance()
            return state

        def epilogue_barrier(self, wg):
            """Consumer warpgroup wg's own 128 threads (``named_barriers``)."""
            return pipeline.NamedBarrier(barrier_id=named_barriers(self.num_consumer_wg)[0] + wg, num_threads=128)

        def signal_barrier(self, wg):
            """Consumer warpgroup wg (128 threads) and the signal warp (32) (``named_barriers``), once per signalled
            tile."""
            return pipeline.NamedBarrier(barrier_id=named_barriers(self.num_consumer_wg)[1] + wg, num_threads=160)

        @cute.jit
        def signaller(self, mGroupA, mGroupB, num_groups, max_m, total_rows, dims, sync: Int64, bidx, gdim, tiles_pub):
            """Fused, warp 1: for each of this CTA's first-GEMM tiles, meet every consumer warpgroup once its rows
            are stored (``signal_barrier``), then add 1 to the group's (Mega MoE: pool block's) counter and to the
            all-tiles counter (``fence.acq_rel.gpu`` + release add: cumulative over the stores the barrier ordered
            before). The fence waits here, not in the consumers. Ends at the first second-GEMM tile (each CTA's
            first-GEMM tiles come first). Mega MoE: the tiles come from the producer warp (``take_tile``, every one
            released after its signal), and with ring blocks reused (``ring_reused``) an L2 tile adds 1 to its
            block's ``L2_DONE`` once its reads of the ring (tokens, row addresses) are done."""
            if cutlass.const_expr(self.comm is not None):
                reused = self.ring_reused(mGroupB)
                taken = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)
                phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
                while valid:
                    if (phase == 0) | reused:
                        for wg in cutlass.range_constexpr(self.num_consumer_wg):
                            self.signal_barrier(wg).arrive_and_wait()
                        if cute.arch.lane_idx() == 0:
                            if phase == 0:
                                ptx.arrive(self.word(sync, num_groups, L1_DONE, block))
                                ptx.arrive(self.word(sync, num_groups, ALL_L1))
                            else:
                                ptx.arrive(self.word(sync, num_groups, L2_DONE, block))
                    tiles_pub[0].consumer_release(taken)
                    taken.advance()
                    phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
            else:
                t = bidx
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
                more = valid & (phase == 0)
                while more:
                    for wg in cutlass.range_constexpr(self.num_consumer_wg):
                        self.signal_barrier(wg).arrive_and_wait()
                    if cute.arch.lane_idx() == 0:
                        ptx.arrive(self.word(sync, num_groups, L1_DONE, e))
                        ptx.arrive(self.word(sync, num_groups, ALL_L1))
                    t = t + gdim
                    phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                        t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                    )
                    more = valid & (phase == 0)

        @cute.jit
        def reset_counters(self, sync: Int64, num_groups: Int32, tidx: Int32, warp_idx: Int32, gdim: Int32, base: Int64,
                           call: Int32, firsts, flag):
            """Fused, at the end: the last CTA to finish (all its tiles done, its waits over) zeroes the counters
            (``sync_words``) for the next launch; Mega MoE: every thread of it, the header and this call's blocks'
            counters (``firsts``: the block prefix; ``flag``: one shared int32), then it ends the call
            (``EpPhases.finish_call``)."""
            cute.arch.sync_threads()
            if cutlass.const_expr(self.comm is not None):
                if tidx == 0:
                    flag[0] = ptx.atom_add(self.word(sync, num_groups, FINISHED), 1, "acq_rel")
                cute.arch.sync_threads()
                if flag[0] == gdim - 1:
                    nb = Int32(firsts[self.ep_all.num_local])
                    per = cutlass.max(nb, 1)
                    for i in cutlass.range(tidx, MEGA_HEADER + 3 * nb, self.threads, unroll=1):
                        j = cutlass.max(i - MEGA_HEADER, 0)
                        kind = j // per
                        index = Int32(cutlass.select_(i < MEGA_HEADER, i, MEGA_HEADER + kind * self.max_blocks + j - kind * per))
                        ptx.st_global_u32(sync + Int64(index) * 4, Int32(0))
                    self.ep_all.finish_call(base, call, tidx)
            else:
                if warp_idx == 0:
                    self.zero_if_last(sync, num_groups, gdim, num_groups + 2)

        @cute.jit
        def zero_if_last(self, sync: Int64, num_groups: Int32, gdim: Int32, words):
            """One warp per CTA, once its CTA is done with the counters: add 1 to ``FINISHED`` (acq_rel, so every
            earlier counter update of the CTA precedes it); the last of the ``gdim`` CTAs zeroes the first ``words``
            words of ``sync`` for the next launch."""
            lane = cute.arch.lane_idx()
            old = Int32(0)
            if lane == 0:
                old = ptx.atom_add(self.word(sync, num_groups, FINISHED), 1, "acq_rel")
            if cute.arch.shuffle_sync(old, 0) == gdim - 1:
                for i in cutlass.range(lane, words, 32, unroll=1):
                    ptx.st_global_u32(sync + Int64(i) * 4, Int32(0))

        @cute.jit
        def load_chunk(self, ab_pipeline, state, kt, ops, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile,
                       tokens: cutlass.Constexpr[bool], weights: cutlass.Constexpr[bool]):
            """TMA loads of K step ``kt`` (chunks ``kt * cps`` ..., ``cps`` of them) into ``state``'s stage (acquired
            by the caller): the token tiles and/or the weight tiles with their packed scale words (one box of the
            step's chunks, tile_n words each). ``ops``: the GEMM's (tma_a, tA, tma_w, tW, tma_sfw, tSFW)."""
            bar = ab_pipeline.producer_get_barrier(state)
            s = state.index
            for h in cutlass.range_constexpr(self.cps):
                c = kt * self.cps + h
                if cutlass.const_expr(tokens):
                    cute.copy(ops[0], tAg[(None, c)], tAs[(None, s * self.cps + h)], tma_bar_ptr=bar)
                if cutlass.const_expr(weights):
                    cute.copy(ops[2], tWg[(None, n_tile, c, e)], tWs[(None, s * self.cps + h)], tma_bar_ptr=bar)
            if cutlass.const_expr(weights):
                cute.copy(ops[4], tSFWg[(None, n_tile, kt, e)], tSFWs[(None, s)], tma_bar_ptr=bar)

        def weight_partitions(self, ops, sW, sSFW):
            """Weight and scale TMA partitions of one GEMM (``ops``: tma_a, tA, tma_w, tW, tma_sfw, tSFW); static:
            (TMA, RestN, RestK, E)."""
            one = cute.make_layout(1)
            tWs, tWg = cpasync.tma_partition(
                ops[2], 0, one, cute.group_modes(sW, 0, 2),
                cute.group_modes(cute.local_tile(ops[3], (self.tile_n, CHUNK_BYTES), (None, None, None)), 0, 2),
            )
            tSFWs, tSFWg = cpasync.tma_partition(
                ops[4], 0, one, cute.group_modes(sSFW, 0, 2),
                cute.group_modes(cute.local_tile(ops[5], (self.tile_n, self.cps), (None, None, None)), 0, 2),
            )
            return tWs, tWg, tSFWs, tSFWg

        def token_partitions(self, ops, row0, sA):
            """Token TMA partitions of one GEMM for the tile starting at ``row0`` (any row: the coordinate
            domain is offset): (TMA, K chunk)."""
            gA = cute.local_tile(cute.domain_offset((row0, 0), ops[1]), (self.tile_tokens, K_CHUNK), (0, None))
            return cpasync.tma_partition(ops[0], 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                         cute.group_modes(gA, 0, 2))

        @cute.jit
        def prefetch_first_tile(self, ops, sW, sSFW, mGroupA, mGroupB, num_groups: Int32, max_m: Int32,
                                total_rows: Int32, dims, bidx: Int32):
            """Separate launches, the producer warp, before ``griddepcontrol.wait``: an L2 prefetch (TMA) of the
            weights and scale words of the first ``stages`` K steps of this CTA's first tile, so they stream while
            the previous grid ends. The tile comes from the group bounds as they are then -- the previous grid may
            still be writing them, so it is a guess that only this prefetch uses; a wrong one costs bandwidth, never
            a value: the loads come after the wait, and L2 holds the previous grid's stores over any prefetched
            line. ``ops``: (tma_a, tA, tma_w, tW, tma_sfw, tSFW)."""
            tWs, tWg, tSFWs, tSFWg = self.weight_partitions(ops, sW, sSFW)
            _, e, _, _, valid, _, _, n_tile, _ = self.next_tile(
                bidx, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
            if valid:
                n_tile = cutlass.min(n_tile, dims[1] - 1)
                for kt in cutlass.range(cutlass.min(self.k_steps(dims[0]), Int32(self.stages)), unroll=1):
                    for h in cutlass.range_constexpr(self.cps):
                        cute.prefetch(ops[2], tWg[(None, n_tile, kt * self.cps + h, e)])
                    cute.prefetch(ops[4], tSFWg[(None, n_tile, kt, e)])

        @cute.jit
        def producer(self, ab_pipeline, first, second, tma_sfa, tSFA, sA, sW, sSFW, sSFA, mGroupA, mGroupB,
                     num_groups, max_m, total_rows, dims, sync, timeout_ns, bidx, gdim, tiles_pub):
            """Warp 0: TMA loads of every tile's K chunks. ``first``/``second``: (tma_a, tA, tma_w, tW, tma_sfw,
            tSFW) of the two GEMMs (second: all None unless fused). A second-GEMM tile first loads the weights of
            up to ``stages`` chunks (they do not depend on the first GEMM), then waits for its tokens' rows
            (``load_tile``); Mega MoE: a first-GEMM tile likewise waits for its rows' pulls, and every tile (then
            an invalid one, the end) is published to the consumer warpgroups (``publish_tile``) before its loads."""
            tt = self.tile_tokens
            one = cute.make_layout(1)
            tWs, tWg, tSFWs, tSFWg = self.weight_partitions(first, sW, sSFW)
            if cutlass.const_expr(self.fused):
                tWs2, tWg2, tSFWs2, tSFWg2 = self.weight_partitions(second, sW, sSFW)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            pub = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
            t = bidx
            phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
            )
            if cutlass.const_expr(self.published):
                pub = self.publish_tile(tiles_pub, pub, phase, valid, row0, row_end, n_tile, block)
            all_done = Int32(0)  # fused: every first-GEMM tile seen done (acquired + proxy fence): no more checks
            while valid:
                if phase == 0:
                    tAs, tAg = self.token_partitions(first, row0, sA)
                    if cutlass.const_expr(self.comm is not None):
                        # Mega MoE: the tile's rows are this launch's pulls (``EpPhases.pull_ring`` counts units).
                        addr = self.word(sync, num_groups, PULLED, block)
                        target = tiles.pulled_target(row_end - row0, self.ep_all.row_units)
                        ahead = self.chunks_ahead(addr, target, self.k_steps(dims[0]))
                        state = self.load_tile(ab_pipeline, state, first, (tAg, tAs, tWg, tWs, tSFWg, tSFWs), e, n_tile,
                                               self.k_steps(dims[0]), ahead, addr, target, timeout_ns, block, "pulled row units of pool block")
                    else:
                        tSFAs, tSFAg = None, None
                        if cutlass.const_expr(not self.bf16):
                            gSFA = cute.local_tile(cute.domain_offset((row0, 0), tSFA), (tt, 4), (0, None))
                            tSFAs, tSFAg = cpasync.tma_partition(
                                tma_sfa, 0, one, cute.group_modes(sSFA, 0, 2), cute.group_modes(gSFA, 0, 2)
                            )
                        for kt in cutlass.range(self.k_steps(dims[0]), unroll=1):
                            ab_pipeline.producer_acquire(state)
                            self.load_chunk(ab_pipeline, state, kt, first, tAg, tAs, tWg, tWs, tSFWg, tSFWs, e, n_tile,
                                            True, True)
                            if cutlass.const_expr(not self.bf16):
                                bar = ab_pipeline.producer_get_barrier(state)
                                cute.copy(tma_sfa, tSFAg[(None, kt // 4)], tSFAs[(None, state.index)], tma_bar_ptr=bar)
                            ab_pipeline.producer_commit(state)
                            state.advance()
                else:
                    if cutlass.const_expr(self.fused):
                        tAs2, tAg2 = self.token_partitions(second, row0, sA)
                        addr, target = self.first_gemm_count(sync, e, block, dims, num_groups, mGroupA, mGroupB, max_m,
                                                             total_rows)
                        l1_tiles = t_off  # all first-GEMM tiles (Mega MoE: n_l1 per pool block)
                        if cutlass.const_expr(self.comm is not None):
                            l1_tiles = dims[1] * Int32(mGroupB[self.ep_all.num_local])
                        # Rows ready (always once all first-GEMM tiles are seen done): load chunks as the first GEMM
                        # does. Else the weights of the first chunks are loaded before the wait.
                        ahead = Int32(0)
                        if all_done == 0:
                            if ptx.behind(ptx.ld_acquire(self.word(sync, num_groups, ALL_L1), False, "gpu"), l1_tiles) == 0:
                                all_done = Int32(1)
                                cute.arch.fence_proxy("async.global")
                            else:
                                ahead = self.chunks_ahead(addr, target, self.k_steps(dims[2]))
                        state = self.load_tile(ab_pipeline, state, second, (tAg2, tAs2, tWg2, tWs2, tSFWg2, tSFWs2), e,
                                               n_tile, self.k_steps(dims[2]), ahead, addr, target, timeout_ns,
                                               block if self.comm is not None else e,
                                               "first-GEMM tiles of pool block" if self.comm is not None
                                               else "first-GEMM tiles of group")
                if cutlass.const_expr(self.published):
                    t = self.fetch_tile(sync, num_groups, gdim)
                else:
                    t = t + gdim
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
                if cutlass.const_expr(self.published):
                    pub = self.publish_tile(tiles_pub, pub, phase, valid, row0, row_end, n_tile, block)
            if cutlass.const_expr(self.dynamic):
                self.zero_if_last(sync, num_groups, gdim, 2)  # after this CTA's last claim
            ab_pipeline.producer_tail(state)

        @cute.jit
        def consumer(self, ab_pipeline, tiled_mma, ctidx, sA, sW, sSFW, sSFA, sScale, sAct, sOut, mD, mDSF, mRowW,
                     mRowAddr, mRowScale, mGroupA, mGroupB, num_groups, max_m, clamp, total_rows, dims, sync, bidx,
                     gdim, tiles_pub, record):
            """Consumer warpgroups: every tile's mainloop and epilogue; the tiles come from ``next_tile``, or Mega
            MoE: from the producer warp (``take_tile``). ``record``: the trace build's timeline rows."""
            tt, tn = self.tile_tokens, self.tile_n
            thr_mma = tiled_mma.get_slice(ctidx)
            # Register A fragment as int32, ((1, 2, 2), 1, k blocks): per (row r, k-half h) of each k block
            # (FP8: k32, four e4m3; BF16: k16, two bf16).
            tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((tn, K_CHUNK)))
            frag = cute.recast_tensor(tCrA, Int32)
            tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sA))  # (MMA, MMA_N, k blocks, stages)
            # Explicit ((2, 2, tt/8), 1, 1): partition_shape_C drops the unit mode at tt == 8, which cute.gemm rejects.
            acc_shape = ((2, 2, tt // 8), 1, 1)
            acc = cute.make_rmem_tensor(acc_shape, Float32)

            # This thread's coordinates: A-fragment rows (weights) and accumulator (row, token column).
            cA = thr_mma.partition_A(cute.make_identity_tensor((tn, K_CHUNK)))
            q = cA[(0, 0, 0), 0, 0][1] // (2 if self.bf16 else 4)
            wrow0 = cA[(0, 0, 0), 0, 0][0]
            wrow1 = cA[(0, 1, 0), 0, 0][0]
            # Accumulator value i = c + 2*r + 4*j is (weight row g + 8r, token column 8j + 2q + c).
            cC = thr_mma.partition_C(cute.make_identity_tensor((tn, tt)))
            n_cols = tt // 8

            sW_words = cute.make_tensor(  # (word, quad, row, slot)
                cute.recast_ptr(sW.iterator, dtype=Int32),
                cute.make_layout((4, 4, tn, self.stages * self.cps), stride=(1, 4, 16, tn * 16)),
            )
            wbuf = cute.make_rmem_tensor((4, 2), Int32)  # (word, r): FP8 k32 block kb / BF16 k16 blocks 2w, 2w+1
            sfw_words = cute.make_rmem_tensor((2,), Int32)
            if cutlass.const_expr(self.bf16):
                mult = cute.make_rmem_tensor((2, 2), Int32)  # (k32 block pair, r): two BF16 decode multipliers
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                # Token widths: a tile whose rows fit the first n of its tt rows multiplies only those (wgmma N = n):
                # per width its MMA, the token fragments of the first n rows of sA, the first n/8 accumulator
                # column groups (the rest stay 0 and are not stored); the full width is the tile's own.
                widths = token_widths(tt)
                mmas, accs, tCrBs = [], [], []
                for n in widths:
                    if cutlass.const_expr(n == tt):
                        mmas.append(tiled_mma)
                        accs.append(acc)
                        tCrBs.append(tCrB)
                    else:
                        mma_n = self.make_tiled_mma(cutlass.BFloat16, n)
                        mma_n.set(warpgroup.Field.ACCUMULATE, True)
                        thr_n = mma_n.get_slice(ctidx)
                        sA_n = cute.local_tile(sA, (n, K_CHUNK, self.stages * self.cps), (0, 0, 0))
                        mmas.append(mma_n)
                        tCrBs.append(thr_n.make_fragment_B(thr_n.partition_B(sA_n)))
                        accs.append(cute.make_tensor(acc.iterator, cute.make_layout(((2, 2, n // 8), 1, 1))))
            else:
                tmp0 = cute.make_rmem_tensor(acc_shape, Float32)
                tmp1 = cute.make_rmem_tensor(acc_shape, Float32)
                tmps = (tmp0, tmp1, cute.make_rmem_tensor(acc_shape, Float32), cute.make_rmem_tensor(acc_shape, Float32))
                sfa_words = cute.make_rmem_tensor((2, n_cols), Int32)  # (c, j)
                sw = cute.make_rmem_tensor((2,), Float32)
                sa = cute.make_rmem_tensor((2, n_cols), Float32)
                lut_lo = Int32(E4M3_LUT_LO)
                lut_hi = Int32(E4M3_LUT_HI)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                if cutlass.const_expr(self.wide):
                    # Wide tiles: each k32 block as two wgmmas of half the tokens (their own temporaries, together
                    # one tile's worth of registers), so one half's promotion overlaps the other half's wgmma.
                    half = tt // 2
                    half_mma = self.make_tiled_mma(cutlass.Float8E4M3FN, half)
                    half_mma.set(warpgroup.Field.ACCUMULATE, False)
                    thr_half = half_mma.get_slice(ctidx)
                    half_B = [thr_half.make_fragment_B(thr_half.partition_B(
                        cute.local_tile(sA, (half, K_CHUNK, self.stages * self.cps), (h, 0, 0)))) for h in range(2)]
                    half_shape = ((2, 2, half // 8), 1, 1)
                    halves = (cute.make_rmem_tensor(half_shape, Float32), cute.make_rmem_tensor(half_shape, Float32))

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            t = bidx
            e = Int32(0)
            base = Int32(0)
            t_off = Int32(0)
            block = Int32(0)
            taken = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)
            if cutlass.const_expr(self.published):
                phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
                self.stamp(record, gdim, bidx, ctidx, "first tile")
            else:
                phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                    t, Int32(0), Int32(0), Int32(0), Int32(0), dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                )
            while valid:
                k_tiles = self.k_steps(dims[0])
                if cutlass.const_expr(self.fused):
                    k_tiles = self.k_steps(Int32(cutlass.select_(phase == 0, dims[0], dims[2])))
                acc.fill(0.0)
                if cutlass.const_expr(self.bf16):
                    if cutlass.const_expr(len(widths) == 1):
                        state, release = self.bf16_mainloop(ab_pipeline, state, release, k_tiles, mmas[0], accs[0], frag,
                                                            tCrA, tCrBs[0], sW_words, sSFW, q, wrow0, wrow1, wbuf,
                                                            sfw_words, mult)
                    else:
                        # The narrowest width holding the tile's rows (every branch runs a whole K loop).
                        rows = cutlass.max(row_end - row0, 1)
                        step = widths[0]
                        width = cutlass.min((rows + step - 1) // step, len(widths)) - 1
                        for w in cutlass.range_constexpr(len(widths)):
                            if width == w:
                                state, release = self.bf16_mainloop(
                                    ab_pipeline, state, release, k_tiles, mmas[w], accs[w], frag, tCrA, tCrBs[w],
                                    sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult,
                                )
                    acc.store(acc.load() * Float32(2.0**BF16_ACC_SHIFT))  # undo the decode's 2**-P (exact)
                else:
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipeline.consumer_wait(state)
                        s = state.index
                        if cutlass.const_expr(self.wide):
                            self.stage_token_scales(sSFA, sScale, ctidx, kt, s)
                        # Packed scale words of this 128-K chunk, the weights' (one per row): absolute codes, or
                        # folded into the decode tables.
                        sfw_words[0] = sSFW[wrow0, 0, s]
                        sfw_words[1] = sSFW[wrow1, 0, s]
                        # FP4 -> E4M3 into the A fragment (one 16-byte load per weight row).
                        cute.autovec_copy(sW_words[None, q, wrow0, s], wbuf[None, 0])
                        cute.autovec_copy(sW_words[None, q, wrow1, s], wbuf[None, 1])
                        for kb in cutlass.range_constexpr(4):
                            for r in cutlass.range_constexpr(2):
                                if cutlass.const_expr(self.folded):
                                    t_lo, t_hi = dev.fold_luts(sfw_words[r], kb)
                                    lo, hi = dev.decode_e2m1x8(wbuf[kb, r], t_lo, t_hi)
                                else:
                                    lo, hi = dev.decode_e2m1x8(wbuf[kb, r], lut_lo, lut_hi)
                                frag[(0, r, 0), 0, kb] = lo
                                frag[(0, r, 1), 0, kb] = hi
                        if cutlass.const_expr(self.wide):
                            # This warpgroup's token scales of the chunk are in shared memory.
                            self.epilogue_barrier(ctidx // 128).arrive_and_wait()
                            # Step u = (block kb, token half h) = divmod(u, 2): issue u, wait for u - 1, promote it
                            # (its temporary is the one step u + 1 writes).
                            for u in cutlass.range_constexpr(9):
                                if cutlass.const_expr(u < 8):
                                    warpgroup.fence()
                                    cute.gemm(half_mma, halves[u % 2], tCrA[(None, None, u // 2)],
                                              half_B[u % 2][(None, None, u // 2, s)], halves[u % 2])
                                    warpgroup.commit_group()
                                if cutlass.const_expr(u > 0):
                                    warpgroup.wait_group(1 if u < 8 else 0)
                                    self.promote_wide(acc, halves[(u - 1) % 2], (u - 1) // 2, (u - 1) % 2, sScale, q,
                                                      kt % 2, ctidx // 128, sfw_words, sw)
                        else:
                            # The tokens' packed scale words: word (kt % 4) of each 4-word box row.
                            w = kt % 4
                            for j in cutlass.range_constexpr(n_cols):
                                for c in cutlass.range_constexpr(2):
                                    sfa_words[c, j] = sSFA[cC[c + 4 * j][1], w, s]
                            if cutlass.const_expr(self.deferred):
                                warpgroup.fence()
                                for kb in cutlass.range_constexpr(4):
                                    cute.gemm(tiled_mma, tmps[kb], tCrA[(None, None, kb)], tCrB[(None, None, kb, s)],
                                              tmps[kb])
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                                for kb in cutlass.range_constexpr(4):
                                    self.promote(acc, tmps[kb], kb, sfw_words, sfa_words, sw, sa)
                            else:
                                for kb in cutlass.range_constexpr(4):
                                    tmp = tmp0 if kb % 2 == 0 else tmp1
                                    warpgroup.fence()
                                    cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb)], tCrB[(None, None, kb, s)], tmp)
                                    warpgroup.commit_group()
                                    if cutlass.const_expr(kb > 0):
                                        warpgroup.wait_group(1)
                                        self.promote(acc, tmp1 if kb % 2 == 0 else tmp0, kb - 1, sfw_words, sfa_words,
                                                     sw, sa)
                                warpgroup.wait_group(0)
                                self.promote(acc, tmp1, 3, sfw_words, sfa_words, sw, sa)
                        ab_pipeline.consumer_release(state)
                        state.advance()
                    if cutlass.const_expr(self.folded):
                        # The weight rows' scales, left out of the decode (exact power-of-two products); folded
                        # weights run in separate launches only, whose block word is the group.
                        for r in cutlass.range_constexpr(2):
                            row_scale = Float32(mRowScale[n_tile * tn + cC[2 * r][0], block])
                            for j in cutlass.range_constexpr(n_cols):
                                for c in cutlass.range_constexpr(2):
                                    acc[c + 2 * r + 4 * j] = acc[c + 2 * r + 4 * j] * row_scale

                if cutlass.const_expr(self.fused):
                    if phase == 0:
                        self.epilogue_swiglu(acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile)
                        # This warpgroup's rows of the tile are stored: hand the count to the signal warp.
                        self.signal_barrier(ctidx // 128).arrive_and_wait()
                    else:
                        self.epilogue_scatter(acc, cC, ctidx, sOut, mRowAddr, row0, row_end, n_tile)
                        if cutlass.const_expr(self.comm is not None):
                            if self.ring_reused(mGroupB):  # its ring rows are read: the signal warp frees them
                                self.signal_barrier(ctidx // 128).arrive_and_wait()
                elif cutlass.const_expr(self.swiglu):
                    self.epilogue_swiglu(acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile)
                elif cutlass.const_expr(self.scatter):
                    self.epilogue_scatter(acc, cC, ctidx, sOut, mRowW, row0, row_end, n_tile)
                else:
                    # BF16, stored only for token rows inside the group.
                    n0 = n_tile * tn
                    for j in cutlass.range_constexpr(n_cols):
                        for c in cutlass.range_constexpr(2):
                            m = row0 + cC[c + 4 * j][1]
                            if m < row_end:
                                for r in cutlass.range_constexpr(2):
                                    i = c + 2 * r + 4 * j
                                    mD[m, n0 + cC[i][0]] = acc[i].to(cutlass.BFloat16)

                self.trace_tile(record, gdim, bidx, ctidx, phase)
                if cutlass.const_expr(self.published):
                    tiles_pub[0].consumer_release(taken)
                    taken.advance()
                    phase, valid, row0, row_end, n_tile, block = self.take_tile(tiles_pub, taken)
                else:
                    t = t + gdim
                    phase, e, base, t_off, valid, row0, row_end, n_tile, block = self.next_tile(
                        t, phase, e, base, t_off, dims, num_groups, mGroupA, mGroupB, max_m, total_rows
                    )
            if cutlass.const_expr(self.scatter):
                ptx.fence_acq_rel_sys()  # rows stored to other GPUs precede any release after this kernel

        @cute.jit
        def epilogue_scatter(self, acc, cC, ctidx, sOut, mRowAddr, row0, row_end, n_tile):
            """BF16 rows of one tile to per-row addresses: each consumer warpgroup stages its 64 columns x
            tile_tokens rows in shared memory, then stores each row's 128 bytes with eight 16-byte stores
            (lanes 8r..8r+7 of a warp: one row), so peer memory receives whole 128-byte lines."""
            n_cols = self.tile_tokens // 8
            wg = ctidx // 128
            barrier = self.epilogue_barrier(wg)
            for j in cutlass.range_constexpr(n_cols):
                for c in cutlass.range_constexpr(2):
                    for r in cutlass.range_constexpr(2):
                        i = c + 2 * r + 4 * j
                        sOut[cC[i][1], cC[i][0]] = acc[i].to(cutlass.BFloat16)
            barrier.arrive_and_wait()
            words = cute.make_tensor(
                cute.recast_ptr(sOut.iterator, dtype=Int32),
                cute.make_layout((self.tile_tokens, self.out_stride // 2), stride=(self.out_stride // 2, 1)),
            )
            t = ctidx % 128
            col = 64 * wg + 8 * (t % 8)  # first of this lane's 8 columns in the tile
            vals = cute.make_rmem_tensor((4,), Int32)
            for pass_ in cutlass.range_constexpr((self.tile_tokens + 15) // 16):
                tok = 16 * pass_ + t // 8
                m = row0 + tok
                if (tok < self.tile_tokens) & (m < row_end):
                    cute.autovec_copy(cute.local_tile(words[tok, None], (4,), (col // 8,)), vals)
                    addr = Int64(mRowAddr[m]) + Int64(n_tile * self.tile_n + col) * 2
                    ptx.st_global_v4(addr, [vals[0], vals[1], vals[2], vals[3]], Int32(1))
            barrier.arrive_and_wait()  # the staged tile is read before the next tile overwrites it

        @cute.jit
        def epilogue_swiglu(self, acc, cC, ctidx, sAct, mD, mDSF, mRowW, clamp, row0, row_end, n_tile):
            """``megamoe.numerics`` steps 2-5 for one tile of interleaved (granularity 8) gate/up rows.

            Accumulator rows g and g+8 of a 16-row group are gate and up of intermediate column
            ``(row // 16) * 8 + row % 8``; each consumer warpgroup owns 32 consecutive columns, i.e. one
            UE8M0 block per token. Phase 1: every thread writes ``silu(gate) * up`` (BF16-rounded, clamped
            inputs, FP32 math) to shared memory; phase 2: thread t of the warpgroup takes token t, multiplies
            by its routing weight, quantizes the 32 values (smallest power-of-two scale with amax / scale <= 448,
            RNE) and stores 32 FP8 bytes and one scale byte. ``fast_math``: silu with ``ex2.approx`` and
            ``rcp.approx`` (a few FP32 ulps, as ``megamoe.numerics`` allows): against the IEEE exp and division, flash
            L1 (256 experts, 192 rows each) 3169-3172 vs 3708-3722 us on one H200, as fast as no silu at all
            (``bench/results/2026-12-01_gemm_swiglu_fast_math_h200.json``)."""
            n_cols = self.tile_tokens // 8
            wg = ctidx // 128
            barrier = self.epilogue_barrier(wg)
            for j in cutlass.range_constexpr(n_cols):
                for c in cutlass.range_constexpr(2):
                    row = cC[c + 4 * j][0]
                    gate = acc[c + 4 * j].to(cutlass.BFloat16).to(Float32)
                    up = acc[c + 2 + 4 * j].to(cutlass.BFloat16).to(Float32)
                    gate = cutlass.min(gate, clamp)
                    up = cutlass.max(cutlass.min(up, clamp), -clamp)
                    if cutlass.const_expr(self.fast_math):
                        silu = gate * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gate, fastmath=True))
                    else:
                        silu = gate / (Float32(1.0) + Float32(cute.math.exp(-gate)))
                    sAct[cC[c + 4 * j][1], (row // 16) * 8 + row % 8] = silu * up
            barrier.arrive_and_wait()
            t = ctidx % 128
            m = row0 + t
            if t < self.tile_tokens:
                if m < row_end:
                    weight = Float32(mRowW[m])
                    vals = cute.make_rmem_tensor((32,), Float32)
                    amax = Float32(0.0)
                    for v in cutlass.range_constexpr(32):
                        vals[v] = sAct[t, 32 * wg + v] * weight
                        amax = cutlass.max(amax, cutlass.max(vals[v], -vals[v]))
                    # Smallest e with amax <= 448 * 2^e: amax = 1.f * 2^(E-127) and 448 = 1.75 * 2^8, so
                    # e = E - 135 + (f > 0.75), at least -127 (also for amax = 0 and subnormals).
                    bits = dev.f32_bits(amax)
                    e = ((bits >> 23) & Int32(0xFF)) - Int32(135)
                    if (bits & Int32(0x7FFFFF)) > Int32(0x600000):
                        e = e + Int32(1)
                    e = cutlass.max(e, Int32(-127))
                    inv_scale = dev.bits_to_f32((Int32(127) - e) << 23)  # 2^-e, exact
                    words = cute.make_rmem_tensor((8,), Int32)
                    for w in cutlass.range_constexpr(8):
                        words[w] = dev.f32x4_to_e4m3x4(
                            vals[4 * w] * inv_scale,
                            vals[4 * w + 1] * inv_scale,
                            vals[4 * w + 2] * inv_scale,
                            vals[4 * w + 3] * inv_scale,
                        )
                    block = n_tile * (self.tile_n // 64) + wg  # 32-wide block of the intermediate dim
                    if cutlass.const_expr(self.swiglu_bf16):
                        scale = dev.ue8m0_code_to_f32(e + Int32(127))  # 2^e, exact
                        halves = cute.make_rmem_tensor((16,), Int32)
                        for w in cutlass.range_constexpr(8):
                            h0, h1 = dev.e4m3x4_to_bf16x4(words[w], scale)
                            halves[2 * w] = h0
                            halves[2 * w + 1] = h1
                        cute.autovec_copy(halves, cute.local_tile(mD[m, None], (16,), (block,)))
                    else:
                        cute.autovec_copy(words, cute.local_tile(mD[m, None], (8,), (block,)))
                        mDSF[m, block] = (e + Int32(127)).to(cutlass.Uint8)
            barrier.arrive_and_wait()

        @cute.jit
        def bf16_mainloop(self, ab_pipeline, state, release, k_tiles, tiled_mma, acc, frag, tCrA, tCrB, sW_words, sSFW, q,
                          wrow0, wrow1, wbuf, sfw_words, mult):
            """BF16 mode: one tile's K loop (``k_tiles`` stages of ``cps`` chunks) into ``acc`` (``tiled_mma``'s token
            width); returns the advanced pipeline states (waits, then frees every stage it used)."""
            # The release of stage kt-1 sits between stage kt's wgmma groups; a data-dependent branch
            # there makes ptxas serialize every wgmma, so stage 0 (nothing to release) is peeled.
            ab_pipeline.consumer_wait(state)
            for h in cutlass.range_constexpr(self.cps):
                self.bf16_load(state, Int32(0), h, sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult)
                for kb in cutlass.range_constexpr(4):
                    warpgroup.wait_group(3)
                    self.bf16_block(tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, state.index * self.cps + h, kb)
            state.advance()
            for kt in cutlass.range(1, k_tiles, unroll=1):
                ab_pipeline.consumer_wait(state)
                for h in cutlass.range_constexpr(self.cps):
                    self.bf16_load(state, kt, h, sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult)
                    for kb in cutlass.range_constexpr(4):
                        # Block kb's registers were last read by the previous chunk's block-kb wgmmas, four
                        # groups ago: at most three may still be pending.
                        warpgroup.wait_group(3)
                        if cutlass.const_expr(h == 0 and kb == 3):  # every group of stage kt-1 is done: free it
                            ab_pipeline.consumer_release(release)
                            release.advance()
                        self.bf16_block(tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, state.index * self.cps + h, kb)
                state.advance()
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release)
            release.advance()
            return state, release

        @cute.jit
        def bf16_load(self, state, kt, h: cutlass.Constexpr[int], sW_words, sSFW, q, wrow0, wrow1, wbuf, sfw_words, mult):
            """BF16 mode, chunk h of stage ``state`` (K step kt; the caller waited for it): this thread's weight words
            of rows wrow0/wrow1 (one 16-byte load each) and the BF16 decode multipliers of its four 32-K blocks,
            two per word."""
            s = state.index
            cute.autovec_copy(sW_words[None, q, wrow0, s * self.cps + h], wbuf[None, 0])
            cute.autovec_copy(sW_words[None, q, wrow1, s * self.cps + h], wbuf[None, 1])
            sfw_words[0] = sSFW[wrow0, h, s]
            sfw_words[1] = sSFW[wrow1, h, s]
            for r in cutlass.range_constexpr(2):
                for p in cutlass.range_constexpr(2):
                    mult[p, r] = dev.ue8m0_to_bf16_multiplier_pair(sfw_words[r], p)

        @cute.jit
        def bf16_block(self, tiled_mma, acc, frag, tCrA, tCrB, wbuf, mult, slot, kb: cutlass.Constexpr[int]):
            """BF16 mode: decode 32-K block kb (word kb of both rows) into the fragment registers of k16 blocks
            2kb, 2kb+1 and issue their wgmmas (tokens of chunk ``slot``) as one group."""
            for r in cutlass.range_constexpr(2):
                d0, d1, d2, d3 = dev.decode_e2m1x8_bf16(wbuf[kb, r], mult[kb // 2, r], kb % 2)
                frag[(0, r, 0), 0, 2 * kb] = d0
                frag[(0, r, 1), 0, 2 * kb] = d1
                frag[(0, r, 0), 0, 2 * kb + 1] = d2
                frag[(0, r, 1), 0, 2 * kb + 1] = d3
            warpgroup.fence()
            for kk in cutlass.range_constexpr(2 * kb, 2 * kb + 2):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kk)], tCrB[(None, None, kk, slot)], acc)
            warpgroup.commit_group()

        @cute.jit
        def promote(self, acc, tmp, kb: cutlass.Constexpr[int], sfw_words, sfa_words, sw, sa):
            """acc += tmp * 2^(sb[row, kb]) * 2^(sa[token, kb]) (exact power-of-two scaling, one FP32 add)."""
            n_cols = self.tile_tokens // 8
            if cutlass.const_expr(not self.folded):
                for r in cutlass.range_constexpr(2):
                    sw[r] = dev.ue8m0_to_f32(sfw_words[r], kb)
            for j in cutlass.range_constexpr(n_cols):
                for c in cutlass.range_constexpr(2):
                    sa[c, j] = dev.ue8m0_to_f32(sfa_words[c, j], kb)
            for j in cutlass.range_constexpr(n_cols):
                for r in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        i = c + 2 * r + 4 * j  # flat index of accumulator value (c, r, j)
                        if cutlass.const_expr(self.folded):
                            acc[i] = acc[i] + tmp[i] * sa[c, j]
                        else:
                            acc[i] = acc[i] + tmp[i] * (sw[r] * sa[c, j])

        @cute.jit
        def stage_token_scales(self, sSFA, sScale, ctidx, kt, s):
            """Wide FP8 tiles: thread m of each consumer warpgroup converts token m's four UE8M0 codes of chunk
            ``kt`` (stage ``s``) to FP32 into its warpgroup's table half ``kt % 2`` (``sScale``); a named barrier
            of the warpgroup follows before any promotion reads them."""
            m = ctidx % 128
            word = sSFA[m, kt % 4, s]
            j = m // 8
            for kb in cutlass.range_constexpr(4):
                sScale[(j % 2) * 2 + m % 2, j // 2, (m % 8) // 2, kb, kt % 2, ctidx // 128] = dev.ue8m0_to_f32(word, kb)

        @cute.jit
        def promote_wide(self, acc, tmp, kb: cutlass.Constexpr[int], h: cutlass.Constexpr[int], sScale, q, parity, wg,
                         sfw_words, sw):
            """``promote`` for wide FP8 tiles, token half ``h`` (``tmp``: its temporary): the token scales of block kb
            from this warpgroup's table half ``parity`` (one 16-byte load per two column groups)."""
            if cutlass.const_expr(not self.folded):
                for r in cutlass.range_constexpr(2):
                    sw[r] = dev.ue8m0_to_f32(sfw_words[r], kb)
            v = cute.make_rmem_tensor((4,), Float32)
            pairs = self.tile_tokens // 32  # column-group pairs per half
            for jp in cutlass.range_constexpr(pairs):
                cute.autovec_copy(sScale[None, h * pairs + jp, q, kb, parity, wg], v)
                for u in cutlass.range_constexpr(4):
                    j = 2 * jp + u // 2  # column group within the half
                    c = u % 2
                    for r in cutlass.range_constexpr(2):
                        i = c + 2 * r + 4 * j
                        a = i + 4 * self.tile_tokens // 16 * h  # the same value's index in the whole tile
                        if cutlass.const_expr(self.folded):
                            acc[a] = acc[a] + tmp[i] * v[u]
                        else:
                            acc[a] = acc[a] + tmp[i] * (sw[r] * v[u])

    return Sm90Fp4GroupedGemm


_KERNEL_CLASS = None


def _kernel_class():
    global _KERNEL_CLASS
    if _KERNEL_CLASS is None:
        _KERNEL_CLASS = _build_kernel_class()
    return _KERNEL_CLASS


def _weight_args(b, b_sf):
    """5-D blocked kernel-layout weights of either mode and their scales -> CuTe tensors in kernel mode order."""
    e, blocks, chunks, rows, _ = b.shape
    w = b.view(torch.uint8).view(e, blocks, chunks, rows, CHUNK_BYTES)
    w = w.permute(3, 1, 4, 2, 0)  # (row, block, byte, chunk, E)
    sfw = b_sf.permute(2, 1, 0)  # (N, K/128, E), N contiguous
    return runtime.to_cute(w, leading_dim=2), runtime.to_cute(sfw, leading_dim=0)


def _cute_args(a, a_sf, b, b_sf, out, out_sf, row_weights, group_a, group_b, second=None):
    """Torch tensors (2-D token views, 5-D blocked kernel-layout weights of either mode) -> CuTe tensors in kernel mode
    order; ``a_sf`` None (BF16 mode) stays None. ``second``: the "l1_l2" epilogue's ``(a2, b2, b2_sf, row_ptrs)``
    (its tokens [M, I] bf16, weights, scales, row addresses int64 [M]), else None. Folded FP8-mode scales
    (``b_sf`` with K/128 + 1 chunk rows) add their last row, the weight rows' FP32 scales, as ``(N, E)``."""
    extra = (None,) * 4
    if second is not None:
        a2, b2, b2_sf, row_ptrs = second
        extra = (runtime.to_cute(a2, leading_dim=1), *_weight_args(b2, b2_sf),
                 runtime.to_cute(row_ptrs, leading_dim=0, align=8))
    return (
        runtime.to_cute(a, leading_dim=1),
        None if a_sf is None else runtime.to_cute(a_sf, leading_dim=1),
        *_weight_args(b, b_sf),
        runtime.to_cute(out, leading_dim=1),
        runtime.to_cute(out_sf, leading_dim=1, align=4),
        runtime.to_cute(row_weights, leading_dim=0, align=row_weights.element_size()),
        runtime.to_cute(group_a, leading_dim=0, align=4),
        runtime.to_cute(group_b, leading_dim=0, align=4),
        *extra,
        runtime.to_cute(b_sf[:, -1].view(torch.float32).t(), leading_dim=0) if _folded(b, b_sf) else None,
    )


def _folded(b: torch.Tensor, b_sf: torch.Tensor) -> bool:
    """Whether kernel-layout weights carry folded FP8-mode scales (``fold_fp8_scales``: one chunk row more)."""
    return b.dtype == torch.uint8 and b_sf.shape[1] == b.shape[2] + 1


def compile_grouped_gemm(config: GemmConfig, group_mode: str, epilogue: str = "bf16", debug: bool = False, comm=None,
                         folded: bool = False, fast_math: bool = True):
    """Compile (and cache) the kernel for ``config`` (incl. its MMA mode), ``group_mode``, ``epilogue``, ``folded``
    (FP8 mode: the weights' scales folded into the decode, ``sm90_fp4_decode.fold_fp8_scales``), ``fast_math``
    (SwiGLU epilogues, "l1_l2" included: approximate exp and reciprocal in silu; ignored by the others),
    ``debug`` ("l1_l2" only: the build whose waits can time out and report; its wgmmas run serialized) and
    ``comm`` ("l1_l2" only: an ``ep_comm.EpCommConfig`` makes it the one-launch Mega MoE kernel for that buffer
    layout, ``mega_moe_sm90``); works on a CPU with ``CUTE_DSL_ARCH=sm_90a``. Shapes are dynamic: one compile
    serves every M, N, K, E."""
    if group_mode not in GROUP_MODES:
        fail("group_mode", f"must be one of {GROUP_MODES}, got {group_mode!r}")
    if epilogue not in EPILOGUES:
        fail("epilogue", f"must be one of {EPILOGUES}, got {epilogue!r}")
    if debug and epilogue != "l1_l2":
        fail("debug", f"applies to the 'l1_l2' epilogue only (the only kernel here that waits), got {epilogue!r}")
    if comm is not None and (epilogue != "l1_l2" or group_mode != "offsets" or comm.debug != debug):
        fail("comm", f"needs the 'l1_l2' epilogue, 'offsets' groups and the same debug flag, got {epilogue!r}, "
             f"{group_mode!r}, debug={debug} vs {comm.debug}")
    if epilogue == "l1_l2" and comm is None and config.consumer_warpgroups > 2:
        fail("config.tile_n", f"must be 64 or 128 for the 'l1_l2' epilogue without Mega MoE communication (four "
             f"consumer warpgroups are tested in the Mega MoE kernel only), got {config.tile_n}")
    if folded and (config.mma != "fp8" or comm is not None or epilogue == "l1_l2"):
        fail("folded", f"applies to FP8-mode single GEMMs only, got mma={config.mma!r}, epilogue={epilogue!r}")
    check_fast_math(fast_math)
    fast_math = fast_math or epilogue not in SWIGLU_EPILOGUES  # one build where silu is not computed

    def build():
        import cutlass
        import cutlass.cute as cute

        m, n, k, e = 128, 256, 512, 2
        if config.mma == "bf16":
            a, a_sf = torch.empty(m, k, dtype=torch.bfloat16), None
            b = torch.empty(e, n // ROW_BLOCK, k // 128, ROW_BLOCK, BF16_WORDS, dtype=torch.int32)
        else:
            a, a_sf = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(m, k // 128, dtype=torch.int32)
            b = torch.empty(e, n // ROW_BLOCK, k // 128, ROW_BLOCK, CHUNK_BYTES, dtype=torch.uint8)
        b_sf = torch.empty(e, k // 128 + int(folded), n, dtype=torch.int32)
        second = None
        if epilogue == "swiglu_fp8":
            out = torch.empty(m, n // 8, dtype=torch.int32)
        elif epilogue in ("swiglu_fp8_bf16", "l1_l2"):
            out = torch.empty(m, n // 4, dtype=torch.int32)
        else:
            out = torch.empty(m, n, dtype=torch.bfloat16)
        if epilogue == "l1_l2":  # second GEMM: K = n / 2, N = k
            second = (torch.empty(m, n // 2, dtype=torch.bfloat16),
                      torch.empty(e, k // ROW_BLOCK, n // 2 // 128, ROW_BLOCK, BF16_WORDS, dtype=torch.int32),
                      torch.empty(e, n // 2 // 128, k, dtype=torch.int32), torch.empty(m, dtype=torch.int64))
        out_sf = torch.empty(m, n // 64, dtype=torch.uint8)
        row_weights = torch.empty(m, dtype=torch.int64 if epilogue == "bf16_scatter" else torch.float32)
        groups = torch.zeros(e + 1, dtype=torch.int32)
        args = _cute_args(a, a_sf, b, b_sf, out, out_sf, row_weights, groups, groups, second)
        kernel = _kernel_class()(config, group_mode, epilogue, debug, comm, folded, fast_math)
        z32, z64 = cutlass.Int32(0), cutlass.Int64(0)
        return cute.compile(
            kernel, *args, cutlass.Int32(e), cutlass.Int32(m), cutlass.Float32(float("inf")), z64, z64,
            z32, z32, z64, z64, z64, z64, z64, cutlass.Int32(1), runtime.current_stream(),
        )

    return runtime.compiled(("sm90_fp4_grouped_gemm", config, group_mode, epilogue, debug, comm, folded, fast_math),
                            build)


_DUMMIES: dict = {}


def _dummies(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Placeholder (out_sf, row_weights, out) operands for the epilogues that never touch them."""
    key = str(device)
    if key not in _DUMMIES:
        _DUMMIES[key] = (torch.zeros(1, 16, dtype=torch.uint8, device=device),
                         torch.zeros(4, dtype=torch.float32, device=device),
                         torch.zeros(1, 64, dtype=torch.bfloat16, device=device))
    return _DUMMIES[key]


TILE_COUNTER_SLOTS = 64
"""Pairs of tile counters allocated at a time per device (one pair per stream that runs separate launches)."""
_TILE_COUNTERS: dict = {}  # device index -> ({stream handle: int32 [2]}, [spare zeroed int32 [2] views])


def _zeroed_counter_pairs(device: torch.device, what: str) -> list:
    if torch.cuda.is_current_stream_capturing():
        fail("tile counters", f"{what} cannot be made during a CUDA graph capture: prepare the weights "
             "(prepare_fp4_weights) or run one grouped GEMM on each capturing stream before capturing")
    return list(torch.zeros(TILE_COUNTER_SLOTS, 2, dtype=torch.int32, device=device).unbind(0))


def make_tile_counters(device: torch.device) -> None:
    """Allocate (zeroed, outside any graph capture) the separate launches' tile counters on ``device``: per
    stream an int32 pair (tiles handed out, CTAs finished), zero before every launch and left zero by it;
    ``TILE_COUNTER_SLOTS`` pairs at a time. ``prepare_fp4_weights`` calls this, so launches captured into CUDA
    graphs find pairs ready for their streams."""
    if device.type == "cuda" and device.index is not None and device.index not in _TILE_COUNTERS:
        _TILE_COUNTERS[device.index] = ({}, _zeroed_counter_pairs(device, f"for {device}"))


def tile_counters(device: torch.device) -> torch.Tensor:
    """The current stream's tile counters on ``device`` (int32 [2]; ``make_tile_counters``): launches in stream
    order, or in a CUDA graph captured on the stream, share them; launches on other streams have their own."""
    make_tile_counters(device)
    by_stream, spare = _TILE_COUNTERS[device.index]
    stream = torch.cuda.current_stream(device).cuda_stream
    if stream not in by_stream:
        if not spare:
            spare.extend(_zeroed_counter_pairs(device, f"for a stream beyond the first {len(by_stream)} on {device}"))
        by_stream[stream] = spare.pop()
    return by_stream[stream]


# ----------------------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------------------

_LAYOUTS = {
    "fp8": (torch.uint8, CHUNK_BYTES, "uint8 [E, N/64, K/128, 64, 64] (prepare_fp4_weights(..., mma='fp8'))"),
    "bf16": (torch.int32, BF16_WORDS, "int32 [E, N/64, K/128, 64, 16] (prepare_fp4_weights(..., mma='bf16'))"),
}


def _weights_mode(b: torch.Tensor, name: str = "b") -> str:
    """The MMA mode the kernel-layout weights ``b`` (called ``name``) were prepared for (from their dtype)."""
    if isinstance(b, torch.Tensor):
        for mma, (dtype, _, _) in _LAYOUTS.items():
            if b.dtype == dtype:
                return mma
    got = f"dtype {str(b.dtype).removeprefix('torch.')}" if isinstance(b, torch.Tensor) else type(b).__name__
    fail(name, f"must be a kernel weight layout, FP8 mode {_LAYOUTS['fp8'][2]} or BF16 mode {_LAYOUTS['bf16'][2]}; "
         f"got {got}")


def _check_weights(b: torch.Tensor, b_sf: torch.Tensor, k: int, device, mma: str,
                   names: tuple[str, str] = ("b", "b_sf")) -> tuple[int, int]:
    dtype, width, _ = _LAYOUTS[mma]
    check_blocked_layout(names[0], b, dtype, width, f"SM90 {mma}-mode weight layout (prepare_fp4_weights(..., "
                         f"mma={mma!r})) {str(dtype).removeprefix('torch.')}", device=device, contiguous=True)
    e, blocks, chunks = b.shape[:3]
    if chunks * K_CHUNK != k:
        fail(names[0], f"must hold K/128 = {k // K_CHUNK} chunks per row block (dim 2) for a.shape[-1] = {k}, "
             f"got {list(b.shape)}")
    n = blocks * ROW_BLOCK
    # FP8 mode: absolute scales [E, K/128, N], or folded ones with the row scales after the chunks (fold_fp8_scales).
    folded = isinstance(b_sf, torch.Tensor) and b_sf.ndim == 3 and _folded(b, b_sf)
    check_chunk_major_scales(names[1], b_sf, e, n, k + K_CHUNK * folded, device=device)
    return e, n


def _check_tokens(a: torch.Tensor, a_sf: torch.Tensor | None, ndim: int, mma: str) -> int:
    """Tokens of ``mma`` mode: BF16 with ``a_sf`` None, or FP8 E4M3 with packed UE8M0 ``a_sf``. Returns K."""
    check_tensor("a", a, ndim=ndim)
    if mma == "bf16":
        if a.dtype != torch.bfloat16:
            fail("a", f"must have dtype bfloat16 for BF16-mode weights ({_LAYOUTS['bf16'][2]}), got "
                 f"{str(a.dtype).removeprefix('torch.')}; dequantize FP8 tokens exactly with "
                 "layouts.dequantize_fp8(a, a_sf, torch.bfloat16), or prepare the weights with mma='fp8'")
        if a_sf is not None:
            fail("a_sf", "must be None with BF16 tokens (BF16 mode: the token scales are already applied)")
    else:
        if a.dtype != torch.float8_e4m3fn:
            fail("a", f"must have dtype float8_e4m3fn for FP8-mode weights ({_LAYOUTS['fp8'][2]}), got "
                 f"{str(a.dtype).removeprefix('torch.')}; BF16 tokens need weights prepared with mma='bf16'")
        if a_sf is None:
            fail("a_sf", "is required with FP8 tokens: packed UE8M0 scales int32 [..., K/128]")
    check_tensor("a", a, contiguous=True)
    k = a.shape[-1]
    check_multiple("a.shape[-1] (K)", k, K_MULTIPLE, "packed UE8M0 scale rows must be 16-byte aligned for TMA")
    if mma == "fp8":
        check_tensor("a_sf", a_sf, dtype=torch.int32, shape=(*a.shape[:-1], k // K_CHUNK), device=a.device,
                     contiguous=True)
    return k


def _check_device(a: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """After the dtype/shape checks: Hopper device, 16-byte aligned TMA operands (None: absent operand)."""
    runtime.require_sm90(a, "a")
    for name, t in dict(a=a, **tensors).items():
        if t is not None and t.numel() and t.data_ptr() % 16:
            fail(name, f"data pointer must be 16-byte aligned for TMA, got address {t.data_ptr():#x}")


def _resolve_config(config: GemmConfig | None, rows_per_expert: float, n: int, k: int, mma: str,
                    four_warpgroups: bool = True) -> GemmConfig:
    if config is None:
        return select_config(rows_per_expert, n, k, mma, four_warpgroups)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"megamoe: `config` must be a GemmConfig or None, got {type(config).__name__}")
    if config.mma != mma:
        fail("config.mma", f"is {config.mma!r} but the weights are in the {mma}-mode layout {_LAYOUTS[mma][2]}")
    if n % config.tile_n:
        fail("config.tile_n", f"must divide N={n}, got {config.tile_n}")
    return config


def _rows_view(a_sf: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Masked-layout token scales ``[E, max_m, K/128]`` as ``[E * max_m, K/128]`` (None stays None)."""
    return None if a_sf is None else a_sf.view(rows, a_sf.shape[-1])


def _check_operands(a, a_sf, b, b_sf, groups, counts=None, *, masked: bool, swiglu: bool,
                    names: tuple[str, str] = ("b", "b_sf")) -> tuple[str, int, int, int]:
    """What the four entries share: tokens and weights of one MMA mode, the group tensors (``offsets`` [E+1]
    and optional ``counts`` [E], or ``masked_m`` [E] with one token slab per expert), and for SwiGLU an N
    of whole 128-column output blocks. Returns ``(mma, K, E, N)``."""
    mma = _weights_mode(b, names[0])
    k = _check_tokens(a, a_sf, 3 if masked else 2, mma)
    e, n = _check_weights(b, b_sf, k, a.device, mma, names)
    if swiglu:
        check_multiple(f"{names[0]}.shape[1] * 64 (2I)", n, 2 * K_CHUNK, "I must be a multiple of 128 for packed output scales")
    if masked:
        if a.shape[0] != e:
            fail("a", f"must have one slab per expert: shape[0] = {e} (b.shape[0]), got {a.shape[0]}")
        check_tensor("masked_m", groups, dtype=torch.int32, shape=(e,), device=a.device, contiguous=True)
    else:
        check_tensor("offsets", groups, dtype=torch.int32, shape=(e + 1,), device=a.device, contiguous=True)
        if counts is not None:
            check_tensor("counts", counts, dtype=torch.int32, shape=(e,), device=a.device, contiguous=True)
    return mma, k, e, n


def _launch(config, group_mode, epilogue, a2, a_sf2, b, b_sf, out2, out_sf2, row_weights, group_a, group_b,
            num_groups, max_m, clamp, max_tiles, second=None, sync=None, timeout_ns=0, mega=None, fast_math=True):
    """Compile (cached) and launch one variant (``fast_math``: ``compile_grouped_gemm``'s);
    ``second``/``sync``/``timeout_ns``: the "l1_l2" epilogue's second-GEMM operands (``_cute_args``), its zeroed
    int32 counters (``sync_words``) and spin-wait limit (> 0: the debug build). ``mega``: the Mega MoE kernel's
    ``(comm, me, num_tokens, base, peers, stats, record, y)`` (``mega_moe_sm90``): it runs on every CTA slot, tiles
    or not."""
    if mega is None and (max_tiles <= 0 or a2.shape[0] == 0):
        return
    import cutlass

    comm, *comm_args = (None, 0, 0, 0, None, None, 0, None) if mega is None else mega
    kernel = compile_grouped_gemm(config, group_mode, epilogue, timeout_ns > 0, comm, _folded(b, b_sf), fast_math)
    num_ctas = torch.cuda.get_device_properties(a2.device).multi_processor_count * config.ctas_per_sm
    if mega is None:
        num_ctas = min(num_ctas, max_tiles)
    if mega is None and epilogue != "l1_l2":
        sync = tile_counters(a2.device)
    if epilogue == "bf16":
        out_sf2, row_weights, _ = _dummies(a2.device)
    elif epilogue == "bf16_scatter":  # row_weights holds the row addresses
        out_sf2, _, out2 = _dummies(a2.device)
    elif out_sf2 is None:  # "swiglu_fp8_bf16" writes no scales
        out_sf2 = _dummies(a2.device)[0]
    args = _cute_args(a2, a_sf2, b, b_sf, out2, out_sf2, row_weights, group_a, group_b, second)
    me, num_tokens, base, peers, stats, record, y = comm_args
    kernel(*args, cutlass.Int32(num_groups), cutlass.Int32(max_m), cutlass.Float32(clamp), cutlass.Int64(_address(sync)),
           cutlass.Int64(timeout_ns), cutlass.Int32(me), cutlass.Int32(num_tokens), cutlass.Int64(base),
           cutlass.Int64(_address(peers)), cutlass.Int64(_address(stats)), cutlass.Int64(record), cutlass.Int64(_address(y)),
           cutlass.Int32(num_ctas), runtime.current_stream())


def _address(t: torch.Tensor | None) -> int:
    """A tensor's device address, 0 for None (the kernel's "absent")."""
    return 0 if t is None else t.data_ptr()


def grouped_gemm_fp8_fp4_contiguous(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    counts: torch.Tensor | None = None,
    out_row_ptrs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Contiguous grouped GEMM ``out[rows of e] = a[rows of e] . b[e]^T`` (tokens x FP4 -> BF16, FP32 accumulate).

    The MMA mode follows the weights (``prepare_fp4_weights(..., mma=)``): BF16 mode, b ``int32 [E, N/64, K/128,
    64, 16]`` with a ``bfloat16 [M, K]`` and a_sf None; FP8 mode, b ``uint8 [E, N/64, K/128, 64, 64]`` with a
    ``float8_e4m3fn [M, K]`` and a_sf ``int32 [M, K/128]`` (packed UE8M0 per 32). b_sf ``int32 [E, K/128, N]``;
    ``config.mma``, when a config is given, must match the weights. offsets ``int32 [E+1]``:
    expert e owns rows ``[offsets[e], offsets[e+1])``, or ``[offsets[e], offsets[e] + counts[e])`` when
    ``counts`` (``int32 [E]``, e.g. ``ContiguousLayout.counts``) is given. Any alignment; rows of no group are
    neither read as data for the output nor written. Group bounds are read on the device (no sync; CUDA-graph
    capturable: the stream's tile counters, ``tile_counters``, exist once the weights were prepared on this
    device) and clamped to ``[0, M)``. Needs K % 512 == 0, N % 64 == 0. Returns ``out`` (``bf16 [M, N]``,
    allocated uninitialised when None).

    ``out_row_ptrs`` (``int64 [M]``, instead of ``out``; returns None): row m's N BF16 values are stored at
    the device address ``out_row_ptrs[m]`` (16-byte aligned; any memory this GPU maps, e.g. a peer rank's
    symmetric buffer), staged per tile so that each row leaves as whole 128-byte lines. Every storing
    thread ends with ``fence.acq_rel.sys``, so a release that follows the kernel (stream order) publishes
    the rows to other GPUs too."""
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, offsets, counts, masked=False, swiglu=False)
    m = a.shape[0]
    if out_row_ptrs is None:
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        check_tensor("out", out, dtype=torch.bfloat16, shape=(m, n), device=a.device, contiguous=True)
        epilogue = "bf16"
    else:
        if out is not None:
            fail("out", "must be None when out_row_ptrs gives the row addresses")
        check_tensor("out_row_ptrs", out_row_ptrs, dtype=torch.int64, shape=(m,), device=a.device, contiguous=True)
        epilogue = "bf16_scatter"
    cfg = _resolve_config(config, m / max(e, 1), n, k, mma)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out)
    max_tiles = (m // cfg.tile_tokens + e) * (n // cfg.tile_n)
    mode = "offsets" if counts is None else "offsets_counts"
    _launch(cfg, mode, epilogue, a, a_sf, b, b_sf, out, None, out_row_ptrs, offsets,
            offsets if counts is None else counts, e, 0, float("inf"), max_tiles)
    return out


def grouped_gemm_fp8_fp4_masked(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    expected_m: float | None = None,
) -> torch.Tensor:
    """Masked grouped GEMM: ``out[e, :masked_m[e]] = a[e, :masked_m[e]] . b[e]^T`` (tokens x FP4 -> BF16).

    a ``[E, max_m, K]`` (bfloat16 with a_sf None, or float8_e4m3fn with a_sf ``int32 [E, max_m, K/128]``,
    as the weights' mode requires), weights and config as in the contiguous entry,
    masked_m ``int32 [E]`` (read on the device, clamped to [0, max_m]); rows ``>= masked_m[e]`` are never
    written. ``expected_m`` (rows per expert) steers the config heuristic (default max_m)."""
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, masked_m, masked=True, swiglu=False)
    max_m = a.shape[1]
    if out is None:
        out = torch.empty(e, max_m, n, dtype=torch.bfloat16, device=a.device)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(e, max_m, n), device=a.device, contiguous=True)
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, mma)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out)
    max_tiles = e * math.ceil(max_m / cfg.tile_tokens) * (n // cfg.tile_n)
    _launch(
        cfg, "masked", "bf16", a.view(e * max_m, k), _rows_view(a_sf, e * max_m), b, b_sf,
        out.view(e * max_m, n), None, None, masked_m, masked_m, e, max_m, float("inf"), max_tiles,
    )
    return out


# ----------------------------------------------------------------------------------------------------
# L1 with the fused SwiGLU epilogue
# ----------------------------------------------------------------------------------------------------


def prepare_fp4_weights_l1(w1: torch.Tensor, w1_sf: torch.Tensor, mma: str = "fp8",
                           fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical L1 weights (``uint8 [E, 2I, H/2]`` with rows [gate; up], ``int32 [E, 2I, H/128]``) -> the
    SwiGLU kernel's operands: rows interleaved (``interleave_gate_up``, granularity 8), then the kernel layout
    of ``mma`` mode (``prepare_fp4_weights``, ``fold`` as there)."""
    from ..layouts import interleave_gate_up

    check_tensor("w1", w1, dtype=torch.uint8, ndim=3)
    check_tensor("w1_sf", w1_sf, dtype=torch.int32, ndim=3)
    return prepare_fp4_weights(
        interleave_gate_up(w1, SWIGLU_GRANULARITY), interleave_gate_up(w1_sf, SWIGLU_GRANULARITY), mma, fold
    )


SWIGLU_OUT_DTYPES = {torch.float8_e4m3fn: "swiglu_fp8", torch.bfloat16: "swiglu_fp8_bf16"}
"""L1 output dtype -> epilogue: FP8 + packed UE8M0 scales, or the same quantized values as BF16."""


def _swiglu_outputs(rows: tuple[int, ...], inter: int, out, out_sf, out_dtype, device, name: str = "out"):
    """Check or allocate the L1 outputs (``out`` called ``name``); returns (epilogue, out, out_sf or None, kernel
    views of both)."""
    if out_dtype not in SWIGLU_OUT_DTYPES:
        fail("out_dtype", f"must be torch.float8_e4m3fn (FP8 + UE8M0 scales) or torch.bfloat16 (the same quantized "
             f"values in BF16), got {out_dtype}")
    if out is None:
        out = torch.empty(*rows, inter, dtype=out_dtype, device=device)
    check_tensor(name, out, dtype=out_dtype, shape=(*rows, inter), device=device, contiguous=True)
    n_rows = math.prod(rows)
    if out_dtype == torch.bfloat16:
        if out_sf is not None:
            fail("out_sf", "must be None with out_dtype=torch.bfloat16 (the values carry their scales)")
        return "swiglu_fp8_bf16", out, None, out.view(torch.int32).view(n_rows, inter // 2), None
    if out_sf is None:
        out_sf = torch.empty(*rows, inter // K_CHUNK, dtype=torch.int32, device=device)
    check_tensor("out_sf", out_sf, dtype=torch.int32, shape=(*rows, inter // K_CHUNK), device=device, contiguous=True)
    return ("swiglu_fp8", out, out_sf, out.view(torch.int32).view(n_rows, inter // 4),
            out_sf.view(torch.uint8).view(n_rows, inter // 32))


def _bf16_clamp(clamp: float | None) -> float:
    if check_activation_clamp(clamp, "clamp") is None:
        return float("inf")
    return float(torch.tensor(clamp, dtype=torch.float32).to(torch.bfloat16))


def grouped_gemm_fp8_fp4_swiglu_contiguous(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    offsets: torch.Tensor,
    row_weights: torch.Tensor,
    clamp: float | None = None,
    out: torch.Tensor | None = None,
    out_sf: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    counts: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    fast_math: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """L1 of the FP8 x FP4 recipe with the fused epilogue (``megamoe.numerics`` steps 1-5), contiguous layout.

    Operands (either MMA mode), groups and config as ``grouped_gemm_fp8_fp4_contiguous``, with b/b_sf from
    ``prepare_fp4_weights_l1``
    (N = 2I, I % 128 == 0); ``row_weights`` float32 [M]: the routing weight of each row. Per row of a group:
    gate, up = bf16(acc), optional clamp (rounded to BF16), ``(silu(gate) * up) * w`` in FP32, quantized per 32
    columns to FP8 E4M3 with UE8M0 scales like ``layouts.quantize_fp8``. Returns ``(out float8_e4m3fn [M, I],
    out_sf int32 [M, I/128])`` (the layout FP8-mode L2 consumes), or with ``out_dtype=torch.bfloat16``
    ``(out bfloat16 [M, I], None)``: the same quantized values times their scales (exact), the BF16-mode L2
    operand. Rows of no group are not written. ``fast_math``: silu with approximate exp and reciprocal (default)
    or the IEEE exp and division (``megamoe.numerics`` step 4)."""
    check_fast_math(fast_math)
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, offsets, counts, masked=False, swiglu=True)
    m = a.shape[0]
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(m,), device=a.device, contiguous=True)
    epilogue, out, out_sf, out_k, out_sf_k = _swiglu_outputs((m,), n // 2, out, out_sf, out_dtype, a.device)
    clamp_value = _bf16_clamp(clamp)
    cfg = _resolve_config(config, m / max(e, 1), n, k, mma)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out)
    max_tiles = (m // cfg.tile_tokens + e) * (n // cfg.tile_n)
    mode = "offsets" if counts is None else "offsets_counts"
    _launch(cfg, mode, epilogue, a, a_sf, b, b_sf, out_k, out_sf_k, row_weights,
            offsets, offsets if counts is None else counts, e, 0, clamp_value, max_tiles, fast_math=fast_math)
    return out, out_sf


def grouped_gemm_fp8_fp4_l1_l2_contiguous(
    a: torch.Tensor,
    b1: torch.Tensor,
    b1_sf: torch.Tensor,
    offsets: torch.Tensor,
    row_weights: torch.Tensor,
    b2: torch.Tensor,
    b2_sf: torch.Tensor,
    out_row_ptrs: torch.Tensor,
    clamp: float | None = None,
    act: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    *,
    sync: torch.Tensor | None = None,
    timeout_ns: int = 0,
    fast_math: bool = True,
) -> torch.Tensor:
    """L1 with the SwiGLU epilogue and L2 with the scatter epilogue in one persistent launch (BF16 mode).

    Computes ``grouped_gemm_fp8_fp4_swiglu_contiguous(a, None, b1, b1_sf, offsets, row_weights, clamp, act,
    out_dtype=torch.bfloat16, fast_math=fast_math)`` then ``grouped_gemm_fp8_fp4_contiguous(act, None, b2, b2_sf,
    offsets, out_row_ptrs=out_row_ptrs)``, bit for bit, without the launch boundary: the CTAs take the L1 tiles, then
    the L2 tiles; an L2 tile loads its first ``stages`` weight chunks, then waits until every L1 tile of its
    expert has stored its rows of ``act`` (per-expert counters in ``sync``, release / acquire at gpu scope,
    then a proxy fence before the TMA reads them). Deadlock-free because every CTA finishes its L1 tiles
    before its first L2 tile and all CTAs are resident (the grid is at most the SMs' CTA slots).

    a ``bfloat16 [M, H]``; b1/b1_sf from ``prepare_fp4_weights_l1(..., mma="bf16")`` (N = 2I); b2/b2_sf from
    ``prepare_fp4_weights(..., mma="bf16")`` (N = H, K = I); offsets ``int32 [E+1]``; row_weights ``float32
    [M]``; out_row_ptrs ``int64 [M]`` (as ``grouped_gemm_fp8_fp4_contiguous``; every storing thread ends with
    ``fence.acq_rel.sys``); act ``bfloat16 [M, I]`` (allocated when None; rows of no group are not written).
    H and I multiples of 512; ``config`` serves both GEMMs (its tile_n must divide 2I and H). ``sync``: ``int32
    [E + 2]`` zeros, left zeroed by the launch (one per stream: launches in flight at once must not share it;
    None: a fresh zeroed tensor). ``timeout_ns`` > 0 runs the debug build: a spin-wait that lasts longer
    printf's what it waits for and traps (the printf call makes ptxas serialize that build's wgmmas: slower).
    Returns ``act``."""
    check_fast_math(fast_math)
    for name, b in (("b1", b1), ("b2", b2)):
        if _weights_mode(b, name) != "bf16":
            fail(name, f"must be in the BF16-mode layout {_LAYOUTS['bf16'][2]} (the fused L1/L2 launch is BF16 mode only)")
    _, k, e, n1 = _check_operands(a, None, b1, b1_sf, offsets, masked=False, swiglu=True, names=("b1", "b1_sf"))
    inter, m = n1 // 2, a.shape[0]
    check_multiple("I (rows of b1 / 2)", inter, K_MULTIPLE, "L2's K granularity")
    check_tensor("b2", b2, ndim=5)
    if b2.shape[0] != e or b2.shape[1] * ROW_BLOCK != k:
        fail("b2", f"must hold the same {e} experts with N = H = {k} rows (L2 of b1's experts), got "
             f"{b2.shape[0]} experts of {b2.shape[1] * ROW_BLOCK} rows")
    _check_weights(b2, b2_sf, inter, a.device, "bf16", ("b2", "b2_sf"))
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(m,), device=a.device, contiguous=True)
    check_tensor("out_row_ptrs", out_row_ptrs, dtype=torch.int64, shape=(m,), device=a.device, contiguous=True)
    _, act, _, act_k, _ = _swiglu_outputs((m,), inter, act, None, torch.bfloat16, a.device, "act")
    if not isinstance(timeout_ns, int) or timeout_ns < 0:
        fail("timeout_ns", f"must be a non-negative int (0: no limit), got {timeout_ns!r}")
    if sync is None:
        sync = torch.zeros(sync_words(e), dtype=torch.int32, device=a.device)
    check_tensor("sync", sync, dtype=torch.int32, shape=(sync_words(e),), device=a.device, contiguous=True)
    cfg = _resolve_config(config, m / max(e, 1), math.gcd(n1, k), k, "bf16", four_warpgroups=False)
    _check_device(a, b1=b1, b1_sf=b1_sf, b2=b2, b2_sf=b2_sf, act=act)
    max_tiles = (m // cfg.tile_tokens + e) * ((n1 + k) // cfg.tile_n)
    _launch(cfg, "offsets", "l1_l2", a, None, b1, b1_sf, act_k, None, row_weights, offsets, offsets, e, 0,
            _bf16_clamp(clamp), max_tiles, second=(act, b2, b2_sf, out_row_ptrs), sync=sync, timeout_ns=timeout_ns,
            fast_math=fast_math)
    return act


def mega_moe_sm90(comm, a: torch.Tensor, b1: torch.Tensor, b1_sf: torch.Tensor, row_weights: torch.Tensor,
                  b2: torch.Tensor, b2_sf: torch.Tensor, row_ptrs: torch.Tensor, act: torch.Tensor, offsets: torch.Tensor,
                  clamp: float | None, config: GemmConfig, sync: torch.Tensor, me: int, num_tokens: int, base: int,
                  peers: torch.Tensor, stats: torch.Tensor | None, record: int, y: torch.Tensor, timeout_ns: int,
                  fast_math: bool) -> None:
    """Launch the one-launch Mega MoE kernel (``megamoe.mega`` validates the arguments; no checks here).

    ``grouped_gemm_fp8_fp4_l1_l2_contiguous`` on the SymmBuffer's ring (``a`` = ``l1_acts``, ``row_weights`` =
    ``l1_topk_weights``, ``row_ptrs`` = ``ring_dest``, ``act`` = ``l2_acts``; ``offsets`` only fills the
    group-bounds argument: the kernel computes the offsets itself) with the ``ep_comm`` phases around it, on
    every CTA slot (``SMs * config.ctas_per_sm`` CTAs, all resident): dispatch (announce, scan, grid barrier,
    expert offsets and pool blocks in shared memory, pull; each pulled unit counted per pool block in ``sync``),
    the tiles (``scheduler.tiles``' order, handed out dynamically; an L1 tile loads its first weight chunks,
    then waits for its block's pulls), then combine on the consumer warpgroups (grid barrier, done exchange,
    sum into ``y``) and the call's end. ``comm``: the buffer's ``ep_comm.EpCommConfig`` (debug iff
    ``timeout_ns`` > 0); ``sync``: int32 ``[sync_words(E, layout)]`` zeros,
    left zeroed; ``peers``: int64 [R] device array of the ranks' buffer bases; ``record``: host-mapped int64
    ``[CTAs, 8]`` (debug reports), or in the trace build (``comm.trace``) a ``timeline.trace_buffer``;
    ``fast_math``: the L1 epilogue's silu (``grouped_gemm_fp8_fp4_swiglu_contiguous``)."""
    m, inter = act.shape
    _launch(config, "offsets", "l1_l2", a, None, b1, b1_sf, act.view(torch.int32).view(m, inter // 2), None,
            row_weights, offsets, offsets, b1.shape[0], 0, _bf16_clamp(clamp), None, second=(act, b2, b2_sf, row_ptrs),
            sync=sync, timeout_ns=timeout_ns, mega=(comm, me, num_tokens, base, peers, stats, record, y),
            fast_math=fast_math)


def grouped_gemm_fp8_fp4_swiglu_masked(
    a: torch.Tensor,
    a_sf: torch.Tensor | None,
    b: torch.Tensor,
    b_sf: torch.Tensor,
    masked_m: torch.Tensor,
    row_weights: torch.Tensor,
    clamp: float | None = None,
    out: torch.Tensor | None = None,
    out_sf: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    expected_m: float | None = None,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    fast_math: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked-layout L1 with the fused SwiGLU epilogue: a ``[E, max_m, H]``, row_weights float32 ``[E, max_m]``,
    returns ``(out float8_e4m3fn [E, max_m, I], out_sf int32 [E, max_m, I/128])``, or with
    ``out_dtype=torch.bfloat16`` ``(out bfloat16 [E, max_m, I], None)``; rows >= masked_m[e] are not written.
    See ``grouped_gemm_fp8_fp4_swiglu_contiguous`` for the computation and ``fast_math``."""
    check_fast_math(fast_math)
    mma, k, e, n = _check_operands(a, a_sf, b, b_sf, masked_m, masked=True, swiglu=True)
    max_m = a.shape[1]
    check_tensor("row_weights", row_weights, dtype=torch.float32, shape=(e, max_m), device=a.device, contiguous=True)
    epilogue, out, out_sf, out_k, out_sf_k = _swiglu_outputs((e, max_m), n // 2, out, out_sf, out_dtype, a.device)
    clamp_value = _bf16_clamp(clamp)
    cfg = _resolve_config(config, max_m if expected_m is None else expected_m, n, k, mma)
    _check_device(a, a_sf=a_sf, b=b, b_sf=b_sf, out=out)
    max_tiles = e * math.ceil(max_m / cfg.tile_tokens) * (n // cfg.tile_n)
    rows = e * max_m
    _launch(
        cfg, "masked", epilogue, a.view(rows, k), _rows_view(a_sf, rows), b, b_sf, out_k, out_sf_k,
        row_weights.view(rows), masked_m, masked_m, e, max_m, clamp_value, max_tiles, fast_math=fast_math,
    )
    return out, out_sf
