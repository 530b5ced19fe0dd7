"""What every CuTe DSL kernel wrapper shares: arch checks, tensor conversion, streams, compile cache.

Kernels are compiled once per (kernel, static configuration) key with ``cute.compile`` and kept in
a process-wide cache; launches then cost only argument conversion. Without a GPU, setting
``CUTE_DSL_ARCH=sm_90a`` before the first import of ``cutlass`` lets every kernel compile on a CPU
(CI does this); ``compile_only_arch()`` reports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..checks import fail

_cache: dict[Hashable, Any] = {}


def compile_only_arch() -> str | None:
    """The architecture forced through ``CUTE_DSL_ARCH`` (CPU compile checks), else None."""
    return os.environ.get("CUTE_DSL_ARCH")


def require_sm90(t: torch.Tensor, name: str) -> None:
    """Raise unless ``t`` lives on a Hopper (compute capability 9.0) CUDA device."""
    if t.device.type != "cuda":
        fail(name, f"must be a CUDA tensor for this kernel, got device {t.device}")
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) != (9, 0):
        fail(name, f"is on a device of compute capability {major}.{minor}; this kernel needs sm_90 (Hopper)")


def to_cute(t: torch.Tensor, *, leading_dim: int | None = None, align: int = 16):
    """A torch tensor as a CuTe tensor with dynamic layout (``leading_dim`` = the stride-1 mode)."""
    from cutlass.cute.runtime import from_dlpack

    ct = from_dlpack(t.detach(), assumed_align=align)
    if leading_dim is not None:
        ct = ct.mark_layout_dynamic(leading_dim=leading_dim)
    return ct


def current_stream():
    """The current torch CUDA stream as a ``cuda.CUstream`` (a null stream without a GPU)."""
    from cuda.bindings import driver as cuda

    if torch.cuda.is_available():
        return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    return cuda.CUstream(0)


H100_SMEM_PER_SM = 233472  # bytes, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR on sm_90


def _answer_device_queries_without_gpu() -> None:
    """GPU-blind compiles: the DSL asks the driver for the shared memory per SM when a kernel requests
    several CTAs per SM; with ``CUTE_DSL_ARCH`` set and no GPU, answer with the sm_90 value."""
    from cutlass.cutlass_dsl import cutlass as dsl

    helpers = dsl.cuda_helpers
    if getattr(helpers.get_device_attribute, "_megamoe_gpu_blind", False):
        return
    real = helpers.get_device_attribute
    smem_attr = helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR

    def get_device_attribute(attr, *args, **kwargs):
        return H100_SMEM_PER_SM if attr == smem_attr else real(attr, *args, **kwargs)

    get_device_attribute._megamoe_gpu_blind = True
    helpers.get_device_attribute = get_device_attribute


def compiled(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, building (``cute.compile``) it on first use."""
    fn = _cache.get(key)
    if fn is None:
        if compile_only_arch() and not torch.cuda.is_available():
            _answer_device_queries_without_gpu()
        fn = _cache[key] = build()
    return fn
