"""Swap a Hugging Face MoE model's MoE blocks for megamoe.nn expert-parallel blocks and compare.

    torchrun --nproc-per-node 2 examples/hf_swap.py [--model-dir DIR] [--mma-type bf16] [--mode low_latency]

DIR: a local Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint (safetensors). Without it a tiny random
Qwen3-MoE is built and saved to a temporary directory. Each rank runs the whole model on its own
tokens; the swapped MoE layers hold only the rank's experts and exchange tokens over the EP group.
Each rank prints how far its final hidden states moved from the untouched model's.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import megamoe
from megamoe.nn import Checkpoint, moe_block_from_config
from megamoe.numerics import rel_fro_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir")
    parser.add_argument("--mma-type", default="fp8xfp4", choices=["fp8xfp4", "bf16"])
    parser.add_argument("--mode", default="normal", choices=["normal", "low_latency"])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    group, device = megamoe.dist.init_from_env()
    rank, _ = megamoe.dist.rank_and_size(group)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = os.path.join(tempfile.gettempdir(), "megamoe_tiny_qwen3_moe")
        if rank == 0:
            torch.manual_seed(0)
            config = Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    num_experts=8, num_experts_per_tok=2)
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
        if group is not None:
            dist.barrier(group)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        ref = model.model(input_ids=ids.to(device)).last_hidden_state

    ckpt = Checkpoint(model_dir)
    swapped, buffer = 0, None  # the layers run one after the other: one SymmBuffer serves them all
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):  # a MoE block; saved Mixtral checkpoints name it block_sparse_moe
            name = "mlp" if f"model.layers.{i}.mlp.gate.weight" in ckpt else "block_sparse_moe"
            layer.mlp = moe_block_from_config(model.config, ckpt, f"model.layers.{i}.{name}.", args.tokens, group,
                                              mma_type=args.mma_type, mode=args.mode, device=device, buffer=buffer)
            buffer, swapped = layer.mlp.moe.buffer, swapped + 1
    with torch.no_grad():
        y = model.model(input_ids=ids.to(device)).last_hidden_state
    print(f"rank {rank}: {swapped} MoE blocks swapped ({args.mma_type}, staged {args.mode}); "
          f"final hidden states relative difference {rel_fro_error(y, ref):.4f}")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
