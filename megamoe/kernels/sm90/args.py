"""Argument bundles of the SM90 kernels (NamedTuples of CuTe tensors and scalars).

``cute.compile`` and the kernels take them as they are: a bundle flattens into its fields, a field that is None is
static (absent from the compiled kernel), so one kernel signature serves every variant -- e.g. ``MegaArgs.none()``
for kernels without Mega MoE communication.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class GemmArgs(NamedTuple):
    """One GEMM's operands."""

    a: Any  # (M, K) tokens, K-major: bf16 (BF16 mode) or float8_e4m3fn (FP8 modes)
    a_sf: Any  # FP8 block-32 mode: (M, K/128) int32 packed UE8M0; else None
    w: Any  # (64 rows, N/64, 64 bytes, K/128, E) uint8 view of the blocked kernel weight layout
    w_sf: Any  # (N, K/128, E) int32 chunk-major scale words (folded: the relative codes)
    row_scale: Any = None  # folded FP8 scales: (N, E) float32 scale of each weight row; else None


class EpilogueArgs(NamedTuple):
    """What the epilogue stores (``epilogues``)."""

    out: Any  # bf16 (M, N); SwigluQuant: (M, N/8) int32 view of FP8 [M, N/2], or (M, N/4) of BF16 [M, N/2]; scatter: None
    out_sf: Any  # SwigluQuant to FP8: (M, N/64) uint8 view of the packed UE8M0 scales; else None
    rows: Any  # per-row operand: SwigluQuant (M,) float32 routing weights, ScatterRows (M,) int64 addresses; else None
    clamp: Any  # SwigluQuant: Float32 clamp of gate (above) and up (both sides), +inf: none; else None
    bias: Any = None  # separate grouped GEMMs: (E, N) float32 bias of each expert's weight rows (kernel row order),
    # added to the accumulator before the epilogue; else None


class GroupArgs(NamedTuple):
    """Which rows belong to which expert (read on the device)."""

    group_a: Any  # int32 offsets [E+1] ("offsets*") or masked_m [E] ("masked")
    group_b: Any  # int32 counts [E] ("offsets_counts"), else any int32 tensor (unused)
    num_groups: Any  # Int32 E
    max_m: Any  # Int32 rows per expert slab ("masked"), else unused


class SecondGemmArgs(NamedTuple):
    """L1 + L2 in one launch: the second GEMM (its tokens are the first's SwigluQuant output)."""

    gemm: GemmArgs  # a: (M, I) bf16 (the first GEMM's output memory), w / w_sf: L2's weights
    row_addr: Any  # (M,) int64: where the second GEMM's ScatterRows stores each row
    timeout_ns: Any  # Int64: spin-wait limit (0: none) of the Mega MoE kernel and the fused launch's debug build


class RowScales(NamedTuple):
    """L1 + L2 in one launch with folded FP8-mode weights: both GEMMs' weight-row scales (``GemmArgs.row_scale``)."""

    l1: Any  # (2I, E) float32
    l2: Any  # (H, E) float32


class MegaArgs(NamedTuple):
    """The Mega MoE kernel's communication: this rank, its token count, its SymmBuffer base, the peers' bases
    (device address of an int64 [R] array), the recv stats (int32 [E_l] address, 0: none), the record of failed waits
    and checks (host-mapped int64 [CTAs, 8]) or the trace buffer, and the output y (bf16 [T, H] address)."""

    me: Any
    num_tokens: Any
    base: Any
    peers: Any
    stats: Any
    record: Any
    y: Any

    @staticmethod
    def none() -> MegaArgs:
        """No communication (every kernel but the Mega MoE kernel)."""
        return MegaArgs(None, None, None, None, None, None, None)


# Device side: what ``GroupedGemmSm90.__call__`` builds from the bundles above and hands to the kernel.


class TmaOps(NamedTuple):
    """One GEMM's TMA atoms and coordinate tensors: tokens, weights, weight scales, FP8 block-32 token scales."""

    atom_a: object
    a: object  # (M, K)
    atom_w: object
    w: object  # ((64, N/64), (64 B, K/128), E)
    atom_sfw: object
    sfw: object  # (N, K/128, E)
    atom_sfa: object = None
    sfa: object = None  # (M, K/128 words)


class SmemLayouts(NamedTuple):
    """The shared-memory layouts of one kernel's pipeline stages (static)."""

    a: object  # (tile_tokens, 128, stage slots), 128B-swizzled
    w: object  # (tile_n, 64 B, stage slots)
    sfw: object  # (tile_n, chunks per stage, stages), chunk-major as in global memory
    sfa: object  # (tile_tokens, 4 words, stages)
