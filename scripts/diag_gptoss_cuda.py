"""Stage-by-stage check of the gpt-oss block of ``tests/test_gptoss.py::test_gpt_oss_block_swap_gpu`` against
transformers' ``GptOssMLP``, on CUDA (when there is one) and on CPU, to pinpoint where the two part.

Run from the repository root: ``python scripts/diag_gptoss_cuda.py [--mma bf16|fp8xfp4] [--hidden 512]``.

The block is ``moe_block_from_config`` on the test's random model (hidden = intermediate = 512, 8 experts, top-2,
layer 1, the ``save_pretrained`` checkpoint), staged path, normal mode. Each (token, slot) pair is followed through
the staged path's own steps (its torch GEMM operands ``w1t`` / ``w2t`` and ``numerics.l1_epilogue``, grouped by
expert as it groups them) and through an FP32 computation from transformers' own parameters (gate / up
de-interleaved here, the clamp at the model's ``experts.limit``). Printed, as ``||mine - ref|| / ||ref||``:

* ``router``: ids equal, weights' largest difference (the model's router vs the block's);
* ``L1 pre-act``: the L1 GEMM with its bias (BF16, R1) vs FP32;
* ``L1 post-act``: the activation times the routing weight (R2 dequantized) vs FP32 with the model's clamp, next to
  the clamp the block uses;
* ``L2``: the L2 GEMM on the block's own activations vs FP32 on the same activations (isolates the L2 weights);
* ``block`` / ``model``: the block's and the model's outputs vs an FP64 loop over the model's parameters.

Expected within rounding: router equal; L1 ~2**-8; post-act ~2**-8 (BF16) or ~2**-4 (FP8); L2 ~2**-8; block and
model ~2**-8 (BF16) or a few 2**-5 (FP8). O(1) marks the stage that differs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch

torch.backends.cuda.matmul.allow_tf32 = False  # the FP32 references in full FP32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import transformers
from test_gptoss import hf_gpt_oss

from megamoe.inputs import random_tokens
from megamoe.layouts import contiguous_layout, dequantize_fp8, quantize_fp8
from megamoe.nn import moe_block_from_config
from megamoe.numerics import SWIGLU_OAI_ALPHA, l1_epilogue, rel_fro_error

LAYER = 1


def _oai_fp32(gate_up: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's activation on ``[M, 2I]`` ([gate | up]) in FP32, clamped at ``limit``, times ``weight [M]``."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter].clamp(max=limit), gate_up[:, inter:].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate) * weight.unsqueeze(-1)


def stages(config, model, path, x: torch.Tensor, mma_type: str, device: str) -> None:
    model = copy.deepcopy(model).to(device)
    x = x.to(device)
    hf = model.model.layers[LAYER].mlp
    ex = hf.experts
    block = moe_block_from_config(config, path, f"model.layers.{LAYER}.mlp.", x.shape[0], None, mma_type=mma_type,
                                  mode="normal", device=device)
    moe, staged = block.moe, block.moe._impl
    inter = ex.down_proj.shape[1]
    print(f"--- {device} {mma_type}: block clamp {moe.activation_clamp}, model clamp {ex.limit}, alpha {ex.alpha}")
    with torch.no_grad():
        _, ref_w, ref_idx = hf.router(x)
        idx, w = block.router(x)
        print(f"router: ids equal {torch.equal(idx, ref_idx)}, weights max |diff| "
              f"{float((w - ref_w.float()).abs().max()):.3e}")

        # The staged path's grouping (StagedMoE._expert_compute with one rank): pairs sorted by expert.
        k = idx.shape[1]
        grouped = contiguous_layout(idx.flatten(), moe.num_experts, 1)
        pair = torch.empty(grouped.num_rows, dtype=torch.int64, device=device)
        valid = grouped.row_index >= 0
        pair[grouped.row_index[valid]] = torch.arange(idx.numel(), device=device)[valid]
        row, slot = pair // k, pair % k
        expert, weight = idx[row, slot], w[row, slot]
        ends = grouped.offsets[1:]
        a_in = dequantize_fp8(*quantize_fp8(x[row]), torch.bfloat16) if staged.fp8 else x[row].bfloat16()

        # FP32 from transformers' parameters: gate_up_proj [E, H, 2I] with gate / up interleaved in its columns.
        w1 = ex.gate_up_proj.float()[expert]
        w1 = torch.cat([w1[:, :, 0::2], w1[:, :, 1::2]], dim=2)  # [M, H, 2I] as [gate | up]
        b1 = ex.gate_up_proj_bias.float()[expert]
        b1 = torch.cat([b1[:, 0::2], b1[:, 1::2]], dim=1)
        l1_ref = torch.bmm(a_in.float().unsqueeze(1), w1).squeeze(1) + b1
        l1 = torch._grouped_mm(staged._bias_columns(a_in), staged.w1t, offs=ends)
        gate_err = rel_fro_error(l1[:, :inter], l1_ref[:, :inter])
        up_err = rel_fro_error(l1[:, inter:], l1_ref[:, inter:])
        print(f"L1 pre-act:  {rel_fro_error(l1, l1_ref):.3e}  (gate {gate_err:.3e}, up {up_err:.3e})")

        a, a_sf = l1_epilogue(l1, weight, moe.activation_clamp, staged.fp8, activation="swiglu_oai")
        a = dequantize_fp8(a, a_sf, torch.bfloat16) if staged.fp8 else a
        act_ref = _oai_fp32(l1_ref, weight, ex.limit)
        clamped = float(((l1_ref[:, :inter] > ex.limit) | (l1_ref[:, inter:].abs() > ex.limit)).float().mean())
        print(f"L1 post-act: {rel_fro_error(a, act_ref):.3e}  (block clamp {moe.activation_clamp}, model clamp "
              f"{ex.limit}; {clamped:.1%} of gate/up pairs past the model's clamp)")

        l2 = torch._grouped_mm(a, staged.w2t, offs=ends)
        l2_ref = torch.bmm(a.float().unsqueeze(1), ex.down_proj.float()[expert]).squeeze(1)
        print(f"L2:          {rel_fro_error(l2, l2_ref):.3e}")

        y, _ = block(x.unsqueeze(0))
        ref_y, _ = hf(x.unsqueeze(0))
        exact = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=device)
        for j in range(k):  # the model's parameters in FP64, slot by slot
            e, wj = ref_idx[:, j], ref_w[:, j].double()
            gu = torch.bmm(x.double().unsqueeze(1), ex.gate_up_proj.double()[e]).squeeze(1)
            gu = gu + ex.gate_up_proj_bias.double()[e]
            act = _oai_fp32(torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1), wj, ex.limit)
            exact += torch.bmm(act.unsqueeze(1), ex.down_proj.double()[e]).squeeze(1)
            exact += wj.unsqueeze(-1) * ex.down_proj_bias.double()[e]
        print(f"block vs FP64: {rel_fro_error(y[0], exact):.3e}   model vs FP64: {rel_fro_error(ref_y[0], exact):.3e}"
              f"   block vs model: {rel_fro_error(y[0], ref_y[0]):.3e}")
    moe.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mma", choices=("bf16", "fp8xfp4"), default="bf16")
    parser.add_argument("--hidden", type=int, default=512, help="hidden = intermediate (the GPU test's 512)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        config, model, path, _ = hf_gpt_oss(tmp, hidden=args.hidden, inter=args.hidden)
        print(f"config.swiglu_limit {getattr(config, 'swiglu_limit', 'absent')}, "
              f"config.swiglu_alpha {getattr(config, 'swiglu_alpha', 'absent')}")
        x = random_tokens(48, args.hidden, torch.Generator().manual_seed(7))
        for device in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
            stages(config, model, path, x, args.mma, device)


if __name__ == "__main__":
    main()
