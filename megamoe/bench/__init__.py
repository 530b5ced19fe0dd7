"""megamoe benchmarks: ``python -m megamoe.bench [moe|gemm|decode] ...`` (``moe`` is the default)."""
