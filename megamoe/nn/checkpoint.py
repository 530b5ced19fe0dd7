"""Reading expert weights from standard checkpoint layouts.

A checkpoint ``source`` is a state dict (``Mapping[str, Tensor]``), a ``.safetensors`` file, or a
directory holding ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Only the
tensors asked for are read (safetensors files are opened lazily, fused tensors are sliced on read).

Expert namings under a MoE block's ``prefix`` (e.g. ``"model.layers.3.mlp."``), expert ``e``:

=============  ==============================================================  ====================
naming         keys                                                            models
=============  ==============================================================  ====================
gate_up_down   ``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],    Qwen2/3-MoE,
               ``down_proj`` [H, I]                                            DeepSeek-V2/V3, OLMoE
w1_w3_w2       ``experts.{e}.w1.weight`` (gate) [I, H], ``w3`` (up) [I, H],    Mixtral
               ``w2`` (down) [H, I]
fused          ``experts.gate_up_proj`` [E, 2I, H] (rows [gate; up]),          transformers >= 5
               ``experts.down_proj`` [E, H, I]                                 in-memory state dicts
gpt_oss        ``experts.gate_up_proj`` [E, H, 2I] (columns alternate gate,    gpt-oss as transformers
               up), ``experts.down_proj`` [E, I, H], ``experts.gate_up_proj``  saves it (BF16)
               ``_bias`` [E, 2I] (alternating), ``experts.down_proj_bias``
               [E, H]
gpt_oss_mxfp4  ``experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] and    gpt-oss as published
               ``_scales`` uint8 [E, 2I, H/32] (rows alternate gate, up),      (openai/gpt-oss-*)
               ``experts.down_proj_blocks`` [E, H, I/32, 16], ``_scales``
               [E, H, I/32], and the two biases of ``gpt_oss``
=============  ==============================================================  ====================

Every reader returns the canonical megamoe layout: ``w1 [E_l, 2I, H]`` (rows ``[0, I)`` gate,
``[I, 2I)`` up) and ``w2 [E_l, H, I]``, in the checkpoint's dtype (``read_expert_weights``; the ``gpt_oss_mxfp4``
naming: dequantized exactly to BF16), or for ``gpt_oss_mxfp4`` the FP4 weights as they are stored
(``read_fp4_expert_weights``): each block of 32 E2M1 values packed two a byte, element ``2j`` in the low nibble
of byte ``j`` (transformers' ``convert_moe_packed_tensors`` decodes the low nibble first), one UE8M0 code (bias
127) per block -- megamoe's own FP4 format, so the bytes move unchanged (rows reordered, codes packed four to an
int32). gpt-oss's alternating gate/up order (row ``2i`` gate ``i``, ``2i + 1`` up ``i``) becomes [gate; up] by an
exact permutation (``layouts.deinterleave_gate_up`` with granularity 1); ``read_expert_biases`` returns the biases
in the canonical order, BF16.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from ..checks import check_multiple, check_tensor, fail
from ..layouts import deinterleave_gate_up, dequantize_fp4, pack_ue8m0
from ..layouts.ue8m0 import pad_codes

EXPERT_NAMINGS = {"gate_up_down": ("gate_proj", "up_proj", "down_proj"), "w1_w3_w2": ("w1", "w3", "w2")}
GPT_OSS_NAMINGS = ("gpt_oss", "gpt_oss_mxfp4")
NAMINGS = (*EXPERT_NAMINGS, "fused", *GPT_OSS_NAMINGS)


class Checkpoint:
    """Uniform read access to a state dict or safetensors file(s); see the module docstring."""

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike):
        self._files: dict[str, object] = {}
        if isinstance(source, Mapping):
            self._tensors, self._where = source, None
            return
        self._tensors, path = None, os.fspath(source)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isdir(path) and os.path.isfile(index):
            with open(index) as f:
                self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
            return
        if os.path.isdir(path):
            path = os.path.join(path, "model.safetensors")
        if not os.path.isfile(path):
            fail("source", f"is not a state dict, a .safetensors file or a checkpoint directory: {path!r}")
        self._where = dict.fromkeys(self._open(path).keys(), path)

    def _open(self, path: str):
        if path not in self._files:
            from safetensors import safe_open  # optional dependency, needed only for files

            self._files[path] = safe_open(path, framework="pt", device="cpu")
        return self._files[path]

    def __contains__(self, key: str) -> bool:
        return key in (self._tensors if self._tensors is not None else self._where)

    def get(self, key: str, rows: range | None = None) -> torch.Tensor:
        """Tensor ``key`` (only dim-0 ``rows`` of it when given); raises naming the missing key."""
        if key not in self:
            fail("source", f"has no tensor {key!r}")
        if self._tensors is not None:
            t = self._tensors[key]
            return t if rows is None else t[rows.start : rows.stop]
        f = self._open(self._where[key])
        return f.get_tensor(key) if rows is None else f.get_slice(key)[rows.start : rows.stop]


def detect_naming(ckpt: Checkpoint, prefix: str) -> str:
    """Which of ``NAMINGS`` the experts under ``prefix`` use (raises when none matches)."""
    if f"{prefix}experts.gate_up_proj_blocks" in ckpt:
        return "gpt_oss_mxfp4"
    if f"{prefix}experts.gate_up_proj_bias" in ckpt:
        return "gpt_oss"
    if f"{prefix}experts.gate_up_proj" in ckpt:
        return "fused"
    for naming, (gate, _, _) in EXPERT_NAMINGS.items():
        if f"{prefix}experts.0.{gate}.weight" in ckpt:
            return naming
    fail("prefix", f"{prefix!r} has no experts in a known naming {NAMINGS} (looked for {prefix}experts.0.gate_proj.weight, "
         f"{prefix}experts.0.w1.weight, {prefix}experts.gate_up_proj)")


def expert_range(num_experts: int, rank: int, num_ranks: int) -> range:
    """Experts of ``rank``: the contiguous ``[rank * E / R, (rank + 1) * E / R)``."""
    check_multiple("num_experts", num_experts, num_ranks, f"experts are split evenly over {num_ranks} ranks")
    per = num_experts // num_ranks
    return range(rank * per, (rank + 1) * per)


def read_expert_weights(
    source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike,
    prefix: str,
    experts: range,
    naming: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``experts`` under ``prefix`` as canonical ``(w1 [E_l, 2I, H], w2 [E_l, H, I])`` on the CPU."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    if naming == "auto":
        naming = detect_naming(ckpt, prefix)
    if naming not in NAMINGS:
        fail("naming", f"must be 'auto' or one of {NAMINGS}, got {naming!r}")
    if naming == "fused":
        return ckpt.get(f"{prefix}experts.gate_up_proj", experts), ckpt.get(f"{prefix}experts.down_proj", experts)
    if naming == "gpt_oss":
        w1 = ckpt.get(f"{prefix}experts.gate_up_proj", experts).transpose(1, 2)
        return deinterleave_gate_up(w1, 1), ckpt.get(f"{prefix}experts.down_proj", experts).transpose(1, 2).contiguous()
    if naming == "gpt_oss_mxfp4":
        return tuple(dequantize_fp4(w, sf, torch.bfloat16) for w, sf in read_fp4_expert_weights(ckpt, prefix, experts))
    gate, up, down = EXPERT_NAMINGS[naming]
    w1 = torch.stack([torch.cat([ckpt.get(f"{prefix}experts.{e}.{gate}.weight"), ckpt.get(f"{prefix}experts.{e}.{up}.weight")])
                      for e in experts])
    w2 = torch.stack([ckpt.get(f"{prefix}experts.{e}.{down}.weight") for e in experts])
    return w1, w2


def _fp4_tensor(ckpt: Checkpoint, key: str, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """``{key}_blocks`` uint8 ``[E, N, K/32, 16]`` and ``{key}_scales`` uint8 ``[E, N, K/32]`` of ``experts`` ->
    megamoe's FP4 pair (packed uint8 ``[E_l, N, K/2]``, packed int32 UE8M0 ``[E_l, N, ceil(K/128)]``), bytes unchanged
    (a partial last scale word, e.g. gpt-oss's K = 2880, gets ``layouts.ue8m0`` padding codes)."""
    blocks, scales = ckpt.get(f"{key}_blocks", experts), ckpt.get(f"{key}_scales", experts)
    check_tensor(f"{key}_blocks", blocks, dtype=torch.uint8, ndim=4)
    e, n, groups, width = blocks.shape
    if width != 16:
        fail(f"{key}_blocks", f"must hold 16 bytes (32 E2M1 values) per block in its last dim, got {list(blocks.shape)}")
    check_tensor(f"{key}_scales", scales, dtype=torch.uint8, shape=(e, n, groups))
    return blocks.reshape(e, n, groups * 16).contiguous(), pack_ue8m0(pad_codes(scales))


def read_fp4_expert_weights(
    source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike, prefix: str, experts: range
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """gpt-oss's MXFP4 experts (naming ``gpt_oss_mxfp4``) as canonical FP4 pairs ``(w1 [E_l, 2I, H/2] uint8,
    int32 [E_l, 2I, H/128])``, ``(w2 [E_l, H, I/2], int32 [E_l, H, I/128])``: the stored bytes, gate/up rows
    permuted to [gate; up] (bit-exact, no dequantize / requantize)."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    w1, s1 = _fp4_tensor(ckpt, f"{prefix}experts.gate_up_proj", experts)
    return (deinterleave_gate_up(w1, 1), deinterleave_gate_up(s1, 1)), _fp4_tensor(ckpt, f"{prefix}experts.down_proj",
                                                                                  experts)


def read_expert_biases(
    source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike, prefix: str, experts: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's expert biases: ``(l1_bias [E_l, 2I]`` of ``experts``, rows [gate; up], ``l2_bias [E, H]`` of all
    experts``)``, BF16 (the combine adds the L2 bias on the tokens' rank, whichever rank ran the expert)."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    b1 = ckpt.get(f"{prefix}experts.gate_up_proj_bias", experts)
    b2 = ckpt.get(f"{prefix}experts.down_proj_bias")
    return deinterleave_gate_up(b1.to(torch.bfloat16), 1), b2.to(torch.bfloat16).contiguous()


def read_mlp_weights(
    source: Checkpoint | Mapping[str, torch.Tensor] | str | os.PathLike, prefix: str, naming: str = "gate_up_down"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense MLP (e.g. DeepSeek's ``shared_experts.``) as ``(gate [I, H], up [I, H], down [H, I])``."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    if naming not in EXPERT_NAMINGS:
        fail("naming", f"must be one of {tuple(EXPERT_NAMINGS)} for a dense MLP, got {naming!r}")
    return tuple(ckpt.get(f"{prefix}{name}.weight") for name in EXPERT_NAMINGS[naming])
