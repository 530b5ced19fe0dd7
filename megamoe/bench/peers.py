"""Peers for ``megamoe.bench``: what a Hopper user would run instead of megamoe, measured in the same run.

``humming`` (``--peers humming``): vLLM's MXFP4 MoE path through Humming (``humming-kernels``, the ``bench`` extra,
pinned to ``HUMMING_VERSION``), built and called the way vLLM's ``HummingMoEMethod`` and ``HummingIndexedExperts``
(its default ``indexed`` GEMM type) build and call it. megamoe's FP4 weights with their UE8M0 scales per 32 are MXFP4
byte for byte (E2M1 pairs, even element in the low nibble; one E8M0 byte per 32 weights), so both sides read the
same weights: they go through Humming's ``mxfp4`` weight schema, ``HummingMethod.prepare_layer_meta`` (N padded to a
multiple of 256, K of 128, BF16 outputs) and ``transform_humming_layer``. Two variants, one path each:

* ``humming-bf16``: BF16 activations (W4A16; ``HummingInputSchema()``);
* ``humming-fp8``: FP8 E4M3 activations with one FP32 scale per 128 elements, computed per call from the BF16
  tokens (``HummingInputSchema(a_dtype=float8e4m3, input_scale_group_size=128)``, Humming's dynamic group mode).

One call (``HummingMoE.__call__``) is vLLM's ``main_apply``: ``may_quant_input`` (FP8 only), the W13 GEMM
(``forward_layer``, indexed, ``top_k`` rows per token), the SwiGLU ``silu(gate) * up`` into BF16, ``may_quant_input``
(FP8 only), the W2 GEMM, and the top-k sum weighted by the routing weights. Where it differs from vLLM, and why:

* routing preparation (vLLM's ``moe_align_block_size`` CUDA op: the (token, slot) rows sorted by expert, each
  expert padded to the GEMM's row block) runs once per routing outside the timed call (``align_block_size``, torch);
  the receipt says so;
* the SwiGLU is Humming's own fused ``process_input`` kernel (binary-split activation, FP32 math, BF16 out), one
  launch as vLLM's ``silu_and_mul``;
* the weighted top-k sum is one Triton kernel (``megamoe.bench.topk_sum``), one launch as vLLM's
  ``moe_fused_mul_sum``;
* one row block for both GEMMs. The indexed routing (rows padded per expert to a block, one expert id per block)
  serves both GEMMs, and each launch reads it with its own config's ``block_m`` (``m_blocks =
  ceil(num_tokens_padded / block_m)`` entries of ``expert_ids``). vLLM's ``HummingIndexedExperts`` aligns with
  w13's block and launches w2 with w2's own tuning table, and humming-kernels 0.1.20 tunes the two sublayers
  independently: where w2's tuned block is smaller than w13's, vLLM's call would read ``expert_ids`` /
  ``sorted_ids`` out of bounds here; where larger, one block would span two experts' rows. At such a point the
  peer aligns with w13's block as vLLM does and launches w2 with a config from w2's own tuning table that has
  that block: the one tuned for the ``shape_m`` nearest the point (``_HummingLayer.row_block_plan``): a config
  Humming itself picks for this layer, where a block edited into the tuned config would need every field that
  depends on it (warp M, stages, CTAs per SM, Stream-K, grid) refitted by hand. Only where w2's table has no
  config with w13's block is w13 run on w2's block instead (from w13's table, the same way);
  where neither table has the other's block, the point is refused before any launch (``PeerRefused``). The
  receipt records every such point under ``row_blocks_forced`` (the peer's config) and in the point's row: the
  sublayer, its tuned block and config, the launched block and config and the ``shape_m`` interval it was tuned
  for, and the fields that differ.

Numerics: Humming applies the routing weight after the W2 GEMM, where megamoe's contract (``megamoe.numerics``)
applies it inside the SwiGLU before R2, and rounds the SwiGLU output to BF16 before quantizing it. So a peer is
checked against ``peer_reference``, an FP64 reference of its own rounding points (the structure of megamoe's:
R1 gate/up to BF16, R2 the SwiGLU output to BF16 and, for FP8 activations, per 128 to E4M3 with an FP32 scale as
Humming computes it (``humming_fp8_values``), R3 each slot's W2 output to BF16, R4 ``bf16(sum_j w_j * o_j)``), with
megamoe's tolerance rules (``peer_tolerances``: ``moe_tolerances`` of recipe (1, 1, 32) for BF16 activations, as
megamoe's BF16 path uses, of recipe (1, 1, 128) for the per-128 FP8 ones). R1 and R3 are not always one rounding:
where a GEMM's tuning config uses Stream-K, Humming splits some output tiles along K and sums the slices' BF16
partials in BF16 in the output (``streamk_split`` reproduces its schedule, ``streamk_product`` those rounding points;
beyond ``STREAM_K_ORDERED_SLICES`` slices the adds are atomics in the hardware's order, which ``peer_reference``
takes as slice order and the GEMM check bounds).

``HummingGemm`` is one of those GEMMs alone (``megamoe.bench gemm``): rows already grouped by expert (the contiguous
layout megamoe's grouped GEMM reads), ``top_k = 1``, tokens quantized before the timed call as megamoe's are; its
reference (``HummingGemm.reference``) is ``streamk_product`` of the values it reads, checked with the interval the
unordered atomic adds allow (``excess_rel_fro``).

Refusals: a point whose two sublayers' tuning tables share no row block for it (above) is refused before any
launch (``PeerRefused``, naming both blocks; ``bench/findings/humming-peer.md`` lists the points concerned).

Nothing in the megamoe library imports this module; ``humming`` is imported only when a peer is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math

import torch

from ..layouts import FP8_MAX, dequantize_fp4, dequantize_fp8, unpack_ue8m0
from ..numerics import (
    RECIPE_32,
    RECIPE_128,
    bf16_rne,
    check_activation_clamp,
    clamp_gate_up,
    moe_tolerances,
    swiglu_weighted,
)
from .common import package_version

PEERS = ("humming",)
HUMMING_VERSION = "0.1.20"
"""The humming-kernels release these peers are written against and measured with (the ``bench`` extra pins it)."""
ACTIVATIONS = ("bf16", "fp8")
FP8_GROUP = 128
"""Elements per FP32 activation scale of the FP8 variant."""
WEIGHT_GROUP = 32
"""Weights per E8M0 scale (MXFP4): with ``FP8_GROUP``, the K groups Humming's Stream-K split keeps whole."""
STREAM_K_MAX_SLICES = 10
"""Humming's cap on the K slices of one output tile (``kMaxSlices`` in its ``scheduler.cuh``)."""
STREAM_K_ORDERED_SLICES = 3
"""Up to this many K slices per tile, Humming adds them into the output in slice order under a lock; beyond it,
with BF16 atomics in whatever order the slices arrive (``epilogue/gmem_writer.cuh``, SM90)."""
STREAM_K_ENUMERATED_ORDERS = 120
"""Up to this many atomic add orders (``(S - 1)!`` for S slices) the reference computes each one's result; past it,
a bound (``streamk_product``)."""
BF16_UNIT_ROUNDOFF = 2.0**-8
"""Round to nearest in BF16 (8 significant bits): ``|bf16(x) - x| <= 2**-8 |x|``."""
ROUTING_PREP = ("outside the timed call: once per routing, the (token, slot) rows sorted by expert and padded to the "
                "GEMM's row block (vLLM's moe_align_block_size, here in torch); buffers allocated then too")


class PeerRefused(RuntimeError):
    """A point the peer cannot run the way vLLM runs it, refused before any launch (the bench reports it, with this
    reason, as a refused point: never a silent skip, never a launch that reads out of bounds)."""


def parse_peers(text: str) -> list[str]:
    """``--peers`` value: comma-separated peer names from ``PEERS`` (ValueError naming the unknown ones)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise ValueError(f"--peers takes a comma-separated list of {', '.join(PEERS)}, got {text!r}")
    return names


def peer_paths(peers: list[str]) -> list[str]:
    """The bench path names of ``peers``: one per activation variant (``humming-bf16``, ``humming-fp8``)."""
    return [f"{peer}-{act}" for peer in peers for act in ACTIVATIONS]


def make_moe_peer(path: str, l1, l2, activation_clamp: float | None = None) -> HummingMoE:
    """The MoE peer named by a ``peer_paths`` name (e.g. ``humming-fp8``) on canonical FP4 weights ``l1``/``l2``."""
    peer, activations = path.rsplit("-", 1)
    if peer != "humming":
        raise ValueError(f"no MoE peer named {path!r} (peers: {', '.join(PEERS)})")
    return HummingMoE(l1, l2, activations, activation_clamp)


def require_humming():
    """Import ``humming`` or stop with a clear message (a peer asked for is never skipped silently); warns on stdout
    when the installed release is not the pinned one (the receipt records the installed one)."""
    try:
        humming = importlib.import_module("humming")
    except ImportError as ex:
        raise SystemExit(
            f"megamoe.bench: --peers humming needs humming-kernels=={HUMMING_VERSION} "
            f"(pip install -e '.[bench]'); importing it failed: {type(ex).__name__}: {ex}"
        ) from ex
    installed = humming_version()
    if installed != HUMMING_VERSION:
        print(f"megamoe.bench: humming-kernels {installed} installed, these peers are written for {HUMMING_VERSION}")
    return humming


def humming_version() -> str:
    """The installed humming-kernels release (its metadata, else the module's ``__version__``)."""
    version = package_version("humming-kernels")
    if version == "not installed":
        humming = importlib.import_module("humming")
        version = getattr(humming, "__version__", "unknown")
    return version


def check_peer_setup(peers: list[str], device: torch.device, num_ranks: int, mxfp4_weights: bool) -> None:
    """Stop with a clear message when the peers asked for cannot run here: they need one CUDA GPU, one rank (EP1)
    and MXFP4 weights (``--mma-type fp8xfp4``: megamoe's FP4 weights); then import them."""
    if num_ranks != 1:
        raise SystemExit(f"megamoe.bench: --peers runs on one rank (EP1), this run has {num_ranks}")
    if device.type != "cuda":
        raise SystemExit("megamoe.bench: --peers needs a CUDA GPU (Humming's kernels are CUDA only)")
    if not mxfp4_weights:
        raise SystemExit("megamoe.bench: --peers compares MXFP4 weights: use --mma-type fp8xfp4 (the default)")
    for peer in peers:
        if peer == "humming":
            require_humming()


def peer_tolerances(intermediate: int, activations: str) -> dict[str, float]:
    """megamoe's tolerance rules for a peer: recipe (1, 1, 32)'s for BF16 activations (as megamoe's BF16 path),
    recipe (1, 1, 128)'s for FP8 activations with per-128 FP32 scales."""
    return moe_tolerances(intermediate, RECIPE_128 if _check_activations(activations) == "fp8" else RECIPE_32)


def _check_activations(activations: str) -> str:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return activations


def _as_peer_input(v: torch.Tensor, activations: str) -> torch.Tensor:
    """float64 values a peer's GEMM reads from ``v``: ``v`` itself (BF16), or ``humming_fp8_values(v)``."""
    if activations == "bf16":
        return v.double()
    return humming_fp8_values(v)


def humming_fp8_values(v: torch.Tensor) -> torch.Tensor:
    """float64 values Humming's FP8 GEMMs read for rows ``v [..., K]`` (K a multiple of 128): its dynamic per-128
    quantization (``process_input``, compiled without fast math, FP32 IEEE round-to-nearest throughout):
    ``scale = max(amax / 448, 1e-30)``, ``q = sat_e4m3(RNE_e4m3(v * (1 / scale)))`` (a reciprocal, then a multiply;
    megamoe's recipe 128 multiplies by ``448 / amax`` instead, which can differ by one FP32 ulp and so flip an E4M3
    rounding), ``q * scale`` exact in float64."""
    if v.shape[-1] % FP8_GROUP:
        raise ValueError(f"humming FP8 activations: K={v.shape[-1]} must be a multiple of {FP8_GROUP}")
    blocks = v.float().reshape(*v.shape[:-1], v.shape[-1] // FP8_GROUP, FP8_GROUP)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: IEEE divisions (a Python scalar divisor would become a reciprocal multiply)
    scale = torch.div(amax, torch.full_like(amax, FP8_MAX)).clamp(min=1e-30)
    q = (blocks * torch.div(torch.ones_like(scale), scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.double() * scale.double()).reshape(v.shape)


@dataclasses.dataclass(frozen=True)
class StreamKSplit:
    """Which output tiles of one Humming GEMM launch are split along K (Stream-K), and how.

    ``block`` is the config's ``(block_m, block_n, block_k)``; ``tiles`` maps an output tile ``(m_block, n_block)``
    (rows ``[m_block * block_m, ...)`` of the routing, columns ``[n_block * block_n, ...)``) to its K slices as element
    ranges ``(k_begin, k_end)`` in the order they reach the output: the first is stored, each later one is added to it
    in BF16 (module ``streamk_split``). Tiles absent from ``tiles`` are computed whole (one slice)."""

    block: tuple[int, int, int]
    tiles: dict[tuple[int, int], tuple[tuple[int, int], ...]]

    def max_slices(self) -> int:
        return max((len(s) for s in self.tiles.values()), default=1)


def streamk_split(config: dict, shape_n: int, shape_k: int, rows_padded: int, num_sms: int,
                  input_group: int) -> StreamKSplit:
    """Humming 0.1.20's Stream-K schedule (``Scheduler`` in ``include/humming/scheduler.cuh``, SM90 WGMMA, no CTA
    clusters, as its indexed MoE GEMMs run) for one launch: tuning ``config`` (``block_shape``, ``num_stages``,
    ``num_ctas_per_sm``, ``use_stream_k``), the padded problem ``shape_n x shape_k``, ``rows_padded`` routing rows
    (``num_tokens_padded``), ``num_sms`` SMs (the grid is ``num_ctas_per_sm * num_sms`` CTAs), ``input_group``
    activations per input scale (0: none). Written from that source:

    * ``m_blocks = ceil(rows_padded / block_m)``, ``n_blocks = N / block_n``, ``K_BLOCKS = K / block_k``; the K space is
      padded to a multiple of the scale-group alignment ``max(1, max(input_group, 32) // block_k)`` blocks;
    * with ``G`` CTAs and ``T = m_blocks * n_blocks`` tiles, the last ``T mod G`` tiles (plus a whole wave when they are
      at most a tenth of G) are shared out along K: each CTA takes ``ceil(tiles * K_BLOCKS / G)`` consecutive
      (tile, k-block) iterations, at least ``ceil((K_BLOCKS - 1) / 9)``, rounded up to a multiple of
      ``num_stages * alignment / gcd(alignment, num_stages)``; the others are computed whole, one per CTA and wave;
    * a tile's pieces are its K slices; the slice holding the tile's last K block writes first (``slice_id`` 0, the
      kernel counts them from the end), then the others in decreasing K order (under a lock for at most
      ``STREAM_K_ORDERED_SLICES`` slices; beyond that every later slice adds with BF16 atomics, order unknown).

    The slice count each CTA derives on its own (the kernel's formula) is checked against the pieces found here;
    a ``RuntimeError`` names the tile where they differ (a model that no longer matches the kernel)."""
    block_m, block_n, block_k = (int(v) for v in config["block_shape"])
    if not config.get("use_stream_k", False):
        return StreamKSplit((block_m, block_n, block_k), {})
    if shape_n % block_n or shape_k % block_k:
        raise ValueError(f"humming Stream-K model: N={shape_n}, K={shape_k} not multiples of block {config['block_shape']}")
    stages, grid = int(config["num_stages"]), int(config.get("num_ctas_per_sm", 1)) * num_sms
    k_blocks = shape_k // block_k
    align = max(1, max(input_group, WEIGHT_GROUP) // block_k)
    k_space = -(-k_blocks // align) * align
    tiles_mn = -(-rows_padded // block_m) * (shape_n // block_n)
    shared_tiles = tiles_mn
    if tiles_mn > grid:
        shared_tiles = tiles_mn % grid
        if shared_tiles and shared_tiles * 10 <= grid:
            shared_tiles += grid
    waves = (tiles_mn - shared_tiles) // grid
    per_cta = max(-(-shared_tiles * k_space // grid), -(-(k_space - 1) // (STREAM_K_MAX_SLICES - 1)))
    step = align // math.gcd(align, stages) * stages
    per_cta = -(-per_cta // step) * step
    end = tiles_mn * k_space
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # tile -> (first k block, k blocks, kernel's slice count)
    for cta in range(grid):
        at = grid * waves * k_space + per_cta * cta
        left = min(end - at, per_cta) if at < end else 0
        while left:
            tile, k0 = divmod(at, k_space)
            taken = min(k_space - k0, left)
            if k0 == 0:
                count = -(-(k_space - taken) // per_cta) + 1
            else:
                first = k0 - k0 // per_cta * per_cta
                count = -(-(k_space - first) // per_cta) + (1 if first else 0)
            pieces.setdefault(tile, []).append((k0, min(k_blocks - k0, taken), count))
            left -= taken
            at += taken
    tiles = {}
    n_blocks = shape_n // block_n
    for tile, got in pieces.items():
        if any(count != len(got) for _, _, count in got):
            raise RuntimeError(f"humming Stream-K model: tile {tile} has {len(got)} slices, the kernel counts "
                               f"{sorted({c for _, _, c in got})}")
        if len(got) > 1:
            ranges = sorted(((k0 * block_k, (k0 + n) * block_k) for k0, n, _ in got), reverse=True)
            tiles[divmod(tile, n_blocks)] = tuple(ranges)
    return StreamKSplit((block_m, block_n, block_k), tiles)


def streamk_product(a: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, split: StreamKSplit | None,
                    interval: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP64 reference of one Humming GEMM's rows with its Stream-K rounding points, and the interval its unordered
    reductions allow.

    ``a`` float64 ``[R, K]``: the values the GEMM reads for R of its rows; ``w`` float64 ``[N, K]``: the rows' expert's
    weights; ``positions`` int64 ``[R]``: each row's index in the routing (its ``sorted_ids`` slot: tile row block
    ``position // block_m``). Returns ``(ref, low, high)``: ``ref`` BF16, ``low <= ref <= high`` float64, ``[R, N]``:

    * a tile computed whole: ``ref = bf16(a . w)`` (FP32 accumulation inside a slice, one rounding: the FP32-vs-FP64
      difference flips a rounding rarely, as for any GEMM), ``low = high = ref``;
    * a tile split in K slices ``s_0, s_1, ...`` (``StreamKSplit`` order): each slice's FP32 partial is rounded to
      BF16 (``p_i``), ``s_0`` is stored and each later one added in BF16: ``ref = bf16(...bf16(p_0 + p_1) + ...)``,
      exact where the kernel adds in slice order (at most ``STREAM_K_ORDERED_SLICES`` slices; ``low = high = ref``);
    * beyond that the S - 1 later slices are BF16 atomic adds in an order the hardware picks per element pair: ``ref``
      keeps slice order and ``[low, high]`` spans every order's result, each computed (``(S - 1)!`` orders) up to
      ``STREAM_K_ENUMERATED_ORDERS``; past that, the bound: any order's result and ``ref`` are sums of the same
      ``p_i`` with S - 1 roundings, each of at most ``u = 2**-8`` times its running sum, every running sum at most
      ``A = sum |p_i|`` (times ``(1 + u)**S`` for the roundings before it), so ``|y - ref| <= 2 (S - 1) u (1 + u)**S A``.

    ``interval=False``: ``low = high = ref`` everywhere (the caller uses ``ref`` alone).
    """
    out = bf16_rne(a @ w.T)
    low, high = out.double(), out.double()
    if split is None or not split.tiles:
        return out, low, high
    block_m, block_n, _ = split.block
    row_blocks = positions.to(a.device) // block_m
    wanted = set(row_blocks.unique().tolist())
    for (m_block, n_block), ranges in split.tiles.items():
        if m_block not in wanted:
            continue
        rows = torch.nonzero(row_blocks == m_block).squeeze(1)
        cols = slice(n_block * block_n, (n_block + 1) * block_n)
        parts = [bf16_rne(a[rows, k0:k1] @ w[cols, k0:k1].T).double() for k0, k1 in ranges]
        ref = _add_in_bf16(parts[0], parts[1:])
        out[rows, cols] = ref.to(torch.bfloat16)
        lo = hi = ref
        if interval and len(parts) > STREAM_K_ORDERED_SLICES:
            if math.factorial(len(parts) - 1) <= STREAM_K_ENUMERATED_ORDERS:
                ends = torch.stack([_add_in_bf16(parts[0], order) for order in itertools.permutations(parts[1:])])
                lo, hi = ends.amin(dim=0), ends.amax(dim=0)
            else:
                s = len(parts)
                bound = 2 * (s - 1) * BF16_UNIT_ROUNDOFF * (1 + BF16_UNIT_ROUNDOFF) ** s
                slack = bound * torch.stack(parts).abs().sum(dim=0)
                lo, hi = ref - slack, ref + slack
        low[rows, cols], high[rows, cols] = lo, hi
    return out, low, high


def _add_in_bf16(first: torch.Tensor, later) -> torch.Tensor:
    """``first`` (BF16 values, float64) with each of ``later`` added in turn, each sum rounded to BF16."""
    acc = first
    for part in later:
        acc = bf16_rne(acc + part).double()
    return acc


def excess_rel_fro(y: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> float:
    """``||d||_F / ||ref||_F`` in float64 with ``d`` each element's distance outside ``[low, high]``
    (``streamk_product``); inf where ``y`` holds NaN or Inf. Where ``low = high = ref`` it is
    ``numerics.rel_fro_error(y, ref)``."""
    y = y.double()
    if not torch.isfinite(y).all():
        return float("inf")
    excess = torch.maximum(low - y, y - high).clamp(min=0).norm()
    den = ref.double().norm()
    return float(excess / den) if den > 0 else float(excess)


def peer_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1, l2, activations: str,
                   activation_clamp: float | None = None, routing: HummingRouting | None = None) -> torch.Tensor:
    """FP64 reference of a peer that applies routing weights after the second GEMM (module docstring).

    ``x`` BF16 ``[T, H]``; ``topk_idx`` ``[T, k]`` (-1 = unused slot), ``topk_weights`` float32 ``[T, k]``; ``l1`` /
    ``l2``: canonical FP4 ``(uint8 [E, 2I, H/2], int32 [E, 2I, H/128])`` / ``(.. [E, H, I/2], .. [E, H, I/128])``.
    ``activations``: ``"bf16"`` or ``"fp8"`` (tokens and SwiGLU output quantized as ``humming_fp8_values``). The
    clamp applies to the BF16 gate/up in FP32 (gate <= c, |up| <= c). ``routing``: the prepared routing of these
    tokens (``HummingMoE.prepare``); with it, R1 and R3 are the GEMMs' Stream-K rounding points (``streamk_product``,
    its slice order where the kernel's order is the hardware's); without it, one rounding each. Returns BF16 ``[T, H]``.
    """
    _check_activations(activations)
    clamp = check_activation_clamp(activation_clamp)
    t, k = topk_idx.shape
    hidden, inter = x.shape[1], l2[0].shape[-1] * 2
    o = torch.zeros(t, k, hidden, dtype=torch.float64, device=x.device)
    xd = _as_peer_input(x, activations)
    splits = routing.splits if routing is not None else {}
    positions = routing.positions(t * k) if routing is not None else None
    for e in range(l1[0].shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        at = positions[tok * k + slot] if positions is not None else tok
        acc, _, _ = streamk_product(xd[tok], dequantize_fp4(l1[0][e], l1[1][e]).double(), at, splits.get("w13"),
                                    interval=False)
        gate, up = clamp_gate_up(acc[:, :inter].float(), acc[:, inter:].float(), clamp)  # R1
        a = bf16_rne(swiglu_weighted(gate, up, torch.ones(tok.numel(), device=x.device)))  # R2: BF16, FP8 below
        down, _, _ = streamk_product(_as_peer_input(a, activations), dequantize_fp4(l2[0][e], l2[1][e]).double(), at,
                                     splits.get("w2"), interval=False)
        o[tok, slot] = down.double()  # R3
    weights = torch.where(topk_idx >= 0, topk_weights.double(), 0.0)
    return bf16_rne((o * weights.unsqueeze(-1)).sum(dim=1))  # R4 after the weighted sum (FP64 here)


def align_block_size(topk_idx: torch.Tensor, block: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Humming's indexed-GEMM routing (vLLM's ``moe_align_block_size``): the flat (token, slot) ids ``t * k + j``
    grouped by expert in increasing id order, each expert's group padded with the id ``T * k`` to a multiple of
    ``block``; unused slots (-1) are left out. Returns ``(sorted_ids int32 [P], expert_ids int32 [P / block],
    num_tokens_padded int32 [1])`` with P the padded total, on ``topk_idx``'s device."""
    flat = topk_idx.reshape(-1).long()
    n = flat.numel()
    valid = flat >= 0
    ids = torch.nonzero(valid).squeeze(1)  # already in increasing id order
    experts = flat[ids]
    order = torch.argsort(experts, stable=True)
    ids, experts = ids[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + block - 1) // block * block
    starts = torch.cumsum(padded, 0) - padded
    firsts = torch.cumsum(counts, 0) - counts
    total = int(padded.sum())
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[experts] + torch.arange(ids.numel(), device=flat.device) - firsts[experts]] = ids.int()
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block).int()
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=flat.device)


def block_m(config: dict) -> int:
    """The row block (``block_shape[0]``) of a Humming tuning config."""
    return int(config["block_shape"][0])


def nearest_config_with_block(table: list, block: int, valid_shape_m: int) -> tuple[int, int, dict] | None:
    """Of a Humming tuning table (``[low, high, config]`` intervals ``(low, high]`` of ``shape_m``), the interval whose
    config has row block ``block`` and lies nearest ``valid_shape_m`` (distance 0 inside it, else to its nearer
    end; the first of equals), as ``(low, high, config)``; None where no config has that block."""
    def distance(low: int, high: int) -> int:
        return low + 1 - valid_shape_m if valid_shape_m <= low else max(0, valid_shape_m - high)

    found = [(distance(low, high), n) for n, (low, high, config) in enumerate(table) if block_m(config) == block]
    if not found:
        return None
    low, high, config = table[min(found)[1]]
    return int(low), int(high), config


@dataclasses.dataclass(frozen=True)
class RowBlockPlan:
    """What the launches on one indexed routing run at one ``valid_shape_m`` (``_HummingLayer.row_block_plan``):
    the routing's row block ``block``, each sublayer's launched tuning config (``configs``, all with that block)
    and, for each sublayer whose launched config is not its tuned one, the receipt's record of why and from what
    (``forced``; empty where the call is vLLM's)."""

    block: int
    configs: dict[str, dict]
    forced: dict[str, dict]


def humming_input_config(activations: str) -> dict:
    """Humming's input schema arguments for a variant: none (BF16 activations), or FP8 E4M3 with one FP32 scale per
    ``FP8_GROUP`` elements, quantized per call (its dynamic group mode)."""
    return {} if _check_activations(activations) == "bf16" else {"a_dtype": "float8e4m3",
                                                                "input_scale_group_size": FP8_GROUP}


def load_humming_sublayer(module: torch.nn.Module, name: str, packed: torch.Tensor, sf: torch.Tensor, gated: bool,
                          activations: str) -> None:
    """Sublayer ``name`` of ``module`` from canonical MXFP4 weights ``packed`` uint8 ``[E, N, K/2]`` and ``sf`` int32
    ``[E, N, K/128]`` (``gated``: rows ``[0, N/2)`` gate, ``[N/2, N)`` up), prepared as vLLM's ``HummingMoEMethod``
    prepares it up to its layer meta: Humming's tensors as parameters ``<name>_<tensor>`` and
    ``module.humming_metas[name]`` (``mxfp4`` weight schema, the variant's input schema, N padded to a multiple of
    256, K of 128, BF16 outputs). Runs no kernel: ``HummingMethod.transform_humming_layer`` follows on the GPU."""
    from humming.layer import HummingMethod
    from humming.schema import HummingInputSchema
    from humming.schema.mxfp4 import Mxfp4WeightSchema

    num_experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    tensors = {"weight": packed.contiguous(), "weight_scale": unpack_ue8m0(sf)}
    stacks = [n // 2] * 2 if gated else [n]
    weight_schema, tensors = Mxfp4WeightSchema().convert_humming(
        tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
        num_experts=num_experts)
    input_schema, _ = HummingInputSchema(**humming_input_config(activations)).convert_humming(
        tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
        num_experts=num_experts)
    for key, tensor in tensors.items():
        setattr(module, f"{name}_{key}", torch.nn.Parameter(tensor, requires_grad=False))
    HummingMethod.prepare_layer_meta(
        layer=module, shape_n=n, shape_k=k, weight_schema=weight_schema, input_schema=input_schema,
        num_experts=num_experts, pad_n_to_multiple=256, pad_k_to_multiple=128, has_bias=False,
        torch_dtype=torch.bfloat16, sublayer_name=name)


class _HummingLayer:
    """A module holding MXFP4 expert weights as Humming sublayers (``<name>_weight``, ``<name>_weight_scale``),
    prepared as vLLM's ``HummingMoEMethod.process_weights_after_loading`` prepares them."""

    def __init__(self, sublayers: dict, activations: str):
        self.humming = require_humming()
        from humming.config import GemmType
        from humming.layer import HummingMethod

        self.method = HummingMethod
        self.activations = _check_activations(activations)
        self.input_config = humming_input_config(activations)
        self.module = module = torch.nn.Module()
        device = None
        for name, (packed, sf, gated) in sublayers.items():
            device = packed.device
            load_humming_sublayer(module, name, packed, sf, gated, activations)
            HummingMethod.transform_humming_layer(module, sublayer_name=name)
        module.register_buffer("locks", torch.zeros(1024, dtype=torch.int32, device=device))
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.compute = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": GemmType.INDEXED.value}
        self.compute_str = json.dumps(self.compute)
        self.tuning = {
            name: HummingMethod.get_default_tuning_configs(
                layer=module, use_f16_accum=False, use_batch_invariant=False, gemm_type=GemmType.INDEXED,
                sublayer_name=name)
            for name in sublayers
        }
        self.tuning_str = {name: json.dumps(configs) for name, configs in self.tuning.items()}

    def config_at(self, name: str, valid_shape_m: int) -> dict:
        """The tuning config of the interval ``(low, high]`` holding ``valid_shape_m``: the one the launch runs."""
        for low, high, config in self.tuning[name]:
            if low < valid_shape_m <= high:
                return config
        raise RuntimeError(f"humming: no tuning interval of {name} holds shape_m={valid_shape_m}: {self.tuning[name]}")

    def split(self, name: str, config: dict, rows_padded: int) -> StreamKSplit:
        """The Stream-K split of sublayer ``name``'s launch with tuning ``config`` over ``rows_padded`` routing rows
        (``streamk_split`` with the layer's padded N and K and, as the launcher, the config's ``num_sms`` where it
        has one, else the device's SM count ``self.sms``)."""
        meta = self.module.humming_metas[name]
        sms = int(config.get("num_sms") or self.sms)
        return streamk_split(config, meta.shape_n, meta.shape_k, rows_padded, sms, meta.input_scale_group_size)

    def row_block_plan(self, valid_shape_m: int) -> RowBlockPlan:
        """The row block of the indexed routing at ``valid_shape_m`` and the config each sublayer's launch runs on
        it (module docstring, "one row block for both GEMMs"). Where the sublayers' tuned configs agree on
        ``block_m``: those configs, nothing forced (vLLM's call). Else, with the first sublayer (w13, whose block
        vLLM aligns with) leading, then the next: every other sublayer runs the config of its own tuning table
        that has the leader's ``block_m``, from the interval nearest ``valid_shape_m``
        (``nearest_config_with_block``); the first leader all others can follow wins. Raises ``PeerRefused``
        naming the tuned blocks where no leader can be followed, before any launch."""
        tuned = {name: self.config_at(name, valid_shape_m) for name in self.tuning}
        blocks = {name: block_m(config) for name, config in tuned.items()}
        first = next(iter(blocks))
        vllm = ("read expert_ids/sorted_ids out of bounds" if min(blocks.values()) < blocks[first]
                else "run blocks spanning two experts' rows")
        for lead, block in blocks.items():
            taken = {name: nearest_config_with_block(self.tuning[name], block, valid_shape_m)
                     for name in self.tuning if blocks[name] != block}
            if None in taken.values():
                continue
            configs, forced = dict(tuned), {}
            for name, (low, high, config) in taken.items():
                configs[name] = config
                fields = sorted(key for key in tuned[name].keys() | config.keys()
                                if tuned[name].get(key) != config.get(key))
                forced[name] = {
                    "block_m": block, "tuned_block_m": blocks[name], "aligned_with": lead,
                    "reason": (f"tuned row blocks {blocks} at shape_m={valid_shape_m}: vLLM aligns the routing to "
                               f"{first}'s block and launches the others on it, which would {vllm} here; aligned to "
                               f"{lead}'s {block}-row blocks instead, {name} runs its own tuning table's config for "
                               f"shape_m in ({low}, {high}]"),
                    "launched_config": config, "launched_config_interval": [low, high],
                    "tuned_config": tuned[name], "differs_in": fields,
                }
            return RowBlockPlan(block, configs, forced)
        raise PeerRefused(f"humming peer: at shape_m={valid_shape_m} the sublayers' tuned configs pick different row "
                          f"blocks {blocks} and no sublayer's tuning table has a config with another's block; one "
                          "indexed routing cannot serve both GEMMs")

    def quant(self, name: str, inputs: torch.Tensor, quanted: torch.Tensor | None):
        return self.method.may_quant_input(layer=self.module, inputs=inputs, quanted_input=quanted, sublayer_name=name)

    def gemm(self, name: str, inputs, scale, outputs, routing: HummingRouting, top_k: int) -> None:
        """Sublayer ``name``'s launch on ``routing``: with its tuning table (vLLM's call), or where ``routing``'s plan
        forced its config, with that one config."""
        forced = routing.forced.get(name)
        tuning = json.dumps(forced["launched_config"]) if forced else self.tuning_str[name]
        self.method.forward_layer(
            layer=self.module, inputs=inputs, input_scale=scale, outputs=outputs, sublayer_name=name,
            sorted_ids=routing.sorted_ids, expert_ids=routing.expert_ids, num_tokens_padded=routing.num_tokens_padded,
            top_k=top_k, valid_shape_m=routing.valid_shape_m, compute_config=self.compute_str, tuning_config=tuning)

    def config(self) -> dict:
        """What the receipt records: the release, the activation schema, compute and tuning configs, layer metas."""
        return {
            "peer": "humming", "humming_kernels": humming_version(), "pinned": HUMMING_VERSION,
            "activations": self.activations, "input_schema": self.input_config or "BF16 (no input quantization)",
            "weight_schema": "mxfp4 (E2M1, E8M0 per 32), N padded to 256, K to 128",
            "compute_config": self.compute, "tuning_configs": self.tuning,
            "layer_metas": {name: meta.to_str() for name, meta in self.module.humming_metas.items()},
            "routing_preparation": ROUTING_PREP,
        }


@dataclasses.dataclass
class HummingRouting:
    """One routing's prepared state and buffers (built outside the timed call), each sublayer's Stream-K split of its
    launch on it (for the reference) and ``forced``: the sublayers launched with another config than their tuned one
    (``RowBlockPlan.forced``)."""

    valid_shape_m: int
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_padded: torch.Tensor
    buffers: dict[str, torch.Tensor]
    splits: dict[str, StreamKSplit] = dataclasses.field(default_factory=dict)
    forced: dict[str, dict] = dataclasses.field(default_factory=dict)

    def positions(self, rows: int) -> torch.Tensor:
        """int64 ``[rows]``: each flat (token, slot) row's index in ``sorted_ids`` (``rows`` = T * k, the padding id;
        unused slots keep -1)."""
        ids = self.sorted_ids.long()
        real = torch.nonzero(ids < rows).squeeze(1)
        pos = torch.full((rows,), -1, dtype=torch.int64, device=ids.device)
        pos[ids[real]] = real
        return pos


class HummingMoE:
    """Humming's MoE layer on MXFP4 weights, one GPU (module docstring).

    ``l1``/``l2``: canonical FP4 ``(uint8 [E, 2I, H/2], int32 [E, 2I, H/128])`` and ``(.. [E, H, I/2], ..
    [E, H, I/128])`` (rows ``[0, I)`` of L1 gate, ``[I, 2I)`` up) on the GPU; ``activations`` ``"bf16"`` or
    ``"fp8"``; ``activation_clamp`` as megamoe's (gate <= c, |up| <= c, in FP32 here).
    """

    def __init__(self, l1, l2, activations: str, activation_clamp: float | None = None):
        self.l1, self.l2 = l1, l2
        self.clamp = check_activation_clamp(activation_clamp)
        self.experts, self.hidden, self.inter = l1[0].shape[0], l1[0].shape[2] * 2, l2[0].shape[2] * 2
        self.layer = _HummingLayer({"w13": (*l1, True), "w2": (*l2, False)}, activations)
        self.activations = activations
        self.forced: dict[int, dict[str, dict]] = {}  # valid_shape_m -> RowBlockPlan.forced, for the receipt
        from .topk_sum import topk_sum

        self._topk_sum = topk_sum
        gate, up = "a", "b"
        if self.clamp is not None:
            c = f"{self.clamp!r}f"
            gate, up = f"fminf(a, {c})", f"fminf(fmaxf(b, -{c}), {c})"
        self.activation_impl = f"{gate} / (1.f + expf(-{gate})) * {up}"

    def prepare(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> HummingRouting:
        """Routing and buffers for BF16 tokens ``x [T, H]`` routed by ``topk_idx``/``topk_weights [T, k]``: aligned
        to the row block of ``_HummingLayer.row_block_plan``, with the Stream-K splits of the configs launched on it
        (a forced config's, not the tuned one's). Raises ``PeerRefused`` where the plan does."""
        t, k = topk_idx.shape
        valid_shape_m = t * k  # vLLM's estimate at EP1: every (token, slot) row, unused slots included
        plan = self.layer.row_block_plan(valid_shape_m)
        ids = align_block_size(topk_idx, plan.block, self.experts)
        splits = {name: self.layer.split(name, config, ids[0].numel()) for name, config in plan.configs.items()}
        if plan.forced:
            self.forced[valid_shape_m] = plan.forced
        dev, bf16 = x.device, torch.bfloat16
        buffers = {
            "x": x.contiguous(), "idx": topk_idx.to(torch.int32).contiguous(),
            "weights": topk_weights.float().contiguous(),
            "gate_up": torch.empty(t * k, 2 * self.inter, dtype=bf16, device=dev),
            "act": torch.empty(t * k, self.inter, dtype=bf16, device=dev),
            "down": torch.empty(t * k, self.hidden, dtype=bf16, device=dev),
            "y": torch.empty(t, self.hidden, dtype=bf16, device=dev),
        }
        if self.activations == "fp8":
            buffers["x_q"] = torch.empty(t, self.hidden, dtype=torch.float8_e4m3fn, device=dev)
            buffers["act_q"] = torch.empty(t * k, self.inter, dtype=torch.float8_e4m3fn, device=dev)
        return HummingRouting(valid_shape_m, *ids, buffers, splits, plan.forced)

    def __call__(self, routing: HummingRouting) -> torch.Tensor:
        """One MoE layer call on a prepared routing; returns its BF16 output ``[T, H]`` (``buffers["y"]``)."""
        b, layer = routing.buffers, self.layer
        inputs, scale = layer.quant("w13", b["x"], b.get("x_q"))
        layer.gemm("w13", inputs, scale, b["gate_up"], routing, top_k=b["idx"].shape[1])
        layer.humming.ops.process_input(b["gate_up"], outputs=b["act"], activation_type="binary_split",
                                        activation_impl=self.activation_impl)
        inputs, scale = layer.quant("w2", b["act"], b.get("act_q"))
        layer.gemm("w2", inputs, scale, b["down"], routing, top_k=1)
        return self._topk_sum(b["down"], b["weights"], b["idx"], b["y"])

    def reference(self, routing: HummingRouting) -> torch.Tensor:
        """``peer_reference`` of the tokens and routing ``routing`` was prepared for, with its Stream-K splits."""
        b = routing.buffers
        return peer_reference(b["x"], b["idx"], b["weights"], self.l1, self.l2, self.activations, self.clamp, routing)

    def tolerances(self) -> dict[str, float]:
        return peer_tolerances(self.inter, self.activations)

    def config(self) -> dict:
        return {**self.layer.config(), "row_blocks_forced": {str(m): f for m, f in sorted(self.forced.items())},
                "swiglu": f"humming process_input binary_split: {self.activation_impl}",
                "topk_sum": "Triton (megamoe.bench.topk_sum), FP32 sum in slot order", "tolerance": self.tolerances()}


class HummingGemm:
    """One Humming grouped GEMM on MXFP4 weights ``(uint8 [E, N, K/2], int32 [E, N, K/128])``: rows grouped by
    expert, ``top_k = 1``; ``activations`` ``"bf16"`` or ``"fp8"`` (per-128 FP32 scales, quantized in ``prepare``,
    outside the timed call)."""

    def __init__(self, packed: torch.Tensor, sf: torch.Tensor, activations: str):
        self.layer = _HummingLayer({"w": (packed, sf, False)}, activations)
        self.activations, self.experts, self.n = activations, packed.shape[0], packed.shape[1]

    def prepare(self, a: torch.Tensor, rows_per_expert: int) -> tuple[HummingRouting, torch.Tensor]:
        """Rows ``a`` BF16 ``[E * r, K]`` (expert e's rows at ``[e * r, (e + 1) * r)``): the routing with the
        quantized inputs and a NaN-filled output, and the float64 rows the GEMM reads (for the check)."""
        idx = torch.arange(self.experts, device=a.device).repeat_interleave(rows_per_expert).unsqueeze(1)
        config = self.layer.config_at("w", idx.numel())
        ids = align_block_size(idx, block_m(config), self.experts)
        inputs, scale = self.layer.quant("w", a, None)
        read = a.double() if scale is None else dequantize_fp8(inputs, scale.reshape(a.shape[0], -1), torch.float64)
        out = torch.full((a.shape[0], self.n), float("nan"), dtype=torch.bfloat16, device=a.device)
        split = self.layer.split("w", config, ids[0].numel())
        return HummingRouting(idx.numel(), *ids, {"inputs": inputs, "scale": scale, "out": out}, {"w": split}), read

    def __call__(self, routing: HummingRouting) -> torch.Tensor:
        b = routing.buffers
        self.layer.gemm("w", b["inputs"], b["scale"], b["out"], routing, top_k=1)
        return b["out"]

    def max_slices(self, routing: HummingRouting) -> int:
        """The most K slices one output tile of this launch is split in (1: no Stream-K split)."""
        return routing.splits["w"].max_slices()

    def reference(self, routing: HummingRouting, read: torch.Tensor, weights: torch.Tensor,
                  rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streamk_product`` of output rows ``rows`` (one expert's): ``read`` float64 ``[len, K]`` the values the
        GEMM reads for them, ``weights`` float64 ``[N, K]`` their expert's; ``(ref, low, high)``."""
        at = routing.positions(routing.buffers["out"].shape[0])[rows]
        return streamk_product(read, weights, at, routing.splits["w"])

    def config(self) -> dict:
        return self.layer.config()
