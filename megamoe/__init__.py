"""megamoe: expert-parallel Mixture-of-Experts layers for multi-GPU inference.

Public surface (see README.md): the SymmBuffer and its sizing helper, the legacy EP baseline, the
FP32 reference of the numerics contract, and the data layouts (``megamoe.layouts``).
"""

from . import layouts, nn, numerics
from .legacy import LegacyMoE
from .reference import distributed_reference_moe, reference_moe
from .symm_buffer import SymmBuffer, get_symm_buffer_for_mega_moe, symm_buffer_layout

__version__ = "0.1.0"

__all__ = [
    "LegacyMoE",
    "SymmBuffer",
    "distributed_reference_moe",
    "get_symm_buffer_for_mega_moe",
    "layouts",
    "nn",
    "numerics",
    "reference_moe",
    "symm_buffer_layout",
]
