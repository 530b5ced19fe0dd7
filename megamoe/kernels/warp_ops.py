"""Warp-cooperative integer helpers shared by the CuTe DSL kernels (every lane of the warp must call them)."""

from __future__ import annotations

import cutlass
from cutlass import Int32, cute
from cutlass.cutlass_dsl import T, dsl_user_op

from . import ptx


@dsl_user_op
def nth_set_bit(mask: Int32, n: Int32, *, loc=None, ip=None) -> Int32:
    """Position of the set bit of rank ``n`` (0-based, lowest first) of ``mask``; -1 if there is none (``fns``).
    Per lane: needs no other lane."""
    args = [Int32(mask).ir_value(loc=loc, ip=ip), Int32(n + 1).ir_value(loc=loc, ip=ip)]
    return Int32(ptx.inline_asm([T.i32()], args, "fns.b32 $0, $1, 0, $2;", "=r,r,r", loc, ip, side_effects=False)[0])


@cute.jit
def warp_inclusive_sum(v: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum of ``v`` over lanes ``0..lane`` (five ``shfl.up`` steps)."""
    incl = v
    for d in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync_up(incl, 1 << d, mask_and_clamp=0)  # clamp 0: shfl.up's own-lane bound
        incl = incl + cutlass.select_(lane >= (1 << d), below, Int32(0))
    return incl
