"""The EP MoE benchmark, one process without torchrun: the tiny preset (on CPU: legacy path, FP32 reference)."""

import pytest

from megamoe.bench.moe import main


def test_moe_bench_cycles_routings_and_checks_each():
    rows = main(["--preset", "tiny", "--tokens", "1,3", "--routings", "2", "--warmup", "1", "--iters", "2", "--seed", "5"])
    assert {r["tokens_per_rank"] for r in rows} == {1, 3}
    assert all(r["routings"] == 2 and r["correct"] and r["us"] > 0 for r in rows)
    # Two distinct routings of 3 tokens x top-4 over 16 experts: the mean routed rows is 3 * 4 (one rank).
    assert all(r["routed_rows_per_rank"] == 3 * 4 for r in rows if r["tokens_per_rank"] == 3)


def test_moe_bench_rejects_no_routings():
    with pytest.raises(SystemExit):
        main(["--routings", "0"])
