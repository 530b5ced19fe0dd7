"""MoE layer on one GPU holding every expert, for decode: warp decode or the grouped path, by batch size.

``MoEDecoder(l1, l2, num_topk, max_tokens)`` takes canonical FP4 weights of all E experts and runs
``y = MoE(x)`` for ``x`` bfloat16 ``[T, H]`` by one of two paths:

* ``"warp_decode"`` (``megamoe.moe_decode``, ``kernels.warp_decode``): output-centric kernels, BF16
  activations, FP32 accumulation, one BF16 rounding of ``y``. Over the Mega MoE layout both projections run on
  tensor cores: up to 4 tokens the token-major kernels (``kernels.token_major_decode``: K split over the warps of a
  CTA, slots combined in shared memory), above it the expert-major ones (``kernels.expert_major_decode``: each
  routed expert read once per batch). The weights are the grouped path's Mega MoE layout (``warp_weights``), at H
  and I where they are multiples of 128 (the kernels' K chunk, ``kernels.sm90.K_MULTIPLE``), else (multiples of 32
  only) at its zero-padded sizes: ``x`` padded with zero columns per call and only the real H columns of ``y`` kept
  (exact: the padded weights are zeros, ``symm_buffer``).
* ``"grouped"``: the Mega MoE on one rank (``megamoe.mega``: routing, contiguous expert groups,
  SM90 grouped GEMMs with the SwiGLU-quant epilogue, combine), after quantizing ``x`` to FP8 (the
  numerics contract of ``megamoe.numerics``). Its cost follows the distinct experts' weights.

``path="auto"`` (default) picks warp decode for ``T <= crossover`` and the grouped path above it.
The crossover is measured, not guessed: ``MEASURED_CROSSOVERS`` holds the largest batch at which warp
decode was faster in ``python -m megamoe.bench decode``; other shapes use the rule derived from those
points (``default_crossover``). The two paths differ by the FP8
contract's error (the grouped path quantizes activations), never more than ``moe_tolerances``.

The decoder holds the weights in two layouts: canonical (as given; ``bench decode`` times the SIMT kernels on
them) and the Mega MoE layout of the grouped path and the tensor-core warp decode (twice the FP4 bytes), plus a
one-rank SymmBuffer of ``max_tokens`` rows.
"""

from __future__ import annotations

import torch

from .checks import check_range, check_tensor, fail
from .layouts.weights import check_fp4_expert_weights, pad_columns
from .numerics import RECIPE_32, check_recipe

PATHS = ("auto", "warp_decode", "grouped")
MEASURED_CROSSOVERS: dict[tuple[int, int, int, int], int] = {
    (4096, 2048, 32, 6): 16,
    (4096, 2048, 128, 6): 16,
    (7168, 3072, 48, 6): 4,
    (7168, 3072, 192, 6): 4,
}
"""(hidden, intermediate, experts, top-k) -> the largest batch (of 1, 2, 4, 8, ..., 64) where warp decode, as the
decoder runs it, beat the grouped path on one H200 (``bench/results/decode/2026-11-30_decode_token_major_all_h200.json``;
the times and the close calls: bench/findings/warp-decode-crossover.md)."""


def default_crossover(hidden: int, inter: int, experts: int, topk: int) -> int:
    """Largest batch for which ``path="auto"`` uses warp decode: the measured point for a measured shape,
    else the one of the nearest measured expert count per top-k slot (``experts / topk``), else 0."""
    key = (hidden, inter, experts, topk)
    if key in MEASURED_CROSSOVERS:
        return MEASURED_CROSSOVERS[key]
    if not MEASURED_CROSSOVERS:
        return 0
    ratio = experts / topk
    nearest = min(MEASURED_CROSSOVERS, key=lambda k: abs(k[2] / k[3] - ratio))
    return MEASURED_CROSSOVERS[nearest]


class MoEDecoder:
    """One GPU's MoE layer for decode (module docstring).

    ``l1 = (uint8 [E, 2I, H/2], int32 [E, 2I, ceil(H/128)])`` rows [gate; up], ``l2 = (uint8 [E, H, I/2], int32
    [E, H, ceil(I/128)])`` (canonical FP4 + packed UE8M0, as ``layouts.quantize_fp4`` makes them; H and I multiples
    of 32); ``num_topk``: k of the calls' ``topk_idx``; ``max_tokens``: largest T of a call; ``crossover``: override
    the measured one (``default_crossover``). ``recipe``: (1, 1, 32) only (the grouped path's Mega MoE layout is the one
    warp decode reads; recipe (1, 1, 128) raises: use ``MegaMoE(..., recipe=(1, 1, 128))`` on one rank instead).
    """

    def __init__(self, l1: tuple, l2: tuple, num_topk: int, max_tokens: int, crossover: int | None = None,
                 recipe=RECIPE_32):
        from .mega import MegaMoE
        from .symm_buffer import get_symm_buffer_for_mega_moe

        if check_recipe(recipe) != RECIPE_32:
            fail("recipe", f"must be {RECIPE_32} for MoEDecoder: its warp-decode kernels read the recipe (1, 1, 32) "
                 f"(BF16-mode) weight layout of the grouped path; got {tuple(recipe)}. For recipe (1, 1, 128) on one "
                 "GPU run megamoe.MegaMoE(l1, l2, recipe=(1, 1, 128)) with a one-rank buffer of that recipe")
        check_tensor("l1[0]", l1[0], dtype=torch.uint8, ndim=3)
        hidden, inter = 2 * l1[0].shape[2], l1[0].shape[1] // 2
        experts = check_fp4_expert_weights(l1, l2, hidden, inter)
        check_range("num_topk", num_topk, 1, experts)
        check_range("max_tokens", max_tokens, 1, 1 << 20)
        self.l1, self.l2 = l1, l2
        self.hidden, self.num_topk, self.max_tokens = hidden, num_topk, max_tokens
        if crossover is None:
            crossover = default_crossover(hidden, inter, experts, num_topk)
        check_range("crossover", crossover, 0, 1 << 20)
        self.crossover = crossover
        self.mega = MegaMoE(l1, l2)
        self.buf = get_symm_buffer_for_mega_moe(None, experts, max_tokens, num_topk, hidden, inter, device=l1[0].device)
        self.kernel_hidden = self.buf.layout.kernel_hidden

    def path_for(self, tokens: int) -> str:
        """The path ``auto`` takes for a batch of ``tokens``."""
        return "warp_decode" if tokens <= self.crossover else "grouped"

    def warp_weights(self) -> tuple[tuple, tuple]:
        """The (l1, l2) warp decode runs on: the Mega MoE layout (module docstring)."""
        return self.mega.l1, self.mega.l2

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 activation_clamp: float | None = None, out: torch.Tensor | None = None,
                 path: str = "auto") -> torch.Tensor:
        """``y [T, H]`` bfloat16 for ``x`` bfloat16 ``[T, H]``, ``topk_idx`` int64 ``[T, k]`` (-1: unused
        slot), ``topk_weights`` float32 ``[T, k]``; ``out``: optional destination. CUDA-graph capturable
        once each path used has run outside capture."""
        from .inputs import fill_buffer
        from .kernels.decode import moe_decode

        if path not in PATHS:
            fail("path", f"must be one of {PATHS}, got {path!r}")
        check_tensor("x", x, dtype=torch.bfloat16, shape=(None, self.hidden))
        check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(x.shape[0], self.num_topk))
        tokens = x.shape[0]
        chosen = self.path_for(tokens) if path == "auto" else path
        if chosen == "warp_decode":
            if self.kernel_hidden == self.hidden:
                return moe_decode(x, topk_idx, topk_weights, *self.warp_weights(), activation_clamp, out)
            y = moe_decode(pad_columns(x, self.kernel_hidden), topk_idx, topk_weights, *self.warp_weights(),
                           activation_clamp)[:, : self.hidden]  # padded hidden: the real columns
            return y.contiguous() if out is None else out.copy_(y)
        if tokens > self.max_tokens:
            fail("x", f"has {tokens} tokens; this decoder was built for max_tokens = {self.max_tokens}")
        fill_buffer(self.buf, x, topk_idx, topk_weights)
        y = out if out is not None else torch.empty(tokens, self.hidden, dtype=torch.bfloat16, device=x.device)
        return self.mega(y, self.buf, activation_clamp=activation_clamp)
