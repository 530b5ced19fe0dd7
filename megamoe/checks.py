"""Argument validation shared by every public entry point.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong Python type) whose message names the
tensor or argument and the rule it broke, so bad input fails in Python before any kernel launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fail(name: str, rule: str) -> None:
    """Raise the library's standard validation error for argument ``name``."""
    raise ValueError(f"megamoe: `{name}` {rule}")


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check a tensor argument; ``shape`` entries of ``None`` match any size. Returns the tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"megamoe: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            fail(name, f"must have dtype {want}, got {str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        fail(name, f"must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            fail(name, f"must have shape {want}, got {list(t.shape)}")
    if device is not None:
        want = torch.device(device)
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            fail(name, f"must be on {want}, got {t.device}")
    if contiguous and not t.is_contiguous():
        fail(name, f"must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def check_multiple(name: str, value: int, multiple: int, why: str = "") -> None:
    """Require ``value % multiple == 0``."""
    if value % multiple != 0:
        fail(name, f"must be a multiple of {multiple}{' (' + why + ')' if why else ''}, got {value}")


def check_range(name: str, value: int, lo: int, hi: int) -> None:
    """Require ``lo <= value <= hi``."""
    if not lo <= value <= hi:
        fail(name, f"must be in [{lo}, {hi}], got {value}")


class InStepError(ValueError):
    """A validation error after which the ranks stay in step and the buffer stays usable: every rank raised it
    together at the same point of a collective call (decided from data all of them exchanged), or this rank took its
    part in the call's collectives (with no tokens) before raising it."""


class OutOfStepError(RuntimeError):
    """A collective call on a SymmBuffer whose earlier call raised on this rank: the ranks may be out of step."""


ROUTING_RULE = "must hold expert ids in [-1, num_experts={E}) (-1 = unused slot) with no expert twice in a token's top-k"


def routing_faults(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per row group of ``topk_idx [..., T, k]``: int64 ``[..., 2]`` on its device, (ids outside ``[-1, E)``,
    duplicate valid ids within a token beyond their first occurrence). Device work only, no host sync."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    ids = torch.where(bad, -1, topk_idx).sort(dim=-1).values
    dup = (ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)
    return torch.stack([bad.flatten(-2).sum(-1), dup.flatten(-2).sum(-1)], dim=-1)


def first_valid_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``topk_idx [..., k]`` with ids outside ``[-1, E)`` and every repeat of an id within a token set to -1 (the
    first occurrence kept): what a path that cannot raise (no host sync) computes instead, no host sync."""
    idx = torch.where((topk_idx < -1) | (topk_idx >= num_experts), -1, topk_idx)
    k = idx.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=idx.device).tril(-1)  # [j, i]: slot i comes before slot j
    repeat = ((idx.unsqueeze(-1) == idx.unsqueeze(-2)) & earlier).any(-1) & (idx >= 0)
    return torch.where(repeat, -1, idx)


def routing_error(num_experts: int, faults: dict, cls: type[Exception] = ValueError) -> Exception:
    """The one routing error of every path: ``faults`` maps rank -> (ids out of range, duplicates) (ranks without
    faults may be left out); ``cls``: ``InStepError`` where every rank raises it together."""
    per_rank = "; ".join(f"rank {r}: {bad} id(s) out of range, {dup} duplicate(s)"
                         for r, (bad, dup) in sorted(faults.items()) if bad or dup)
    return cls(f"megamoe: `topk_idx` {ROUTING_RULE.format(E=num_experts)}; {per_rank}")


def check_routing(topk_idx: torch.Tensor, num_experts: int, rank: int = 0) -> None:
    """Raise ``routing_error`` for ``topk_idx [T, k]`` of one rank (reads two counts: a host sync on a GPU)."""
    bad, dup = routing_faults(topk_idx, num_experts).tolist()
    if bad or dup:
        raise routing_error(num_experts, {rank: (bad, dup)})


def check_routing_inputs(topk_idx: object, topk_weights: object, num_tokens: int, num_topk: int,
                         device: torch.device) -> None:
    """Boundary checks of a call's routing: ``topk_idx`` int32 / int64 and ``topk_weights`` float32 / bfloat16 /
    float16, both exactly ``[T, k]`` (no broadcasting) on ``device`` (a meta or other-device tensor would be read as
    garbage or copied silently)."""
    check_tensor("topk_idx", topk_idx, dtype=(torch.int64, torch.int32), device=device)
    check_tensor("topk_weights", topk_weights, dtype=(torch.float32, torch.bfloat16, torch.float16), device=device)
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        check_tensor(name, t, shape=(num_tokens, num_topk))
