"""Data layouts: FP8/FP4 quantization with UE8M0 block scales, weight transforms, grouped row layouts."""

from .fp4 import E2M1_VALUES, FP4_MAX, as_torch_fp4x2, dequantize_fp4, quantize_fp4
from .fp8 import FP8_MAX, dequantize_fp8, quantize_fp8
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
    "ContiguousLayout",
    "MaskedLayout",
    "as_torch_e8m0",
    "as_torch_fp4x2",
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
    "to_contiguous",
    "to_masked",
    "unpack_ue8m0",
]
