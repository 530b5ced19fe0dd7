"""megamoe.nn on 2 ranks (gloo on CPU; NCCL under -m gpu): Hugging Face MoE blocks swapped for EP
layers, each rank reading only its experts from the checkpoint and routing its own tokens.

The parent process builds the models and their reference outputs (transformers is needed there
only); the ranks get plain configs, the checkpoint path, the tokens and the references.
"""

import pytest
import torch
from test_nn import (
    HF_MODELS,
    HIDDEN,
    block_budget,
    check_block,
    hf_block_outputs,
    hf_model,
    hf_prefix,
)

from helpers.spawn import spawn
from megamoe.inputs import random_tokens
from megamoe.nn import EPMoE, expert_range, moe_block_from_config

# (model_type, mma_type, mode, tokens per rank)
CASES = [
    ("qwen3_moe", "bf16", "normal", [13, 6]),
    ("qwen3_moe", "fp8xfp4", "low_latency", [0, 11]),
    ("mixtral", "fp8xfp4", "normal", [9, 17]),
    ("mixtral", "bf16", "low_latency", [12, 12]),
    ("deepseek_v3", "fp8xfp4", "normal", [16, 0]),
    ("deepseek_v3", "fp8xfp4", "low_latency", [7, 20]),
]


def _problems(tmp_path) -> list[dict]:
    """Every case's config (as a dict), checkpoint, global tokens, HF references and budget."""
    models = {name: hf_model(name, tmp_path / name) for name in {c[0] for c in CASES}}
    problems = []
    for seed, (model_type, mma_type, mode, tokens) in enumerate(CASES):
        config, model, ckpt = models[model_type]
        layer = HF_MODELS[model_type][1][-1]
        x = random_tokens(sum(tokens), HIDDEN, torch.Generator().manual_seed(seed))
        problems.append(dict(
            what=f"{model_type} {mma_type} {mode} {tokens}", config=config.to_dict(), ckpt=str(ckpt),
            prefix=hf_prefix(model_type, layer), mma_type=mma_type, mode=mode, tokens=tokens, x=x,
            ref=hf_block_outputs(model, layer, x), budget=block_budget(model, layer, x, mma_type)))
    return problems


def _check_blocks(rank, group, device, problems):
    for p in problems:
        start, t = sum(p["tokens"][:rank]), p["tokens"][rank]
        block = moe_block_from_config(p["config"], p["ckpt"], p["prefix"], max(p["tokens"]), group,
                                      mma_type=p["mma_type"], mode=p["mode"], device=device)
        assert block.moe.local_experts == expert_range(block.moe.num_experts, rank, 2)
        ref = {k: v[start : start + t] for k, v in p["ref"].items()}
        check_block(block, p["x"][start : start + t].to(device), ref, p["budget"], f"rank {rank} {p['what']}")
        block.moe.destroy()
    with pytest.raises(ValueError, match="`num_experts` must be a multiple of 2 \\(experts are split evenly over 2 ranks\\)"):
        EPMoE(9, 2, HIDDEN, 128, 16, group, device=device)  # raises on every rank, before any collective


def test_hf_block_swap_two_ranks_gloo(tmp_path):
    spawn(_check_blocks, 2, _problems(tmp_path))


@pytest.mark.gpu
def test_hf_block_swap_two_gpus_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_check_blocks, 2, _problems(tmp_path), use_cuda=True)
