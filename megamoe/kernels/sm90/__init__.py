"""Hopper (sm_90a) kernels: the FP4-weight grouped GEMM, L1 and L2 in one launch, and the Mega MoE kernel.

Host modules (importing them needs no DSL): ``config`` (GemmConfig, select_config), ``weights`` (weight
preparation), ``counters`` (the separate launches' tile counters), ``api`` (the entry points). Kernel modules
(CuTe DSL, imported when a kernel is compiled): ``gemm``.
"""

from .api import (
    compile_grouped_gemm,
    compile_l1_l2,
    compile_mega_moe,
    grouped_gemm_fp8_fp4_contiguous,
    grouped_gemm_fp8_fp4_l1_l2_contiguous,
    grouped_gemm_fp8_fp4_masked,
    grouped_gemm_fp8_fp4_swiglu_contiguous,
    grouped_gemm_fp8_fp4_swiglu_masked,
    mega_moe_sm90,
    pad_token_scales,
)
from .config import (K_MULTIPLE, MAX_CTAS_PER_SM, MMA_MODES, N_MULTIPLE, SCALE_ROW_WORDS, THREE_CTA_TILE_TOKENS, GemmConfig,
                     select_config, sync_words, token_widths)
from .counters import TILE_COUNTER_SLOTS, make_tile_counters, tile_counters
from ..weight_layout import e4m3_weight_copy
from .weights import prepare_fp4_weights, prepare_fp4_weights_l1, prepare_l1_bias

__all__ = [
    # configuration
    "GemmConfig", "select_config", "token_widths", "sync_words", "K_MULTIPLE", "SCALE_ROW_WORDS", "N_MULTIPLE", "MMA_MODES",
    "MAX_CTAS_PER_SM", "THREE_CTA_TILE_TOKENS",
    # weights and counters
    "prepare_fp4_weights", "prepare_fp4_weights_l1", "prepare_l1_bias", "e4m3_weight_copy", "make_tile_counters", "tile_counters", "TILE_COUNTER_SLOTS",
    # entry points
    "grouped_gemm_fp8_fp4_contiguous", "grouped_gemm_fp8_fp4_masked", "grouped_gemm_fp8_fp4_swiglu_contiguous",
    "grouped_gemm_fp8_fp4_swiglu_masked", "grouped_gemm_fp8_fp4_l1_l2_contiguous", "mega_moe_sm90",
    "compile_grouped_gemm", "compile_l1_l2", "compile_mega_moe", "pad_token_scales",
]
