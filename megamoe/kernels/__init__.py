"""GPU kernels (CuTe DSL). One module per kernel family; ``sm90_*`` modules target Hopper (sm_90a),
an SM100 path would live beside them as ``sm100_*``. ``runtime`` holds what every kernel wrapper
shares: architecture checks, torch -> CuTe tensor conversion, streams and the compile cache.
Importing this package never needs a GPU: with ``CUTE_DSL_ARCH=sm_90a`` kernels compile on a CPU."""
