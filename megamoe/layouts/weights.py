"""Expert weight formats and the transforms kernels want.

Canonical (checkpoint-order) formats, per rank, for E_local experts:

* L1 (gate/up): ``w1 [E_local, 2*I, H]`` with rows ``[0, I)`` = gate_proj and ``[I, 2I)`` = up_proj;
  FP8xFP4 form ``(uint8 [E_local, 2I, H/2], int32 [E_local, 2I, ceil(H/128)])`` (see ``fp4``).
* L2 (down): ``w2 [E_local, H, I]``; FP8xFP4 form ``(uint8 [E_local, H, I/2], int32 [E_local, H, ceil(I/128)])``.
* BF16 variant: plain bfloat16 tensors of the same logical shapes.

H and I are multiples of 32 (the scale block). The SM90 kernels want multiples of ``kernels.sm90.K_MULTIPLE``;
``pad_fp4_expert_weights`` zero-pads canonical weights to such sizes once, at load (exact: module docstring of
``pad_fp4_expert_weights``).

``interleave_gate_up`` reorders L1 rows so that a kernel's N tile holds matching gate and up
columns: with granularity g the rows become gate[0:g], up[0:g], gate[g:2g], up[g:2g], ...
"""

from __future__ import annotations

import torch

from ..checks import check_multiple, check_tensor, fail
from .fp4 import check_finite_scales
from .ue8m0 import (
    BLOCK_K,
    PAD_CODE,
    check_block_multiple,
    pack_ue8m0,
    scale_words,
    unpack_ue8m0,
)


def interleave_gate_up(t: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """``[E, 2I, ...]`` in [gate; up] order -> rows interleaved in runs of ``granularity``."""
    e, two_i = t.shape[:2]
    check_multiple("t.shape[1]", two_i, 2 * granularity, "gate and up halves split into runs")
    runs = t.reshape(e, 2, two_i // (2 * granularity), granularity, *t.shape[2:])
    return runs.transpose(1, 2).reshape(t.shape).contiguous()


def deinterleave_gate_up(t: torch.Tensor, granularity: int = 8) -> torch.Tensor:
    """Inverse of ``interleave_gate_up``."""
    e, two_i = t.shape[:2]
    check_multiple("t.shape[1]", two_i, 2 * granularity, "gate and up halves split into runs")
    runs = t.reshape(e, two_i // (2 * granularity), 2, granularity, *t.shape[2:])
    return runs.transpose(1, 2).reshape(t.shape).contiguous()


def check_fp4_expert_weights(
    l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor], hidden: int, intermediate: int
) -> int:
    """Validate canonical FP8xFP4 L1/L2 weights (shapes, dtypes, no NaN scale code); returns E_local."""
    for name, pair in (("l1", l1), ("l2", l2)):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            fail(name, "must be a (weights, scales) tuple")
    w1, s1 = l1
    w2, s2 = l2
    check_tensor("l1[0]", w1, dtype=torch.uint8, ndim=3, contiguous=True)
    check_block_multiple("hidden (l1[0].shape[2] * 2)", hidden)
    check_block_multiple("intermediate (l1[0].shape[1] / 2)", intermediate)
    e = w1.shape[0]
    check_tensor("l1[0]", w1, shape=(e, 2 * intermediate, hidden // 2))
    check_tensor("l1[1]", s1, dtype=torch.int32, shape=(e, 2 * intermediate, scale_words(hidden)), contiguous=True)
    check_tensor("l2[0]", w2, dtype=torch.uint8, shape=(e, hidden, intermediate // 2), contiguous=True)
    check_tensor("l2[1]", s2, dtype=torch.int32, shape=(e, hidden, scale_words(intermediate)), contiguous=True)
    check_finite_scales(s1, "l1[1]")
    check_finite_scales(s2, "l2[1]")
    return e


def pad_columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t [rows, c]`` with zero columns appended up to ``n`` (``t`` itself when ``c == n``): token rows (FP8 or BF16)
    and their scales at the kernels' padded K, where zeros times the zero-padded weights add exactly zero."""
    if t.shape[1] == n:
        return t
    out = t.new_zeros(t.shape[0], n)
    out[:, : t.shape[1]] = t
    return out


def pad_gate_up_rows(t: torch.Tensor, intermediate_to: int) -> torch.Tensor:
    """L1 rows ``[E, 2I, ...]`` in [gate; up] order (e.g. the L1 bias ``[E, 2I]``) -> ``[E, 2 * intermediate_to, ...]``,
    each half followed by zero rows, as ``pad_fp4_expert_weights`` pads L1: a padded intermediate column has gate =
    up = 0 (and zero weights), so every activation gives it 0 (``silu(0) * 0``; gpt-oss's ``(0 + 1) * 0 * sigmoid(0)``)."""
    inter = t.shape[1] // 2
    if intermediate_to < inter:
        fail("intermediate_to", f"must be at least the rows' intermediate size {inter}, got {intermediate_to}")
    out = t.new_zeros(t.shape[0], 2 * intermediate_to, *t.shape[2:])
    out[:, :inter] = t[:, :inter]
    out[:, intermediate_to : intermediate_to + inter] = t[:, inter:]
    return out


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def pad_fp4_expert_weights(l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor],
                           hidden_to: int, intermediate_to: int):
    """Canonical FP4 experts of sizes (H, I) -> the same experts at (``hidden_to``, ``intermediate_to``), multiples
    of 128 no smaller, in canonical form: ``(l1, l2)`` with L1 ``[E, 2 * intermediate_to, hidden_to / 2]`` (gate rows
    ``[0, I)``, zero rows to ``intermediate_to``, then up rows likewise) and L2 ``[E, hidden_to, intermediate_to /
    2]``. Padded values are E2M1 zeros, so a padded K column adds exactly zero to every dot product (its token
    entries must be finite: callers pad tokens with zeros) and a padded intermediate column is
    ``silu(0) * 0 = 0``; padded L2 rows (outputs past H) are zeros the caller never stores. Their scale codes keep the
    row's range: padded blocks of a real row repeat its last real code (so folding into E4M3, recipe (1, 1, 128),
    sees the same binade span), padded rows hold ``PAD_CODE``. Returns the inputs themselves when nothing is
    padded."""
    w1, _ = l1
    hidden, inter = 2 * w1.shape[2], w1.shape[1] // 2
    check_fp4_expert_weights(l1, l2, hidden, inter)
    for name, to, real in (("hidden_to", hidden_to, hidden), ("intermediate_to", intermediate_to, inter)):
        check_multiple(name, to, 4 * BLOCK_K, "whole packed scale words")
        if to < real:
            fail(name, f"must be at least the weights' size {real}, got {to}")
    if (hidden_to, intermediate_to) == (hidden, inter):
        return l1, l2
    halves = [pad_fp4_weights(tuple(t[:, h * inter : (h + 1) * inter] for t in l1), intermediate_to, hidden_to)
              for h in (0, 1)]  # gate, then up
    l1p = tuple(torch.cat(parts, dim=1) for parts in zip(*halves))
    return l1p, pad_fp4_weights(l2, hidden_to, intermediate_to)


def pad_fp4_weights(pair: tuple[torch.Tensor, torch.Tensor], rows_to: int, k_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP4 weight tensor ``(uint8 [E, N, K/2], int32 [E, N, ceil(K/128)])`` -> ``(uint8 [E, rows_to, k_to/2],
    int32 [E, rows_to, k_to/128])`` (``rows_to >= N``, ``k_to >= K`` a multiple of 128): zero values in the new
    rows and K columns, scale codes as ``pad_fp4_expert_weights`` says (which pads L1's gate and up halves this
    way, each on its own)."""
    w, sf = pair
    check_tensor("pair[0]", w, dtype=torch.uint8, ndim=3)
    check_tensor("pair[1]", sf, dtype=torch.int32, shape=(w.shape[0], w.shape[1], scale_words(2 * w.shape[2])))
    check_multiple("k_to", k_to, 4 * BLOCK_K, "whole packed scale words")
    if rows_to < w.shape[1] or k_to < 2 * w.shape[2]:
        fail("rows_to", f"and k_to must be at least the weights' [N, K] = {[w.shape[1], 2 * w.shape[2]]}, got "
             f"{[rows_to, k_to]}")
    e, n, half_k = w.shape
    blocks = 2 * half_k // BLOCK_K
    wp = w.new_zeros(e, rows_to, k_to // 2)
    wp[:, :n, :half_k] = w
    codes = unpack_ue8m0(sf.contiguous())[..., :blocks]
    cp = codes.new_full((e, rows_to, k_to // BLOCK_K), PAD_CODE)
    cp[:, :n, :blocks] = codes
    cp[:, :n, blocks:] = codes[..., blocks - 1:]
    return wp, pack_ue8m0(cp)


def check_chunk_major_scales(name: str, sf: object, experts: int, n: int, k: int, device=None) -> torch.Tensor:
    """Packed UE8M0 scales of ``[E, N, K]`` weights in a kernel layout: chunk-major ``int32 [E, K/128, N]`` (a
    128-K chunk's words of consecutive rows contiguous; ``prepare_fp4_weights`` / ``transform_weights_for_mega_moe``
    make them). The canonical ``[E, N, K/128]`` gets an error saying so."""
    chunks = k // 128
    if isinstance(sf, torch.Tensor) and tuple(sf.shape) == (experts, n, chunks) and n != chunks:
        fail(name, f"must be the chunk-major scales [E, K/128, N] = {[experts, chunks, n]} that prepare_fp4_weights / "
             f"transform_weights_for_mega_moe make, got the canonical {list(sf.shape)}")
    return check_tensor(name, sf, dtype=torch.int32, shape=(experts, chunks, n), device=device, contiguous=True)


def check_bf16_expert_weights(l1: torch.Tensor, l2: torch.Tensor, hidden: int, intermediate: int) -> int:
    """Validate canonical BF16 L1/L2 weights; returns E_local."""
    check_tensor("l1", l1, dtype=torch.bfloat16, ndim=3, contiguous=True)
    e = l1.shape[0]
    check_tensor("l1", l1, shape=(e, 2 * intermediate, hidden))
    check_tensor("l2", l2, dtype=torch.bfloat16, shape=(e, hidden, intermediate), contiguous=True)
    return e
