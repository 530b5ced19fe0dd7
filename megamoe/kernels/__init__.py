"""GPU kernels (CuTe DSL), by target and role.

* ``sm90/``: Hopper (sm_90a): the FP4-weight grouped GEMM (``gemm``), L1 and L2 in one launch (``l1_l2``), the Mega
  MoE kernel (``mega_moe``), their mainloops, epilogues and tile sources, and the host side (``config``, ``weights``,
  ``api``). An SM100 path would live beside it as ``sm100/``.
* ``comm/``: the Mega MoE protocol's NVLink dispatch and combine (device phases, and the staged kernels made of them).
* ``decode/``: the warp-decode kernels (one GPU, few tokens).
* Shared: ``weight_layout`` (host weight layouts), ``dequant`` (register dequantization), ``ptx`` (inline PTX),
  ``warp_ops`` (warp collectives), ``runtime`` (arch checks, torch -> CuTe tensors, streams, the compile cache).

Importing this package (or any host module in it) never needs the DSL or a GPU; with ``CUTE_DSL_ARCH=sm_90a`` every
kernel compiles on a CPU.
"""
