"""The staged EP path on several ranks, both FP8 x FP4 recipes: gloo processes on CPU; NCCL on GPUs under -m gpu."""

import pytest
import torch

from helpers.spawn import spawn
from megamoe import distributed_reference_moe, get_symm_buffer_for_mega_moe, reference_moe
from megamoe.inputs import fill_buffer, global_problem, local_experts
from megamoe.numerics import check_moe_output
from staged_cases import check_staged_against_reference

BASE = dict(experts=8, topk=3, hidden=256, intermediate=128, seed=11)
CASES = {
    "r2_uneven_masked": dict(BASE, tokens_per_rank=[13, 5], masked_ratio=0.25),
    "r2_zero_token_rank": dict(BASE, tokens_per_rank=[0, 9]),
    "r2_skewed_bf16": dict(BASE, tokens_per_rank=[7, 12], hot_experts=3, mma_type="bf16", clamp=0.75),
    "r4_uneven_empty_experts": dict(BASE, tokens_per_rank=[3, 17, 1, 0], hot_experts=5, masked_ratio=0.2),
    "r2_ll_uneven_masked": dict(BASE, tokens_per_rank=[13, 5], masked_ratio=0.25, mode="low_latency"),
    "r4_ll_zero_token_rank_bf16": dict(BASE, tokens_per_rank=[3, 0, 8, 1], mma_type="bf16", mode="low_latency"),
    # recipe (1, 1, 128): uneven tokens, a rank with none, empty experts, masked slots
    "r2_uneven_masked_r128": dict(BASE, tokens_per_rank=[13, 5], masked_ratio=0.25, recipe=(1, 1, 128)),
    "r2_zero_token_rank_r128": dict(BASE, tokens_per_rank=[0, 9], clamp=0.75, recipe=(1, 1, 128)),
    "r2_ll_uneven_masked_r128": dict(BASE, tokens_per_rank=[13, 5], masked_ratio=0.25, mode="low_latency",
                                     recipe=(1, 1, 128)),
    "r4_uneven_empty_experts_r128": dict(BASE, tokens_per_rank=[3, 17, 1, 0], hot_experts=5, masked_ratio=0.2,
                                         recipe=(1, 1, 128)),
    "r4_ll_zero_token_rank_r128": dict(BASE, tokens_per_rank=[3, 0, 8, 1], masked_ratio=0.2, mode="low_latency",
                                       recipe=(1, 1, 128)),
    # sizes that are multiples of 32 only (the buffers' x and x_sf views of the real H over padded storage)
    "r2_qwen3_sizes_uneven": dict(BASE, hidden=2048, intermediate=768, tokens_per_rank=[7, 4], masked_ratio=0.2),
    "r2_ll_sizes_96_160_r128": dict(BASE, hidden=96, intermediate=160, tokens_per_rank=[9, 0], mode="low_latency",
                                    recipe=(1, 1, 128)),
}


@pytest.mark.parametrize("name", CASES)
def test_staged_multirank_gloo(name):
    case = CASES[name]
    spawn(check_staged_against_reference, len(case["tokens_per_rank"]), case)


def _check_distributed_reference(rank, group, device, tokens_per_rank, recipe=(1, 1, 32)):
    """The per-rank reference (local experts + all-reduce) equals the single-process one."""
    n = len(tokens_per_rank)
    p = global_problem(5, tokens_per_rank, 8, 2, 256, 128, masked_ratio=0.2)
    buf = get_symm_buffer_for_mega_moe(group, 8, max(tokens_per_rank), 2, 256, 128, device=device, recipe=recipe)
    x_q, x_sf = fill_buffer(buf, p["x"][rank], p["topk_idx"][rank], p["topk_weights"][rank])
    got = distributed_reference_moe(
        x_q, x_sf, p["topk_idx"][rank], p["topk_weights"][rank],
        local_experts(p["l1"], rank, n, device), local_experts(p["l2"], rank, n, device), group, max(tokens_per_rank),
    )
    from megamoe.layouts import quantize_fp8

    q, sf = quantize_fp8(torch.cat(p["x"]), recipe=recipe)
    ref = reference_moe(q, sf, torch.cat(p["topk_idx"]), torch.cat(p["topk_weights"]), p["l1"], p["l2"])
    start = sum(tokens_per_rank[:rank])
    check_moe_output(got, ref[start : start + tokens_per_rank[rank]], 128, f"rank {rank}", recipe)
    buf.destroy()


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)], ids=["recipe32", "recipe128"])
def test_distributed_reference_matches_single_process(recipe):
    spawn(_check_distributed_reference, 2, [6, 3], recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r2_uneven_masked", "r2_zero_token_rank", "r2_skewed_bf16", "r2_ll_uneven_masked",
                                  "r2_uneven_masked_r128", "r2_ll_uneven_masked_r128"])
def test_staged_two_gpus_nccl(name):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(check_staged_against_reference, 2, CASES[name], use_cuda=True)


def _check_symmetric_peer_views(rank, group, device):
    """Each rank writes a rank-specific pattern into its own view and reads the peer's over NVLink."""
    buf = get_symm_buffer_for_mega_moe(group, 8, 16, 2, 256, 128, device=device)
    assert buf.handle is not None and len(buf.peer_ptrs) == 2
    buf.topk_idx.copy_(torch.arange(32, device=device).view(16, 2) + 1000 * rank)
    torch.distributed.barrier(group)
    peer = 1 - rank
    assert torch.equal(buf.peer_view(peer, "topk_idx"), torch.arange(32, device=device).view(16, 2) + 1000 * peer)
    torch.distributed.barrier(group)
    buf.destroy()


@pytest.mark.gpu
def test_symm_buffer_peer_views_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(_check_symmetric_peer_views, 2, use_cuda=True)
