"""Random MoE inputs for tests and benchmarks: tokens, routing and quantized expert weights.

Every draw takes an explicit ``torch.Generator`` so that all ranks can rebuild the same global
problem from one seed and each take their slice. Nothing here is ever all zeros.
"""

from __future__ import annotations

import torch

from .checks import check_routing, check_routing_inputs, check_tensor, fail
from .layouts import quantize_fp8
from .layouts.fp8 import describe_recipe, scale_dtype
from .layouts.ue8m0 import BLOCK_K, pad_codes, scale_words
from .symm_buffer import SymmBuffer, collective_call


def random_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    gen: torch.Generator,
    masked_ratio: float = 0.0,
    hot_experts: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64 [T, k], topk_weights float32 [T, k])``: distinct experts per token.

    ``masked_ratio``: probability of a slot being -1. ``hot_experts``: route only to experts
    ``[0, hot_experts)`` (skewed routing; needs ``hot_experts >= num_topk``).
    """
    pool = num_experts if hot_experts is None else hot_experts
    scores = torch.rand(num_tokens, pool, generator=gen)
    idx = scores.topk(num_topk, dim=1).indices
    weights = torch.rand(num_tokens, num_topk, generator=gen) + 0.05
    if masked_ratio > 0:
        idx = torch.where(torch.rand(num_tokens, num_topk, generator=gen) < masked_ratio, -1, idx)
    return idx.to(device), weights.to(device)


def random_tokens(num_tokens: int, hidden: int, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """BF16 ``[T, H]`` tokens with per-token magnitudes spread over two decades."""
    x = torch.randn(num_tokens, hidden, generator=gen) * torch.logspace(-1, 1, num_tokens).unsqueeze(1)
    return x.to(torch.bfloat16).to(device)


def random_fp4_weights(
    num_experts: int, n: int, k: int, gen: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical FP4 weights ``(uint8 [E, n, k/2], int32 [E, n, ceil(k/128)])`` drawn directly as codes (k a multiple
    of 32; a partial last scale word holds ``layouts.ue8m0`` padding codes).

    Every E2M1 code is equally likely; scales are 2**-7 .. 2**-5 (typical of ``1/sqrt(k)`` layers).
    Drawn on ``device`` in one shot (fast for GB-sized weight sets); ``gen`` must live there too.
    """
    packed = torch.randint(0, 256, (num_experts, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
    codes = torch.randint(120, 123, (num_experts, n, k // BLOCK_K), generator=gen, device=device, dtype=torch.uint8)
    return packed, pad_codes(codes).view(torch.int32)


def random_bf16_weights(num_experts: int, n: int, k: int, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """BF16 ``[E, n, k]`` weights with standard deviation ``1/sqrt(k)``."""
    w = torch.randn(num_experts, n, k, generator=gen, device=device) * k**-0.5
    return w.to(torch.bfloat16)


def fill_buffer(
    buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
    x_sf: torch.Tensor | None = None, validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize tokens ``x [T, H]`` as the buffer's recipe wants and copy inputs into its views.

    FP8 x FP4 buffers: ``x`` in BF16 (or FP16 / FP32) is quantized here (``layouts.quantize_fp8`` with the buffer's
    recipe: per-32 UE8M0 scales for (1, 1, 32), per-128 FP32 scales for (1, 1, 128)); or ``x`` already FP8 E4M3
    with its scales ``x_sf`` in the recipe's format (int32 packed UE8M0 ``[T, ceil(H/128)]``, or float32 ``[T,
    ceil(H/128)]``:
    any positive FP32 scales, e.g. powers of two), copied as they are. BF16 buffers take BF16 ``x``.
    ``topk_idx`` int64 / int32 and ``topk_weights`` float32 / bfloat16 / float16, each exactly ``[T, k]``; every
    tensor on the buffer's device (nothing is broadcast or copied across devices).
    ``validate``: check the ids (``checks.check_routing``: in [-1, E), no expert twice in a token; on a GPU it reads
    two counts, a host sync); None: unless the current CUDA stream is capturing a graph (then the Mega MoE kernel's
    error word, ``megamoe.check_errors``, reports them). Part of the collective call that follows: an error here
    marks the buffer out of step on this rank (``SymmBuffer.collective``), since skipping that call would pair this
    rank's next call with the peers' current one.
    Returns what was written: ``(x_q, x_sf)`` (FP8 and scales, or BF16 and None).
    """
    if validate is None:
        validate = not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    with collective_call(buffer, "fill_buffer", "buffer"):
        lay = buffer.layout
        check_tensor("x", x, ndim=2, device=buffer.device)
        t = x.shape[0]
        buffer.check_num_tokens(t, "x")
        check_tensor("x", x, shape=(t, lay.hidden))
        check_routing_inputs(topk_idx, topk_weights, t, lay.num_topk, buffer.device)
        if validate:
            check_routing(topk_idx, lay.num_experts, buffer.rank)
        if lay.mma_type == "fp8xfp4":
            if x.dtype == torch.float8_e4m3fn:
                if x_sf is None:
                    fail("x_sf", "is required with FP8 tokens: their scales in the buffer's recipe "
                         f"{describe_recipe(lay.recipe)}")
                check_tensor("x_sf", x_sf, dtype=scale_dtype(lay.recipe), shape=(t, scale_words(lay.hidden)),
                             device=buffer.device)
                x_q = x
            else:
                if x_sf is not None:
                    fail("x_sf", "must be None when x is not FP8 (fill_buffer quantizes x itself)")
                x_q, x_sf = quantize_fp8(x, recipe=lay.recipe)
            buffer.x_sf[:t] = x_sf
        else:
            if x_sf is not None:
                fail("x_sf", "must be None for a BF16 buffer (mma_type='bf16')")
            x_q, x_sf = x, None
        buffer.x[:t] = x_q
        buffer.topk_idx[:t] = topk_idx
        buffer.topk_weights[:t] = topk_weights
    return x_q, x_sf


def global_problem(
    seed: int,
    tokens_per_rank: list[int],
    num_experts: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
    mma_type: str = "fp8xfp4",
    masked_ratio: float = 0.0,
    hot_experts: int | None = None,
) -> dict:
    """Every rank's tokens and routing plus all experts' weights, identical on every caller.

    Returns ``{"x": [BF16 [T_r, H] per rank], "topk_idx": [...], "topk_weights": [...],
    "l1": all-expert L1 weights, "l2": ...}`` on the CPU (FP4 tuples or BF16 tensors by ``mma_type``).
    """
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for t in tokens_per_rank:
        xs.append(random_tokens(t, hidden, gen))
        idx, w = random_routing(t, num_experts, num_topk, gen, masked_ratio, hot_experts)
        idxs.append(idx)
        ws.append(w)
    if mma_type == "fp8xfp4":
        l1 = random_fp4_weights(num_experts, 2 * intermediate, hidden, gen)
        l2 = random_fp4_weights(num_experts, hidden, intermediate, gen)
    else:
        l1 = random_bf16_weights(num_experts, 2 * intermediate, hidden, gen)
        l2 = random_bf16_weights(num_experts, hidden, intermediate, gen)
    return {"x": xs, "topk_idx": idxs, "topk_weights": ws, "l1": l1, "l2": l2}


def local_experts(weights, rank: int, num_ranks: int, device: torch.device | str):
    """Rank ``rank``'s contiguous slice of all-expert weights (FP4 tuple or BF16 tensor), on ``device``."""
    if isinstance(weights, tuple):
        return tuple(local_experts(w, rank, num_ranks, device) for w in weights)
    per = weights.shape[0] // num_ranks
    return weights[rank * per : (rank + 1) * per].contiguous().to(device)
