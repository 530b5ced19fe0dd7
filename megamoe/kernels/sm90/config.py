"""Static configuration of the SM90 grouped GEMM kernels (host side, no DSL): ``GemmConfig`` (tile shapes, pipeline
depth, CTAs per SM, MMA mode), the heuristic that picks one (``select_config``), the shared-memory budget, the
named barriers, and the sizes of the counters the fused kernels share.

The kernels (``gemm``, ``l1_l2``, ``mega_moe``) compile one variant per (config, group mode, epilogue, ...); shapes
are dynamic. Swap-AB: weights are the wgmma M side (64 rows per consumer warpgroup, ``tile_n`` rows per CTA
tile) and tokens the N side (``tile_tokens`` rows), so a decode-sized group wastes no tensor-core work beyond the
wgmma N granularity of 8; ``GemmConfig.token_side`` "m" turns this round for compute-bound calls (``copy_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...checks import check_range, fail
from ..weight_layout import CHUNK_BYTES, K_CHUNK, ROW_BLOCK

SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
K_MULTIPLE = K_CHUNK
"""K granularity of the kernels (H and I of the fused ones): whole 128-K chunks. Other multiples of 32 run
zero-padded to the next multiple (``layouts.weights.pad_fp4_expert_weights`` once, ``pad_columns`` per call)."""
SCALE_ROW_WORDS = 4
"""FP8 mode: the token scales (one 32-bit word per 128-K chunk) are read by TMA, whose row stride must be a multiple
of 16 bytes: their storage rows are padded to a multiple of this many words (``pad_token_scales``); the
``[..., K/128]`` views the entries take and return are strided where K/128 is not such a multiple."""
N_MULTIPLE = ROW_BLOCK  # weight rows: whole row blocks of the kernel layouts (64 per warpgroup tile)
MMA_MODES = ("bf16", "fp8")
TOKEN_SIDES = ("n", "m")
"""Which wgmma side the tokens take (``GemmConfig.token_side``): "n" (swap-AB: weights on M, 64 rows per consumer
warpgroup, tokens on N in steps of 8: ``gemm.GroupedGemmSm90``) or "m" (tokens on M, 64 rows per consumer warpgroup,
weights on N: ``gemm_tokens_m.TokensMGemmSm90``, recipe (1, 1, 128) with the weights' E4M3 copy only)."""
TOKENS_M_TILE_TOKENS = (64, 128)
"""Token tiles of tokens-on-M configs: one or two consumer warpgroups of 64 token rows (three, 192 rows, measured no
faster: bench/findings/recipe-128-gemm.md)."""
TOKENS_M_TILE_N = (64, 128)
"""Weight tiles of tokens-on-M configs (wgmma N): a consumer thread holds tile_n / 2 accumulator and as many
temporary registers; 256 would not fit its 240 (the per-128 SwiGLU epilogue's 256-row tiles run as two passes of
128: ``GemmConfig.n_passes``)."""
TOKENS_M_ACT_PAD = 8
"""FP32 words of padding per staged token row of the tokens-on-M per-128 SwiGLU epilogue (``SwigluQuant128TokensM``:
64 columns a pass): a row of 72 words puts a warp's eight rows of 8-byte stores on distinct banks, and keeps each row
16-byte aligned for its TMA copy."""
TOKEN_BLOCKS = (32, 128)
"""K elements per token scale in FP8 mode (``GemmConfig.token_block``): the recipes (1, 1, 32) and (1, 1, 128)."""
DECODES = ("regs", "smem", "copy")
"""Where the weights are dequantized (``GemmConfig.decode``): into each consumer thread's registers (RS wgmma), once
per CTA tile into shared memory by the producer warpgroup's three other warps (SS wgmma), or nowhere: the kernel
reads a precomputed E4M3 copy (``weight_layout.e4m3_weight_copy``, SS wgmma). The last two: recipe (1, 1, 128),
one CTA per SM."""
TILE_TOKENS_CHOICES = {"bf16": (8, 16, 32, 64, 128), "fp8": (8, 16, 32, 64, 128)}
TILE_N_CHOICES = (64, 128, 256)
FOUR_WG_MAX_TILE_TOKENS = 64
"""BF16 mode, 256-row weight tiles (four consumer warpgroups, one CTA per SM, 104-112 registers per consumer thread):
the largest token tile whose accumulator fits them. Separate launches and the Mega MoE kernel (``named_barriers``);
the one-launch L1/L2 kernel without communication keeps two consumer warpgroups (not run with four)."""
FOUR_WG_FP8_MAX_TILE_TOKENS = 32
"""FP8 mode with per-128 token scales on four consumer warpgroups (``tile_n`` 256: the per-128 SwiGLU epilogue's 128
intermediate columns): the largest token tile whose accumulator, temporary and two fragment buffers fit 112
registers."""
PASSES = (1, 2)
"""Weight-row passes per tile (``GemmConfig.n_passes``)."""
CLUSTERS = (1, 2, 4)
"""CTAs per cluster (``GemmConfig.cluster``; 2: ``gemm_cluster``, the token tile multicast to both; 4: a 2 x 2 quad,
token and weight tiles multicast)."""
TWO_PASS_TILE_TOKENS = (64, 128)
"""Token tiles of two-pass configs (``GemmConfig.n_passes`` 2): the 256-row tiles' two 128-row passes run on two
consumer warpgroups (232 registers each), whose accumulator, temporary and fragment buffers fit 128-row token tiles
(the separate recipe-128 GEMM's 128 x 128 tiles); below 64 rows the four-warpgroup tiles serve."""
TWO_CTA_TILE_TOKENS = {"bf16": 32, "fp8": 16}
"""Largest token tile that may run two CTAs per SM (``GemmConfig.ctas_per_sm``), per MMA mode."""
DEFERRED_MAX_TILE_TOKENS = 8
"""FP8 block-32 mode: token tiles up to this many rows issue a 128-K chunk's four k32 wgmmas into four temporaries and
promote them after one wait (measured faster at 8 rows; 16-row tiles spill: ``bench/findings/fp8-mode-promotion.md``)."""
THREE_CTA_TILE_TOKENS = 8
"""Three CTAs per SM: BF16 mode, 64-row weight tiles (one consumer warpgroup) and token tiles of this many rows
(80 registers per thread, 256 threads per CTA)."""
MAX_CTAS_PER_SM = 3
"""Most CTAs per SM any config runs (``GemmConfig.ctas_per_sm``): host buffers with one row per CTA are sized by it."""
WIDE_FP8_TILE_TOKENS = 128
"""FP8 block-32 mode, token tiles of this many rows (one per thread of a consumer warpgroup): each 32-K block as two
wgmmas ``m64 n64 k32`` into their own temporaries (with the accumulator, 128 registers), one promoted while the other
runs; the tokens' scales as FP32 in shared memory, converted once per chunk (``GemmConfig.scale_table_bytes``)."""
MIN_WIDE_STAGES = 3
"""One-CTA BF16-mode tiles load two 128-K chunks per stage where at least this many such stages fit."""
GROUP_MODES = ("offsets", "offsets_counts", "masked")
EPILOGUES = ("bf16", "swiglu_fp8", "swiglu_fp8_bf16", "bf16_scatter")
SWIGLU_EPILOGUES = ("swiglu_fp8", "swiglu_fp8_bf16")
"""The epilogues that compute silu (``fast_math`` selects how)."""
SCATTER_PAD = 8
"""BF16 elements of padding per staged row of the scatter epilogue (rows stay 16-byte aligned)."""


def decode_scale_stride(tile_tokens: int) -> int:
    """Decode "smem": FP32 words per lane quad of a stage's token-scale table: the quad's ``tile_tokens / 4`` scales,
    padded to a multiple of 4 plus 4, so that the four quads' 16-byte loads hit different banks."""
    return max(tile_tokens // 4, 4) + 4


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
    mma: "bf16" (BF16 tokens, weights from ``prepare_fp4_weights(..., mma="bf16")``) or "fp8" (FP8 tokens, FP8-mode
        weights).
    token_block: FP8 mode, the K elements one token scale covers: 32 (packed UE8M0 scales, recipe (1, 1, 32): an FP32
        promotion every 32 K) or 128 (one FP32 scale per 128 K, recipe (1, 1, 128): one promotion per 128-K chunk;
        folded weight scales only). BF16 mode: 32 (unused).
    decode: "regs" (every consumer warp decodes its own weight rows into its RS wgmma A fragment) or "smem" (FP8 mode
        with ``token_block`` 128 and one CTA per SM: warps 1-3 decode each stage's weight tile once into an E4M3
        shared-memory tile that the consumers' SS wgmmas read: ``mainloop_fp8_smem``) or "copy" (the same
        constraints: TMA loads each stage's tile of the weights' E4M3 copy, ``weight_layout.e4m3_weight_copy``, one
        byte per weight, straight into the tile the SS wgmmas read; no decode: ``mainloop_fp8_copy``).
    token_side: "n" (swap-AB, every config above) or "m" (``TOKEN_SIDES``): tokens on the wgmma M side, 64 token rows
        per consumer warpgroup (``tile_tokens`` in ``TOKENS_M_TILE_TOKENS``), the weights' E4M3 copy on N
        (``tile_n`` in ``TOKENS_M_TILE_N``, or 256 in two passes for L1's per-128 SwiGLU epilogue:
        ``tokens_m_swiglu_config``); decode "copy", one CTA per SM. Why: a consumer thread's accumulator then covers
        two token rows, so its per-128 promotion needs two token scales per chunk instead of ``tile_tokens / 4``
        (``mainloop_fp8_tokens_m``).
    even_chunks: every K the build runs is an even number of 128-K chunks (K % 256 == 0), so BF16 mode may load two
        chunks per stage (``chunks_per_stage``) and recipe (1, 1, 128)'s register mainloop runs chunk pairs without a
        tail; False runs any whole number of chunks (one per stage; the pair loop's odd tail). The entry points set it
        from the shapes (``for_k``): a config with True is replaced for an odd chunk count.
    n_passes: 1, or 2: each ``tile_n``-row tile (the unit of the tile order, its counters and signals) runs as two
        sequential passes of ``pass_n`` = tile_n / 2 weight rows on ``pass_n / 64`` consumer warpgroups, the tokens
        loaded again for the second pass (L2 hits). Only ``tile_n`` 256 in FP8 mode with ``token_block`` 128, one CTA
        per SM and ``TWO_PASS_TILE_TOKENS``, for the per-128 SwiGLU epilogue, which needs the 128 intermediate columns
        of a 256-row tile together: the Mega MoE kernel of recipe (1, 1, 128) (register decode; ``SwigluQuant128``
        stages the first pass's half, quantizes after the second), with 128-row passes on two consumer warpgroups
        instead of four warpgroups of 32-row token tiles; and the separate L1 GEMM with tokens on the wgmma M side
        (decode "copy"; ``SwigluQuant128TokensM``).
    cluster: 1, or 2: two CTAs of a cluster multiply one token tile with the two weight tiles of a pair, each
        TMA-loading half the token box into both (``gemm_cluster``: half the tokens' L2 reads per CTA). FP8 mode with
        ``token_block`` 128, decode "regs" or "copy", one CTA per SM, ``tile_tokens`` >= 16; separate grouped GEMMs
        only, N a multiple of 2 * ``tile_n``; two passes with tokens on the wgmma M side only. Or 4, tokens on the
        wgmma M side only: a 2 x 2 quad of two token tiles by two weight tiles, each box loaded half by each of the two
        CTAs that multiply it (``gemm_cluster``: half the token and half the weight bytes per CTA).
    """

    tile_tokens: int = 64
    tile_n: int = 128
    stages: int | None = None
    ctas_per_sm: int = 1
    mma: str = "bf16"
    token_block: int = 32
    decode: str = "regs"
    even_chunks: bool = True
    n_passes: int = 1
    token_side: str = "n"
    cluster: int = 1

    def __post_init__(self):
        if self.mma not in MMA_MODES:
            fail("config.mma", f"must be one of {MMA_MODES}, got {self.mma!r}")
        if self.token_block not in TOKEN_BLOCKS or (self.mma == "bf16" and self.token_block != 32):
            fail("config.token_block", f"must be one of {TOKEN_BLOCKS} (128: FP8 mode only), got {self.token_block} "
                 f"with mma={self.mma!r}")
        if self.decode not in DECODES or (self.decode != "regs" and not (
                self.mma == "fp8" and self.token_block == 128 and self.ctas_per_sm == 1)):
            fail("config.decode", f"must be one of {DECODES} ('smem' and 'copy': mma='fp8', token_block=128, "
                 f"ctas_per_sm=1), got "
                 f"{self.decode!r} with mma={self.mma!r}, token_block={self.token_block}, ctas_per_sm={self.ctas_per_sm}")
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
        if self.n_passes not in PASSES or (self.n_passes == 2 and not (
                self.mma == "fp8" and self.token_block == 128 and self.tile_n == 256 and self.ctas_per_sm == 1
                and (self.decode == "regs" or (self.decode == "copy" and self.token_side == "m"))
                and self.tile_tokens in TWO_PASS_TILE_TOKENS)):
            fail("config.n_passes", f"must be one of {PASSES} (2: mma='fp8', token_block=128, tile_n=256, ctas_per_sm=1, "
                 f"decode='regs' or, with token_side='m', 'copy', tile_tokens in {TWO_PASS_TILE_TOKENS}), got "
                 f"{self.n_passes} with mma={self.mma!r}, "
                 f"token_block={self.token_block}, tile_n={self.tile_n}, ctas_per_sm={self.ctas_per_sm}, "
                 f"decode={self.decode!r}, tile_tokens={self.tile_tokens}")
        four_wg_tokens = FOUR_WG_MAX_TILE_TOKENS if self.mma == "bf16" else FOUR_WG_FP8_MAX_TILE_TOKENS
        if self.tile_n == 256 and self.n_passes == 1 and not (
                (self.mma == "bf16" or self.token_block == 128) and self.ctas_per_sm == 1
                and self.tile_tokens <= four_wg_tokens):
            fail("config.tile_n", f"256 needs mma='bf16' (or FP8 with token_block=128), ctas_per_sm=1 and tile_tokens "
                 f"<= {FOUR_WG_MAX_TILE_TOKENS} ({FOUR_WG_FP8_MAX_TILE_TOKENS} in FP8 mode); got mma={self.mma}, "
                 f"token_block={self.token_block}, ctas_per_sm={self.ctas_per_sm}, tile_tokens={self.tile_tokens} "
                 f"(FP8 token_block=128 tiles of {TWO_PASS_TILE_TOKENS} token rows: n_passes=2)")
        if self.token_side not in TOKEN_SIDES or (self.token_side == "m" and not (
                self.decode == "copy" and self.tile_tokens in TOKENS_M_TILE_TOKENS and self.pass_n in TOKENS_M_TILE_N)):
            fail("config.token_side", f"must be one of {TOKEN_SIDES} ('m': decode='copy', tile_tokens in "
                 f"{TOKENS_M_TILE_TOKENS}, tile_n in {TOKENS_M_TILE_N}, or 256 in two passes), got "
                 f"{self.token_side!r} with "
                 f"decode={self.decode!r}, n_passes={self.n_passes}, tile_tokens={self.tile_tokens}, "
                 f"tile_n={self.tile_n}")
        if self.cluster not in CLUSTERS or (self.cluster > 1 and not (
                self.mma == "fp8" and self.token_block == 128 and self.decode in ("regs", "copy")
                and self.ctas_per_sm == 1 and (self.n_passes == 1 or self.token_side == "m")
                and self.tile_tokens >= 16)) or (
                self.cluster == 4 and self.token_side != "m"):
            fail("config.cluster", f"must be one of {CLUSTERS} (2: mma='fp8', token_block=128, decode 'regs' or "
                 f"'copy', ctas_per_sm=1, n_passes=1 or token_side='m', tile_tokens >= 16; 4: also token_side='m'), "
                 f"got {self.cluster} "
                 f"with mma={self.mma!r}, token_block={self.token_block}, decode={self.decode!r}, "
                 f"ctas_per_sm={self.ctas_per_sm}, n_passes={self.n_passes}, tile_tokens={self.tile_tokens}, "
                 f"token_side={self.token_side!r}")
        if self.stages is not None:
            check_range("config.stages", self.stages, 2, self.max_stages())

    def for_k(self, *ks: int) -> GemmConfig:
        """This config for GEMMs of K ``ks`` (multiples of ``K_MULTIPLE``): ``even_chunks`` False where some K is an
        odd number of 128-K chunks, else this config as it is."""
        if self.even_chunks and any(k // K_CHUNK % 2 for k in ks):
            return replace(self, even_chunks=False)
        return self

    @property
    def cluster_weight_tiles(self) -> int:
        """Weight tiles a cluster multiplies side by side (N must be a multiple of this many ``tile_n``): 1, or 2 on
        two- and four-CTA clusters (``gemm_cluster``)."""
        return min(self.cluster, 2)

    @property
    def pass_n(self) -> int:
        """Weight rows one pass multiplies (the mainloop's, a pipeline stage's and the epilogues' tile): ``tile_n``
        over ``n_passes``."""
        return self.tile_n // self.n_passes

    @property
    def act_stride(self) -> int:
        """FP32 words per staged token row of the SwiGLU epilogues: the tile's intermediate columns plus 4 of padding
        (swap-AB: every pass's), or with tokens on the wgmma M side one pass's plus ``TOKENS_M_ACT_PAD``
        (``SwigluQuant128TokensM``)."""
        if self.token_side == "m":
            return self.pass_n // 2 + TOKENS_M_ACT_PAD
        return self.tile_n // 2 + 4

    @property
    def consumer_warpgroups(self) -> int:
        """64 rows of the wgmma M side each: weight rows (``token_side`` "n"), token rows ("m")."""
        return (self.tile_tokens if self.token_side == "m" else self.pass_n) // 64

    def chunks_per_stage(self, epilogue: str = "bf16") -> int:
        """128-K chunks per pipeline stage, in BF16 mode 2 (one barrier wait and release, one loop step per 256 K:
        172.5 instead of 183-186 SASS instructions per chunk and warp at 8-16 rows) for the one-launch L1/L2
        kernels ("l1_l2") with token tiles of up to 32 rows, and for one-CTA tiles where ``MIN_WIDE_STAGES`` such
        stages fit; else 1 (the separate launches' two-CTA variants would run out of registers for their
        wgmmas, ptxas C7512). Builds for odd chunk counts (``even_chunks`` False): 1."""
        if self.mma != "bf16" or not self.even_chunks:
            return 1
        if epilogue == "l1_l2" and self.tile_tokens <= 32:
            return 2
        return 2 if self.ctas_per_sm == 1 and self._fitting_stages(epilogue, 0, 2) >= MIN_WIDE_STAGES else 1

    def stage_bytes(self, epilogue: str = "bf16") -> int:
        """Shared memory of one pipeline stage: tokens, packed weights and the weights' packed scale words (4 bytes
        per row of a pass) of each chunk (decode "copy": the E4M3 copy's 128 bytes per row instead of the packed
        weights', ``weight_row_bytes``); FP8 mode: plus the tokens' 4-chunk scale box (16 bytes per row); decode "smem":
        plus the decoded E4M3 weight tile and the token-scale table (``decoded_stage_bytes``)."""
        return self._stage_bytes(self.chunks_per_stage(epilogue))

    def _stage_bytes(self, chunks: int) -> int:
        if self.mma == "bf16":
            return chunks * (self.tile_tokens * K_CHUNK * 2 + self.tile_n * (CHUNK_BYTES + 4))
        return (self.tile_tokens * K_CHUNK + self.pass_n * (self.weight_row_bytes + 4) + 16 * self.tile_tokens
                + self.decoded_stage_bytes())

    @property
    def weight_row_bytes(self) -> int:
        """Bytes one weight row of a 128-K chunk occupies in a stage and in the weights' TMA box: the E4M3 copy's
        ``K_CHUNK`` (decode "copy"), else the packed FP4 ``CHUNK_BYTES``."""
        return K_CHUNK if self.decode == "copy" else CHUNK_BYTES

    def decoded_stage_bytes(self) -> int:
        """Decode "smem": shared memory per stage besides the TMA's, the decoded E4M3 weight tile (128 bytes per row)
        and the token-scale table (4 lane quads x ``decode_scale_stride`` FP32); else 0."""
        return self.tile_n * K_CHUNK + 16 * decode_scale_stride(self.tile_tokens) if self.decode == "smem" else 0

    def epilogue_bytes(self, epilogue: str = "bf16") -> int:
        """Shared memory the epilogue needs besides the pipeline (SwiGLU: FP32 activations of one tile, all its passes;
        scatter, and BF16 with tokens on the wgmma M side: the BF16 tile, rows padded by 16 bytes; "l1_l2": one region
        for both)."""
        swiglu = self.tile_tokens * self.act_stride * 4
        scatter = self.tile_tokens * (self.tile_n + SCATTER_PAD) * 2
        if epilogue == "l1_l2":  # one region serves both (equal sizes): see the kernel
            return swiglu
        if epilogue.startswith("swiglu"):
            return swiglu
        return scatter if epilogue == "bf16_scatter" or self.token_side == "m" else 0

    def max_stages(self, epilogue: str = "bf16", extra_bytes: int = 0) -> int:
        """Stages that fit beside the epilogue's and ``extra_bytes`` of other shared memory."""
        return self._fitting_stages(epilogue, extra_bytes, self.chunks_per_stage(epilogue))

    @property
    def wide_fp8(self) -> bool:
        """FP8 mode with ``WIDE_FP8_TILE_TOKENS``-row token tiles: two 64-token wgmmas per 32-K block, the tokens'
        per-32 scales converted to FP32 once per chunk into shared memory (``scale_table_bytes``)."""
        return self.mma == "fp8" and self.token_block == 32 and self.tile_tokens >= WIDE_FP8_TILE_TOKENS

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
            f"sm90 fp4 {'tokensM' if self.token_side == 'm' else 'swapAB'} mma={self.mma}{'x128' if self.token_block == 128 else ''} tile_tokens={self.tile_tokens} tile_n={self.tile_n} "
            f"stages={self.num_stages(epilogue)}x{K_CHUNK * self.chunks_per_stage(epilogue)}K ctas/SM={self.ctas_per_sm} "
            f"{'' if self.decode == 'regs' else f'decode={self.decode} '}{f'passes={self.n_passes} ' if self.n_passes > 1 else ''}"
            f"{f'cluster={self.cluster} ' if self.cluster > 1 else ''}"
            f"{'' if self.even_chunks else 'odd-chunks '}epilogue={epilogue}"
        )


def mega_comm_words(comm) -> int:
    """int32 words of the Mega MoE kernel's ``sComm`` (``comm``: its ``comm.EpCommConfig``, or None): the expert
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
    from ...scheduler import tiles

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


FP8_WIDTHS_TILE_TOKENS = 128
"""FP8 mode with per-128 token scales: the token tiles that compile token widths (``fp8_token_widths``)."""


def token_widths(tile_tokens: int) -> tuple[int, ...]:
    """The wgmma token widths (N) a BF16-mode kernel with ``tile_tokens`` compiles, narrowest first, equal steps
    (the first width): the multiples of ``TOKEN_WIDTH_STEP`` up to the tile from 64 rows, else half the tile and the
    tile (8 rows, the wgmma N granularity: the tile alone)."""
    if tile_tokens >= 2 * TOKEN_WIDTH_STEP:
        return tuple(range(TOKEN_WIDTH_STEP, tile_tokens + 1, TOKEN_WIDTH_STEP))
    return (tile_tokens,) if tile_tokens == 8 else (tile_tokens // 2, tile_tokens)


def fp8_token_widths(tile_tokens: int) -> tuple[int, ...]:
    """The wgmma token widths (N) of FP8 mode with per-128 token scales (``mainloops.Fp8Block128Mainloop``), narrowest
    first: ``token_widths`` for tiles of ``FP8_WIDTHS_TILE_TOKENS`` rows, the tile alone below. 64-row tiles keep one K
    loop: with widths (32, 64) ptxas serialized the wgmmas of the two-pass Mega MoE build (C7511, register resources)
    or computed the grouped GEMM's wgmma descriptors in regular registers, depending on how the K loops were branched
    to, and a 64-row tile serves groups of 33-64 expected rows, which seldom fit 32; smaller tiles (small groups; the
    four-warpgroup tiles at 112 registers per thread) are bound by the weight decode, not by their tensor work."""
    return token_widths(tile_tokens) if tile_tokens >= FP8_WIDTHS_TILE_TOKENS else (tile_tokens,)


def per_128_swiglu_config(expected_rows_per_expert: float) -> GemmConfig:
    """The config of a GEMM whose epilogue quantizes per 128 columns (recipe (1, 1, 128)'s ``SwigluQuant128``, and
    the Mega MoE kernel of that recipe up to ``FOUR_WG_FP8_MAX_TILE_TOKENS`` expected rows, whose two GEMMs share one
    config; above, ``two_pass_128_config``): 256-row weight tiles (four consumer
    warpgroups: 128 intermediate columns, one scale block per token), one CTA per SM, the smallest token tile covering
    the expected group, at most ``FOUR_WG_FP8_MAX_TILE_TOKENS`` rows (the most whose registers fit)."""
    tiles = tuple(t for t in TILE_TOKENS_CHOICES["fp8"] if t <= FOUR_WG_FP8_MAX_TILE_TOKENS)
    tokens = next((t for t in tiles if t >= expected_rows_per_expert), tiles[-1])
    return GemmConfig(tile_tokens=tokens, tile_n=256, mma="fp8", token_block=128)


def two_pass_128_config(expected_rows_per_expert: float) -> GemmConfig:
    """Recipe (1, 1, 128)'s Mega MoE config for groups larger than ``FOUR_WG_FP8_MAX_TILE_TOKENS`` rows: 256-row
    tiles (the per-128 SwiGLU epilogue's 128 intermediate columns) as two 128-row passes on two consumer warpgroups
    (``GemmConfig.n_passes``), the smallest of ``TWO_PASS_TILE_TOKENS`` covering the expected group (the largest
    beyond)."""
    tokens = next((t for t in TWO_PASS_TILE_TOKENS if t >= expected_rows_per_expert), TWO_PASS_TILE_TOKENS[-1])
    return GemmConfig(tile_tokens=tokens, tile_n=256, mma="fp8", token_block=128, n_passes=2)


def tokens_m_config(expected_rows_per_expert: float) -> GemmConfig:
    """Recipe (1, 1, 128) with the weights' E4M3 copy and tokens on the wgmma M side (``GemmConfig.token_side`` "m"):
    128 weight rows, 64 token rows (one consumer warpgroup) for groups expected within 64 rows, else 128 (two)."""
    tokens = 64 if expected_rows_per_expert <= 64 else 128
    return GemmConfig(tile_tokens=tokens, tile_n=128, mma="fp8", token_block=128, decode="copy", token_side="m")


def weight_tiles_pair_up(config: GemmConfig, *ns: int) -> bool:
    """Whether every N in ``ns`` is a whole number of weight-tile pairs of ``config`` (``2 * tile_n`` rows): what the
    two CTAs of a cluster multiplying a pair of weight tiles need (the Mega MoE kernel's ``cluster`` 2)."""
    return all(n % (2 * config.tile_n) == 0 for n in ns)


def tokens_m_swiglu_config(expected_rows_per_expert: float) -> GemmConfig:
    """``tokens_m_config`` for L1's per-128 SwiGLU epilogue: 256-row weight tiles (128 intermediate columns, one scale
    block) in two passes of 128 (``GemmConfig.n_passes``; ``SwigluQuant128TokensM``)."""
    return replace(tokens_m_config(expected_rows_per_expert), tile_n=256, n_passes=2)


TOKENS_M_MIN_ROWS = 128
"""Expected rows per expert from which ``copy_config`` puts the tokens on the wgmma M side: from 256 rows its 128 x 128
tiles measured 1.05-1.19x swap-AB's on the pro shapes and on the H200, within 5% either way on the H100's flash
shapes; at 64 rows both orientations are bound by the weights' bytes and equal (bench/findings/recipe-128-gemm.md)."""


QUAD_MIN_ROWS = 1024
QUAD_MIN_K = 4096
"""Expected rows per expert and K from which ``copy_config`` runs tokens on M on four-CTA quads (``GemmConfig.cluster``
4): at 1024 rows/expert they measured 1.08-1.11x two-CTA clusters and 1.12-1.22x one CTA on the flash and pro L1
shapes (K 4096, 7168), and slower than the best of those on the L2 shapes (K 2048, 3072)
(bench/findings/recipe-128-gemm.md)."""


def copy_config(expected_rows_per_expert: float, n: int, k: int) -> GemmConfig:
    """The config of a plain recipe-(1, 1, 128) grouped GEMM given the weights' E4M3 copy and no config: tokens on M
    (``tokens_m_config``) from ``TOKENS_M_MIN_ROWS`` expected rows per expert where N is whole 128-row tiles -- on
    four-CTA quads from ``QUAD_MIN_ROWS`` rows and ``QUAD_MIN_K`` where N is whole pairs of them --, else
    ``select_config``'s swap-AB tile reading the copy (one CTA per SM, which the copy needs)."""
    if expected_rows_per_expert >= QUAD_MIN_ROWS and k >= QUAD_MIN_K and n % 256 == 0:
        return replace(tokens_m_config(expected_rows_per_expert), cluster=4)
    if expected_rows_per_expert >= TOKENS_M_MIN_ROWS and n % 128 == 0:
        return tokens_m_config(expected_rows_per_expert)
    return replace(select_config(expected_rows_per_expert, n, k, "fp8", token_block=128), decode="copy", ctas_per_sm=1)


SWIGLU_PAIR_MIN_ROWS = 256
SWIGLU_PAIR_MIN_K = 4096
"""Expected rows per expert and K from which ``copy_swiglu_config`` runs its tokens-on-M two-pass tiles on two-CTA
clusters: at 256 and 1024 rows/expert they measured 1.06-1.17x one CTA on the flash and pro L1 shapes (K 4096, 7168)
and 1.01-1.09x four-CTA quads at 1024 rows; at 128 rows one CTA was 1.01x faster (bench/findings/recipe-128-gemm.md)."""


def copy_swiglu_config(expected_rows_per_expert: float, n: int, k: int) -> GemmConfig:
    """``copy_config`` for L1's per-128 SwiGLU GEMM (N = 2I, a multiple of 256): tokens on M in two passes
    (``tokens_m_swiglu_config``) from ``TOKENS_M_MIN_ROWS`` expected rows per expert, on two-CTA clusters from
    ``SWIGLU_PAIR_MIN_ROWS`` and ``SWIGLU_PAIR_MIN_K`` where N is whole pairs of 256-row tiles; else
    ``per_128_swiglu_config``'s swap-AB tile reading the copy."""
    if expected_rows_per_expert >= TOKENS_M_MIN_ROWS:
        cfg = tokens_m_swiglu_config(expected_rows_per_expert)
        pairs = expected_rows_per_expert >= SWIGLU_PAIR_MIN_ROWS and k >= SWIGLU_PAIR_MIN_K and n % 512 == 0
        return replace(cfg, cluster=2) if pairs else cfg
    return replace(per_128_swiglu_config(expected_rows_per_expert), decode="copy")


def poisson_cover(expected_rows: float) -> float:
    """The rows a token tile should cover for experts expected to get ``expected_rows``: an expert's row count is about
    Poisson around it, so the expected rows plus two standard deviations (about 98% of the experts fit; a tile only as
    wide as the expected rows reads and decodes about half the experts' weights twice)."""
    return expected_rows + 2 * math.sqrt(expected_rows)


def select_config(expected_rows_per_expert: float, n: int, k: int, mma: str = "bf16",
                  four_warpgroups: bool = True, token_block: int = 32) -> GemmConfig:
    """Heuristic config for ``mma`` mode from the expected rows per expert (tokens) and the problem's N, K.

    Token tile: the smallest tile_tokens choice covering the expected group (the largest beyond); in BF16 mode, up
    to ``TWO_CTA_TILE_TOKENS`` rows, the smallest covering the expected group plus two standard deviations of a
    Poisson count (16 rather than 8 rows from 4.5 expected, 32 rather than 16 from 10): the wider tile runs narrower
    K loops for smaller groups (``token_widths``) and reads the weights of a larger group once instead of twice.
    Weight tile 128 rows (two consumer warpgroups) when N allows it, else 64; in BF16 mode with token tiles up to
    ``FOUR_WG_MAX_TILE_TOKENS`` rows 256 (four consumer warpgroups, one CTA per SM) where N allows it and
    ``four_warpgroups`` (False for the one-launch L1/L2 kernel without communication, which takes two at most;
    ``mega.tile_config`` sets it for the Mega MoE kernel by measurement): 16 consumer warps per SM share one token tile
    in shared memory, where two CTAs of 128-row tiles each load and hold their own. Otherwise two CTAs per SM up to
    ``TWO_CTA_TILE_TOKENS`` (they hide each other's waits). Every choice here was measured against its alternatives
    (``bench/findings/four-consumer-warpgroups.md``, ``bench/findings/fp8-mode-promotion.md``)."""
    del k  # the stage count is chosen from shared memory alone
    if mma not in MMA_MODES:
        fail("mma", f"must be one of {MMA_MODES}, got {mma!r}")
    tiles = TILE_TOKENS_CHOICES[mma]
    tile_tokens = next((t for t in tiles if t >= expected_rows_per_expert), tiles[-1])
    if mma == "bf16" and tile_tokens <= TWO_CTA_TILE_TOKENS["bf16"]:
        margin = min(poisson_cover(expected_rows_per_expert), TWO_CTA_TILE_TOKENS["bf16"])
        tile_tokens = next(t for t in tiles if t >= margin)
    tile_n = 128 if n % 128 == 0 else 64
    ctas = 2 if tile_tokens <= TWO_CTA_TILE_TOKENS[mma] else 1
    if mma == "bf16" and four_warpgroups and tile_tokens <= FOUR_WG_MAX_TILE_TOKENS and n % 256 == 0:
        tile_n, ctas = 256, 1
    return GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, mma=mma,
                      token_block=token_block if mma == "fp8" else 32)
