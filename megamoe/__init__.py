"""megamoe: expert-parallel Mixture-of-Experts layers for multi-GPU inference.

Public surface (see README.md): the SymmBuffer and its sizing helper, the Mega MoE path
(``fp8_fp4_mega_moe``: one persistent kernel per rank), the staged EP baseline (``StagedMoE``, also named
``LegacyMoE``), one-GPU decode (``moe_decode``, ``MoEDecoder``), the FP32 reference of the numerics contract, the data
layouts (``megamoe.layouts``), the model layer (``megamoe.nn``) and ``check_errors`` (the buffer's device-side
error word).
"""

from . import layouts, nn, numerics
from .decode import MoEDecoder
from .mega import MegaMoE, bf16_mega_moe, debug_report, fp8_fp4_mega_moe, transform_weights_for_mega_moe
from .reference import distributed_reference_moe, reference_moe
from .staged import LegacyMoE, StagedMoE
from .symm_buffer import SymmBuffer, check_errors, get_symm_buffer_for_mega_moe, symm_buffer_layout

__version__ = "0.1.0"

__all__ = [
    "LegacyMoE",
    "MegaMoE",
    "MoEDecoder",
    "StagedMoE",
    "moe_decode",
    "bf16_mega_moe",
    "check_errors",
    "debug_report",
    "fp8_fp4_mega_moe",
    "transform_weights_for_mega_moe",
    "SymmBuffer",
    "distributed_reference_moe",
    "get_symm_buffer_for_mega_moe",
    "layouts",
    "nn",
    "numerics",
    "reference_moe",
    "symm_buffer_layout",
]


def __getattr__(name: str):
    """``megamoe.moe_decode``: the warp-decode kernels' entry (imported on first use: it loads the DSL)."""
    if name == "moe_decode":
        from .kernels.decode import moe_decode

        return moe_decode
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
