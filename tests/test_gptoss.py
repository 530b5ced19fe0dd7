"""gpt-oss experts ("swiglu_oai", per-expert biases, interleaved gate/up rows, MXFP4 checkpoints as published) and
Qwen3-MoE at its real hidden/intermediate ratio.

* The contract's step 4 of "swiglu_oai" against the formula written out here in float64.
* ``EPMoE`` (staged path, both modes, BF16 / FP8 x FP4 recipes) with gpt-oss experts against the contract's reference
  (``reference_moe`` with the activation and biases), within ``numerics.moe_tolerances``.
* The published MXFP4 tensors read bit for bit: bytes and UE8M0 codes unchanged, decoded exactly as transformers'
  own ``convert_moe_packed_tensors`` decodes them.
* transformers' ``GptOssMLP`` (tiny random config, random biases) against ``moe_block_from_config`` blocks loaded from
  the checkpoint ``save_pretrained`` writes (BF16) and from the same experts in the published MXFP4 naming.
* transformers' Qwen3-MoE block at 8:3 hidden/intermediate (Qwen3-30B-A3B's 2048:768) through ``save_pretrained``.

Error budgets against transformers, relative to the norm of the block's routed output, derived as ``test_nn`` does:

* BF16 recipe: ``GPT_OSS_BF16_BUDGET = sqrt(24) * 2**-8``: independent BF16 roundings (u = 2**-8) of the two paths,
  each a relative error <= u of what it rounds. transformers rounds gate_up + bias, alpha * gate, the sigmoid,
  gate * sigmoid, up + 1, their product, the down projection, + bias, times the routing weight, and once per slot
  added (k = 2): 12; megamoe rounds the BF16 weights and tokens (2), R1 (gate and up: 2), R2, R3, R4 and the
  routing weight: 8; the router's logits and weights are the same computation. 20 roundings, 24 to cover the
  ``up + 1`` near ``up = -1`` where a rounding of ``up`` counts relative to ``up``, not to ``up + 1``.
* FP8 x FP4 recipe: ``test_nn.fp4_budget`` (the weights here are exact FP4 values, so their terms vanish and the FP8
  tokens and activations remain), plus ``GPT_OSS_BF16_BUDGET`` for transformers' own BF16 roundings.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_nn import fp4_budget

from megamoe import reference_moe
from megamoe.inputs import random_routing, random_tokens
from megamoe.kernels.sm90 import GemmConfig
from megamoe.layouts import dequantize_fp4, quantize_fp4, quantize_fp8, unpack_ue8m0
from megamoe.nn import (
    EPMoE,
    GptOssMoEBlock,
    moe_block_from_config,
    read_expert_biases,
    read_fp4_expert_weights,
)
from megamoe.numerics import SWIGLU_OAI_ALPHA, check_moe_output, l1_epilogue

GPT_OSS_BF16_BUDGET = math.sqrt(24) * 2.0**-8
LIMIT = 7.0


def _oai_layer(mma_type="fp8xfp4", mode="normal", hidden=256, inter=256, experts=8, topk=3, device="cpu", seed=0,
               recipe=(1, 1, 32), impl="staged"):
    """An EPMoE with gpt-oss experts and random weights / biases; returns (layer, w1, w2, b1, b2)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    b1 = (torch.randn(experts, 2 * inter, generator=g) * 0.5).bfloat16()
    b2 = (torch.randn(experts, hidden, generator=g) * 0.5).bfloat16()
    layer = EPMoE(experts, topk, hidden, inter, 32, mma_type=mma_type, mode=mode, device=device, recipe=recipe,
                  activation="swiglu_oai", activation_clamp=LIMIT, impl=impl)
    layer.load_experts(w1, w2, b1, b2)
    return layer, w1, w2, b1, b2


def test_swiglu_oai_step4_matches_formula():
    """``l1_epilogue(activation="swiglu_oai")`` (BF16 output) against gpt-oss's formula in float64 on BF16 gate/up,
    clamped at the limit: equal up to the BF16 rounding of R2 (one BF16 ulp, 2**-8 relative) plus FP32 exp."""
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(64, 2 * 96, generator=g) * 6  # beyond the limit on both sides
    weight = torch.rand(64, generator=g)
    a, _ = l1_epilogue(acc, weight, LIMIT, fp8=False, activation="swiglu_oai")
    gate, up = acc[:, :96].bfloat16().double(), acc[:, 96:].bfloat16().double()
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    want = (up + 1) * gate * torch.sigmoid(1.702 * gate) * weight.double().unsqueeze(-1)
    torch.testing.assert_close(a.double(), want, rtol=2.0**-8 + 2.0**-20, atol=1e-30)
    assert SWIGLU_OAI_ALPHA == 1.702
    with pytest.raises(ValueError, match="`activation` must be one of \\('swiglu', 'swiglu_oai'\\), got 'gelu'"):
        l1_epilogue(acc, weight, None, fp8=False, activation="gelu")


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("mma_type,recipe", [("bf16", (1, 1, 32)), ("fp8xfp4", (1, 1, 32)), ("fp8xfp4", (1, 1, 128))])
def test_epmoe_gpt_oss_experts_match_reference(mma_type, recipe, mode):
    """Staged path (torch GEMMs: the L1 bias folded into the GEMM, the L2 bias in the combine) == reference_moe
    with the same activation, clamp and biases, within the contract's tolerances; the output moves by O(1) without
    the biases (they are not dropped)."""
    layer, w1, w2, b1, b2 = _oai_layer(mma_type, mode, recipe=recipe)
    l1, l2 = (quantize_fp4(w1), quantize_fp4(w2)) if mma_type == "fp8xfp4" else (w1.bfloat16(), w2.bfloat16())
    g = torch.Generator().manual_seed(1)
    for t in (29, 7):
        x = random_tokens(t, 256, g)
        idx, w = random_routing(t, 8, 3, g, masked_ratio=0.2)
        layer.buffer.buffer.random_(0, 256)
        with torch.no_grad():
            y = layer(x, idx, w)
        xq, xsf = quantize_fp8(x, recipe=recipe) if mma_type == "fp8xfp4" else (x, None)
        ref = reference_moe(xq, xsf, idx, w, l1, l2, LIMIT, "swiglu_oai", b1, b2)
        check_moe_output(y, ref, 256, f"{mma_type} {recipe} {mode} T={t}", recipe=recipe)
        no_bias = reference_moe(xq, xsf, idx, w, l1, l2, LIMIT, "swiglu_oai")
        assert float((no_bias.double() - ref.double()).norm() / ref.double().norm()) > 0.1


def test_gpt_oss_validation_errors():
    with pytest.raises(ValueError, match="`activation` 'swiglu_oai' runs on impl='staged' only"):
        EPMoE(8, 2, 512, 512, 16, impl="mega", activation="swiglu_oai")
    with pytest.raises(ValueError, match="`activation` must be one of"):
        EPMoE(8, 2, 256, 128, 16, activation="relu")
    layer = EPMoE(8, 2, 256, 128, 16, activation="swiglu_oai")
    w1, w2 = torch.randn(8, 256, 256), torch.randn(8, 256, 128)
    with pytest.raises(ValueError, match="`l1_bias` must have shape \\[8, 256\\], got \\[8, 128\\]"):
        layer.load_experts(w1, w2, torch.zeros(8, 128))
    with pytest.raises(ValueError, match="`l2_bias` must have shape \\[8, 256\\], got \\[4, 256\\]"):
        layer.load_experts(w1, w2, None, torch.zeros(4, 256))


# ---------------------------------------------------------------------------------------------
# Checkpoints as published

def _published_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights ``[E, N, K]`` (rows in the checkpoint's order) as gpt-oss publishes them: FP4 blocks uint8
    ``[E, N, K/32, 16]`` and UE8M0 codes uint8 ``[E, N, K/32]``."""
    q, sf = quantize_fp4(w)
    e, n, k = w.shape
    return q.view(e, n, k // 32, 16), unpack_ue8m0(sf).view(e, n, k // 32)


@pytest.mark.parametrize("h,i", [(256, 128), (2880, 96)])
def test_mxfp4_tensors_read_bit_exact(h, i):
    """Random bytes and scale codes in the published layout: the canonical FP4 pair holds the same bytes and codes
    (gate/up rows de-interleaved; gpt-oss's K = 2880 and K = 96: a partial last scale word), and decodes to exactly what
    transformers' ``convert_moe_packed_tensors`` makes."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(3)
    e = 4
    blocks = {"gate_up_proj": torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, dtype=torch.uint8),
              "down_proj": torch.randint(0, 256, (e, h, i // 32, 16), generator=g, dtype=torch.uint8)}
    scales = {"gate_up_proj": torch.randint(110, 140, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8),
              "down_proj": torch.randint(110, 140, (e, h, i // 32), generator=g, dtype=torch.uint8)}
    sd = {f"m.experts.{p}_{kind}": t[p] for p in blocks for kind, t in (("blocks", blocks), ("scales", scales))}
    (w1, s1), (w2, s2) = read_fp4_expert_weights(sd, "m.", range(1, 3))
    bg, sg = blocks["gate_up_proj"][1:3].reshape(2, 2 * i, h // 2), scales["gate_up_proj"][1:3]
    assert torch.equal(w1[:, :i], bg[:, 0::2]) and torch.equal(w1[:, i:], bg[:, 1::2])
    c1, c2 = unpack_ue8m0(s1)[..., : h // 32], unpack_ue8m0(s2)[..., : i // 32]  # the codes; then padding codes
    assert torch.equal(c1[:, :i], sg[:, 0::2]) and torch.equal(c1[:, i:], sg[:, 1::2])
    assert torch.equal(w2, blocks["down_proj"][1:3].reshape(2, h, i // 2))
    assert torch.equal(c2, scales["down_proj"][1:3])
    theirs1 = mxfp4.convert_moe_packed_tensors(blocks["gate_up_proj"][1:3], scales["gate_up_proj"][1:3],
                                               dtype=torch.float32).transpose(1, 2)  # [E, 2I, H] interleaved
    theirs2 = mxfp4.convert_moe_packed_tensors(blocks["down_proj"][1:3], scales["down_proj"][1:3],
                                               dtype=torch.float32).transpose(1, 2)
    mine1 = dequantize_fp4(w1, s1)
    assert torch.equal(mine1[:, :i], theirs1[:, 0::2]) and torch.equal(mine1[:, i:], theirs1[:, 1::2])
    assert torch.equal(dequantize_fp4(w2, s2), theirs2)


def hf_gpt_oss(path, hidden=256, inter=256, seed=0):
    """(config, BF16 GptOss model with random weights and biases, its save_pretrained dir, the MoE layers'
    published MXFP4 tensors): the experts' weights are replaced by transformers' own decoding of their MXFP4
    quantization, so the model, its BF16 checkpoint and the MXFP4 tensors hold the same values."""
    transformers = pytest.importorskip("transformers", minversion="5.17")
    pytest.importorskip("safetensors")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    config = transformers.GptOssConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"])
    published = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        # The model's own expert loop (GptOssExperts.forward) is the reference on every device, as on CPU (on CUDA,
        # transformers may otherwise dispatch the experts to another implementation).
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")
        with torch.no_grad():
            for layer in range(2):
                mlp, pre = model.model.layers[layer].mlp, f"model.layers.{layer}.mlp."
                mlp.router.bias.normal_(0.0, 0.05)
                ex = mlp.experts
                for name in ("gate_up_proj", "down_proj"):
                    w = torch.randn(getattr(ex, name).shape) * getattr(ex, name).shape[1] ** -0.5
                    blocks, scales = _published_mxfp4(w.transpose(1, 2))  # [E, N, K]: rows of the output
                    getattr(ex, name).copy_(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
                    published[f"{pre}experts.{name}_blocks"], published[f"{pre}experts.{name}_scales"] = blocks, scales
                    getattr(ex, f"{name}_bias").normal_(0.0, 0.5)
                    published[f"{pre}experts.{name}_bias"] = getattr(ex, f"{name}_bias").detach().clone()
                published[f"{pre}router.weight"] = mlp.router.weight.detach().clone()
                published[f"{pre}router.bias"] = mlp.router.bias.detach().clone()
    model.save_pretrained(path)
    return config, model, path, published


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return hf_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def check_gpt_oss_block(config, model, source, layer, x, mma_type, mode, device) -> float:
    """A ``moe_block_from_config`` block from ``source`` against the model's ``GptOssMLP`` on tokens ``x``: same
    experts and router scores (the same computation), output within the budget of the module docstring."""
    block = moe_block_from_config(config, source, f"model.layers.{layer}.mlp.", x.shape[0], None, mma_type=mma_type,
                                  mode=mode, device=device)
    assert isinstance(block, GptOssMoEBlock)
    block.moe.buffer.buffer.random_(0, 256)
    hf = model.model.layers[layer].mlp
    with torch.no_grad():
        _, ref_scores, ref_idx = hf.router(x)
        ref_y, _ = hf(x.unsqueeze(0))
        routed = ref_y[0].double().norm()
        y, scores = block(x.unsqueeze(0))
    idx, _ = block.router(x)
    assert torch.equal(idx.cpu(), ref_idx.cpu()), "routing differs from the model's router"
    assert scores.dtype == ref_scores.dtype and torch.equal(scores.cpu(), ref_scores.cpu())
    err = float((y[0].cpu().double() - ref_y[0].cpu().double()).norm() / routed.cpu())
    budget = GPT_OSS_BF16_BUDGET
    if mma_type == "fp8xfp4":
        ex = hf.experts
        budget += fp4_budget(x, ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2))[1]
    assert err <= budget, f"{mma_type} {mode}: relative error {err:.4f} above the budget {budget:.4f}"
    block.moe.destroy()
    return err


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
@pytest.mark.parametrize("checkpoint", ["save_pretrained", "published_mxfp4"])
def test_gpt_oss_block_swap(gpt_oss, checkpoint, mma_type, mode):
    config, model, path, published = gpt_oss
    x = random_tokens(48, config.hidden_size, torch.Generator().manual_seed(7))
    source = path if checkpoint == "save_pretrained" else published
    check_gpt_oss_block(config, model, source, 1, x, mma_type, mode, "cpu")


def test_gpt_oss_config_without_swiglu_fields(gpt_oss):
    """A gpt_oss config without ``swiglu_limit`` and ``swiglu_alpha`` (transformers' ``GptOssConfig`` has neither up
    to 5.17, whose experts clamp at 7.0 whatever the config says): the block clamps at gpt-oss's 7.0 (the tokens here
    reach the clamp: without it the error is O(1)) and matches the model within the budget."""
    config, model, path, _ = gpt_oss
    bare = {k: v for k, v in config.to_dict().items() if k not in ("swiglu_limit", "swiglu_alpha")}
    x = random_tokens(48, config.hidden_size, torch.Generator().manual_seed(7))
    check_gpt_oss_block(bare, model, path, 1, x, "bf16", "normal", "cpu")


def test_gpt_oss_checkpoints_load_the_same_layer(gpt_oss):
    """The published MXFP4 tensors load as the stored bytes, and hold the same values as the BF16 checkpoint
    quantized at load (whose codes may differ: a block whose largest code is small re-quantizes with a smaller scale,
    and -0 becomes +0); biases de-interleaved exactly."""
    config, model, path, published = gpt_oss
    a = moe_block_from_config(config, path, "model.layers.0.mlp.", 8)
    b = moe_block_from_config(config, published, "model.layers.0.mlp.", 8)
    (w1, s1), (w2, s2) = read_fp4_expert_weights(published, "model.layers.0.mlp.", range(8))
    assert all(torch.equal(x, y) for x, y in zip((*b.moe.w1, *b.moe.w2), (w1, s1, w2, s2)))
    assert torch.equal(dequantize_fp4(*a.moe.w1), dequantize_fp4(*b.moe.w1))
    assert torch.equal(dequantize_fp4(*a.moe.w2), dequantize_fp4(*b.moe.w2))
    assert torch.equal(a.moe.l1_bias, b.moe.l1_bias) and torch.equal(a.moe.l2_bias, b.moe.l2_bias)
    b1, b2 = read_expert_biases(published, "model.layers.0.mlp.", range(8))
    hf_b1 = model.model.layers[0].mlp.experts.gate_up_proj_bias
    assert torch.equal(b1[:, : config.intermediate_size], hf_b1[:, 0::2])
    assert torch.equal(b1[:, config.intermediate_size :], hf_b1[:, 1::2])
    assert torch.equal(b2, model.model.layers[0].mlp.experts.down_proj_bias)
    with pytest.raises(ValueError, match="`activation` must be 'swiglu_oai' for gpt-oss experts"):
        EPMoE.from_checkpoint(published, "model.layers.0.mlp.", 8, 2, 8)


def test_gpt_oss_model_swap(gpt_oss):
    """The whole GptOss model with both MLPs swapped (BF16 recipe; the block returns the router scores as the
    decoder layer unpacks them): final hidden states within ``test_nn.model_budget``."""
    from test_nn import model_budget

    config, model, path, _ = gpt_oss
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    seen = {}
    hooks = [model.model.layers[layer].mlp.register_forward_hook(
        lambda m, i, o, layer=layer: seen.__setitem__(layer, float(o[0].double().norm()))) for layer in range(2)]
    hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("final", float(i[0].double().norm()))))
    with torch.no_grad():
        ref = model.model(input_ids=ids).last_hidden_state
    for h in hooks:
        h.remove()
    originals = [model.model.layers[layer].mlp for layer in range(2)]
    try:
        for layer in range(2):
            model.model.layers[layer].mlp = moe_block_from_config(config, path, f"model.layers.{layer}.mlp.", ids.numel(),
                                                                  mma_type="bf16")
        with torch.no_grad():
            y = model.model(input_ids=ids).last_hidden_state
    finally:
        for layer in range(2):
            model.model.layers[layer].mlp = originals[layer]
    budget = model_budget([GPT_OSS_BF16_BUDGET * seen[layer] for layer in range(2)], seen["final"], 2)
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert err <= budget, f"final hidden states relative error {err:.4f} above {budget:.4f}"


@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
def test_qwen3_moe_real_ratio(tmp_path, mma_type):
    """Qwen3-MoE at Qwen3-30B-A3B's hidden:intermediate ratio (1024:384 = 2048:768) from ``save_pretrained``."""
    from test_nn import BF16_BUDGET, check_block, hf_block_outputs

    transformers = pytest.importorskip("transformers", minversion="5.17")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=1024, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=64, intermediate_size=512, moe_intermediate_size=384, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    x = random_tokens(32, 1024, torch.Generator().manual_seed(5))
    block = moe_block_from_config(config, tmp_path, "model.layers.0.mlp.", 32, mma_type=mma_type)
    experts = model.model.layers[0].mlp.experts
    budget = BF16_BUDGET if mma_type == "bf16" else fp4_budget(x, experts.gate_up_proj, experts.down_proj)[1]
    check_block(block, x, hf_block_outputs(model, 0, x), budget, f"qwen3_moe 1024:384 {mma_type}")
    block.moe.destroy()


# ---------------------------------------------------------------------------------------------
# SM90 kernels on a CPU: the gpt-oss L1 epilogues compile for sm_90a

# (config, group mode, epilogue, folded, bias, fast_math): both recipes' SwiGLU epilogues (FP8 out, BF16 out, per-128), the three
# group modes, with and without the L1 bias, one IEEE-exp build.
OAI_COMPILE_CASES = [
    (GemmConfig(tile_tokens=16, tile_n=128), "offsets", "swiglu_fp8_bf16", False, True, True),
    (GemmConfig(tile_tokens=8, tile_n=64), "masked", "swiglu_fp8_bf16", False, False, True),
    (GemmConfig(tile_tokens=64, tile_n=128, mma="fp8"), "offsets_counts", "swiglu_fp8", False, True, True),
    (GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128), "offsets", "swiglu_fp8", True, True, True),
    (GemmConfig(tile_tokens=8, tile_n=256, mma="fp8", token_block=128), "masked", "swiglu_fp8", True, False, False),
]


def test_gpt_oss_epilogues_compile_for_sm90a(tmp_path):
    """Every gpt-oss L1 epilogue variant compiles, issues wgmma, calls no function (ptxas would serialize the
    wgmmas), and where a ptxas is on PATH draws no C75xx advisory."""
    import dataclasses

    from test_sm90_compile import compile_report

    cases = [(dataclasses.asdict(c), m, e, None, False, False, folded, fast, "swiglu_oai", bias)
             for c, m, e, folded, bias, fast in OAI_COMPILE_CASES]
    for case, build in zip(OAI_COMPILE_CASES, compile_report(cases, tmp_path)):
        assert "error" not in build, (case, build.get("error"))
        assert build["wgmma"] and build["calls"] == 0, (case, build)
        assert not build.get("ptxas"), (case, build["ptxas"])


# ---------------------------------------------------------------------------------------------
# GPU: the SM90 kernels' L1 epilogue (bias + "swiglu_oai") on the staged path

@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)])
@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("hidden,inter", [(512, 512), (512, 1024), (2880, 2880)])
def test_staged_sm90_gpt_oss_experts_gpu(recipe, fast_math, hidden, inter):
    """StagedMoE(gemm="sm90") with gpt-oss experts (the kernel's L1 epilogue adds the bias and applies
    "swiglu_oai") == reference_moe within the contract's tolerances, both modes; at gpt-oss's sizes the kernels run
    H = I = 2944 (23 chunks of 128), the L1 bias zero-padded with the weights."""
    from megamoe import StagedMoE, get_symm_buffer_for_mega_moe
    from megamoe.inputs import fill_buffer

    experts, topk = 8, 3
    g = torch.Generator().manual_seed(12)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    b1 = (torch.randn(experts, 2 * inter, generator=g) * 0.5).bfloat16().cuda()
    b2 = (torch.randn(experts, hidden, generator=g) * 0.5).bfloat16().cuda()
    l1, l2 = quantize_fp4(w1.cuda()), quantize_fp4(w2.cuda())
    buf = get_symm_buffer_for_mega_moe(None, experts, 64, topk, hidden, inter, recipe=recipe)
    moe = StagedMoE(l1, l2, "normal", gemm="sm90", fast_math=fast_math, recipe=recipe, activation="swiglu_oai",
                    l1_bias=b1, l2_bias=b2)
    for mode in ("normal", "low_latency"):
        for t in (61, 5):
            x = random_tokens(t, hidden, g).cuda()
            idx, w = (v.cuda() for v in random_routing(t, experts, topk, g, masked_ratio=0.2))
            fill_buffer(buf, x, idx, w)
            y = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            moe.with_mode(mode)(y, buf, None, LIMIT)
            ref = reference_moe(*quantize_fp8(x, recipe=recipe), idx, w, l1, l2, LIMIT, "swiglu_oai", b1, b2)
            check_moe_output(y, ref, inter, f"sm90 {recipe} {mode} T={t}", recipe=recipe)
    buf.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("mma_type", ["bf16", "fp8xfp4"])
def test_gpt_oss_block_swap_gpu(tmp_path, mma_type):
    """The transformers comparison on a GPU (staged path, torch GEMMs), at hidden = intermediate = 512."""
    config, model, path, published = hf_gpt_oss(tmp_path, hidden=512, inter=512)
    model.cuda()
    x = random_tokens(48, 512, torch.Generator().manual_seed(7)).cuda()
    for source in (path, published):
        for mode in ("normal", "low_latency"):
            check_gpt_oss_block(config, model, source, 1, x, mma_type, mode, "cuda")
