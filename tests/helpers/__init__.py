"""Test helpers: ``spawn`` runs a function on N local processes joined in one process group; ``weights`` makes the
canonical FP4 weights that the layout and grouped GEMM tests share."""
