"""Top-k routers: a model's gate, turned into the ``(topk_idx, topk_weights)`` megamoe consumes.

``TopKRouter`` covers the routing of the common MoE families, step by step as they compute it:

1. ``logits = x @ W^T`` in ``logits_dtype`` (``None``: the input's dtype, e.g. BF16 for Qwen3-MoE and
   Mixtral; float32 for DeepSeek-V3).
   ``logits_bias``: plus a learned bias ``[E]`` (gpt-oss's ``router.bias``), added by the same ``F.linear``.
2. ``scoring="softmax"``: ``scores = softmax(float32(logits))``; ``"sigmoid"``: ``sigmoid(float32(logits))``;
   ``"topk_softmax"`` (gpt-oss): the top ``top_k`` logits are chosen first (step 3 on the logits), ``scores`` is the
   softmax of ``float32`` of those ``top_k`` logits only.
3. Choice: experts ranked by ``scores + bias`` (``correction_bias``, DeepSeek-V3's
   ``e_score_correction_bias``; zero without it). With ``num_groups > 1`` (DeepSeek-V3 grouped
   routing) experts form ``num_groups`` equal groups scored by the sum of their top-2 choice scores;
   only the best ``topk_groups`` groups stay eligible. ``topk_idx`` = the top ``top_k`` eligible experts,
   best first.
4. ``topk_weights`` = the chosen experts' ``scores`` (without the bias); ``renormalize`` divides by
   their sum (+1e-20 for sigmoid scoring, as DeepSeek-V3 does), then times ``scaling_factor``.
5. ``cast_weights_to_logits_dtype`` rounds the weights to the logits' dtype (Qwen3-MoE does this).

Output: ``topk_idx`` int64 ``[T, k]`` and ``topk_weights`` float32 ``[T, k]``, for ``x [T, H]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_multiple, check_range, check_tensor, fail

SCORINGS = ("softmax", "sigmoid", "topk_softmax")


class TopKRouter(nn.Module):
    """The routing of the module docstring. Parameters: ``weight [E, H]`` (the gate), and with
    ``correction_bias`` a float32 buffer ``bias [E]``; both load from a checkpoint's
    ``gate.weight`` / ``gate.e_score_correction_bias``. With ``logits_bias`` a parameter ``logits_bias [E]``
    (``router.bias`` of gpt-oss, whose ``router.weight`` is the gate)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        scoring: str = "softmax",
        renormalize: bool = True,
        num_groups: int = 1,
        topk_groups: int = 1,
        scaling_factor: float = 1.0,
        correction_bias: bool = False,
        logits_dtype: torch.dtype | None = None,
        cast_weights_to_logits_dtype: bool = False,
        logits_bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if scoring not in SCORINGS:
            fail("scoring", f"must be one of {SCORINGS}, got {scoring!r}")
        check_range("top_k", top_k, 1, num_experts)
        if scoring == "topk_softmax" and (num_groups > 1 or correction_bias):
            fail("scoring", "'topk_softmax' chooses on the logits: no expert groups, no correction bias")
        check_range("num_groups", num_groups, 1, num_experts)
        check_multiple("num_experts", num_experts, num_groups, "experts form equal groups")
        if num_groups > 1:
            check_range("topk_groups", topk_groups, 1, num_groups)
            eligible = topk_groups * (num_experts // num_groups)
            check_range("top_k", top_k, 1, eligible)  # the experts of the topk_groups eligible groups
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.scoring, self.renormalize, self.scaling_factor = scoring, renormalize, scaling_factor
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.logits_dtype, self.cast_weights_to_logits_dtype = logits_dtype, cast_weights_to_logits_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Buffer(torch.zeros(num_experts, dtype=torch.float32, device=device)) if correction_bias else None
        self.logits_bias = (nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device), requires_grad=False)
                            if logits_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_idx int64 [T, k], topk_weights float32 [T, k])``."""
        check_tensor("x", x, ndim=2, shape=(None, self.hidden))
        dt = self.logits_dtype or x.dtype
        logits = F.linear(x.to(dt), self.weight.to(dt), None if self.logits_bias is None else self.logits_bias.to(dt))
        if self.scoring == "topk_softmax":
            top, idx = logits.topk(self.top_k, dim=-1)
            weights = top.float().softmax(-1) * self.scaling_factor  # sums to the factor: renormalizing changes nothing
            return idx, (weights.to(dt) if self.cast_weights_to_logits_dtype else weights).float()
        scores = logits.float().softmax(-1) if self.scoring == "softmax" else logits.float().sigmoid()
        choice = scores if self.bias is None else scores + self.bias
        if self.num_groups > 1:
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        weights = weights * self.scaling_factor
        if self.cast_weights_to_logits_dtype:
            weights = weights.to(dt)
        return idx, weights.float()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
                f"renormalize={self.renormalize}, groups={self.topk_groups}/{self.num_groups}, scaling={self.scaling_factor}")
