"""gpt-oss MoE blocks on 2 ranks (gloo on CPU; NCCL under -m gpu): each rank reads its experts (and every expert's
L2 bias, which the combine adds on the tokens' rank) from the published MXFP4 tensors or the BF16 checkpoint, routes
its own tokens, and matches transformers' ``GptOssMLP`` within ``test_gptoss``'s budgets.

The parent builds the model and its reference outputs (transformers is needed there only); the ranks get the config
as a dict, the checkpoint paths, the tokens and the references.
"""

import pytest
import torch
from helpers.spawn import spawn
from test_gptoss import GPT_OSS_BF16_BUDGET, hf_gpt_oss
from test_nn import fp4_budget

from megamoe.inputs import random_tokens
from megamoe.nn import moe_block_from_config

# (checkpoint, mma_type, mode, tokens per rank)
CASES = [
    ("published_mxfp4", "fp8xfp4", "normal", [13, 6]),
    ("published_mxfp4", "bf16", "low_latency", [0, 11]),
    ("save_pretrained", "fp8xfp4", "low_latency", [9, 17]),
    ("save_pretrained", "bf16", "normal", [12, 12]),
]


def _problems(tmp_path) -> list[dict]:
    save_file = pytest.importorskip("safetensors.torch").save_file
    config, model, path, published = hf_gpt_oss(tmp_path / "model")
    save_file({k: v.contiguous() for k, v in published.items()}, tmp_path / "mxfp4.safetensors")
    sources = {"save_pretrained": str(path), "published_mxfp4": str(tmp_path / "mxfp4.safetensors")}
    hf = model.model.layers[1].mlp
    problems = []
    for seed, (checkpoint, mma_type, mode, tokens) in enumerate(CASES):
        x = random_tokens(sum(tokens), config.hidden_size, torch.Generator().manual_seed(seed))
        with torch.no_grad():
            _, scores, idx = hf.router(x)
            y = hf(x.unsqueeze(0))[0][0]
        budget = GPT_OSS_BF16_BUDGET
        if mma_type == "fp8xfp4":
            budget += fp4_budget(x, hf.experts.gate_up_proj.transpose(1, 2), hf.experts.down_proj.transpose(1, 2))[1]
        problems.append(dict(what=f"{checkpoint} {mma_type} {mode} {tokens}", config=config.to_dict(),
                             source=sources[checkpoint], mma_type=mma_type, mode=mode, tokens=tokens, x=x,
                             ref=dict(y=y, scores=scores, idx=idx), budget=budget))
    return problems


def _check_blocks(rank, group, device, problems):
    for p in problems:
        start, t = sum(p["tokens"][:rank]), p["tokens"][rank]
        block = moe_block_from_config(p["config"], p["source"], "model.layers.1.mlp.", max(p["tokens"]), group,
                                      mma_type=p["mma_type"], mode=p["mode"], device=device)
        assert block.moe.l2_bias.shape[0] == block.moe.num_experts  # every expert's L2 bias on every rank
        x = p["x"][start : start + t].to(device)
        block.moe.buffer.buffer.random_(0, 256)
        with torch.no_grad():
            y, scores = block(x.unsqueeze(0))
            idx, _ = block.router(x)
        ref = {k: v[start : start + t] for k, v in p["ref"].items()}
        assert torch.equal(idx.cpu(), ref["idx"]) and torch.equal(scores.cpu(), ref["scores"]), p["what"]
        if t:
            err = float((y[0].cpu().double() - ref["y"].double()).norm() / ref["y"].double().norm())
            assert err <= p["budget"], f"rank {rank} {p['what']}: relative error {err:.4f} above {p['budget']:.4f}"
        block.moe.destroy()


def test_gpt_oss_block_two_ranks_gloo(tmp_path):
    spawn(_check_blocks, 2, _problems(tmp_path))


@pytest.mark.gpu
def test_gpt_oss_block_two_gpus_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_check_blocks, 2, _problems(tmp_path), use_cuda=True)
