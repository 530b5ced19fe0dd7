"""Inline PTX for the CuTe DSL kernels: one helper that every kernel module's PTX wrappers go through, and
the raw-address memory operations more than one kernel module uses."""

from __future__ import annotations

from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def inline_asm(results: list, args: list, text: str, constraints: str, loc, ip, side_effects: bool) -> list:
    """One inline-PTX block with the MLIR result types ``results`` (none, one or several) and operands
    ``args`` (``ir.Value``s); returns the results as ``ir.Value``s. ``side_effects=False`` marks it pure
    (free to move, merge or drop); memory effects are declared in ``constraints`` (``~{memory}``)."""
    ret = None if not results else results[0] if len(results) == 1 else llvm.StructType.get_literal(results)
    out = llvm.inline_asm(ret, args, text, constraints, has_side_effects=side_effects, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    if len(results) <= 1:
        return [out] if results else []
    return [llvm.extractvalue(r, out, [i], loc=loc, ip=ip) for i, r in enumerate(results)]


@dsl_user_op
def st_global_v4(addr, words: list, on, *, loc=None, ip=None) -> None:
    """Store 4 words (16 bytes) at the global address ``addr`` (Int64, 16-byte aligned; any memory this GPU
    maps, a peer's included) when ``on`` (Int32, nonzero). Volatile, clobbers memory: program order kept."""
    text = "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n@p st.global.v4.b32 [$0], {$1, $2, $3, $4};\n}"
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words]
    args.append(Int32(on).ir_value(loc=loc, ip=ip))
    inline_asm([], args, text, "l,r,r,r,r,r,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.sys``: this thread's earlier stores are ordered before its later ones for every
    observer, other GPUs included."""
    inline_asm([], [], "fence.acq_rel.sys;", "~{memory}", loc, ip, side_effects=True)
