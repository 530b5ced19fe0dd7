"""Inline PTX for the CuTe DSL kernels: one helper that every kernel module's PTX wrappers go through, and
the raw-address memory operations (and the flag spin-wait) more than one kernel module uses."""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


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


def ir_arg(x, cls, loc, ip):
    """``x`` as a ``cls`` (Int32, Int64, Float32) operand of an inline-PTX block."""
    return cls(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def st_global_u32(addr, value, *, loc=None, ip=None) -> None:
    """Store one word at the global address ``addr`` (weak; volatile, clobbers memory)."""
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(value, Int32, loc, ip)]
    inline_asm([], args, "st.global.b32 [$0], $1;", "l,r,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def st_global_u64(addr, value, *, loc=None, ip=None) -> None:
    """Store one int64 at the global address ``addr`` (weak; volatile, clobbers memory)."""
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(value, Int64, loc, ip)]
    inline_asm([], args, "st.global.b64 [$0], $1;", "l,l,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def atom_add(addr, value, sem: str, *, loc=None, ip=None) -> Int32:
    """``atom.<sem>.gpu.global.add.s32`` (``sem``: "relaxed" or "acq_rel"); returns the old value."""
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(value, Int32, loc, ip)]
    text = f"atom.{sem}.gpu.global.add.s32 $0, [$1], $2;"
    return Int32(inline_asm([T.i32()], args, text, "=r,l,r,~{memory}", loc, ip, side_effects=True)[0])


@dsl_user_op
def arrive(addr, *, loc=None, ip=None) -> None:
    """Counted arrival: ``fence.acq_rel.gpu`` then a release add of 1 (gpu scope) at ``addr``: every store
    this thread made (or observed, e.g. through a CTA barrier) before is visible to whoever acquires the count."""
    text = "fence.acq_rel.gpu;\nred.release.gpu.global.add.s32 [$0], 1;"
    inline_asm([], [ir_arg(addr, Int64, loc, ip)], text, "l,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def ld_acquire(addr, wide: bool, scope: str, *, loc=None, ip=None) -> Int32:
    """Acquire-load a flag at ``scope`` ("gpu" or "sys"); a 64-bit flag (``wide``) returns its high word."""
    if wide:
        text = f"{{\n.reg .b64 v;\nld.acquire.{scope}.global.b64 v, [$1];\nshr.b64 v, v, 32;\ncvt.u32.u64 $0, v;\n}}"
    else:
        text = f"ld.acquire.{scope}.global.b32 $0, [$1];"
    return Int32(inline_asm([T.i32()], [ir_arg(addr, Int64, loc, ip)], text, "=r,l,~{memory}", loc, ip, side_effects=True)[0])


@dsl_user_op
def behind(seen, expected, *, loc=None, ip=None) -> Int32:
    """1 when ``(int32)(seen - expected) < 0`` (wrap-safe "not yet"), else 0."""
    text = "{\n.reg .b32 d;\n.reg .pred p;\nsub.s32 d, $1, $2;\nsetp.lt.s32 p, d, 0;\nselp.b32 $0, 1, 0, p;\n}"
    args = [ir_arg(seen, Int32, loc, ip), ir_arg(expected, Int32, loc, ip)]
    return Int32(inline_asm([T.i32()], args, text, "=r,r,r", loc, ip, side_effects=True)[0])


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """``%globaltimer`` (ns)."""
    return Int64(inline_asm([T.i64()], [], "mov.u64 $0, %globaltimer;", "=l", loc, ip, side_effects=True)[0])


@dsl_user_op
def count_u64(addr, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.add.u64 [addr], 1``."""
    inline_asm([], [ir_arg(addr, Int64, loc, ip)], "red.relaxed.gpu.global.add.u64 [$0], 1;", "l,~{memory}", loc, ip,
               side_effects=True)


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    return Int32(inline_asm([T.i32()], [], "mov.u32 $0, %smid;", "=r", loc, ip, side_effects=True)[0])


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    inline_asm([], [], "trap;", "~{memory}", loc, ip, side_effects=True)


@cute.jit
def spin_until(addr: Int64, expected: Int32, wide: cutlass.Constexpr, scope: cutlass.Constexpr, timeout_ns: Int64,
               timed: cutlass.Constexpr) -> Int32:
    """Acquire-load the flag at ``addr`` (``ld_acquire``) until it reaches ``expected`` (wrap-safe); returns the
    last value seen. ``timed``: also give up once ``timeout_ns`` (> 0; 0: never) has passed -- the caller then
    sees ``behind(seen, expected)`` and reports."""
    seen = ld_acquire(addr, wide, scope)
    if cutlass.const_expr(timed):
        start = globaltimer()
        waiting = behind(seen, expected)
        while waiting != 0:
            seen = ld_acquire(addr, wide, scope)
            waiting = behind(seen, expected)
            if timeout_ns > Int64(0):
                if globaltimer() - start > timeout_ns:
                    waiting = Int32(0)
    else:
        while behind(seen, expected) != 0:
            seen = ld_acquire(addr, wide, scope)
    return seen
