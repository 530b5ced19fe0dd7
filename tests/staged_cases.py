"""Shared body of the staged-path checks, run by single-process and multi-rank tests alike (``case["recipe"]``: the
FP8 x FP4 recipe, default (1, 1, 32))."""

import torch

from megamoe import StagedMoE, get_symm_buffer_for_mega_moe, reference_moe
from megamoe.inputs import fill_buffer, global_problem, local_experts
from megamoe.numerics import check_moe_output


def check_staged_against_reference(rank, group, device, case: dict) -> None:
    """Build the global problem of ``case``, run the staged path for this rank's tokens (twice, with
    fresh inputs the second time) and compare with the single-process FP32 reference."""
    num_ranks = len(case["tokens_per_rank"])
    e, k, h, i = case["experts"], case["topk"], case["hidden"], case["intermediate"]
    mma = case.get("mma_type", "fp8xfp4")
    recipe = case.get("recipe", (1, 1, 32))
    buf = get_symm_buffer_for_mega_moe(group, e, max(case["tokens_per_rank"] + [1]), k, h, i, mma_type=mma, device=device,
                                       recipe=recipe)
    for call, seed in enumerate((case["seed"], case["seed"] + 1)):
        p = global_problem(seed, case["tokens_per_rank"], e, k, h, i, mma, case.get("masked_ratio", 0.0), case.get("hot_experts"))
        l1, l2 = local_experts(p["l1"], rank, num_ranks, device), local_experts(p["l2"], rank, num_ranks, device)
        staged = StagedMoE(l1, l2, case.get("mode", "normal"), case.get("gemm", "torch"), recipe=recipe)
        x_q, x_sf = fill_buffer(buf, p["x"][rank].to(device), p["topk_idx"][rank].to(device), p["topk_weights"][rank].to(device))
        t = p["x"][rank].shape[0]
        y = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=device)  # poisoned
        stats = torch.full((e // num_ranks,), 7, dtype=torch.int32, device=device)
        staged(y, buf, stats, activation_clamp=case.get("clamp"))

        # Reference on the whole problem (all ranks' tokens, all experts), then this rank's rows.
        all_x = torch.cat([v.to(device) for v in p["x"]])
        if mma == "fp8xfp4":
            from megamoe.layouts import quantize_fp8

            all_q, all_sf = quantize_fp8(all_x, recipe=recipe)
        else:
            all_q, all_sf = all_x, None
        all_idx, all_w = torch.cat(p["topk_idx"]).to(device), torch.cat(p["topk_weights"]).to(device)
        l1_all, l2_all = local_experts(p["l1"], 0, 1, device), local_experts(p["l2"], 0, 1, device)
        ref = reference_moe(all_q, all_sf, all_idx, all_w, l1_all, l2_all, case.get("clamp"))
        start = sum(case["tokens_per_rank"][:rank])
        check_moe_output(y, ref[start : start + t], i, f"rank {rank} call {call} recipe {recipe}",
                         recipe if mma == "fp8xfp4" else (1, 1, 32))
        assert not y.isnan().any()

        per = e // num_ranks
        mine = all_idx[(all_idx >= rank * per) & (all_idx < (rank + 1) * per)] - rank * per
        assert torch.equal(stats.cpu(), (7 + torch.bincount(mine.cpu(), minlength=per)).int())
    buf.destroy()
