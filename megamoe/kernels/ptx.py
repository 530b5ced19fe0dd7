"""Inline PTX for the CuTe DSL kernels: one helper that every kernel module's PTX wrappers go through."""

from __future__ import annotations

from cutlass._mlir.dialects import llvm


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
