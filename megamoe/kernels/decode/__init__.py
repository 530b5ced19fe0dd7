"""Warp-decode MoE kernels (CuTe DSL, sm_90a)."""
