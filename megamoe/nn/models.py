"""Drop-in MoE blocks for model code: a router and an ``EPMoE`` behind one ``forward(hidden_states)``.

``moe_block_from_config`` reads a Hugging Face style config (an object with attributes, or a dict,
e.g. ``config.to_dict()``; transformers itself is not needed) and a checkpoint, and builds the block
with the model family's routing (``megamoe.nn.routing``):

============  ===================================================  =================================
model_type    routing                                              experts (under ``prefix``)
============  ===================================================  =================================
qwen3_moe     softmax, top-k, renormalized if ``norm_topk_prob``,   ``experts.{e}.gate_proj`` ...,
              weights rounded to the logits' dtype                  E = ``num_experts``
mixtral       softmax, top-k, renormalized                          ``experts.{e}.w1/w3/w2``,
                                                                    E = ``num_local_experts``
deepseek_v3   float32 logits, sigmoid, ``e_score_correction_bias``  ``experts.{e}.gate_proj`` ...,
              for the choice, top-2-sum group scores keep           E = ``n_routed_experts``; shared
              ``topk_group`` of ``n_group`` groups, renormalized    expert ``shared_experts.`` of
              if ``norm_topk_prob`` (+1e-20), times                 width ``n_shared_experts *
              ``routed_scaling_factor``                             moe_intermediate_size``
gpt_oss       logits with ``router.bias``, top-k of the logits,     ``experts.gate_up_proj_blocks``
              softmax over the k chosen (rounded to the logits'     ... (MXFP4 as published) or
              dtype); block returns ``(y, router_scores)``          ``experts.gate_up_proj`` (BF16),
                                                                    biases; ``"swiglu_oai"`` clamped
                                                                    at ``swiglu_limit``
                                                                    (7.0 if absent),
                                                                    E = ``num_local_experts``
============  ===================================================  =================================

The router's ``gate.weight`` (and ``gate.e_score_correction_bias``) load from the same ``prefix`` (gpt-oss:
``router.weight`` and ``router.bias``).
Any expert naming of ``megamoe.nn.checkpoint`` works (a transformers >= 5 ``model.state_dict()``
holds fused experts under ``model.layers.{l}.mlp.``; saved checkpoints hold per-expert tensors, for
Mixtral under ``model.layers.{l}.block_sparse_moe.``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..checks import fail
from ..numerics import SWIGLU_OAI_ALPHA
from .checkpoint import Checkpoint
from .layer import EPMoE
from .routing import TopKRouter

MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")

GPT_OSS_SWIGLU_LIMIT = 7.0
"""gpt-oss's clamp ``limit``, used where a gpt_oss config has no ``swiglu_limit`` (or holds None): transformers'
``GptOssConfig`` has no such field up to 5.17, whose ``GptOssExperts`` clamps at 7.0 whatever the config says, and
the published checkpoints' config.json holds 7.0. Without the clamp a block would silently compute another function
wherever a gate or up value passes 7."""


class MoEBlock(nn.Module):
    """``router`` then ``moe``: ``hidden_states [..., H]`` -> BF16 ``[..., H]`` (routed + shared experts)."""

    def __init__(self, router: TopKRouter, moe: EPMoE):
        super().__init__()
        self.router, self.moe = router, moe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        topk_idx, topk_weights = self.router(x)
        return self.moe(x, topk_idx, topk_weights).view(hidden_states.shape)


class GptOssMoEBlock(MoEBlock):
    """A drop-in for transformers' ``GptOssMLP``: ``hidden_states [B, S, H]`` -> ``(y [B, S, H]`` BF16,
    ``router_scores [B * S, k])`` in the logits' dtype, as the model's decoder layer unpacks it."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        topk_idx, topk_weights = self.router(x)
        y = self.moe(x, topk_idx, topk_weights).view(hidden_states.shape)
        return y, topk_weights.to(self.router.logits_dtype or x.dtype)


def _routing(config, model_type: str) -> tuple[int, dict, bool]:
    """(E, TopKRouter keyword arguments, whether the block has a shared expert) of a config."""
    def get(*names):  # the first of several spellings (hub config.json vs transformers' to_dict) present
        for name in names:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if value is not None:
                return value
        fail("config", f"has none of {names}")

    k = get("num_experts_per_tok")
    if model_type == "gpt_oss":
        return get("num_local_experts", "num_experts"), dict(
            top_k=k, scoring="topk_softmax", logits_bias=True, cast_weights_to_logits_dtype=True), False
    if model_type == "qwen3_moe":
        return get("num_experts", "num_local_experts"), dict(
            top_k=k, renormalize=get("norm_topk_prob"), cast_weights_to_logits_dtype=True), False
    if model_type == "mixtral":
        return get("num_local_experts", "num_experts"), dict(top_k=k, renormalize=True), False
    return get("n_routed_experts", "num_local_experts"), dict(
        top_k=k, scoring="sigmoid", renormalize=get("norm_topk_prob"), num_groups=get("n_group"),
        topk_groups=get("topk_group"), scaling_factor=get("routed_scaling_factor"), correction_bias=True,
        logits_dtype=torch.float32,
    ), get("n_shared_experts") > 0


def moe_block_from_config(
    config,
    source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike,
    prefix: str,
    max_tokens: int,
    group: dist.ProcessGroup | None = None,
    **kwargs,
) -> MoEBlock:
    """The ``MoEBlock`` of the MoE layer whose tensors sit under ``prefix`` (e.g.
    ``"model.layers.3.mlp."``) in ``source``, for a config of a ``MODEL_TYPES`` model. Collective over
    ``group``; each rank reads only its experts. ``kwargs`` go to ``EPMoE`` (``mma_type``, ``recipe``, ``impl``,
    ``mode``, ``device``, ...)."""
    model_type = config["model_type"] if isinstance(config, Mapping) else config.model_type
    if model_type not in MODEL_TYPES:
        fail("config.model_type", f"must be one of {MODEL_TYPES}, got {model_type!r}")
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    num_experts, routing, shared = _routing(config, model_type)
    if model_type == "gpt_oss":
        alpha = config.get("swiglu_alpha") if isinstance(config, Mapping) else getattr(config, "swiglu_alpha", None)
        if alpha is not None and float(alpha) != SWIGLU_OAI_ALPHA:
            fail("config.swiglu_alpha", f"must be {SWIGLU_OAI_ALPHA} (megamoe's 'swiglu_oai'), got {alpha}")
        limit = config.get("swiglu_limit") if isinstance(config, Mapping) else getattr(config, "swiglu_limit", None)
        limit = GPT_OSS_SWIGLU_LIMIT if limit is None else limit
        kwargs = {"activation": "swiglu_oai", "activation_clamp": limit, **kwargs}
    moe = EPMoE.from_checkpoint(ckpt, prefix, num_experts, routing["top_k"], max_tokens, group,
                                shared_prefix=f"{prefix}shared_experts." if shared else None, **kwargs)
    gate_name = "router" if model_type == "gpt_oss" else "gate"
    gate = ckpt.get(f"{prefix}{gate_name}.weight")
    router = TopKRouter(moe.hidden, num_experts, **routing, dtype=gate.dtype, device=moe.device)
    with torch.no_grad():
        router.weight.copy_(gate)
        if router.bias is not None:
            router.bias.copy_(ckpt.get(f"{prefix}gate.e_score_correction_bias"))
        if router.logits_bias is not None:
            router.logits_bias.copy_(ckpt.get(f"{prefix}{gate_name}.bias"))
    return (GptOssMoEBlock if model_type == "gpt_oss" else MoEBlock)(router, moe)
