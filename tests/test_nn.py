"""megamoe.nn: the EP MoE layer against the contract's reference and against real model code.

Hugging Face models (Qwen3-MoE, Mixtral, DeepSeek-V3) are built from tiny configs with random
weights, saved with their own ``save_pretrained`` (per-expert checkpoint tensors), and their MoE
blocks compared with ``megamoe.nn`` blocks loaded from that checkpoint.

Error budgets (relative to the norm of the Hugging Face block's routed-expert output):

* BF16 recipe: ``BF16_BUDGET = 2**-6``. Both paths compute the same function with BF16 roundings
  (unit roundoff u = 2**-8) at different points: at most ~8 per path (gate/up, SiLU, product, down,
  routing weight, one per accumulated slot), 16 in all, each an independent relative error <= u, so
  the difference is <= sqrt(16) * u = 2**-6 in RMS.
* FP8 x FP4 recipe: ``fp4_budget`` derives it from the measured quantization errors, see there.
* Whole model: ``model_budget``, see there.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from megamoe import reference_moe
from megamoe.inputs import random_routing, random_tokens
from megamoe.layouts import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from megamoe.nn import Checkpoint, EPMoE, MoEBlock, TopKRouter, expert_range, moe_block_from_config, read_expert_weights
from megamoe.numerics import check_moe_output, rel_fro_error

BF16_BUDGET = 2.0**-6
FP8_UNIT_ROUNDOFF = 2.0**-4  # E4M3 keeps 3 mantissa bits: |round(v) - v| <= 2**-4 |v| in the normal range
HIDDEN, MOE_INTERMEDIATE = 256, 128


# ---------------------------------------------------------------------------------------------
# Tiny Hugging Face models (helpers shared with tests/distributed/test_nn_multirank.py)

# model_type -> (checkpoint block name, MoE layers); transformers' save_pretrained writes Mixtral's
# experts under `block_sparse_moe`, the name of the original checkpoints.
HF_MODELS = {"qwen3_moe": ("mlp", (0, 1)), "mixtral": ("block_sparse_moe", (0, 1)), "deepseek_v3": ("mlp", (1,))}


def hf_config(model_type: str):
    """A tiny config (2 layers, hidden 256, expert width 128) of a HF_MODELS model."""
    transformers = pytest.importorskip("transformers", minversion="5.17")
    common = dict(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    if model_type == "qwen3_moe":  # softmax top-2 of 8, no renormalization
        return transformers.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=MOE_INTERMEDIATE,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    if model_type == "mixtral":  # softmax top-2 of 8, renormalized
        return transformers.MixtralConfig(**common, intermediate_size=MOE_INTERMEDIATE, num_local_experts=8,
                                          num_experts_per_tok=2)
    # DeepSeek-V3: layer 0 dense, layer 1 MoE; sigmoid top-4 of 16 in 2 of 4 groups, x2.5, shared expert
    return transformers.DeepseekV3Config(
        **dict(common, num_key_value_heads=4, head_dim=32), intermediate_size=256, moe_intermediate_size=MOE_INTERMEDIATE,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64)


def hf_model(model_type: str, path, seed: int = 0, device: str = "cpu"):
    """(config, BF16 model with random weights, checkpoint dir written by ``save_pretrained``)."""
    transformers = pytest.importorskip("transformers", minversion="5.17")
    pytest.importorskip("safetensors")
    config = hf_config(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        for layer in HF_MODELS[model_type][1]:
            gate = model.model.layers[layer].mlp.gate
            if hasattr(gate, "e_score_correction_bias"):  # zeros at init; random to exercise it
                gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return config, model.to(device), path


def hf_prefix(model_type: str, layer: int) -> str:
    return f"model.layers.{layer}.{HF_MODELS[model_type][0]}."


def hf_block_outputs(model, layer: int, x: torch.Tensor) -> dict:
    """The untouched HF block on tokens ``x [T, H]``: output, routed-expert part, its routing."""
    block = model.model.layers[layer].mlp
    with torch.no_grad():
        _, weights, idx = block.gate(x)
        return {"y": block(x.unsqueeze(0))[0], "routed": block.experts(x, idx, weights), "idx": idx, "weights": weights}


def quant_rel_error(t: torch.Tensor, fp4: bool) -> float:
    """Relative RMS error ``||deq(q(t)) - t|| / ||t||`` of FP4 (weights) or FP8 (tokens) quantization."""
    t = t.detach().float()
    d = dequantize_fp4(*quantize_fp4(t)) if fp4 else dequantize_fp8(*quantize_fp8(t))
    return float((d - t).norm() / t.norm())


def fp4_budget(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[float, float]:
    """(predicted, budget) relative error of the FP8 x FP4 routed output, from first principles.

    Quantizing one operand of a matmul with relative RMS error e (errors independent of the other
    operand) perturbs the product by a relative RMS e. Tokens x (FP8, measured e_x) and L1 weights
    (FP4, measured e_1 over all experts) perturb gate and up; their independent errors add in
    quadrature in silu(gate) * up (silu's log-derivative 1 + g(1 - sigmoid(g)) is <= 1.28 for g > 0,
    where the output's norm lives), giving sqrt(2 e_x^2 + 2 e_1^2); the FP8 activations add at
    most the E4M3 unit roundoff 2**-4, the FP4 L2 weights e_2. Independent sources add in quadrature:
    ``predicted = sqrt(2 e_x^2 + 2 e_1^2 + 2**-8 + e_2^2)`` (~0.22 for Gaussian weights: e_1, e_2
    ~ 2**-3, e_x ~ 0.027); BF16 roundings (2**-8) are negligible. ``budget = 1.5 * predicted`` covers
    silu's log-derivative (<= 1.28) and the sampling noise of T * H elements.
    """
    ex, e1, e2 = quant_rel_error(x, False), quant_rel_error(w1, True), quant_rel_error(w2, True)
    predicted = math.sqrt(2 * ex**2 + 2 * e1**2 + FP8_UNIT_ROUNDOFF**2 + e2**2)
    return predicted, 1.5 * predicted


def model_budget(block_errors: list[float], final_norm: float, num_layers: int) -> float:
    """Relative error budget of a model's final hidden states with every MoE block swapped.

    ``block_errors``: each swapped block's error bound, its budget times its routed output's norm
    (what it adds to the residual stream). The blocks' errors are independent (quadrature) and a
    later residual layer ``h + f(h)`` with init-scale weights (Lip(f) <= 1) at most doubles them
    (factor 2, also covering top-k flips of near-tied experts in the later router); the final
    RMSNorm keeps relative errors. Each layer's BF16 residual, attention and norm roundings can flip
    by one BF16 unit where their inputs moved: ``BF16_BUDGET`` per layer.
    """
    return 2 * math.sqrt(sum(e * e for e in block_errors)) / final_norm + num_layers * BF16_BUDGET


def check_block(block: MoEBlock, x: torch.Tensor, ref: dict, budget: float, what: str) -> float:
    """Run ``block`` on tokens ``x`` (its SymmBuffer poisoned first) and check it against the HF
    block's outputs ``ref`` for the same tokens: the same experts per token as the model's router
    (order may differ), the same weights up to FP32 rounding, and an output within ``budget``
    relative to the norm of the routed part. Returns the relative error."""
    block.moe.buffer.buffer.random_(0, 256)  # stale garbage must not matter
    with torch.no_grad():
        idx, weights = block.router(x)
        y = block(x.unsqueeze(0))[0]
    mine, order = idx.cpu().sort(-1)
    theirs, their_order = ref["idx"].cpu().sort(-1)
    assert torch.equal(mine, theirs), f"{what}: routing differs from the model's router"
    torch.testing.assert_close(weights.cpu().gather(1, order), ref["weights"].cpu().float().gather(1, their_order),
                               rtol=1e-6, atol=0)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    if x.shape[0] == 0:
        return 0.0
    err = float((y.cpu().double() - ref["y"].cpu().double()).norm() / ref["routed"].cpu().double().norm())
    assert err <= budget, f"{what}: relative error {err:.4f} above the budget {budget:.4f}"
    return err


def block_budget(model, layer: int, x: torch.Tensor, mma_type: str) -> float:
    if mma_type == "bf16":
        return BF16_BUDGET
    experts = model.model.layers[layer].mlp.experts
    return fp4_budget(x, experts.gate_up_proj, experts.down_proj)[1]


def check_swapped_block(config, model, ckpt, model_type, layer, x, mma_type, mode, device) -> float:
    """Single-process swap check of one MoE block on tokens ``x``; returns the relative error."""
    block = moe_block_from_config(config, ckpt, hf_prefix(model_type, layer), x.shape[0], None,
                                  mma_type=mma_type, mode=mode, device=device)
    err = check_block(block, x, hf_block_outputs(model, layer, x), block_budget(model, layer, x, mma_type),
                      f"{model_type} {mma_type} {mode}")
    block.moe.destroy()
    return err


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """model_type -> (config, model, checkpoint dir), built once per module."""
    return {name: hf_model(name, tmp_path_factory.mktemp(name)) for name in HF_MODELS}


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
@pytest.mark.parametrize("model_type", list(HF_MODELS))
def test_hf_block_swap(hf, model_type, mma_type, mode):
    config, model, ckpt = hf[model_type]
    x = random_tokens(48, HIDDEN, torch.Generator().manual_seed(7))
    check_swapped_block(config, model, ckpt, model_type, HF_MODELS[model_type][1][-1], x, mma_type, mode, "cpu")


@pytest.mark.parametrize("model_type", list(HF_MODELS))
def test_hf_state_dict_loads_like_checkpoint(hf, model_type):
    """transformers' in-memory state dict (fused experts under `mlp.`) gives the same layer."""
    config, model, ckpt = hf[model_type]
    layer = HF_MODELS[model_type][1][-1]
    x = random_tokens(16, HIDDEN, torch.Generator().manual_seed(8))
    from_file = moe_block_from_config(config, ckpt, hf_prefix(model_type, layer), 16)
    from_sd = moe_block_from_config(config, model.state_dict(), f"model.layers.{layer}.mlp.", 16)
    with torch.no_grad():
        assert torch.equal(from_file(x), from_sd(x))
    assert Checkpoint(ckpt).get(f"{hf_prefix(model_type, layer)}gate.weight").shape == (from_sd.router.num_experts, HIDDEN)


@contextlib.contextmanager
def swapped_blocks(config, model, ckpt, model_type: str, max_tokens: int, **kwargs):
    """Every MoE block of ``model`` replaced by a megamoe.nn block inside the context."""
    originals = {layer: model.model.layers[layer].mlp for layer in HF_MODELS[model_type][1]}
    buffer = None  # the first block's, shared by the others
    try:
        for layer in originals:
            block = moe_block_from_config(config, ckpt, hf_prefix(model_type, layer), max_tokens, buffer=buffer, **kwargs)
            model.model.layers[layer].mlp, buffer = block, block.moe.buffer
        yield
    finally:
        for layer, block in originals.items():
            model.model.layers[layer].mlp = block


@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
@pytest.mark.parametrize("model_type", list(HF_MODELS))
def test_hf_model_swap(hf, model_type, mma_type):
    """The whole model with every MoE block swapped: final hidden states within ``model_budget``."""
    config, model, ckpt = hf[model_type]
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    layers = HF_MODELS[model_type][1]
    seen, hooks = {}, []  # the reference run's block inputs and routed outputs, and the final norm's input
    for layer in layers:
        hooks.append(model.model.layers[layer].mlp.experts.register_forward_hook(
            lambda m, i, o, layer=layer: seen.__setitem__(layer, (i[0], float(o.double().norm())))))
    hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("final", float(i[0].double().norm()))))
    with torch.no_grad():
        ref = model.model(input_ids=ids).last_hidden_state
    for h in hooks:
        h.remove()

    with swapped_blocks(config, model, ckpt, model_type, ids.numel(), mma_type=mma_type), torch.no_grad():
        y = model.model(input_ids=ids).last_hidden_state
    block_errors = [block_budget(model, layer, seen[layer][0], mma_type) * seen[layer][1] for layer in layers]
    budget = model_budget(block_errors, seen["final"], config.num_hidden_layers)
    err = rel_fro_error(y, ref)
    assert err <= budget, f"{model_type} {mma_type}: final hidden states relative error {err:.4f} above {budget:.4f}"


# ---------------------------------------------------------------------------------------------
# EPMoE against the contract's reference

def _layer(mma_type="fp8xfp4", mode="normal", shared=0, max_tokens=32, experts=8, topk=3, device="cpu", seed=0,
           impl="staged", hidden=HIDDEN, inter=MOE_INTERMEDIATE, recipe=(1, 1, 32)):
    """An EPMoE with random weights; returns (layer, w1, w2, shared weights or None)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    layer = EPMoE(experts, topk, hidden, inter, max_tokens, mma_type=mma_type, impl=impl, mode=mode,
                  shared_intermediate=shared, device=device, recipe=recipe)
    layer.load_experts(w1, w2)
    sw = None
    if shared:
        sw = [torch.randn(s, generator=g) * s[1] ** -0.5 for s in ((shared, hidden), (shared, hidden), (hidden, shared))]
        layer.shared.load(*sw)
    return layer, w1, w2, sw


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
def test_epmoe_matches_reference(mma_type, mode):
    """Routed output == reference_moe within the contract's tolerances; shared expert added in BF16;
    leading dims, int32 ids, BF16 weights and -1 slots accepted; a second call with other inputs."""
    layer, w1, w2, sw = _layer(mma_type, mode, shared=128)
    if mma_type == "fp8xfp4":
        l1, l2 = quantize_fp4(w1), quantize_fp4(w2)
    else:
        l1, l2 = w1.bfloat16(), w2.bfloat16()
    g = torch.Generator().manual_seed(1)
    for t in (29, 11):
        x = random_tokens(t, HIDDEN, g)
        idx, w = random_routing(t, 8, 3, g, masked_ratio=0.2)
        layer.buffer.buffer.random_(0, 256)
        with torch.no_grad():
            y = layer(x.view(1, t, HIDDEN), idx.int().view(1, t, 3), w.bfloat16().view(1, t, 3))
        assert y.shape == (1, t, HIDDEN) and y.dtype == torch.bfloat16
        xq, xsf = quantize_fp8(x) if mma_type == "fp8xfp4" else (x, None)
        routed = reference_moe(xq, xsf, idx, w.bfloat16().float(), l1, l2)
        shared = layer.shared(x)
        torch.testing.assert_close(shared, torch.nn.functional.linear(
            torch.nn.functional.silu(x @ sw[0].bfloat16().T) * (x @ sw[1].bfloat16().T), sw[2].bfloat16()))
        check_moe_output(y[0], (routed.float() + shared.float()).bfloat16(), MOE_INTERMEDIATE, f"{mma_type} {mode} T={t}")


def test_epmoe_zero_tokens():
    layer, *_ = _layer()
    y = layer(torch.empty(0, HIDDEN, dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3))
    assert y.shape == (0, HIDDEN)


def test_validation_errors():
    with pytest.raises(ValueError, match="`impl` must be one of \\('staged', 'mega'\\), got 'fused'"):
        EPMoE(8, 2, HIDDEN, 128, 16, impl="fused")
    with pytest.raises(ValueError, match="`hidden` must be a multiple of 32"):
        EPMoE(8, 2, 200, 512, 16, impl="mega")
    with pytest.raises(ValueError, match="`mode` must be one of \\('mega',\\) for impl 'mega'"):
        EPMoE(8, 2, 512, 512, 16, impl="mega", mode="normal")
    with pytest.raises(ValueError, match="`mode` must be one of \\('normal', 'low_latency'\\) for impl 'staged'"):
        EPMoE(8, 2, HIDDEN, 128, 16, mode="fast")
    with pytest.raises(ValueError, match="`hidden` must be a multiple of 32"):
        EPMoE(8, 2, 200, 128, 16)
    with pytest.raises(ValueError, match="`num_topk` must be in \\[1, 8\\], got 9"):
        EPMoE(8, 9, HIDDEN, 128, 16)
    with pytest.raises(ValueError, match="`num_experts` must be a multiple of 4 \\(experts are split evenly over 4 ranks\\)"):
        expert_range(10, 0, 4)
    with pytest.raises(ValueError, match="`activation_clamp` must be positive"):
        EPMoE(8, 2, HIDDEN, 128, 16, activation_clamp=0.0)

    layer = EPMoE(8, 2, HIDDEN, 128, 16)
    x, idx, w = torch.randn(4, HIDDEN).bfloat16(), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    with pytest.raises(ValueError, match="`weights` are not loaded"):
        layer(x, idx, w)
    with pytest.raises(ValueError, match="`w1` must have shape \\[8, 256, 256\\]"):
        layer.load_experts(torch.randn(8, 256, 128), torch.randn(8, 256, 128))
    layer.load_experts(torch.randn(8, 256, 256), torch.randn(8, 256, 128))
    with pytest.raises(ValueError, match="`hidden_states` holds 17 tokens, above max_tokens=16"):
        layer(torch.randn(17, HIDDEN), torch.zeros(17, 2, dtype=torch.int64), torch.ones(17, 2))
    with pytest.raises(ValueError, match="`topk_idx` must have shape \\[4, 2\\], got \\[4, 3\\]"):
        layer(x, torch.zeros(4, 3, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="`hidden_states` must have shape \\[4, 256\\], got \\[4, 128\\]"):
        layer(x[:, :128], idx, w)
    with pytest.raises(ValueError, match="`topk_idx` must have dtype int32 or int64"):
        layer(x, idx.float(), w)
    with pytest.raises(ValueError, match="`topk_idx` must hold expert ids in \\[-1, num_experts=8\\)"):
        layer(x, idx + 8, w)
    with pytest.raises(ValueError, match="`buffer` has .* = \\(1, 8, 2, 256, 128, 'fp8xfp4'\\) and room for 16 tokens; "
                       "this layer needs \\(1, 8, 2, 256, 128, 'fp8xfp4'\\) and 17 tokens"):
        EPMoE(8, 2, HIDDEN, 128, 17, buffer=layer.buffer)
    with pytest.raises(ValueError, match="`buffer` has .* this layer needs \\(1, 8, 2, 256, 128, 'bf16'\\)"):
        EPMoE(8, 2, HIDDEN, 128, 16, mma_type="bf16", buffer=layer.buffer)

    with pytest.raises(ValueError, match="`scoring` must be one of"):
        TopKRouter(HIDDEN, 8, 2, scoring="relu")
    with pytest.raises(ValueError, match="`top_k` must be in \\[1, 4\\], got 5"):
        TopKRouter(HIDDEN, 16, 5, num_groups=4, topk_groups=1)


def test_checkpoint_namings_and_shards(tmp_path):
    """Per-expert (gate/up/down and w1/w3/w2) and fused namings, a sharded safetensors directory,
    and one rank's slice all read the same canonical weights."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(4, 2 * MOE_INTERMEDIATE, HIDDEN, generator=g).bfloat16()
    w2 = torch.randn(4, HIDDEN, MOE_INTERMEDIATE, generator=g).bfloat16()
    i = MOE_INTERMEDIATE
    gud = {f"m.experts.{e}.{n}.weight": t for e in range(4) for n, t in
           (("gate_proj", w1[e, :i]), ("up_proj", w1[e, i:]), ("down_proj", w2[e]))}
    mix = {f"m.experts.{e}.{n}.weight": t for e in range(4) for n, t in (("w1", w1[e, :i]), ("w3", w1[e, i:]), ("w2", w2[e]))}
    fused = {"m.experts.gate_up_proj": w1, "m.experts.down_proj": w2}
    shards = {"a.safetensors": {k: v.contiguous() for k, v in list(gud.items())[:5]},
              "b.safetensors": {k: v.contiguous() for k, v in list(gud.items())[5:]}}
    for name, part in shards.items():
        save_file(part, tmp_path / name)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(f'"{k}": "{n}"' for n, p in shards.items() for k in p) + "}}")
    save_file({k: v.contiguous() for k, v in fused.items()}, tmp_path / "fused.safetensors")
    for source in (gud, mix, fused, tmp_path, tmp_path / "fused.safetensors"):
        got1, got2 = read_expert_weights(source, "m.", expert_range(4, 1, 2))
        assert torch.equal(got1, w1[2:]) and torch.equal(got2, w2[2:])
    with pytest.raises(ValueError, match="`prefix` 'n.' has no experts in a known naming"):
        read_expert_weights(gud, "n.", range(2))
    with pytest.raises(ValueError, match="`source` has no tensor 'm.experts.4.gate_proj.weight'"):
        read_expert_weights(gud, "m.", range(4, 6))
    with pytest.raises(ValueError, match="`source` is not a state dict, a .safetensors file or a checkpoint directory"):
        read_expert_weights(tmp_path / "missing.safetensors", "m.", range(2))


# ---------------------------------------------------------------------------------------------
# torch.compile

@pytest.mark.parametrize("model_type", list(HF_MODELS))
def test_hf_model_compiles_without_graph_breaks(hf, model_type):
    """A whole HF model with swapped blocks compiles as one graph (aot_eager) and matches eager."""
    config, model, ckpt = hf[model_type]
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(11))
    torch._dynamo.reset()
    with swapped_blocks(config, model, ckpt, model_type, ids.numel()), torch.no_grad():
        compiled = torch.compile(model.model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(input_ids=ids).last_hidden_state, model.model(input_ids=ids).last_hidden_state)


def test_torch_compile_no_graph_breaks():
    """The custom op passes opcheck; full-graph compilation (aot_eager for a router + layer + shared
    expert, inductor for the layer) gives the eager result bit for bit, at two token counts."""
    layer, *_ = _layer(shared=128, max_tokens=40)
    torch.library.opcheck(torch.ops.megamoe.ep_moe.default, (random_tokens(12, HIDDEN, torch.Generator().manual_seed(3)),
                          *random_routing(12, 8, 3, torch.Generator().manual_seed(4)), layer.layer_id))
    router = TopKRouter(HIDDEN, 8, 3)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(5))
    block = MoEBlock(router, layer)
    bare, *_ = _layer(max_tokens=40, seed=1)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        compiled_block = torch.compile(block, fullgraph=True, backend="aot_eager")
        compiled_bare = torch.compile(bare, fullgraph=True, backend="inductor")
        for t in (40, 9):
            x = random_tokens(t, HIDDEN, g)
            idx, w = random_routing(t, 8, 3, g)
            assert torch.equal(compiled_block(x), block(x))
            assert torch.equal(compiled_bare(x, idx, w), bare(x, idx, w))


# ---------------------------------------------------------------------------------------------
# GPU

@pytest.mark.gpu
@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
@pytest.mark.parametrize("model_type", list(HF_MODELS))
def test_hf_block_swap_gpu(tmp_path, model_type, mma_type):
    config, model, ckpt = hf_model(model_type, tmp_path, device="cuda")
    x = random_tokens(48, HIDDEN, torch.Generator().manual_seed(7)).cuda()
    for mode in ("normal", "low_latency"):
        check_swapped_block(config, model, ckpt, model_type, HF_MODELS[model_type][1][-1], x, mma_type, mode, "cuda")


def _check_graph_replays_like_eager(layer: EPMoE, hidden: int, g: torch.Generator) -> None:
    """Capture one call of ``layer`` (which has run eagerly) in a CUDA graph, then replay it twice with new
    tokens and routing copied into its inputs: each replay must equal an eager call bit for bit."""
    x, idx, w = random_tokens(20, hidden, g).cuda(), *(t.cuda() for t in random_routing(20, 8, 3, g))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = layer(x, idx, w)
    for _ in range(2):
        x.copy_(random_tokens(20, hidden, g))
        new_idx, new_w = random_routing(20, 8, 3, g, masked_ratio=0.2)
        idx.copy_(new_idx)
        w.copy_(new_w)
        graph.replay()
        with torch.no_grad():
            assert torch.equal(out, layer(x, idx, w))


@pytest.mark.gpu
def test_cuda_graph_low_latency_gpu():
    """A low-latency layer captured in a CUDA graph replays new inputs like eager calls."""
    layer, *_ = _layer(mode="low_latency", shared=128, device="cuda")
    g = torch.Generator().manual_seed(10)
    x, idx, w = random_tokens(20, HIDDEN, g).cuda(), *(t.cuda() for t in random_routing(20, 8, 3, g))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        layer(x, idx, w)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    _check_graph_replays_like_eager(layer, HIDDEN, g)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)])
def test_mega_impl_gpu(recipe):
    """impl="mega" (the Mega MoE) on one GPU, both recipes: the recipe's reference plus the shared expert,
    then a CUDA graph of the layer replaying new inputs exactly like eager calls."""
    hidden = inter = 512
    layer, w1, w2, _ = _layer(impl="mega", mode=None, shared=128, device="cuda", hidden=hidden, inter=inter,
                              recipe=recipe)
    assert layer.cuda_graph_capturable
    l1, l2 = quantize_fp4(w1.cuda()), quantize_fp4(w2.cuda())
    g = torch.Generator().manual_seed(11)
    for t in (29, 1):
        x = random_tokens(t, hidden, g).cuda()
        idx, w = (v.cuda() for v in random_routing(t, 8, 3, g, masked_ratio=0.2))
        with torch.no_grad():
            y = layer(x, idx, w)
        routed = reference_moe(*quantize_fp8(x, recipe=recipe), idx, w, l1, l2)
        check_moe_output(y, (routed.float() + layer.shared(x).float()).bfloat16(), inter, f"mega {recipe} T={t}",
                         recipe)
    _check_graph_replays_like_eager(layer, hidden, g)
