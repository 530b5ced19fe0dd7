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
  ``moe_fused_mul_sum``.

Numerics: Humming applies the routing weight after the W2 GEMM, where megamoe's contract (``megamoe.numerics``)
applies it inside the SwiGLU before R2, and rounds the SwiGLU output to BF16 before quantizing it. So a peer is
checked against ``peer_reference``, an FP64 reference of its own rounding points (the structure of megamoe's:
R1 gate/up to BF16, R2 the SwiGLU output to BF16 and, for FP8 activations, per 128 to E4M3 with an FP32 scale, R3
each slot's W2 output to BF16, R4 ``bf16(sum_j w_j * o_j)``), with megamoe's tolerance rules
(``peer_tolerances``: ``moe_tolerances`` of recipe (1, 1, 32) for BF16 activations, as megamoe's BF16 path uses,
of recipe (1, 1, 128) for the per-128 FP8 ones).

``HummingGemm`` is one of those GEMMs alone (``megamoe.bench gemm``): rows already grouped by expert (the contiguous
layout megamoe's grouped GEMM reads), ``top_k = 1``, tokens quantized before the timed call as megamoe's are.

Nothing in the megamoe library imports this module; ``humming`` is imported only when a peer is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import torch

from ..layouts import dequantize_fp4, dequantize_fp8, quantize_fp8, unpack_ue8m0
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
ROUTING_PREP = ("outside the timed call: once per routing, the (token, slot) rows sorted by expert and padded to the "
                "GEMM's row block (vLLM's moe_align_block_size, here in torch); buffers allocated then too")


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
    """float64 values a peer's GEMM reads from ``v``: ``v`` itself (BF16), or its per-128 E4M3 quantization with
    FP32 scales (``amax / 448``), dequantized exactly."""
    if activations == "bf16":
        return v.double()
    return dequantize_fp8(*quantize_fp8(v, recipe=RECIPE_128), torch.float64)


def peer_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1, l2, activations: str,
                   activation_clamp: float | None = None) -> torch.Tensor:
    """FP64 reference of a peer that applies routing weights after the second GEMM (module docstring).

    ``x`` BF16 ``[T, H]``; ``topk_idx`` ``[T, k]`` (-1 = unused slot), ``topk_weights`` float32 ``[T, k]``; ``l1`` /
    ``l2``: canonical FP4 ``(uint8 [E, 2I, H/2], int32 [E, 2I, H/128])`` / ``(.. [E, H, I/2], .. [E, H, I/128])``.
    ``activations``: ``"bf16"`` or ``"fp8"`` (tokens and SwiGLU output quantized per 128 with FP32 scales). The clamp
    applies to the BF16 gate/up in FP32 (gate <= c, |up| <= c). Returns BF16 ``[T, H]``.
    """
    _check_activations(activations)
    clamp = check_activation_clamp(activation_clamp)
    t, k = topk_idx.shape
    hidden, inter = x.shape[1], l2[0].shape[-1] * 2
    o = torch.zeros(t, k, hidden, dtype=torch.float64, device=x.device)
    xd = _as_peer_input(x, activations)
    for e in range(l1[0].shape[0]):
        tok, slot = torch.nonzero(topk_idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        acc = xd[tok] @ dequantize_fp4(l1[0][e], l1[1][e]).double().T
        gate, up = clamp_gate_up(bf16_rne(acc[:, :inter]).float(), bf16_rne(acc[:, inter:]).float(), clamp)  # R1
        a = bf16_rne(swiglu_weighted(gate, up, torch.ones(tok.numel(), device=x.device)))  # R2: BF16, FP8 below
        o[tok, slot] = bf16_rne(_as_peer_input(a, activations) @ dequantize_fp4(l2[0][e], l2[1][e]).double().T).double()
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


class _HummingLayer:
    """A module holding MXFP4 expert weights as Humming sublayers (``<name>_weight``, ``<name>_weight_scale``),
    prepared as vLLM's ``HummingMoEMethod.process_weights_after_loading`` prepares them."""

    def __init__(self, sublayers: dict, activations: str):
        self.humming = require_humming()
        from humming.config import GemmType
        from humming.layer import HummingMethod
        from humming.schema import HummingInputSchema
        from humming.schema.mxfp4 import Mxfp4WeightSchema

        self.method = HummingMethod
        self.activations = _check_activations(activations)
        self.input_config = {} if activations == "bf16" else {"a_dtype": "float8e4m3", "input_scale_group_size": FP8_GROUP}
        input_schema = HummingInputSchema(**self.input_config)
        self.module = module = torch.nn.Module()
        device = None
        for name, (packed, sf, gated) in sublayers.items():
            device = packed.device
            num_experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
            tensors = {"weight": packed.contiguous(), "weight_scale": unpack_ue8m0(sf)}
            stacks = [n // 2] * 2 if gated else [n]
            weight_schema, tensors = Mxfp4WeightSchema().convert_humming(
                tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
                num_experts=num_experts)
            layer_input_schema, _ = input_schema.convert_humming(
                tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
                num_experts=num_experts)
            for key, tensor in tensors.items():
                setattr(module, f"{name}_{key}", torch.nn.Parameter(tensor, requires_grad=False))
            HummingMethod.prepare_layer_meta(
                layer=module, shape_n=n, shape_k=k, weight_schema=weight_schema, input_schema=layer_input_schema,
                num_experts=num_experts, pad_n_to_multiple=256, pad_k_to_multiple=128, has_bias=False,
                torch_dtype=torch.bfloat16, sublayer_name=name)
            HummingMethod.transform_humming_layer(module, sublayer_name=name)
        module.register_buffer("locks", torch.zeros(1024, dtype=torch.int32, device=device))
        self.compute = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": GemmType.INDEXED.value}
        self.compute_str = json.dumps(self.compute)
        self.tuning = {
            name: HummingMethod.get_default_tuning_configs(
                layer=module, use_f16_accum=False, use_batch_invariant=False, gemm_type=GemmType.INDEXED,
                sublayer_name=name)
            for name in sublayers
        }
        self.tuning_str = {name: json.dumps(configs) for name, configs in self.tuning.items()}

    def block_rows(self, name: str, valid_shape_m: int) -> int:
        """The row block of the tuning interval holding ``valid_shape_m`` (vLLM's choice of the alignment block)."""
        for low, high, config in self.tuning[name]:
            if low < valid_shape_m <= high:
                return int(config["block_shape"][0])
        raise RuntimeError(f"humming: no tuning interval of {name} holds shape_m={valid_shape_m}: {self.tuning[name]}")

    def shared_block_rows(self, valid_shape_m: int) -> int:
        """The row block of every sublayer at ``valid_shape_m``: the indexed routing (rows padded per expert to the
        block, one expert id per block) serves both GEMMs, so their tuning configs must agree on it (vLLM aligns once,
        with w13's block configs). Raises ``RuntimeError`` naming both blocks where they differ, before any launch."""
        blocks = {name: self.block_rows(name, valid_shape_m) for name in self.tuning}
        if len(set(blocks.values())) > 1:
            raise RuntimeError(f"humming peer: at shape_m={valid_shape_m} the sublayers' default tuning configs pick "
                               f"different row blocks {blocks}; one indexed routing cannot serve both GEMMs "
                               "(humming-kernels 0.1.20 chooses each sublayer's config independently)")
        return next(iter(blocks.values()))

    def quant(self, name: str, inputs: torch.Tensor, quanted: torch.Tensor | None):
        return self.method.may_quant_input(layer=self.module, inputs=inputs, quanted_input=quanted, sublayer_name=name)

    def gemm(self, name: str, inputs, scale, outputs, routing: HummingRouting, top_k: int) -> None:
        self.method.forward_layer(
            layer=self.module, inputs=inputs, input_scale=scale, outputs=outputs, sublayer_name=name,
            sorted_ids=routing.sorted_ids, expert_ids=routing.expert_ids, num_tokens_padded=routing.num_tokens_padded,
            top_k=top_k, valid_shape_m=routing.valid_shape_m, compute_config=self.compute_str,
            tuning_config=self.tuning_str[name])

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
    """One routing's prepared state and buffers (built outside the timed call)."""

    valid_shape_m: int
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_padded: torch.Tensor
    buffers: dict[str, torch.Tensor]


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
        from .topk_sum import topk_sum

        self._topk_sum = topk_sum
        gate, up = "a", "b"
        if self.clamp is not None:
            c = f"{self.clamp!r}f"
            gate, up = f"fminf(a, {c})", f"fminf(fmaxf(b, -{c}), {c})"
        self.activation_impl = f"{gate} / (1.f + expf(-{gate})) * {up}"

    def prepare(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> HummingRouting:
        """Routing and buffers for BF16 tokens ``x [T, H]`` routed by ``topk_idx``/``topk_weights [T, k]``."""
        t, k = topk_idx.shape
        valid_shape_m = t * k  # vLLM's estimate at EP1: every (token, slot) row, unused slots included
        ids = align_block_size(topk_idx, self.layer.shared_block_rows(valid_shape_m), self.experts)
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
        return HummingRouting(valid_shape_m, *ids, buffers)

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

    def reference(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return peer_reference(x, topk_idx, topk_weights, self.l1, self.l2, self.activations, self.clamp)

    def tolerances(self) -> dict[str, float]:
        return peer_tolerances(self.inter, self.activations)

    def config(self) -> dict:
        return {**self.layer.config(), "swiglu": f"humming process_input binary_split: {self.activation_impl}",
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
        ids = align_block_size(idx, self.layer.block_rows("w", idx.numel()), self.experts)
        inputs, scale = self.layer.quant("w", a, None)
        read = a.double() if scale is None else dequantize_fp8(inputs, scale.reshape(a.shape[0], -1), torch.float64)
        out = torch.full((a.shape[0], self.n), float("nan"), dtype=torch.bfloat16, device=a.device)
        return HummingRouting(idx.numel(), *ids, {"inputs": inputs, "scale": scale, "out": out}), read

    def __call__(self, routing: HummingRouting) -> torch.Tensor:
        b = routing.buffers
        self.layer.gemm("w", b["inputs"], b["scale"], b["out"], routing, top_k=1)
        return b["out"]

    def config(self) -> dict:
        return self.layer.config()
