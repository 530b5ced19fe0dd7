"""The benchmarks' peers (``--peers humming``), ``--routings`` cycling for peers and the GEMM bench, and the plots.

On CPU: argument parsing, the clear errors when a peer cannot run (not installed, no GPU, several ranks, BF16
weights), the peers' routing preparation and FP64 reference against independent constructions, the cycling of
token sets / routings through the timed calls with stand-in peers, and the plot command (drawing skipped without
matplotlib). On the GPU machine with humming-kernels installed: the peers' rows in both benches, every point checked.
"""

import json
import subprocess
import sys

import pytest
import torch

import megamoe.bench.moe as bench_moe
from megamoe.bench import peers as peer_lib
from megamoe.bench import plot as bench_plot
from megamoe.inputs import random_fp4_weights, random_routing, random_tokens
from megamoe.numerics import RECIPE_32, RECIPE_128, bf16_rne, moe_tolerances
from megamoe.reference import reference_moe, reference_slot_outputs


@pytest.fixture
def no_humming(monkeypatch):
    """Make ``import humming`` fail, whatever is installed (None in sys.modules raises ImportError)."""
    monkeypatch.setitem(sys.modules, "humming", None)


def test_peers_argument_parsing():
    assert bench_moe.parse_args(["--peers", "humming"]).peers == ["humming"]
    assert bench_moe.parse_args([]).peers == []
    assert peer_lib.peer_paths(["humming"]) == ["humming-bf16", "humming-fp8"]
    for bad in ("nope", "humming,nope", ","):
        with pytest.raises(SystemExit):
            bench_moe.parse_args(["--peers", bad])
        with pytest.raises(ValueError, match="--peers takes a comma-separated list of humming"):
            peer_lib.parse_peers(bad)


def test_gemm_bench_rejects_bad_peers_and_routings():
    """bench.gemm refuses an unknown peer and fewer than one token set before it looks for a GPU."""
    from megamoe.bench.gemm import main as gemm_main

    for bad in (["--peers", "nope"], ["--routings", "0"]):
        with pytest.raises(SystemExit) as info:
            gemm_main(bad)
        assert info.value.code == 2  # argparse's usage error, not the no-GPU return


def test_missing_humming_is_an_error(no_humming):
    with pytest.raises(SystemExit, match=r"--peers humming needs humming-kernels==0\.1\.20 \(pip install -e '\.\[bench\]'\)"):
        peer_lib.require_humming()
    with pytest.raises(SystemExit, match="needs humming-kernels"):
        peer_lib.check_peer_setup(["humming"], torch.device("cuda"), 1, True)


def test_peers_that_cannot_run_here_stop_the_run(no_humming):
    """No GPU, several ranks or BF16 weights: a clear error before anything is built (never a silent skip)."""
    with pytest.raises(SystemExit, match="--peers needs a CUDA GPU"):
        bench_moe.main(["--preset", "tiny", "--tokens", "1", "--peers", "humming"])
    with pytest.raises(SystemExit, match=r"runs on one rank \(EP1\), this run has 2"):
        peer_lib.check_peer_setup(["humming"], torch.device("cuda"), 2, True)
    with pytest.raises(SystemExit, match="use --mma-type fp8xfp4"):
        peer_lib.check_peer_setup(["humming"], torch.device("cuda"), 1, False)


def test_library_never_imports_humming():
    code = ("import sys, megamoe, megamoe.nn, megamoe.bench.moe, megamoe.bench.gemm, megamoe.bench.plot; "
            "assert 'humming' not in sys.modules and 'megamoe.bench.topk_sum' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def _align_by_loops(idx: torch.Tensor, block: int, experts: int):
    """vLLM's moe_align_block_size written out: per expert, its flat (token, slot) ids in order, padded with T*k."""
    flat = idx.reshape(-1).tolist()
    sorted_ids, expert_ids = [], []
    for e in range(experts):
        ids = [i for i, v in enumerate(flat) if v == e]
        pad = -len(ids) % block
        sorted_ids += ids + [len(flat)] * pad
        expert_ids += [e] * ((len(ids) + pad) // block)
    return sorted_ids, expert_ids


@pytest.mark.parametrize("block", [1, 16, 64])
def test_align_block_size_groups_rows_by_expert(block):
    gen = torch.Generator().manual_seed(block)
    idx, _ = random_routing(37, 12, 4, gen, masked_ratio=0.2)
    sorted_ids, expert_ids, padded = peer_lib.align_block_size(idx, block, 12)
    want_ids, want_experts = _align_by_loops(idx, block, 12)
    assert sorted_ids.dtype == expert_ids.dtype == padded.dtype == torch.int32
    assert sorted_ids.tolist() == want_ids and expert_ids.tolist() == want_experts
    assert padded.tolist() == [len(want_ids)] and len(want_ids) % block == 0


def test_sublayers_must_agree_on_the_row_block():
    """The indexed routing serves both GEMMs: where the sublayers' tuning intervals pick different row blocks the peer
    refuses before any launch, naming both (the intervals here are made up; Humming's are (low, high] of shape_m)."""
    layer = object.__new__(peer_lib._HummingLayer)
    layer.tuning = {"w13": [(0, 64, {"block_shape": [16, 128, 128]}), (64, 1 << 30, {"block_shape": [64, 128, 128]})],
                    "w2": [(0, 256, {"block_shape": [16, 128, 128]}), (256, 1 << 30, {"block_shape": [64, 256, 64]})]}
    assert layer.shared_block_rows(8) == 16 and layer.shared_block_rows(1000) == 64
    with pytest.raises(RuntimeError, match=r"shape_m=100 .*'w13': 64, 'w2': 16"):
        layer.shared_block_rows(100)


def test_peer_reference_bf16_matches_megamoe_reference_where_the_contracts_meet():
    """With one slot per token and unit weights the two contracts coincide for BF16 tokens (the routing weight's place
    does not matter, R4 sums one row): the peer's reference must equal megamoe's, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    e, h, i = 8, 256, 128
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    x = random_tokens(9, h, gen)
    idx, _ = random_routing(9, e, 1, gen)
    ones = torch.ones(9, 1)
    want = reference_moe(x, None, idx, ones, l1, l2)
    assert torch.equal(peer_lib.peer_reference(x, idx, ones, l1, l2, "bf16").view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("activations", ["bf16", "fp8"])
def test_peer_reference_weights_after_the_second_gemm(activations):
    """Routing weights apply to each slot's BF16 output (R3) in the sum, unused slots add nothing: built here from
    megamoe's per-slot reference with unit weights (for FP8: the tokens' per-128 quantization, the SwiGLU output's
    taken by megamoe's reference after its own R2 - so FP8 is compared within the tolerance, BF16 exactly)."""
    from megamoe.layouts import quantize_fp8

    gen = torch.Generator().manual_seed(5)
    e, h, i, t, k = 8, 256, 128, 11, 3
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    x = random_tokens(t, h, gen)
    idx, w = random_routing(t, e, k, gen, masked_ratio=0.25)
    got = peer_lib.peer_reference(x, idx, w, l1, l2, activations)
    x_q, x_sf = quantize_fp8(x, recipe=RECIPE_128) if activations == "fp8" else (x, None)
    o = reference_slot_outputs(x_q, x_sf, idx, torch.ones(t, k), l1, l2)
    want = bf16_rne((o.double() * torch.where(idx >= 0, w.double(), 0.0).unsqueeze(-1)).sum(1))
    if activations == "bf16":
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    else:
        tol = peer_lib.peer_tolerances(i, "fp8")
        assert tol == moe_tolerances(i, RECIPE_128)
        from megamoe.numerics import rel_fro_error

        assert 0 < rel_fro_error(got, want) <= tol["rel_fro"]
    assert peer_lib.peer_tolerances(i, "bf16") == moe_tolerances(i, RECIPE_32)
    dead = (idx < 0).all(dim=1)
    assert torch.equal(got[dead], torch.zeros_like(got[dead]))


class _StandInPeer:
    """A peer with HummingMoE's interface computing its own reference (no GPU): records which routing each call got."""

    def __init__(self, l1, l2):
        self.l1, self.l2, self.inter, self.calls = l1, l2, l2[0].shape[2] * 2, []

    def prepare(self, x, idx, w):
        return peer_lib.HummingRouting(idx.numel(), idx, idx, idx, {"y": torch.empty(x.shape, dtype=torch.bfloat16),
                                                                    "case": (x, idx, w)})

    def __call__(self, routing):
        self.calls.append(routing)
        routing.buffers["y"].copy_(self.reference(*routing.buffers["case"]))
        return routing.buffers["y"]

    def reference(self, x, idx, w):
        return peer_lib.peer_reference(x, idx, w, self.l1, self.l2, "bf16")

    def tolerances(self):
        return peer_lib.peer_tolerances(self.inter, "bf16")


def test_moe_peer_row_checks_every_routing_and_cycles_them(monkeypatch):
    """bench.moe's peer rows: every routing checked against the peer's reference, then the timed calls (here a
    stand-in for the CUDA graph) cycle through the routings."""
    gen = torch.Generator().manual_seed(7)
    e, h, i, t = 8, 256, 128, 5
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    cases = []
    for _ in range(3):
        idx, w = random_routing(t, e, 2, gen)
        cases.append((None, idx, None, random_tokens(t, h, gen), w))
    peer = _StandInPeer(l1, l2)

    def graph_stand_in(fn, warmup, iters, calls_per_graph, before=None):
        for _ in range(calls_per_graph):
            fn()
        return [1.0] * iters

    monkeypatch.setattr(bench_moe, "time_graph", graph_stand_in)
    args = bench_moe.parse_args(["--routings", "3", "--calls-per-graph", "6"])
    row = bench_moe._peer_row("humming-bf16", peer, cases, t, args, lambda: None, 0.0, 1000, h, i, print)
    assert row["correct"] and row["routings"] == 3 and row["us"] == 1.0 and row["rel_fro"] == 0.0
    checked, timed = peer.calls[:3], peer.calls[3:]
    assert [r.buffers["case"][1] is c[1] for r, c in zip(checked, cases)] == [True] * 3
    # the timed calls cycle through the 3 prepared routings
    assert [next(n for n, c in enumerate(checked) if c is r) for r in timed] == [0, 1, 2, 0, 1, 2]
    assert row["routed_rows_per_rank"] == t * 2


def test_gemm_peer_checks_every_token_set_and_cycles_them(monkeypatch):
    """bench.gemm's peer rows: each token set checked against the FP64 product of the rows the peer reads and the
    canonical weights, the timed calls cycling through the sets; a wrong product fails the verdict."""
    import megamoe.bench.gemm as bench_gemm
    from megamoe.layouts import dequantize_fp4, quantize_fp8

    gen = torch.Generator().manual_seed(11)
    p = bench_gemm.Point("tiny", "l1", 1, 4, 3, 256, 128)
    canonical = random_fp4_weights(p.experts, p.n, p.k, gen)
    sets = []
    for _ in range(2):
        a, a_sf = quantize_fp8(torch.randn(p.experts * p.rows_per_expert, p.k, generator=gen))
        sets.append((a, a_sf, None))

    class Gemm:
        activations, calls, wrong = "bf16", [], False

        def prepare(self, a, rows_per_expert):
            return {"a": a}, a.double()

        def __call__(self, routing):
            self.calls.append(routing)
            a = routing["a"].double()
            out = torch.cat([a[e * 3 : e * 3 + 3] @ dequantize_fp4(canonical[0][e], canonical[1][e]).double().T
                             for e in range(p.experts)])
            return (out * (1.5 if self.wrong else 1.0)).to(torch.bfloat16)

    def time_stand_in(fn):
        for _ in range(4):
            fn()
        return 2.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_gemm, "_time_us", time_stand_in)
    gemm = Gemm()
    result = bench_gemm.run_peer(p, gemm, canonical, sets)
    assert result.verdict.startswith("PASS") and "(2 token sets)" in result.verdict and result.us == 2.0
    timed = gemm.calls[2:]
    assert [r is gemm.calls[n % 2] for n, r in enumerate(timed)] == [True] * 4
    gemm.wrong = True
    assert bench_gemm.run_peer(p, gemm, canonical, sets).verdict.startswith("FAIL")


def _moe_receipt():
    rows = [{"tokens_per_rank": t, "path": path, "us": us, "correct": ok}
            for path, base in (("mega", 10.0), ("humming-fp8", 20.0))
            for t, us, ok in ((1, base, True), (8, base * 1.5, True), (128, base * 4, path == "mega"))]
    return {"benchmark": "megamoe.bench moe", "preset": "tiny", "shape": {"experts": 16}, "mma_type": "fp8xfp4",
            "environment": {"gpu": "none"}, "results": rows}


def _gemm_receipt():
    def record(rows, layer):
        point = {"preset": "flash", "layer": layer, "ep": 8, "experts": 32, "rows_per_expert": rows, "n": 4096,
                 "k": 4096}
        results = [{"impl": "megamoe fp8 mode", "verdict": "PASS", "us": 5.0 * rows},
                   {"impl": "megamoe fp8 mode", "verdict": "PASS", "us": 6.0 * rows},
                   {"impl": "humming fp8-act", "verdict": "FAIL rel_fro=1", "us": 1.0},
                   {"impl": "torch._scaled_grouped_mm fp8", "verdict": "skipped: no", "us": None}]
        return {"point": point, "results": results}

    return {"benchmark": "megamoe.bench gemm", "records": [record(1, "l1"), record(16, "l1"), record(1, "l2")]}


def test_plot_panels_of_both_receipts():
    """One line per path, x sorted, failed or unchecked points left out and counted; gemm: one panel per layer."""
    (panel,) = bench_plot.panels(_moe_receipt())
    assert panel["lines"] == {"mega": [(1, 10.0), (8, 15.0), (128, 40.0)], "humming-fp8": [(1, 20.0), (8, 30.0)]}
    assert panel["left_out"] == 1 and panel["xlabel"] == "tokens per rank"
    l1, l2 = bench_plot.panels(_gemm_receipt())
    assert l1["lines"] == {"megamoe fp8 mode": [(1, 5.0), (16, 80.0)], "megamoe fp8 mode (alt)": [(1, 6.0), (16, 96.0)]}
    assert l1["left_out"] == 4 and l2["lines"]["megamoe fp8 mode"] == [(1, 5.0)] and "l2 EP8" in l2["title"]
    with pytest.raises(ValueError, match="not a megamoe.bench receipt"):
        bench_plot.panels({"rows": []})


def test_plot_without_matplotlib_says_how_to_draw_it_later(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_moe_receipt()))
    monkeypatch.setattr(bench_plot, "have_matplotlib", lambda: False)
    said = []
    assert bench_plot.save_plot_beside(path, said.append) is None
    assert said == [f"matplotlib not installed: no plot (draw it where matplotlib is: python -m megamoe.bench plot {path})"]
    with pytest.raises(SystemExit, match="needs matplotlib"):
        bench_plot.main([str(path)])


@pytest.mark.parametrize("receipt", [_moe_receipt(), _gemm_receipt()], ids=["moe", "gemm"])
def test_plot_command_draws_a_receipt(tmp_path, receipt):
    pytest.importorskip("matplotlib")
    from megamoe.bench.__main__ import main as bench_main

    path = tmp_path / "r.json"
    path.write_text(json.dumps(receipt))
    bench_main(["plot", str(path)])
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench_plot.save_plot_beside(path, lambda *a: None) == png
    other = tmp_path / "other.svg"
    assert bench_plot.main([str(path), "--out", str(other)]) == other and other.read_text().startswith("<?xml")


@pytest.mark.gpu
def test_moe_bench_humming_peers(tmp_path):
    """GPU with humming-kernels: both peer variants next to megamoe's paths on the flash preset (Humming's FP8 path is
    wrong at the tiny preset's I = 128: bench/findings/humming-peer.md), every point checked against the peer's
    reference over 2 routings (one masked slot in four), receipt with the peers' configs."""
    pytest.importorskip("humming")
    path = tmp_path / "moe.json"
    rows = bench_moe.main(["--preset", "flash", "--tokens", "1,33", "--routings", "2", "--masked-ratio", "0.25",
                           "--peers", "humming", "--warmup", "1", "--iters", "3", "--json", str(path)])
    peers = [r for r in rows if r["path"].startswith("humming-")]
    assert {r["path"] for r in peers} == {"humming-bf16", "humming-fp8"} and len(peers) == 4
    assert all(r["correct"] and r["us"] > 0 and r["routings"] == 2 for r in rows)
    receipt = json.loads(path.read_text())
    assert set(receipt["peers"]) == {"humming-bf16", "humming-fp8"}
    assert receipt["peers"]["humming-fp8"]["humming_kernels"] == peer_lib.humming_version()
    assert "outside the timed call" in receipt["method"]


@pytest.mark.gpu
def test_gemm_bench_humming_peers(tmp_path):
    pytest.importorskip("humming")
    from megamoe.bench.gemm import main as gemm_main

    path = tmp_path / "gemm.json"
    assert gemm_main(["--presets", "flash", "--ep", "8", "--rows", "1,64", "--layers", "l1,l2", "--no-baselines",
                      "--no-alt", "--routings", "2", "--peers", "humming", "--json", str(path)]) == 0
    receipt = json.loads(path.read_text())
    for record in receipt["records"]:
        impls = {r["impl"] for r in record["results"]}
        assert {"humming bf16-act", "humming fp8-act"} <= impls
        assert all(r["verdict"].startswith("PASS") and r["us"] > 0 for r in record["results"])
