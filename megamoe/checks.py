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
