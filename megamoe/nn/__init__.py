"""``megamoe.nn``: expert-parallel MoE layers for model code (inference).

* ``EPMoE``: the layer (quantized local experts, SymmBuffer, explicit implementation, optional
  shared expert); ``forward(hidden_states, topk_idx, topk_weights)`` with the model's routing.
* ``TopKRouter``: softmax / sigmoid / grouped top-k routing of the common MoE families.
* ``MoEBlock`` and ``moe_block_from_config``: router + layer built from a Hugging Face style config
  and checkpoint (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss), a drop-in for the model's MoE block
  (``GptOssMoEBlock`` for gpt-oss: its MLP returns the router scores too).
* ``Checkpoint``, ``read_expert_weights``, ``read_mlp_weights``, ``expert_range``: reading experts
  from state dicts and safetensors files in the standard namings.
"""

from .checkpoint import (NAMINGS, Checkpoint, expert_range, read_expert_biases, read_expert_weights,
                         read_fp4_expert_weights, read_mlp_weights)
from .layer import IMPLS, EPMoE, SharedMLP
from .models import MODEL_TYPES, GptOssMoEBlock, MoEBlock, moe_block_from_config
from .routing import TopKRouter

__all__ = [
    "IMPLS",
    "MODEL_TYPES",
    "NAMINGS",
    "Checkpoint",
    "EPMoE",
    "GptOssMoEBlock",
    "MoEBlock",
    "SharedMLP",
    "TopKRouter",
    "expert_range",
    "moe_block_from_config",
    "read_expert_biases",
    "read_expert_weights",
    "read_fp4_expert_weights",
    "read_mlp_weights",
]
