"""``EPMoE``: an expert-parallel MoE layer as a ``torch.nn.Module`` (inference only).

Each rank of the EP group holds the experts ``[r*E/R, (r+1)*E/R)`` in megamoe's canonical layout,
quantized once at load (FP4 E2M1 with per-32 UE8M0 scales for ``mma_type="fp8xfp4"``, BF16 for
``"bf16"``), and a ``SymmBuffer`` sized for ``max_tokens`` tokens per rank. A call quantizes the
tokens as the recipe wants (FP8 E4M3 with per-32 UE8M0 scales for ``recipe=(1, 1, 32)``, the default, or
with per-128 FP32 scales for ``recipe=(1, 1, 128)``; or BF16), runs the chosen
implementation over the group with the caller's routing and returns BF16 hidden states; an optional
shared expert (a dense BF16 SwiGLU MLP, computed locally) is added to the result. The routed part
follows the numerics contract (``megamoe.numerics``). No gradients flow through it (backward raises).

Implementations (``impl``, ``mode``), chosen explicitly, never substituted:

* ``"staged"``: ``megamoe.StagedMoE``; ``mode="normal"`` (one host sync, exact sizes) or
  ``"low_latency"`` (no host sync, CUDA-graph capturable).
* ``"mega"``: ``megamoe.MegaMoE`` (``mode="mega"``: FP8 x FP4 one persistent kernel per rank -- NVLink
  dispatch, grouped GEMM tiles, NVLink combine --, BF16 those kernels staged around torch's grouped GEMMs;
  no host sync, CUDA-graph capturable after one eager call); Hopper GPUs. SwiGLU experts without biases only:
  gpt-oss experts (``activation="swiglu_oai"``, biases) are refused at construction; they run on ``"staged"``.

H and I are any multiples of 32 (the scale block) on both implementations: the SM90 kernels run zero-padded sizes
(``megamoe.symm_buffer``: ``kernel_hidden`` / ``kernel_intermediate``), the outputs have the real H.

gpt-oss experts: ``activation="swiglu_oai"`` with ``activation_clamp`` = the model's ``swiglu_limit``, and the
per-expert biases given to ``load_experts`` / ``load_fp4_experts`` (``megamoe.numerics`` steps 1, 4 and 7).

The routed part runs as the custom op ``torch.ops.megamoe.ep_moe`` (with a fake impl), so
``torch.compile`` traces a layer without graph breaks. Construction and every call are collective
over ``group``: all ranks call them, each with its own tokens.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..checks import InStepError, check_routing, check_routing_inputs, check_tensor, fail
from ..dist import rank_and_size
from ..inputs import fill_buffer
from ..layouts import quantize_fp4
from ..layouts.fp4 import check_finite_weights
from ..staged import StagedMoE
from ..mega import MegaMoE
from ..layouts import dequantize_fp4
from ..layouts.weights import check_fp4_expert_weights
from ..numerics import (RECIPE_32, RECIPE_128, check_activation, check_activation_clamp, check_expert_bias, check_recipe,
                        describe_recipe)
from ..symm_buffer import SymmBuffer
from .checkpoint import (GPT_OSS_NAMINGS, Checkpoint, detect_naming, expert_range, read_expert_biases,
                         read_expert_weights, read_fp4_expert_weights, read_mlp_weights)

IMPLS = {"staged": StagedMoE.MODES, "mega": ("mega",)}
"""Implementation -> its modes (the first is the default)."""

_LAYERS: weakref.WeakValueDictionary[int, EPMoE] = weakref.WeakValueDictionary()
_IDS = itertools.count()


@torch.library.custom_op("megamoe::ep_moe", mutates_args=())
def ep_moe(hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Routed experts of the ``EPMoE`` with id ``layer_id``: ``[T, H]`` float, ``[T, k]`` int, ``[T, k]``
    float -> a new BF16 ``[T, H]`` tensor. Writes the layer's SymmBuffer (private state)."""
    return _routed_by_id(hidden_states, topk_idx, topk_weights, layer_id)


def _routed_by_id(hidden_states, topk_idx, topk_weights, layer_id: int) -> torch.Tensor:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        fail("layer_id", f"{layer_id} names no live EPMoE layer")
    return layer._routed(hidden_states, topk_idx, topk_weights)


@ep_moe.register_fake
def _ep_moe_fake(hidden_states, topk_idx, topk_weights, layer_id):
    """Shapes for tracing (fake tensors). A real call reaches it too when one input is on the meta device (the
    dispatcher picks the meta kernel): it then runs the op, whose device check raises in step with the peers
    instead of returning uninitialised memory."""
    if not all(isinstance(t, FakeTensor) for t in (hidden_states, topk_idx, topk_weights)):
        return _routed_by_id(hidden_states, topk_idx, topk_weights, layer_id)
    return hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)


class SharedMLP(nn.Module):
    """Dense SwiGLU MLP in BF16, ``down(silu(gate(x)) * up(x))`` for ``x [T, H]``, as Hugging Face
    models compute their shared experts (``gate_proj``/``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``)."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device | str | None = None):
        super().__init__()
        kw = dict(bias=False, dtype=torch.bfloat16, device=device)
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @torch.no_grad()
    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy checkpoint weights (any float dtype, rounded to BF16)."""
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            lin = getattr(self, name)
            check_tensor(f"shared {name}", w, shape=tuple(lin.weight.shape))
            lin.weight.copy_(w)


class EPMoE(nn.Module):
    """Expert-parallel MoE layer (module docstring). Collective: every rank of ``group`` builds it.

    ``num_experts`` E (divisible by the group size R), ``num_topk`` k (<= min(E, 32)), ``hidden`` H
    and ``intermediate`` I (multiples of 128), ``max_tokens``: most tokens per rank and call (sizes the
    SymmBuffer). ``group=None``: one process. ``shared_intermediate``: width of the shared expert
    (0 = none; DeepSeek-V3's ``n_shared_experts * moe_intermediate_size``). ``activation_clamp``: the
    contract's optional SwiGLU clamp; ``activation``: its step 4 (``numerics.ACTIVATIONS``; gpt-oss:
    ``"swiglu_oai"``, staged only). ``recipe``: the FP8 x FP4 recipe, (1, 1, 32) (default) or (1, 1, 128)
    (per-128 FP32 token scales; ``megamoe.numerics``); BF16 layers take the default. ``e4m3_copy``: impl "mega"
    with recipe (1, 1, 128) only, also hold the weights' E4M3 copies (``MegaMoE(..., e4m3_copy=True)``: one more byte
    per weight; calls from ``mega.MEGA_TOKENS_M_MIN_ROWS`` expected rows per expert read them). ``device``: defaults to the
    current CUDA device, else CPU; the
    layer stays there (weights are plain attributes, not moved by ``.to()``). ``buffer``: an existing
    SymmBuffer to use instead of allocating one (layers of a model run one after the other and can
    share one; its layout must match and hold ``max_tokens``; ``destroy`` then leaves it alone).

    Weights: ``load_experts`` (this rank's experts, canonical layout), or ``load_fp4_experts`` (already FP4, e.g.
    gpt-oss's published MXFP4, kept bit for bit) and, with a shared expert, ``shared.load``; or build everything with
    ``EPMoE.from_checkpoint``. Loaded, ``w1``/``w2`` hold the local experts as the impl reads them: FP4 ``(uint8,
    int32 scales)`` tuples or BF16 tensors; ``l1_bias`` (local experts) / ``l2_bias`` (all experts) the BF16 biases
    or None.
    """

    def __init__(
        self,
        num_experts: int,
        num_topk: int,
        hidden: int,
        intermediate: int,
        max_tokens: int,
        group: dist.ProcessGroup | None = None,
        *,
        mma_type: str = "fp8xfp4",
        impl: str = "staged",
        mode: str | None = None,
        shared_intermediate: int = 0,
        activation_clamp: float | None = None,
        device: torch.device | str | None = None,
        buffer: SymmBuffer | None = None,
        recipe=RECIPE_32,
        activation: str = "swiglu",
        e4m3_copy: bool = False,
    ):
        super().__init__()
        recipe = check_recipe(recipe)
        if not isinstance(e4m3_copy, bool):
            raise TypeError(f"megamoe: `e4m3_copy` must be a bool, got {type(e4m3_copy).__name__}")
        if e4m3_copy and not (impl == "mega" and mma_type == "fp8xfp4" and recipe == RECIPE_128):
            fail("e4m3_copy", f"applies to impl='mega' with mma_type='fp8xfp4' and recipe {describe_recipe(RECIPE_128)} "
                 f"(the Mega MoE kernel's tokens-on-M tiles), got impl={impl!r}, mma_type={mma_type!r}, recipe="
                 f"{describe_recipe(recipe)}")
        if mma_type == "bf16" and recipe != RECIPE_32:
            fail("recipe", f"applies to mma_type='fp8xfp4' only, got {recipe} with mma_type='bf16'")
        if impl not in IMPLS:
            fail("impl", f"must be one of {tuple(IMPLS)}, got {impl!r}")
        mode = IMPLS[impl][0] if mode is None else mode
        if mode not in IMPLS[impl]:
            fail("mode", f"must be one of {IMPLS[impl]} for impl {impl!r}, got {mode!r}")
        check_activation_clamp(activation_clamp)
        if check_activation(activation) != "swiglu" and impl == "mega":
            fail("activation", f"{activation!r} runs on impl='staged' only: the Mega MoE kernel computes 'swiglu' "
                 "without biases")
        rank, num_ranks = rank_and_size(group)
        self.local_experts = expert_range(num_experts, rank, num_ranks)
        self._owns_buffer = buffer is None
        if buffer is None:
            buffer = SymmBuffer(group, num_experts, max_tokens, num_topk, hidden, intermediate, mma_type=mma_type, device=device,
                                recipe=recipe)
        else:
            lay = buffer.layout
            have = (lay.num_ranks, lay.num_experts, lay.num_topk, lay.hidden, lay.intermediate_hidden, lay.mma_type)
            want = (num_ranks, num_experts, num_topk, hidden, intermediate, mma_type)
            if have != want or lay.num_max_tokens_per_rank < max_tokens:
                fail("buffer", f"has (ranks, experts, top-k, hidden, intermediate, mma_type) = {have} and room for "
                     f"{lay.num_max_tokens_per_rank} tokens; this layer needs {want} and {max_tokens} tokens")
            if mma_type == "fp8xfp4" and lay.recipe != recipe:
                fail("buffer", f"holds recipe {describe_recipe(lay.recipe)}; this layer runs recipe "
                     f"{describe_recipe(recipe)}")
        self.buffer = buffer
        self.num_experts, self.num_topk, self.hidden, self.intermediate = num_experts, num_topk, hidden, intermediate
        self.max_tokens, self.mma_type, self.impl, self.mode = max_tokens, mma_type, impl, mode
        self.recipe = recipe if mma_type == "fp8xfp4" else None
        self.e4m3_copy = e4m3_copy
        self.activation_clamp, self.activation, self.device = activation_clamp, activation, self.buffer.device
        self.shared = SharedMLP(hidden, shared_intermediate, self.device) if shared_intermediate else None
        self.w1 = self.w2 = self.l1_bias = self.l2_bias = self._impl = None
        self.layer_id = next(_IDS)
        _LAYERS[self.layer_id] = self

    @property
    def cuda_graph_capturable(self) -> bool:
        """Whether a call can be captured in a CUDA graph (staged low-latency mode, or mega after one
        eager call). Not the staged path of recipe (1, 1, 128) on CUDA: its torch GEMMs run in FP32, which torch
        does as a per-group loop that reads the group sizes on the host."""
        if self.impl == "mega":
            return True
        fp32_gemms = self.recipe == RECIPE_128 and self.device.type == "cuda"
        return self.mode == "low_latency" and not fp32_gemms

    @torch.no_grad()
    def load_experts(self, w1: torch.Tensor, w2: torch.Tensor, l1_bias: torch.Tensor | None = None,
                     l2_bias: torch.Tensor | None = None) -> None:
        """This rank's experts, canonical layout, any float dtype: ``w1 [E/R, 2I, H]`` (rows ``[0, I)``
        gate, ``[I, 2I)`` up) and ``w2 [E/R, H, I]``. Quantized once here (FP4 + UE8M0, or BF16); NaN or Inf
        raise, naming the expert (its global number), row and 32-element block. Optional biases (gpt-oss), rounded
        to BF16: ``l1_bias [E/R, 2I]`` (rows as w1) and ``l2_bias [E, H]`` of all E experts."""
        e, i, h = len(self.local_experts), self.intermediate, self.hidden
        check_tensor("w1", w1, dtype=(torch.float32, torch.bfloat16, torch.float16), shape=(e, 2 * i, h))
        check_tensor("w2", w2, dtype=(torch.float32, torch.bfloat16, torch.float16), shape=(e, h, i))
        w1, w2 = w1.to(self.device).contiguous(), w2.to(self.device).contiguous()
        check_finite_weights(w1, "w1", self.local_experts.start)  # experts named globally
        check_finite_weights(w2, "w2", self.local_experts.start)
        if self.mma_type == "fp8xfp4":
            w1, w2 = quantize_fp4(w1, "w1"), quantize_fp4(w2, "w2")
        else:
            w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
        self._set_experts(w1, w2, l1_bias, l2_bias)

    @torch.no_grad()
    def load_fp4_experts(self, l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor],
                         l1_bias: torch.Tensor | None = None, l2_bias: torch.Tensor | None = None) -> None:
        """This rank's experts already in canonical FP4 (``(uint8 [E/R, 2I, H/2], int32 [E/R, 2I, H/128])``,
        ``(uint8 [E/R, H, I/2], int32 [E/R, H, I/128])``; ``megamoe.layouts.fp4``), used as they are (bit-exact) for
        ``mma_type="fp8xfp4"``, dequantized exactly to BF16 for ``"bf16"``; biases as ``load_experts``."""
        check_fp4_expert_weights(l1, l2, self.hidden, self.intermediate)
        if l1[0].shape[0] != len(self.local_experts):
            fail("l1[0]", f"must hold this rank's {len(self.local_experts)} experts, got {l1[0].shape[0]}")
        l1, l2 = tuple(t.to(self.device) for t in l1), tuple(t.to(self.device) for t in l2)
        if self.mma_type == "bf16":
            l1, l2 = dequantize_fp4(*l1, torch.bfloat16), dequantize_fp4(*l2, torch.bfloat16)
        self._set_experts(l1, l2, l1_bias, l2_bias)

    def _set_experts(self, w1, w2, l1_bias, l2_bias) -> None:
        """Keep the loaded weights and biases (BF16 on the layer's device) and build the impl on them."""
        biases = []
        for name, b, experts, width in (("l1_bias", l1_bias, len(self.local_experts), 2 * self.intermediate),
                                        ("l2_bias", l2_bias, self.num_experts, self.hidden)):
            if b is not None:
                check_tensor(name, b, dtype=(torch.float32, torch.bfloat16, torch.float16))
                b = b.to(self.device, torch.bfloat16).contiguous()
            biases.append(check_expert_bias(b, name, experts, width))
        if self.impl == "mega" and any(b is not None for b in biases):
            fail("l1_bias" if biases[0] is not None else "l2_bias", "runs on impl='staged' only: the Mega MoE kernel "
                 "computes experts without biases")
        self.w1, self.w2 = w1, w2
        self.l1_bias, self.l2_bias = biases
        recipe = RECIPE_32 if self.recipe is None else self.recipe
        self._impl = (MegaMoE(self.w1, self.w2, recipe=recipe, e4m3_copy=self.e4m3_copy) if self.impl == "mega"
                      else StagedMoE(self.w1, self.w2, self.mode, recipe=recipe, activation=self.activation,
                                     l1_bias=self.l1_bias, l2_bias=self.l2_bias))

    @classmethod
    def from_checkpoint(
        cls,
        source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike,
        prefix: str,
        num_experts: int,
        num_topk: int,
        max_tokens: int,
        group: dist.ProcessGroup | None = None,
        *,
        naming: str = "auto",
        shared_prefix: str | None = None,
        **kwargs,
    ) -> EPMoE:
        """Build the layer from the experts under ``prefix`` (see ``megamoe.nn.checkpoint`` for the
        sources and namings), reading only this rank's experts; H and I come from the weights.
        ``shared_prefix`` (e.g. ``"model.layers.3.mlp.shared_experts."``) loads a shared expert.
        ``kwargs`` go to the constructor (``mma_type``, ``recipe``, ``impl``, ...). gpt-oss namings load the
        biases too and need ``activation="swiglu_oai"`` (with ``activation_clamp`` = the model's ``swiglu_limit``;
        ``moe_block_from_config`` passes both); ``gpt_oss_mxfp4`` loads the stored FP4 bytes as they are."""
        ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
        rank, num_ranks = rank_and_size(group)
        experts = expert_range(num_experts, rank, num_ranks)
        naming = detect_naming(ckpt, prefix) if naming == "auto" else naming
        biases = (None, None)
        if naming in GPT_OSS_NAMINGS:
            if kwargs.get("activation") != "swiglu_oai":
                fail("activation", f"must be 'swiglu_oai' for gpt-oss experts (naming {naming!r}), got "
                     f"{kwargs.get('activation', 'swiglu')!r}")
            biases = read_expert_biases(ckpt, prefix, experts)
        if naming == "gpt_oss_mxfp4":
            w1, w2 = read_fp4_expert_weights(ckpt, prefix, experts)
            hidden, inter = w2[0].shape[1], 2 * w2[0].shape[2]
        else:
            w1, w2 = read_expert_weights(ckpt, prefix, experts, naming)
            hidden, inter = w2.shape[1], w2.shape[2]
        shared = read_mlp_weights(ckpt, shared_prefix) if shared_prefix else None
        layer = cls(num_experts, num_topk, hidden, inter, max_tokens, group,
                    shared_intermediate=shared[0].shape[0] if shared else 0, **kwargs)
        (layer.load_fp4_experts if naming == "gpt_oss_mxfp4" else layer.load_experts)(w1, w2, *biases)
        if shared:
            layer.shared.load(*shared)
        return layer

    def forward(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., H]`` (BF16, FP16 or FP32) with ``topk_idx [..., k]`` (int32/int64 expert
        ids, -1 = unused slot) and ``topk_weights [..., k]`` (float) -> BF16 ``[..., H]``: the sum of
        the routed experts' outputs, each scaled by its routing weight, plus the shared expert's.
        At most ``max_tokens`` tokens (the product of the leading dims) per rank and call."""
        check_tensor("hidden_states", hidden_states, dtype=(torch.bfloat16, torch.float16, torch.float32))
        check_tensor("topk_idx", topk_idx, dtype=(torch.int32, torch.int64))
        check_tensor("topk_weights", topk_weights, dtype=(torch.float32, torch.bfloat16, torch.float16))
        lead = hidden_states.shape[:-1]
        check_tensor("hidden_states", hidden_states, shape=(*lead, self.hidden))
        for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            check_tensor(name, t, shape=(*lead, self.num_topk))
        x = hidden_states.reshape(-1, self.hidden)
        k = self.num_topk
        y = torch.ops.megamoe.ep_moe(x, topk_idx.reshape(-1, k), topk_weights.reshape(-1, k), self.layer_id)
        if self.shared is not None:
            y = y + self.shared(x.to(torch.bfloat16))
        return y.view(hidden_states.shape)

    def _routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The custom op's body: check the inputs, quantize and copy them into the SymmBuffer, run the impl.

        Collective-call guard (``SymmBuffer.collective``): a bad input of this rank (device, dtype, shape, more than
        ``max_tokens`` tokens; for impl "mega" outside CUDA-graph capture, ids outside [-1, E) or an expert twice in
        a token) makes this rank take its part in the call with no tokens, then raise ``InStepError``: the peers'
        call completes and the ranks stay in step. The staged impl checks the ids itself, on every rank together."""
        if self._impl is None:
            fail("weights", "are not loaded: call load_experts() or build the layer with EPMoE.from_checkpoint")
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with self.buffer.collective("EPMoE"):
            if capturing and not self.cuda_graph_capturable:
                if self.mode == "low_latency":
                    fail("impl", "'staged' with recipe (1, 1, 128) runs torch's FP32 grouped GEMMs, which sync with "
                         "the host on CUDA and cannot be captured in a CUDA graph; use impl='mega'")
                fail("mode", f"{self.mode!r} of impl {self.impl!r} syncs with the host and cannot be captured in a "
                     "CUDA graph; use mode='low_latency'")
            try:
                self._check_inputs(x, topk_idx, topk_weights, capturing)
            except (ValueError, TypeError) as err:
                self._run(torch.empty(0, self.hidden, dtype=torch.bfloat16, device=self.device), capturing)
                raise InStepError(f"{err} (this rank took part in the call with no tokens: the ranks stay in "
                                  "step)") from err
            fill_buffer(self.buffer, x if self.mma_type == "fp8xfp4" else x.to(torch.bfloat16),
                        topk_idx.to(torch.int64), topk_weights.to(torch.float32), validate=False)
            return self._run(torch.empty(x.shape[0], self.hidden, dtype=torch.bfloat16, device=self.device),
                             capturing)

    def _check_inputs(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      capturing: bool) -> None:
        """The routed inputs as the custom op receives them: ``x [T, H]`` float, ``topk_idx [T, k]`` int32 / int64,
        ``topk_weights [T, k]`` float, all on the layer's device, T <= ``max_tokens``; for impl "mega" outside
        capture, the ids (``checks.check_routing``: a host sync on a GPU)."""
        check_tensor("hidden_states", x, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                     device=self.device)
        check_tensor("hidden_states", x, shape=(None, self.hidden))
        t = x.shape[0]
        if t > self.max_tokens:
            fail("hidden_states", f"holds {t} tokens, above max_tokens={self.max_tokens} (the SymmBuffer's capacity "
                 "per rank and call; build the layer with a larger max_tokens or split the batch)")
        check_routing_inputs(topk_idx, topk_weights, t, self.num_topk, self.device)
        if self.impl == "mega" and not capturing:
            check_routing(topk_idx, self.num_experts, self.buffer.rank)

    def _run(self, y: torch.Tensor, capturing: bool) -> torch.Tensor:
        """Run the impl for ``y.shape[0]`` tokens already in the buffer."""
        if self.impl == "mega":
            return self._impl(y, self.buffer, None, activation_clamp=self.activation_clamp)
        return self._impl(y, self.buffer, None, self.activation_clamp, validate=not capturing)

    def destroy(self) -> None:
        """Release the SymmBuffer it allocated (collective: every rank calls it); unusable after."""
        _LAYERS.pop(self.layer_id, None)
        self._impl = None
        if self._owns_buffer:
            self.buffer.destroy()

    def extra_repr(self) -> str:
        return (f"experts={self.local_experts.start}..{self.local_experts.stop - 1} of {self.num_experts}, top_k={self.num_topk}, "
                f"hidden={self.hidden}, intermediate={self.intermediate}, max_tokens={self.max_tokens}, "
                f"mma_type={self.mma_type}{'' if self.recipe is None else f', recipe={self.recipe}'}, impl={self.impl}, "
                f"mode={self.mode}{', e4m3_copy=True' if self.e4m3_copy else ''}")
