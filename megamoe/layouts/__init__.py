"""Data layouts: FP8/FP4 quantization (UE8M0 block scales; FP32 per-128 token scales), weight transforms, grouped
row layouts."""

from .fp4 import E2M1_VALUES, FP4_MAX, as_torch_fp4x2, dequantize_fp4, quantize_fp4
from .fp8 import (FP8_MAX, RECIPE_32, RECIPE_128, RECIPES, check_recipe, dequantize_fp8, quantize_fp8,
                  recipe_of_scales)
from .grouped import (
    ContiguousLayout,
    MaskedLayout,
    contiguous_layout,
    masked_layout,
    max_contiguous_rows,
    to_contiguous,
    to_masked,
)
from .ue8m0 import BLOCK_K, PACKED_BLOCK_K, as_torch_e8m0, pack_ue8m0, unpack_ue8m0
from .weights import deinterleave_gate_up, interleave_gate_up

__all__ = [
    "BLOCK_K",
    "PACKED_BLOCK_K",
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "RECIPE_32",
    "RECIPE_128",
    "RECIPES",
    "ContiguousLayout",
    "MaskedLayout",
    "as_torch_e8m0",
    "as_torch_fp4x2",
    "check_recipe",
    "contiguous_layout",
    "deinterleave_gate_up",
    "dequantize_fp4",
    "dequantize_fp8",
    "interleave_gate_up",
    "masked_layout",
    "max_contiguous_rows",
    "pack_ue8m0",
    "quantize_fp4",
    "quantize_fp8",
    "recipe_of_scales",
    "to_contiguous",
    "to_masked",
    "unpack_ue8m0",
]
