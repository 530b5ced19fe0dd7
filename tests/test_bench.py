"""The EP MoE benchmark, one process without torchrun: the tiny preset (on CPU: staged path, FP32 reference)."""

import json

import pytest
import torch

from megamoe import StagedMoE
from megamoe.bench.common import environment_receipt, source_digest
from megamoe.bench.moe import main


def test_moe_bench_cycles_routings_and_checks_each():
    rows = main(["--preset", "tiny", "--tokens", "1,3", "--routings", "2", "--warmup", "1", "--iters", "2", "--seed", "5"])
    assert {r["tokens_per_rank"] for r in rows} == {1, 3}
    assert all(r["routings"] == 2 and r["correct"] and r["us"] > 0 for r in rows)
    # Two distinct routings of 3 tokens x top-4 over 16 experts: the mean routed rows is 3 * 4 (one rank).
    assert all(r["routed_rows_per_rank"] == 3 * 4 for r in rows if r["tokens_per_rank"] == 3)


def test_moe_bench_model_presets_and_size_overrides(tmp_path):
    """The model presets hold the models' routed-expert shapes; --experts/--hidden/--intermediate override a preset's
    sizes (here tiny's, on CPU, at sizes the SM90 kernels would pad: every point checked, the receipt records them)."""
    from megamoe.bench.moe import DEFAULT_TOKENS, PRESETS

    assert PRESETS["gpt-oss-120b"] == {"experts": 128, "topk": 4, "hidden": 2880, "intermediate": 2880}
    assert PRESETS["qwen3-30b-a3b"] == {"experts": 128, "topk": 8, "hidden": 2048, "intermediate": 768}
    assert set(DEFAULT_TOKENS) == set(PRESETS)
    path = tmp_path / "r.json"
    rows = main(["--preset", "tiny", "--experts", "8", "--hidden", "96", "--intermediate", "160", "--tokens", "3",
                 "--warmup", "1", "--iters", "2", "--recipe", "128", "--json", str(path)])
    assert rows and all(r["correct"] for r in rows)
    assert json.loads(path.read_text())["shape"] == {"experts": 8, "topk": 4, "hidden": 96, "intermediate": 160}


def test_moe_bench_paths_filter():
    """--paths runs only the named paths (here the staged path's low-latency mode) and refuses any word matching none,
    also beside one that matches (it would silently drop the paths the user asked for)."""
    rows = main(["--preset", "tiny", "--tokens", "2", "--paths", "low_latency", "--warmup", "1", "--iters", "2"])
    assert rows and all("low_latency" in r["path"] and r["correct"] for r in rows)
    for words in ("no-such-path", "low_latency,staged-sm90", "fused", "legacy"):
        with pytest.raises(SystemExit, match=r"--paths \S+ matches none of the paths here: staged-torch-normal"):
            main(["--preset", "tiny", "--tokens", "2", "--paths", words])


def test_moe_bench_builds_only_the_selected_paths(monkeypatch):
    """Paths are built after the --paths filter (a path's prepared weights can be several times the FP4 ones), and
    a GEMM's two staged modes share one StagedMoE's weights (``with_mode``)."""
    import megamoe.bench.moe as bench_moe

    built = []

    class Counting(StagedMoE):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.mode)

    monkeypatch.setattr(bench_moe, "StagedMoE", Counting)
    rows = main(["--preset", "tiny", "--tokens", "2", "--paths", "low_latency", "--warmup", "1", "--iters", "1"])
    assert built == ["low_latency"] and all(r["correct"] for r in rows)
    built.clear()
    rows = main(["--preset", "tiny", "--tokens", "2", "--warmup", "1", "--iters", "1"])
    assert built == ["normal"] and {r["path"] for r in rows} == {"staged-torch-normal", "staged-torch-low_latency"}
    assert all(r["correct"] for r in rows)


def test_moe_bench_recipe_128(tmp_path):
    """--recipe 128: buffers, paths, reference and tolerances of recipe (1, 1, 128); the receipt records it."""
    import json

    from megamoe.numerics import RECIPE_128, moe_tolerances

    out = tmp_path / "r128.json"
    rows = main(["--preset", "tiny", "--tokens", "1,5", "--recipe", "128", "--warmup", "1", "--iters", "1",
                 "--json", str(out)])
    assert rows and all(r["correct"] for r in rows)
    receipt = json.loads(out.read_text())
    assert receipt["recipe"] == [1, 1, 128] and receipt["tolerance"] == moe_tolerances(128, RECIPE_128)
    with pytest.raises(SystemExit):
        main(["--recipe", "128", "--mma-type", "bf16"])
    with pytest.raises(SystemExit):
        main(["--recipe", "64"])


def test_gemm_bench_recipe_128_is_fp8_mode_only():
    from megamoe.bench.gemm import main as gemm_main

    with pytest.raises(SystemExit):
        gemm_main(["--recipe", "128", "--mma", "bf16,fp8"])


def test_moe_bench_rejects_no_routings_and_empty_graphs():
    for bad in (["--routings", "0"], ["--calls-per-graph", "0"]):
        with pytest.raises(SystemExit):
            main(bad)


def test_moe_bench_ring_cap():
    """--ring-tokens caps each point's ring (recorded per row); it must be a positive multiple of 128."""
    rows = main(["--preset", "tiny", "--tokens", "1,40", "--ring-tokens", "128", "--warmup", "1", "--iters", "2"])
    assert {r["ring_tokens"] for r in rows} == {128} and all(r["correct"] for r in rows)
    for bad in ("100", "0"):
        with pytest.raises(SystemExit):
            main(["--ring-tokens", bad])


def test_receipt_names_the_source_it_ran(tmp_path):
    """The digest follows the package's sources: same files, same digest; one changed byte or a renamed file,
    another; the receipt carries the installed package's."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert source_digest(tmp_path) == first and len(first) == 16
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = source_digest(tmp_path)
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert len({first, changed, source_digest(tmp_path)}) == 3
    assert environment_receipt(torch.device("cpu"), 1)["megamoe_source"] == source_digest()


def test_gemm_bench_alternative_configs_differ_from_the_choice():
    """bench.gemm's alternative row is another config than select_config's (BF16 mode: 128-row weight tiles where
    it picks 256, 1 CTA/SM where it picks 2; either mode: 64-row token tiles where it picks 128), never a repeat; the
    other tiles get none."""
    from megamoe.bench.gemm import Point, kernel_configs
    from megamoe.kernels.sm90 import select_config

    for rows in (1, 4, 16, 64, 4096):
        p = Point("flash", "l1", 8, 32, rows, 4096, 4096)
        for mma in ("bf16", "fp8"):
            configs = kernel_configs(p, mma, True)
            assert configs[0] == select_config(rows, 4096, 4096, mma)
            alternative = mma == "bf16" or (mma == "fp8" and rows == 4096)
            assert len(set(configs)) == len(configs) == (2 if alternative else 1), (rows, mma, configs)
            if mma == "bf16" and rows <= 64:  # the four-warpgroup tile against the 128-row tile
                assert (configs[0].tile_n, configs[1].tile_n) == (256, 128)
                assert configs[1].ctas_per_sm == (2 if configs[1].tile_tokens <= 32 else 1)
            assert kernel_configs(p, mma, False) == configs[:1]


def test_gemm_bench_times_every_weight_decode_of_recipe_128():
    """``--decode regs,smem,copy``: each recipe-128 config in the consumers' register decode, then each as the
    shared-memory decode, then each reading the weights' E4M3 copy, both on one CTA per SM (configs that differ only
    in their CTAs per SM run once)."""
    from megamoe.bench.gemm import Point, kernel_configs

    for rows in (1, 64, 4096):
        p = Point("flash", "l1", 8, 32, rows, 4096, 4096)
        regs = kernel_configs(p, "fp8", True, 128)
        both = kernel_configs(p, "fp8", True, 128, ("regs", "smem"))
        smem = kernel_configs(p, "fp8", True, 128, ("smem",))
        assert both == regs + smem and len(set(both)) == len(both)
        assert all(c.decode == "regs" for c in regs) and all(c.decode == "smem" and c.ctas_per_sm == 1 for c in smem)
        assert [(c.tile_tokens, c.tile_n) for c in smem] == [(c.tile_tokens, c.tile_n) for c in regs]
        copy = kernel_configs(p, "fp8", True, 128, ("copy",))
        assert kernel_configs(p, "fp8", True, 128, ("regs", "smem", "copy")) == regs + smem + copy
        assert all(c.decode == "copy" and c.ctas_per_sm == 1 for c in copy)
        assert [(c.tile_tokens, c.tile_n) for c in copy] == [(c.tile_tokens, c.tile_n) for c in smem]
    assert kernel_configs(p, "bf16", True, 32, ("regs", "smem")) == kernel_configs(p, "bf16", True)


def test_gemm_bench_pairs_each_config_that_may_run_on_a_cluster():
    """``--cluster 1,2``: each recipe-128 config, then beside it its two-CTA cluster variant where the config allows
    one (one CTA per SM, token tiles of 16 rows or more, N a multiple of two weight tiles); ``--cluster 2`` alone: the
    variants only."""
    import dataclasses

    from megamoe.bench.gemm import Point, kernel_configs

    for rows in (1, 64, 1024):
        p = Point("flash", "l1", 8, 32, rows, 4096, 4096)
        one = kernel_configs(p, "fp8", True, 128, ("regs", "copy"))
        both = kernel_configs(p, "fp8", True, 128, ("regs", "copy"), clusters=(1, 2))
        pairs = [dataclasses.replace(c, cluster=2) for c in one if c.ctas_per_sm == 1 and c.tile_tokens >= 16]
        assert [c for c in both if c.cluster == 1] == one and [c for c in both if c.cluster == 2] == pairs
        assert kernel_configs(p, "fp8", True, 128, ("regs", "copy"), clusters=(2,)) == pairs
        assert pairs or rows == 1
    narrow = Point("flash", "l1", 8, 32, 1024, 128, 4096)  # N: one 128-row weight tile, no pair
    assert all(c.cluster == 1 for c in kernel_configs(narrow, "fp8", True, 128, ("copy",), clusters=(1, 2)))
    # with tokens on M (``--token-sides n,m``): the tokens-on-M config after the swap-AB ones, each paired alike
    sides = kernel_configs(p, "fp8", False, 128, ("copy",), ("n", "m"), (1, 2))
    assert [(c.token_side, c.cluster) for c in sides] == [("n", 1), ("n", 2), ("m", 1), ("m", 2)]
    # ``--cluster 1,2,4``: four-CTA quads beside tokens on M only
    sides = kernel_configs(p, "fp8", False, 128, ("copy",), ("n", "m"), (1, 2, 4))
    assert [(c.token_side, c.cluster) for c in sides] == [("n", 1), ("n", 2), ("m", 1), ("m", 2), ("m", 4)]


def test_gemm_bench_swiglu_configs_and_reference_columns():
    """``--swiglu``: the swap-AB per-128 SwiGLU tile with each decode, then tokens on M in two passes on each cluster
    size whose weight-tile pairs divide N; recipe 32 refused before the bench looks for a GPU."""
    from megamoe.bench.gemm import Point, main as gemm_main, swiglu_configs

    p = Point("flash", "l1", 8, 32, 1024, 4096, 4096)
    cfgs = swiglu_configs(p, ("regs", "copy"), ("n", "m"), (1, 2, 4))
    assert [(c.decode, c.token_side, c.tile_tokens, c.tile_n, c.n_passes, c.cluster) for c in cfgs] == [
        ("regs", "n", 32, 256, 1, 1), ("copy", "n", 32, 256, 1, 1), ("copy", "m", 128, 256, 2, 1),
        ("copy", "m", 128, 256, 2, 2), ("copy", "m", 128, 256, 2, 4)]
    assert [c.cluster for c in swiglu_configs(Point("x", "l1", 8, 32, 1024, 768, 4096), ("copy",), ("m",), (1, 4))] == [
        1, 1]  # N = 768: no pair of 256-row tiles, the quad dropped; the swap-AB tile
    with pytest.raises(SystemExit) as info:
        gemm_main(["--swiglu"])
    assert info.value.code == 2


def test_gemm_bench_token_sides_need_the_copy():
    """``--token-sides``: n and/or m; m (tokens on the wgmma M side) runs with the weights' E4M3 copy only, and
    ``--cluster 4`` with tokens on M only: refused (argparse's usage error) before the bench looks for a GPU."""
    from megamoe.bench.gemm import main as gemm_main

    for bad in (["--recipe", "128", "--token-sides", "k", "--decode", "copy"],
                ["--recipe", "128", "--token-sides", "n,m"], ["--recipe", "128", "--token-sides", "m", "--decode", "regs"],
                ["--recipe", "128", "--decode", "copy", "--cluster", "1,4"], ["--recipe", "128", "--cluster", "3"]):
        with pytest.raises(SystemExit) as info:
            gemm_main(bad)
        assert info.value.code == 2, bad


def test_ab_runs_the_builds_in_turn_each_its_own_source(tmp_path):
    """bench/ab.py: two builds of this tree (copied: no git needed) run in turn (one ``python -m
    torch.distributed.run`` each: no torchrun on PATH needed; tiny preset on CPU) into one receipt and a summary
    line per point, the receipt rewritten after every checked run; a build that runs another megamoe than its own
    (digest) fails the A/B and leaves the runs before it as a partial receipt; labels are unique."""
    import json

    from bench import ab

    d, tree = tmp_path / "ab", str(ab.ROOT)
    builds = ab.prepare([f"base={tree}", f"new={tree}"], d)
    assert [b["label"] for b in builds] == ["base", "new"] and all(b["commit"] is None for b in builds)
    assert builds[0]["megamoe_source"] == builds[1]["megamoe_source"] == source_digest(ab.ROOT / "megamoe")
    args = ["--preset", "tiny", "--tokens", "1", "--paths", "low_latency", "--warmup", "1", "--iters", "1"]
    receipt = ab.run(d, args, nproc=1, rounds=1, timeout=300, out=tmp_path / "ab.json")
    assert [(r["build"], r["round"]) for r in receipt["runs"]] == [("base", 1), ("new", 1)]
    assert receipt["complete"] and json.loads((tmp_path / "ab.json").read_text()) == receipt
    assert all(row["correct"] and row["us"] > 0 for r in receipt["runs"] for row in r["results"])
    lines = ab.summary(receipt)
    assert len(lines) == 2 and lines[1].startswith("tiny 1 staged-torch-low_latency") and "(1.000x)" in lines[1]
    builds[1]["megamoe_source"] = "0" * 16
    (d / ab.BUILDS_FILE).write_text(json.dumps(builds))
    with pytest.raises(SystemExit, match="new round 1 ran megamoe"):
        ab.run(d, args, nproc=1, rounds=1, timeout=300, out=tmp_path / "cut.json")
    cut = json.loads((tmp_path / "cut.json").read_text())  # the run checked before the failed one, marked partial
    assert not cut["complete"] and [(r["build"], r["round"]) for r in cut["runs"]] == [("base", 1)]
    with pytest.raises(SystemExit, match="must be unique"):
        ab.prepare([f"x={tree}", f"x={tree}"], d)


def test_ab_needs_git_only_for_a_git_ref(tmp_path, monkeypatch):
    """Without git on PATH, a git ref fails with a message naming git (before ``--dir`` is touched); a directory
    holding a megamoe tree still prepares."""
    from bench import ab

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    keep = tmp_path / "ab" / "kept"
    keep.mkdir(parents=True)
    with pytest.raises(SystemExit, match="needs git, not found on PATH"):
        ab.prepare([f"base={ab.ROOT}", "new=HEAD"], tmp_path / "ab")
    assert keep.is_dir()
    (build,) = ab.prepare([f"base={ab.ROOT}"], tmp_path / "ab")
    assert (tmp_path / "ab" / "base" / "megamoe" / "__init__.py").is_file() and build["commit"] is None


@pytest.mark.gpu
def test_decode_bench_receipt(tmp_path):
    """``megamoe.bench decode --json`` records every printed row with its checks and the crossover per expert set."""
    import json

    from megamoe.bench.decode import main as decode_main

    path = tmp_path / "decode.json"
    decode_main(["--shapes", "flash", "--experts", "8", "--batches", "1,4", "--routings", "2", "--warmup", "1",
                 "--iters", "2", "--hbm-gib", "0.5", "--no-torch", "--json", str(path)])
    receipt = json.loads(path.read_text())
    assert receipt["environment"]["megamoe_source"] == source_digest() and receipt["hbm_read_gbps"] > 0
    assert [(r["experts"], r["tokens"]) for r in receipt["rows"]] == [(8, 1), (8, 4)]
    for row in receipt["rows"]:
        assert all(row[f"{n}_check"] == "ok" for n in ("simt", "mma", "tc", "grouped"))
        assert row["decoder_runs"] in ("simt", "mma", "tc") and row[f"{row['decoder_runs']}_us"] > 0
    (crossover,) = receipt["crossovers"]
    assert crossover["experts"] == 8 and crossover["crossover"] in (0, 1, 4)


@pytest.mark.gpu
def test_gemm_bench_receipt_checks_every_kernel(tmp_path):
    """``megamoe.bench gemm --json`` checks each kernel config against a float64 reference from the weights it ran
    (chunk-major scales included) and records the verdicts."""
    import json

    from megamoe.bench.gemm import main as gemm_main

    path = tmp_path / "gemm.json"
    assert gemm_main(["--presets", "flash", "--ep", "8", "--rows", "1,16", "--layers", "l1,l2", "--no-baselines",
                      "--json", str(path)]) == 0
    receipt = json.loads(path.read_text())
    assert [(r["point"]["layer"], r["point"]["rows_per_expert"]) for r in receipt["records"]] == [
        ("l1", 1), ("l1", 16), ("l2", 1), ("l2", 16)]
    for record in receipt["records"]:
        assert {r["impl"] for r in record["results"]} >= {"megamoe bf16 mode", "megamoe fp8 mode"}
        assert all(r["verdict"].startswith("PASS") and r["us"] > 0 for r in record["results"])
