"""Inline PTX for the CuTe DSL kernels: the helpers every PTX wrapper goes through (``inline_asm``, ``pure_asm``,
``volatile_asm``), conversions and bit casts, raw-address memory operations and the flag spin-wait.

Conventions: a block that touches memory is volatile and clobbers memory, so the compiler keeps the program order
of all of them; a pure block (``pure_asm``) may be moved, merged or dropped. Addresses are Int64 global addresses
(any memory this GPU maps, a peer's symmetric buffer included)."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
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


def volatile_asm(results: list, args: list, text: str, constraints: str, loc=None, ip=None) -> list:
    """One volatile inline-PTX block (``inline_asm`` with side effects); returns its results as ``ir.Value``s."""
    return inline_asm(results, args, text, constraints, loc, ip, side_effects=True)


def pure_asm(num_results: int, args: list, text: str, constraints: str, loc, ip) -> tuple:
    """One side-effect-free inline-PTX block with ``num_results`` 32-bit results, as ``Int32``s."""
    res = inline_asm([T.i32()] * num_results, args, text, constraints, loc, ip, side_effects=False)
    return tuple(Int32(r) for r in res)


@dsl_user_op
def prmt(lo, hi, selector, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``selector.nibble[i]`` of ``{hi:lo}`` (pure op)."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (lo, hi, selector)]
    return pure_asm(1, args, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", loc, ip)[0]


@dsl_user_op
def bits_to_f32(bits, *, loc=None, ip=None) -> Float32:
    """Reinterpret an int32 bit pattern as float32."""
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> Int32:
    """The int32 bit pattern of a float32."""
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32x4_to_e4m3x4(v0, v1, v2, v3, *, loc=None, ip=None) -> Int32:
    """Four float32 -> four E4M3 bytes (v0 in the low byte), round to nearest even, saturating."""
    return pure_asm(
        1,
        [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
        "{.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};}",
        "=r,f,f,f,f",
        loc,
        ip,
    )[0]


@dsl_user_op
def f32x2_to_e4m3x2(v0, v1, *, loc=None, ip=None) -> cutlass.Int16:
    """Two float32 -> two E4M3 bytes (v0 in the low byte), with ``f32x4_to_e4m3x4``'s rounding (nearest even,
    saturating)."""
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1)]
    res = inline_asm([T.i16()], args, "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", loc, ip, side_effects=False)
    return cutlass.Int16(res[0])


@dsl_user_op
def e4m3x4_to_bf16x4(word, scale, *, loc=None, ip=None):
    """Four E4M3 bytes (byte 0 first) times a float32 power-of-two ``scale`` -> two bf16x2 words (elements
    0-1, 2-3; low half first). Exact: an E4M3 value times 2**s is a BF16 value for every UE8M0 scale
    s whose products stay at or above 2**-133 (BF16's smallest subnormal)."""
    return pure_asm(
        2,
        [Int32(word).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)],
        "{.reg .b16 l, h, a0, a1, b0, b1;\n"
        ".reg .b32 a, b;\n"
        ".reg .f32 f0, f1, f2, f3;\n"
        "mov.b32 {l, h}, $2;\n"
        "cvt.rn.f16x2.e4m3x2 a, l;\n"
        "cvt.rn.f16x2.e4m3x2 b, h;\n"
        "mov.b32 {a0, a1}, a;\n"
        "mov.b32 {b0, b1}, b;\n"
        "cvt.f32.f16 f0, a0;\n"
        "cvt.f32.f16 f1, a1;\n"
        "cvt.f32.f16 f2, b0;\n"
        "cvt.f32.f16 f3, b1;\n"
        "mul.rn.f32 f0, f0, $3;\n"
        "mul.rn.f32 f1, f1, $3;\n"
        "mul.rn.f32 f2, f2, $3;\n"
        "mul.rn.f32 f3, f3, $3;\n"
        "cvt.rn.bf16x2.f32 $0, f1, f0;\n"
        "cvt.rn.bf16x2.f32 $1, f3, f2;}",
        "=r,=r,r,f",
        loc,
        ip,
    )


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
def red_or(addr, bits, scope: str, *, loc=None, ip=None) -> None:
    """``red.relaxed.<scope>.global.or.b32 [addr], bits`` (``scope``: "gpu" or "sys")."""
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(bits, Int32, loc, ip)]
    inline_asm([], args, f"red.relaxed.{scope}.global.or.b32 [$0], $1;", "l,r,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def count_u64(addr, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.add.u64 [addr], 1``."""
    inline_asm([], [ir_arg(addr, Int64, loc, ip)], "red.relaxed.gpu.global.add.u64 [$0], 1;", "l,~{memory}", loc, ip,
               side_effects=True)


@dsl_user_op
def smid(*, loc=None, ip=None) -> Int32:
    return Int32(inline_asm([T.i32()], [], "mov.u32 $0, %smid;", "=r", loc, ip, side_effects=True)[0])


@dsl_user_op
def barrier_any(barrier_id: int, num_threads: int, flag, *, loc=None, ip=None) -> Int32:
    """``bar.red.or.pred`` on barrier ``barrier_id`` over ``num_threads`` threads (a ``bar.sync`` of them): 1 in every
    one of them when any one's ``flag`` (int32) is nonzero, else 0."""
    text = (f"{{\n.reg .pred p, q;\nsetp.ne.s32 p, $1, 0;\nbar.red.or.pred q, {barrier_id}, {num_threads}, p;\n"
            "selp.b32 $0, 1, 0, q;\n}")
    return Int32(inline_asm([T.i32()], [ir_arg(flag, Int32, loc, ip)], text, "=r,r,~{memory}", loc, ip,
                            side_effects=True)[0])


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    inline_asm([], [], "trap;", "~{memory}", loc, ip, side_effects=True)


SPINS_PER_CLOCK_READ = 64
"""Flag loads between two reads of ``%globaltimer`` in a timed ``spin_until`` (a power of two)."""


@cute.jit
def spin_until(addr: Int64, expected: Int32, wide: cutlass.Constexpr, scope: cutlass.Constexpr, timeout_ns: Int64,
               timed: cutlass.Constexpr) -> Int32:
    """Acquire-load the flag at ``addr`` (``ld_acquire``) until it reaches ``expected`` (wrap-safe); returns the
    last value seen. ``timed``: also give up once ``timeout_ns`` (> 0; 0: never) has passed -- the caller then
    sees ``behind(seen, expected)`` and reports. A flag already reached costs one load either way; a timed wait reads
    the clock when it starts spinning and then every ``SPINS_PER_CLOCK_READ`` loads."""
    seen = ld_acquire(addr, wide, scope)
    if cutlass.const_expr(timed):
        waiting = behind(seen, expected)
        if waiting != 0:
            start = globaltimer()
            spins = Int32(0)
            while waiting != 0:
                seen = ld_acquire(addr, wide, scope)
                waiting = behind(seen, expected)
                spins = spins + 1
                if (spins & (SPINS_PER_CLOCK_READ - 1)) == 0:
                    if (timeout_ns > Int64(0)) & (globaltimer() - start > timeout_ns):
                        waiting = Int32(0)
    else:
        while behind(seen, expected) != 0:
            seen = ld_acquire(addr, wide, scope)
    return seen


@dsl_user_op
def ld_cg_v4_if(addr, on, *, loc=None, ip=None) -> list:
    """16 bytes at ``addr`` (L2, ``.cg``: never a stale L1 line) as 4 words when ``on``, else 4 zero words (no
    access)."""
    text = (
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        "@p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4];\n}"
    )
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(on, Int32, loc, ip)]
    return [Int32(w) for w in volatile_asm([T.i32()] * 4, args, text, "=r,=r,=r,=r,l,r,~{memory}", loc, ip)]


@dsl_user_op
def ld_cg_u32_if(addr, on, *, loc=None, ip=None) -> Int32:
    """The word at ``addr`` (L2, ``.cg``) when ``on``, else 0 (no access)."""
    text = "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.cg.b32 $0, [$1];\n}"
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(on, Int32, loc, ip)]
    return Int32(volatile_asm([T.i32()], args, text, "=r,l,r,~{memory}", loc, ip)[0])


@dsl_user_op
def ld_cg_u32(addr, *, loc=None, ip=None) -> Int32:
    """The word at ``addr`` (L2, ``.cg``)."""
    return Int32(volatile_asm([T.i32()], [ir_arg(addr, Int64, loc, ip)], "ld.global.cg.b32 $0, [$1];", "=r,l,~{memory}",
                              loc, ip)[0])


@dsl_user_op
def ld_cg_u64(addr, *, loc=None, ip=None) -> Int64:
    """The int64 at ``addr`` (L2, ``.cg``)."""
    return Int64(volatile_asm([T.i64()], [ir_arg(addr, Int64, loc, ip)], "ld.global.cg.b64 $0, [$1];", "=l,l,~{memory}",
                              loc, ip)[0])


@dsl_user_op
def st_release_sys(addr, value, wide: bool, *, loc=None, ip=None) -> None:
    """Publish a flag to any agent, other GPUs included: ``st.release.sys`` (64-bit when ``wide``)."""
    if wide:
        volatile_asm([], [ir_arg(addr, Int64, loc, ip), ir_arg(value, Int64, loc, ip)],
                     "st.release.sys.global.b64 [$0], $1;", "l,l,~{memory}", loc, ip)
    else:
        volatile_asm([], [ir_arg(addr, Int64, loc, ip), ir_arg(value, Int32, loc, ip)],
                     "st.release.sys.global.b32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def bf16x2_to_f32x2(word, *, loc=None, ip=None) -> list:
    """Two BF16 (low half first) -> two FP32 (exact)."""
    text = "{\n.reg .b32 t;\nshl.b32 t, $2, 16;\nmov.b32 $0, t;\nand.b32 t, $2, 0xFFFF0000;\nmov.b32 $1, t;\n}"
    return [Float32(v) for v in volatile_asm([T.f32()] * 2, [ir_arg(word, Int32, loc, ip)], text, "=f,=f,r", loc, ip)]


@dsl_user_op
def f32x2_to_bf16x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """Two FP32 -> two BF16 (round to nearest even), ``lo`` in the low half."""
    args = [ir_arg(hi, Float32, loc, ip), ir_arg(lo, Float32, loc, ip)]
    return Int32(volatile_asm([T.i32()], args, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc, ip)[0])


# --------------------------------------------------------------------------------------------------
# Read-only loads, prefetch, cp.async, conversions and the BF16 tensor-core MMA (first used by the decode kernels,
# ``megamoe.kernels.decode``).
#
# ``ld_v4``, ``ld_v4_if`` and ``ld_nc_u32`` are PURE blocks (no side effects, no memory clobber): the compiler may
# move, merge or drop them like arithmetic, which lets it issue a warp's weight loads early and keep them in flight.
# Use them only for memory nothing writes while the kernel runs (weights, inputs, a finished earlier launch's output).

from cutlass._mlir.dialects import math as _mlir_math  # noqa: E402 (appended block)


@dsl_user_op
def ld_v4(addr, cache: str, floats: bool = False, *, loc=None, ip=None) -> list:
    """16 bytes at the global address ``addr`` (16-byte aligned) as 4 Int32 words, or 4 Float32 when ``floats``:
    ``ld.global{cache}.v4`` (``cache`` the qualifiers, e.g. ``".nc"`` or ``".nc.L1::no_allocate.L2::256B"``). Pure."""
    ty, reg, kind, cls = (T.f32(), "f", "f32", Float32) if floats else (T.i32(), "r", "b32", Int32)
    vals = inline_asm([ty] * 4, [ir_arg(addr, Int64, loc, ip)], f"ld.global{cache}.v4.{kind} {{$0, $1, $2, $3}}, [$4];",
                      ",".join([f"={reg}"] * 4 + ["l"]), loc, ip, side_effects=False)
    return [cls(v) for v in vals]


@dsl_user_op
def ld_v4_if(addr, on, cache: str, *, loc=None, ip=None) -> list:
    """``ld_v4`` of 4 words when ``on`` (Int32) is nonzero, else four zero words (no memory access, no branch). Pure."""
    text = (
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        f"@p ld.global{cache}.v4.b32 {{$0, $1, $2, $3}}, [$4];\n}}"
    )
    args = [ir_arg(addr, Int64, loc, ip), ir_arg(on, Int32, loc, ip)]
    return [Int32(v) for v in inline_asm([T.i32()] * 4, args, text, "=r,=r,=r,=r,l,r", loc, ip, side_effects=False)]


@dsl_user_op
def ld_nc_u32(addr, *, loc=None, ip=None) -> Int32:
    """The word at the global address ``addr`` through the read-only path (``ld.global.nc``). Pure."""
    return Int32(inline_asm([T.i32()], [ir_arg(addr, Int64, loc, ip)], "ld.global.nc.b32 $0, [$1];", "=r,l", loc, ip,
                            side_effects=False)[0])


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None) -> list:
    """16 bytes at the shared-memory address ``addr`` (Int32) as 4 words. Volatile (no memory clobber): it stays
    after the ``cp_async_wait_all`` that filled the memory."""
    vals = volatile_asm([T.i32()] * 4, [ir_arg(addr, Int32, loc, ip)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                        "=r,=r,=r,=r,r", loc, ip)
    return [Int32(v) for v in vals]


@dsl_user_op
def prefetch_bulk_l2(addr, nbytes: int, *, loc=None, ip=None) -> None:
    """Start fetching ``nbytes`` (a multiple of 16, 16-byte aligned) at the global address ``addr`` into L2
    (``cp.async.bulk.prefetch.L2``); no registers, no wait."""
    volatile_asm([], [ir_arg(addr, Int64, loc, ip)], f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};", "l", loc, ip)


@dsl_user_op
def cp_async_16_if(dst, src, on, *, loc=None, ip=None) -> None:
    """Start copying 16 bytes from the global address ``src`` to the shared address ``dst`` (Int32) when ``on``
    (Int32, nonzero): ``cp.async.cg`` (through L2). Wait with ``cp_async_wait_all``."""
    text = "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p cp.async.cg.shared.global [$0], [$1], 16;\n}"
    args = [ir_arg(dst, Int32, loc, ip), ir_arg(src, Int64, loc, ip), ir_arg(on, Int32, loc, ip)]
    volatile_asm([], args, text, "r,l,r,~{memory}", loc, ip)


@dsl_user_op
def bulk_store_if(dst, src, nbytes: int, on, *, loc=None, ip=None) -> None:
    """When ``on`` (Int32, nonzero): start copying ``nbytes`` (a multiple of 16) from the shared address ``src``
    (Int32) to the global address ``dst`` (Int64), both 16-byte aligned, through the TMA unit (``cp.async.bulk``
    into this thread's bulk group: ``cute.arch.cp_async_bulk_commit_group``, then ``cp_async_bulk_wait_group``)."""
    text = ("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n"
            f"@p cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {nbytes};\n}}")
    args = [ir_arg(dst, Int64, loc, ip), ir_arg(src, Int32, loc, ip), ir_arg(on, Int32, loc, ip)]
    volatile_asm([], args, text, "l,r,r,~{memory}", loc, ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Wait for this thread's ``cp.async`` copies (``cp.async.wait_all``)."""
    volatile_asm([], [], "cp.async.wait_all;", "~{memory}", loc, ip)


@dsl_user_op
def opaque_i64(v, *, loc=None, ip=None) -> Int64:
    """``v``, through a volatile ``mov`` the compiler may not hoist or fold (e.g. to keep loop-invariant addresses,
    and so the loads they feed, inside a loop)."""
    return Int64(volatile_asm([T.i64()], [ir_arg(v, Int64, loc, ip)], "mov.b64 $0, $1;", "=l,l", loc, ip)[0])


@dsl_user_op
def fma(a, b, c, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` in FP32 with one rounding."""
    return Float32(_mlir_math.fma(ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip), ir_arg(c, Float32, loc, ip),
                                  loc=loc, ip=ip))


def e4m3x2_to_f32x2_ptx(src: str, lo: int, hi: int) -> str:
    """PTX text (for a block declaring ``.reg .b32 p`` and ``.reg .b16 l, h``): the two E4M3 bytes of the b16
    register ``src`` -> the FP32 outputs ``$lo`` (low byte) and ``$hi``, exact (``cvt.rn.f16x2.e4m3x2``, then
    ``cvt.f32.f16``)."""
    return f"cvt.rn.f16x2.e4m3x2 p, {src};\nmov.b32 {{l, h}}, p;\ncvt.f32.f16 ${lo}, l;\ncvt.f32.f16 ${hi}, h;\n"


@dsl_user_op
def e4m3x4_to_f32x4(word, *, loc=None, ip=None) -> list:
    """4 E4M3 bytes (little-endian) -> 4 FP32 values (exact), in byte order. Pure."""
    text = (
        "{\n.reg .b16 b0, b1, l, h;\n.reg .b32 p;\nmov.b32 {b0, b1}, $4;\n"
        + e4m3x2_to_f32x2_ptx("b0", 0, 1) + e4m3x2_to_f32x2_ptx("b1", 2, 3) + "}"
    )
    vals = inline_asm([T.f32()] * 4, [ir_arg(word, Int32, loc, ip)], text, "=f,=f,=f,=f,r", loc, ip, side_effects=False)
    return [Float32(v) for v in vals]


@dsl_user_op
def mma_m16n8k16_bf16(acc: list, a: list, b: list, *, loc=None, ip=None) -> list:
    """``mma.sync.aligned.m16n8k16.row.col`` BF16 x BF16 + FP32 -> FP32: ``acc`` the 4 floats of the C fragment,
    ``a`` 4 and ``b`` 2 bf16x2 words (PTX fragment order); returns the 4 floats of D. Pure."""
    args = [ir_arg(v, Float32, loc, ip) for v in acc] + [ir_arg(v, Int32, loc, ip) for v in a + b]
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$8, $9, $10, $11}, "
            "{$12, $13}, {$4, $5, $6, $7};")
    vals = inline_asm([T.f32()] * 4, args, text, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r", loc, ip, side_effects=False)
    return [Float32(v) for v in vals]


@dsl_user_op
def barrier_sync(barrier_id, num_threads, *, loc=None, ip=None) -> None:
    """``barrier.sync id, n`` -- the non-aligned form: correct even where the compiler duplicates it into divergent
    paths of one warp (tail duplication of a branch around it), where ``bar.sync`` (aligned) would hang."""
    args = [ir_arg(barrier_id, Int32, loc, ip), ir_arg(num_threads, Int32, loc, ip)]
    inline_asm([], args, "barrier.sync $0, $1;", "r,r,~{memory}", loc, ip, side_effects=True)


@dsl_user_op
def st_release_cluster_peer_u64(addr, rank, hi, lo, *, loc=None, ip=None) -> None:
    """Store the 64-bit word (``hi``, ``lo``) at this CTA's shared address ``addr`` (Int32) as mapped into the
    shared memory of cluster CTA ``rank`` (``mapa``), with release semantics at cluster scope."""
    text = ("{\n.reg .b32 r;\n.reg .b64 v;\nmapa.shared::cluster.u32 r, $0, $1;\nmov.b64 v, {$3, $2};\n"
            "st.release.cluster.shared::cluster.b64 [r], v;\n}")
    args = [ir_arg(addr, Int32, loc, ip), ir_arg(rank, Int32, loc, ip), ir_arg(hi, Int32, loc, ip),
            ir_arg(lo, Int32, loc, ip)]
    volatile_asm([], args, text, "r,r,r,r,~{memory}", loc, ip)


@dsl_user_op
def ld_acquire_cluster_shared_u64(addr, *, loc=None, ip=None) -> tuple:
    """The 64-bit word at this CTA's shared address ``addr`` (Int32) as (hi, lo), with acquire semantics at cluster
    scope (a peer's ``st_release_cluster_peer_u64``)."""
    text = "{\n.reg .b64 v;\nld.acquire.cluster.shared::cta.b64 v, [$2];\nmov.b64 {$1, $0}, v;\n}"
    hi, lo = volatile_asm([T.i32()] * 2, [ir_arg(addr, Int32, loc, ip)], text, "=r,=r,r,~{memory}", loc, ip)
    return Int32(hi), Int32(lo)
