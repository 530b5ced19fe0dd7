"""The benchmarks' peers (``--peers humming``), ``--routings`` cycling for peers and the GEMM bench, and the plots.

On CPU: argument parsing, the clear errors when a peer cannot run (not installed, no GPU, several ranks, BF16
weights), the peers' routing preparation and FP64 reference against independent constructions, the cycling of
token sets / routings through the timed calls with stand-in peers, and the plot command (drawing skipped without
matplotlib). On the GPU machine with humming-kernels installed: the peers' rows in both benches, every point checked.
"""

import contextlib
import itertools
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


def _table_config(block_m, stages=4, **extra):
    return {"block_shape": [block_m, 128, 128], "warp_shape": [block_m, 32, 128], "num_stages": stages, **extra}


def _plan_layer(**tables):
    layer = object.__new__(peer_lib._HummingLayer)
    layer.tuning = tables
    return layer


def test_row_block_plan_forces_one_block_for_both_sublayers():
    """Made-up tuning tables (Humming's are (low, high] intervals of shape_m): where the tuned blocks agree, the tuned
    configs, nothing forced; where they differ, w2 runs the config of its own table with w13's block from the interval
    nearest shape_m, and the record says from what and why; w13 follows w2 only where w2's table lacks w13's block;
    where neither table has the other's block, the point is refused naming both."""
    w13 = [[0, 64, _table_config(16)], [64, 1 << 30, _table_config(64)]]
    w2 = [[0, 50, _table_config(16, stages=3)], [50, 256, _table_config(32)], [256, 400, _table_config(64, stages=5)],
          [400, 1 << 30, _table_config(64)]]
    layer = _plan_layer(w13=w13, w2=w2)
    for m, block in ((8, 16), (1000, 64)):
        plan = layer.row_block_plan(m)
        assert plan.block == block and plan.forced == {}
        assert plan.configs == {"w13": next(c for lo, hi, c in w13 if lo < m <= hi),
                                "w2": next(c for lo, hi, c in w2 if lo < m <= hi)}
    plan = layer.row_block_plan(100)  # w13 64, w2 32: w2's 64-row configs at (256, 400] (156 away) and (400, ...)
    assert plan.block == 64 and plan.configs == {"w13": w13[1][2], "w2": w2[2][2]}
    record = plan.forced["w2"]
    assert set(plan.forced) == {"w2"} and record["block_m"] == 64 and record["tuned_block_m"] == 32
    assert record["aligned_with"] == "w13" and record["launched_config_interval"] == [256, 400]
    assert record["tuned_config"] is w2[1][2] and record["launched_config"] is w2[2][2]
    assert record["differs_in"] == ["block_shape", "num_stages", "warp_shape"]
    assert "out of bounds" in record["reason"] and "shape_m=100" in record["reason"]
    plan = layer.row_block_plan(60)  # w13 16, w2 32 (larger: one block would span two experts)
    assert plan.block == 16 and plan.configs["w2"] is w2[0][2] and plan.forced["w2"]["launched_config_interval"] == [0, 50]
    assert "two experts' rows" in plan.forced["w2"]["reason"]

    lone = _plan_layer(w13=[[0, 10, _table_config(16)], [10, 1 << 30, _table_config(40)]],
                       w2=[[0, 1 << 30, _table_config(16)]])
    plan = lone.row_block_plan(20)  # w2's table has no 40-row config: w13 runs its own 16-row one
    assert plan.block == 16 and set(plan.forced) == {"w13"} and plan.forced["w13"]["aligned_with"] == "w2"
    assert plan.configs == {"w13": lone.tuning["w13"][0][2], "w2": lone.tuning["w2"][0][2]}
    with pytest.raises(peer_lib.PeerRefused, match=r"shape_m=12 .*'w13': 40, 'w2': 8"):
        _plan_layer(w13=[[0, 1 << 30, _table_config(40)]], w2=[[0, 1 << 30, _table_config(8)]]).row_block_plan(12)


def _receipt(name):
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "bench/results" / name).read_text())


def _tuned(table, m):
    return next(config for low, high, config in table if low < m <= high)


def _with_block(config, block):
    """``config`` with its row block and warp rows set to ``block`` (one warp row per block in these configs)."""
    assert config["block_shape"][0] == config["warp_shape"][0]
    return {**config, "block_shape": [block, *config["block_shape"][1:]], "warp_shape": [block, *config["warp_shape"][1:]]}


def _stand_in_moe(tables, metas, experts, hidden, inter, activations):
    """A ``HummingMoE`` on recorded tuning tables and layer metas, without Humming or a GPU (``prepare`` only)."""
    from types import SimpleNamespace

    layer = _plan_layer(**tables)
    layer.sms = 132
    layer.module = SimpleNamespace(humming_metas={name: SimpleNamespace(**meta) for name, meta in metas.items()})
    peer = object.__new__(peer_lib.HummingMoE)
    peer.layer, peer.experts, peer.hidden, peer.inter, peer.activations, peer.forced = (
        layer, experts, hidden, inter, activations, {})
    return peer


@pytest.mark.parametrize("activations", ["bf16", "fp8"])
def test_pro_tables_of_the_h100_receipt_run_one_row_block(activations):
    """The pro preset's tuning tables as humming-kernels picked them on the H100 (the refusal receipt): at 2048
    tokens/rank (shape_m 12288) w13 is tuned to 48-row blocks and w2 to 40; the routing is aligned to 48 and w2 runs
    its own table's 48-row config, the interval right above its tuned one, which is its tuned config with 48 rows;
    the Stream-K split of w2's launch is that config's. The other default points run the tuned configs unchanged."""
    receipt = _receipt("moe/2026-12-06_moe_pro_ep1_humming_refusal_h100.json")
    recorded = receipt["peers"][f"humming-{activations}"]
    tables = recorded["tuning_configs"]
    metas = {name: json.loads(meta) for name, meta in recorded["layer_metas"].items()}
    peer = _stand_in_moe(tables, metas, 384, 7168, 3072, activations)
    for t in (1, 8, 128, 512, 8192):
        plan = peer.layer.row_block_plan(t * 6)
        assert plan.forced == {} and plan.configs == {n: _tuned(tables[n], t * 6) for n in tables}
    m = 2048 * 6
    w13, w2 = _tuned(tables["w13"], m), _tuned(tables["w2"], m)
    assert (w13["block_shape"][0], w2["block_shape"][0]) == (48, 40)
    tuned_high = next(high for low, high, config in tables["w2"] if low < m <= high)
    above = next(config for low, high, config in tables["w2"] if low == tuned_high)
    assert above == _with_block(w2, 48)

    gen = torch.Generator().manual_seed(13)
    idx, w = random_routing(2048, 384, 6, gen)
    x = torch.zeros(2048, 7168, dtype=torch.bfloat16)
    routing = peer.prepare(x, idx, w)
    assert routing.forced["w2"]["launched_config"] == above and routing.forced["w2"]["tuned_block_m"] == 40
    assert routing.forced["w2"]["differs_in"] == ["block_shape", "warp_shape"] and set(routing.forced) == {"w2"}
    assert peer.forced == {m: routing.forced}
    counts = torch.bincount(idx.reshape(-1), minlength=384)
    assert routing.num_tokens_padded.item() == int(((counts + 47) // 48 * 48).sum())
    assert routing.expert_ids.numel() * 48 == routing.sorted_ids.numel()
    rows = routing.sorted_ids.numel()
    group = metas["w2"]["input_scale_group_size"]
    assert routing.splits["w2"] == peer_lib.streamk_split(above, 7168, 3072, rows, 132, group)
    assert routing.splits["w2"].block[0] == routing.splits["w13"].block[0] == 48


H100_ATTRIBUTES = {
    "index": 0, "name": "NVIDIA H100 80GB HBM3", "is_ppu": False, "sm_count": 132, "sm_major": 9, "sm_minor": 0,
    "sm_version": 90, "max_threads_per_block": 1024, "max_threads_per_sm": 2048, "max_registers_per_sm": 65536,
    "l2_cache_size": 50 * 2**20, "l2_cache_size_mb": 50.0, "l1_cache_size": 256 * 1024, "l1_cache_size_kb": 256.0,
    "default_smem_size": 48 * 1024, "max_smem_size": 227 * 1024, "max_smem_size_kb": 227.0,
    "memory_clock_khz": 2619000, "memory_bus_width": 5120, "sm_clock_khz": 1980000,
}
"""The device attributes of an H100 SXM 80GB as Humming's device-info extension reads them (CUDA driver attributes);
the two it derives, as its ``device_info.cpp`` does: HBM bandwidth ``clock * 2 * bus / 8`` and SM90 dense tensor
throughput ``SMs * 4096 * clock`` per 16-bit element (twice that for 8-bit types)."""
H100_ATTRIBUTES["memory_bandwidth_gbps"] = 2619000 * 2 * 5120 / 8 / 1e6
H100_ATTRIBUTES["tensorcore_tops"] = {
    dtype: 132 * 4096 * 1980000 / 1e9 * factor
    for dtype, factor in (("float16", 1), ("bfloat16", 1), ("float8e4m3", 2), ("float8e5m2", 2), ("int8", 2),
                          ("int4", 4))
}


@pytest.fixture
def humming_on_h100(monkeypatch):
    """Humming's tuning heuristics and layer metas on CPU as on an H100 (``H100_ATTRIBUTES``), wherever
    humming-kernels is installed: its device info answers with those attributes and device 0 needs no CUDA; its
    heuristics cache is emptied before and after (no answer for another device is reused, none leaks out)."""
    pytest.importorskip("humming")
    from types import SimpleNamespace

    import humming.device
    import humming.tune

    fake = SimpleNamespace(**H100_ATTRIBUTES)
    info = object.__new__(humming.device.DeviceInfo)
    info._index, info._value = 0, fake
    monkeypatch.setattr(humming.device.current_device, "_value", fake)
    monkeypatch.setitem(humming.device.DeviceInfo._instances, 0, info)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    humming.tune._get_heuristics_config.cache_clear()
    yield
    humming.tune._get_heuristics_config.cache_clear()


def _humming_tables(experts, hidden, inter, activations):
    """Layer metas and tuning tables of a MoE layer's two sublayers: loaded as the peer loads them
    (``peers.load_humming_sublayer``, on CPU; the weight values play no part in either), tables from Humming."""
    from humming.config import GemmType
    from humming.layer import HummingMethod

    module, metas, tables = torch.nn.Module(), {}, {}
    for name, n, k, gated in (("w13", 2 * inter, hidden, True), ("w2", hidden, inter, False)):
        packed = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
        peer_lib.load_humming_sublayer(module, name, packed, torch.zeros(experts, n, k // 128, dtype=torch.int32),
                                       gated, activations)
        metas[name] = json.loads(module.humming_metas[name].to_str())
        tables[name] = json.loads(json.dumps(HummingMethod.get_default_tuning_configs(
            layer=module, use_f16_accum=False, use_batch_invariant=False, gemm_type=GemmType.INDEXED,
            sublayer_name=name)))
    return metas, tables


@pytest.mark.parametrize("activations", ["bf16", "fp8"])
def test_h100_attributes_reproduce_the_receipts_tables(humming_on_h100, activations):
    """With ``H100_ATTRIBUTES`` the peer's sublayers get the pro layer metas and Humming's heuristics the tuning
    tables the H100 recorded (after its weight transform, which runs only on the GPU)."""
    recorded = _receipt("moe/2026-12-06_moe_pro_ep1_humming_refusal_h100.json")["peers"][f"humming-{activations}"]
    metas, tables = _humming_tables(384, 7168, 3072, activations)
    assert tables == recorded["tuning_configs"]
    assert metas == {name: json.loads(meta) for name, meta in recorded["layer_metas"].items()}


@pytest.mark.parametrize("activations", ["bf16", "fp8"])
def test_tiny_points_run_one_row_block_on_h100_tables(humming_on_h100, activations):
    """The tiny preset (16 experts, top-4, H 256, I 128) on Humming's H100 tables: with FP8 activations w13 is
    tuned to 40-row blocks at 1, 8 and 33 tokens/rank, w2 to 8, 8 and 16; the routing is aligned to 40 and w2 runs
    its own table's 40-row config, which is its tuned config with 40 rows, and the Stream-K split of its launch is
    that config's (not the tuned one's). With BF16 activations both are tuned alike (8, 8, 16): nothing forced."""
    metas, tables = _humming_tables(16, 256, 128, activations)
    peer = _stand_in_moe(tables, metas, 16, 256, 128, activations)
    gen = torch.Generator().manual_seed(14)
    for t, w2_block in ((1, 8), (8, 8), (33, 16)):
        m = 4 * t
        w13, w2 = _tuned(tables["w13"], m), _tuned(tables["w2"], m)
        idx, w = random_routing(t, 16, 4, gen)
        routing = peer.prepare(torch.zeros(t, 256, dtype=torch.bfloat16), idx, w)
        rows, group = routing.sorted_ids.numel(), metas["w2"]["input_scale_group_size"]
        if activations == "bf16":
            assert w13["block_shape"][0] == w2["block_shape"][0] == w2_block and routing.forced == {}
            assert routing.splits["w2"] == peer_lib.streamk_split(w2, 256, 128, rows, 132, group)
            continue
        assert (w13["block_shape"][0], w2["block_shape"][0]) == (40, w2_block)
        launched = _with_block(w2, 40)
        assert launched in [config for _, _, config in tables["w2"]]
        assert set(routing.forced) == {"w2"} and routing.forced["w2"]["launched_config"] == launched
        assert routing.forced["w2"]["tuned_block_m"] == w2_block and routing.expert_ids.numel() * 40 == rows
        assert routing.splits["w2"] == peer_lib.streamk_split(launched, 256, 128, rows, 132, group)
        assert routing.splits["w2"] != peer_lib.streamk_split(w2, 256, 128, rows, 132, group)
    assert sorted(peer.forced) == ([] if activations == "bf16" else [4, 32, 132])


def _config(block, stream_k=True, stages=4, ctas=1):
    return {"block_shape": list(block), "use_stream_k": stream_k, "num_stages": stages, "num_ctas_per_sm": ctas}


def test_streamk_split_by_hand():
    """Humming's Stream-K schedule on cases worked out by hand from its scheduler: one tile of 8 K blocks on 4 CTAs
    (2 blocks each, rounded up to the 4 pipeline stages: two slices, the last K half stored first); 9 tiles on 4
    CTAs (two whole waves, the ninth tile shared: the same two slices); no Stream-K config: no split tile."""
    one = peer_lib.streamk_split(_config((8, 128, 64)), 128, 512, 8, 4, 0)
    assert one.block == (8, 128, 64) and one.tiles == {(0, 0): ((256, 512), (0, 256))} and one.max_slices() == 2
    nine = peer_lib.streamk_split(_config((8, 128, 64)), 384, 512, 24, 4, 0)
    assert nine.tiles == {(2, 2): ((256, 512), (0, 256))}
    assert peer_lib.streamk_split(_config((8, 128, 64), stream_k=False), 128, 512, 8, 4, 0).tiles == {}


@pytest.mark.parametrize("seed", range(6))
def test_streamk_split_slices_partition_k(seed):
    """On random shapes every split tile's slices cover [0, K) once, in decreasing K order, at most 10 of them, and
    the kernel's own slice count agrees (``streamk_split`` raises otherwise)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(*v):
        return v[int(torch.randint(len(v), (1,), generator=gen))]

    block = (pick(8, 16, 40, 80), pick(128, 256), pick(64, 128))
    n, k = block[1] * pick(1, 3, 8, 28), block[2] * pick(3, 16, 24, 112)
    group = pick(0, 128)
    split = peer_lib.streamk_split(_config(block, stages=pick(3, 4), ctas=pick(1, 2, 4)), n, k,
                                   block[0] * pick(1, 6, 48, 300), pick(8, 132), group)
    for ranges in split.tiles.values():
        assert 2 <= len(ranges) <= peer_lib.STREAM_K_MAX_SLICES
        assert [r[0] for r in ranges] == sorted((r[0] for r in ranges), reverse=True)
        covered = sorted(ranges)
        assert covered[0][0] == 0 and covered[-1][1] == k
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


@pytest.mark.parametrize("activations", ["bf16", "fp8"])
def test_streamk_split_marks_the_failing_receipt_points(activations):
    """The H100 receipt's pro L2 peer points (its tuning configs recorded, 132 SMs): the split has tiles in two or
    more K slices exactly where the GPU check against a one-rounding reference failed."""
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench/results/gemm/2026-12-06_gemm_humming_h100.json"
    receipt = json.loads(path.read_text())
    peer = receipt["peers"][f"humming {activations}-act"]
    meta = json.loads(peer["layer_metas"]["w"])
    checked = 0
    for record in receipt["records"]:
        point = record["point"]
        if (point["preset"], point["layer"]) != ("pro", "l2"):
            continue
        verdict = next(r["verdict"] for r in record["results"] if r["impl"] == f"humming {activations}-act")
        rows, experts = point["rows_per_expert"], point["experts"]
        config = next(c for low, high, c in peer["tuning_configs"]["w"] if low < rows * experts <= high)
        block_m = config["block_shape"][0]
        split = peer_lib.streamk_split(config, meta["shape_n"], meta["shape_k"], experts * -(-rows // block_m) * block_m,
                                       receipt["environment"]["sms"], meta["input_scale_group_size"])
        assert bool(split.tiles) == verdict.startswith("FAIL"), (rows, verdict)
        checked += 1
    assert checked == 3


def _bf16(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).double())


def test_streamk_product_rounds_each_slice_then_each_sum():
    """Ordered slices (at most 3): each slice's partial rounded to BF16, stored in slice order and each sum rounded,
    element by element here; tiles not split (and rows of other row blocks): one rounding; the interval is exact."""
    gen = torch.Generator().manual_seed(2)
    a, w = torch.randn(6, 96, generator=gen, dtype=torch.float64), torch.randn(8, 96, generator=gen, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 3, 9, 10])  # block_m 4: rows 0-3 in row block 0, the others in block 2
    ranges = ((64, 96), (32, 64), (0, 32))
    split = peer_lib.StreamKSplit((4, 4, 32), {(0, 1): ranges})
    ref, low, high = peer_lib.streamk_product(a, w, positions, split)
    assert ref.dtype == torch.bfloat16 and torch.equal(low, ref.double()) and torch.equal(high, ref.double())
    for r in range(6):
        for c in range(8):
            if r < 4 and 4 <= c < 8:
                parts = [_bf16(float(a[r, k0:k1] @ w[c, k0:k1])) for k0, k1 in ranges]
                want = _bf16(_bf16(parts[0] + parts[1]) + parts[2])
            else:
                want = _bf16(float(a[r] @ w[c]))
            assert float(ref[r, c]) == want, (r, c)


@pytest.mark.parametrize("slices", [4, 5, 7])
def test_streamk_product_interval_holds_every_atomic_order(slices):
    """Beyond 3 slices the later ones are added in any order: every order's result lies in [low, high] (all orders
    enumerated up to 5 slices, the bound past that), while the one-rounding result and a result missing one slice
    fall outside by more than the GEMM check's 1e-3."""
    gen = torch.Generator().manual_seed(slices)
    k = 32 * slices
    a, w = torch.randn(4, k, generator=gen, dtype=torch.float64), torch.randn(4, k, generator=gen, dtype=torch.float64)
    ranges = tuple((32 * s, 32 * s + 32) for s in reversed(range(slices)))
    split = peer_lib.StreamKSplit((4, 4, 32), {(0, 0): ranges})
    ref, low, high = peer_lib.streamk_product(a, w, torch.arange(4), split)
    parts = [(a[:, k0:k1] @ w[:, k0:k1].T).to(torch.bfloat16).double() for k0, k1 in ranges]
    orders = list(itertools.permutations(parts[1:]))[:24]
    for order in orders:
        y = parts[0]
        for part in order:
            y = (y + part).to(torch.bfloat16).double()
        assert ((low <= y) & (y <= high)).all()
        assert peer_lib.excess_rel_fro(y, ref, low, high) == 0.0
    plain = (a @ w.T).to(torch.bfloat16)
    missing = sum(parts[:-1]).to(torch.bfloat16)
    assert peer_lib.excess_rel_fro(missing, ref, low, high) > 1e-3
    if slices <= 5:
        assert peer_lib.excess_rel_fro(plain, ref, low, high) > 0


def test_excess_rel_fro_is_rel_fro_on_exact_intervals():
    from megamoe.numerics import rel_fro_error

    gen = torch.Generator().manual_seed(4)
    ref = torch.randn(5, 7, generator=gen).to(torch.bfloat16)
    y = (ref.double() * (1 + 1e-2 * torch.randn(5, 7, generator=gen, dtype=torch.float64))).to(torch.bfloat16)
    assert peer_lib.excess_rel_fro(y, ref, ref.double(), ref.double()) == pytest.approx(rel_fro_error(y, ref), rel=1e-12)
    y[1, 2] = float("nan")
    assert peer_lib.excess_rel_fro(y, ref, ref.double(), ref.double()) == float("inf")


def test_humming_fp8_values_by_element():
    """Humming's dynamic per-128 FP8 quantization, written out per element in numpy float32: scale = amax / 448
    (at least 1e-30), q = e4m3(x * (1 / scale)) saturated, value q * scale; an all-zero block gives zeros."""
    import numpy as np

    gen = torch.Generator().manual_seed(6)
    v = (torch.randn(3, 256, generator=gen) * torch.rand(3, 256, generator=gen) * 5).to(torch.bfloat16)
    v[2, 128:] = 0
    got = peer_lib.humming_fp8_values(v)
    x = v.float().numpy()
    for r in range(3):
        for b in range(2):
            blk = x[r, b * 128 : (b + 1) * 128]
            scale = max(np.float32(np.abs(blk).max()) / np.float32(448), np.float32(1e-30))
            mult = np.float32(1) / np.float32(scale)
            q = torch.from_numpy(np.clip((blk * mult).astype(np.float32), -448, 448)).to(torch.float8_e4m3fn)
            want = q.double() * float(np.float32(scale))
            assert torch.equal(got[r, b * 128 : (b + 1) * 128], want), (r, b)
    assert torch.equal(got[2, 128:], torch.zeros(128, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 128"):
        peer_lib.humming_fp8_values(torch.zeros(2, 96))


def test_routing_positions_invert_sorted_ids():
    gen = torch.Generator().manual_seed(8)
    idx, _ = random_routing(13, 6, 3, gen, masked_ratio=0.2)
    sorted_ids, expert_ids, padded = peer_lib.align_block_size(idx, 8, 6)
    routing = peer_lib.HummingRouting(idx.numel(), sorted_ids, expert_ids, padded, {})
    pos = routing.positions(idx.numel())
    ids = sorted_ids.tolist()
    for flat, slot_expert in enumerate(idx.reshape(-1).tolist()):
        assert pos[flat] == (ids.index(flat) if slot_expert >= 0 else -1)


def test_peer_reference_without_split_tiles_is_one_rounding_per_gemm():
    """A routing whose launches split no tile gives the one-rounding reference bit for bit."""
    gen = torch.Generator().manual_seed(9)
    e, h, i, t, k = 6, 256, 128, 7, 2
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    x = random_tokens(t, h, gen)
    idx, w = random_routing(t, e, k, gen, masked_ratio=0.2)
    ids = peer_lib.align_block_size(idx, 8, e)
    none = peer_lib.StreamKSplit((8, 128, 64), {})
    routing = peer_lib.HummingRouting(t * k, *ids, {}, {"w13": none, "w2": none})
    for act in ("bf16", "fp8"):
        want = peer_lib.peer_reference(x, idx, w, l1, l2, act)
        got = peer_lib.peer_reference(x, idx, w, l1, l2, act, routing=routing)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_peer_reference_takes_the_stream_k_rounding_points_of_both_gemms():
    """With a routing whose W13 and W2 launches split the tiles of some row blocks in two K slices, each (token, slot)
    row in those blocks (found here by searching ``sorted_ids``) gets gate/up and its W2 output as the BF16 sum of two
    BF16 half-K partials, later half first; rows elsewhere one rounding. Written out per row."""
    from megamoe.layouts import dequantize_fp4
    from megamoe.numerics import swiglu_weighted

    gen = torch.Generator().manual_seed(10)
    e, h, i, t, k = 4, 256, 128, 9, 2
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    x = random_tokens(t, h, gen)
    idx, w = random_routing(t, e, k, gen, masked_ratio=0.2)
    sorted_ids, expert_ids, padded = peer_lib.align_block_size(idx, 8, e)
    split_blocks = {0, 2, 3}
    w13 = peer_lib.StreamKSplit((8, 128, 64), {(m, n): ((128, 256), (0, 128)) for m in split_blocks for n in (0, 1)})
    w2 = peer_lib.StreamKSplit((8, 128, 64), {(m, n): ((64, 128), (0, 64)) for m in split_blocks for n in (0, 1)})
    routing = peer_lib.HummingRouting(t * k, sorted_ids, expert_ids, padded, {}, {"w13": w13, "w2": w2})
    got = peer_lib.peer_reference(x, idx, w, l1, l2, "bf16", routing=routing)

    def product(a, weight, half, split):
        if not split:
            return (a @ weight.T).to(torch.bfloat16).double()
        hi = (a[half:] @ weight[:, half:].T).to(torch.bfloat16).double()
        lo = (a[:half] @ weight[:, :half].T).to(torch.bfloat16).double()
        return (hi + lo).to(torch.bfloat16).double()

    ids = sorted_ids.tolist()
    want = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            ex = int(idx[tok, j])
            if ex < 0:
                continue
            split = ids.index(tok * k + j) // 8 in split_blocks
            gate_up = product(x[tok].double(), dequantize_fp4(l1[0][ex], l1[1][ex]).double(), 128, split)
            a = swiglu_weighted(gate_up[:i].float(), gate_up[i:].float(), torch.ones(())).to(torch.bfloat16).double()
            want[tok] += float(w[tok, j]) * product(a, dequantize_fp4(l2[0][ex], l2[1][ex]).double(), 64, split)
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    plain = peer_lib.peer_reference(x, idx, w, l1, l2, "bf16")
    assert not torch.equal(got.view(torch.int16), plain.view(torch.int16))


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
        routing.buffers["y"].copy_(self.reference(routing))
        return routing.buffers["y"]

    def reference(self, routing):
        return peer_lib.peer_reference(*routing.buffers["case"], self.l1, self.l2, "bf16")

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


def test_moe_peer_row_records_a_forced_row_block(monkeypatch):
    """A point where the peer launched a sublayer with another config than its tuned one: the row carries the
    routing's record and the run says it."""
    gen = torch.Generator().manual_seed(15)
    t, e, h, i = 3, 4, 256, 128
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    idx, w = random_routing(t, e, 2, gen)
    record = {"block_m": 40, "tuned_block_m": 8, "reason": "tuned row blocks {'w13': 40, 'w2': 8}"}

    class Forced(_StandInPeer):
        def prepare(self, x, idx, w):
            routing = super().prepare(x, idx, w)
            routing.forced = {"w2": record}
            return routing

    monkeypatch.setattr(bench_moe, "time_graph", lambda fn, warmup, iters, calls, before=None: [1.0] * iters)
    said = []
    row = bench_moe._peer_row("humming-fp8", Forced(l1, l2), [(None, idx, None, random_tokens(t, h, gen), w)], t,
                              bench_moe.parse_args([]), lambda: None, 0.0, 1000, h, i, said.append)
    assert row["correct"] and row["row_blocks_forced"] == {"w2": record}
    note = "NOTE: humming-fp8 at 3 tokens/rank: w2 row block forced 8 -> 40 (tuned row blocks {'w13': 40, 'w2': 8})"
    assert said == [note]


def test_moe_peer_row_reports_a_refused_point():
    """A point the peer refuses before any launch is said and kept as a row with its reason, no figures, not correct
    (the run then exits non-zero), and nothing is called or timed."""
    gen = torch.Generator().manual_seed(12)
    t, e, h, i = 3, 4, 256, 128
    l1, l2 = random_fp4_weights(e, 2 * i, h, gen), random_fp4_weights(e, h, i, gen)
    idx, w = random_routing(t, e, 2, gen)
    cases = [(None, idx, None, random_tokens(t, h, gen), w)]

    class Refusing(_StandInPeer):
        def prepare(self, x, idx, w):
            raise peer_lib.PeerRefused("humming peer: at shape_m=6 the sublayers' default tuning configs pick different")

    def never(*a, **k):
        raise AssertionError("a refused point must not be timed")

    said = []
    peer = Refusing(l1, l2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_moe, "time_graph", never)
        row = bench_moe._peer_row("humming-fp8", peer, cases, t, bench_moe.parse_args([]), lambda: None, 0.0, 1000,
                                  h, i, said.append)
    assert row["correct"] is False and row["method"] == "refused" and "different" in row["refused"]
    assert row["us"] != row["us"] and peer.calls == []  # NaN figures
    assert said == [f"REFUSED: humming-fp8 at 3 tokens/rank: {row['refused']}"]


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

        def reference(self, routing, read, w, rows):  # one rounding, no Stream-K: an exact interval
            ref = (read @ w.T).to(torch.bfloat16)
            return ref, ref.double(), ref.double()

        def max_slices(self, routing):
            return 1

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
    """GPU with humming-kernels: both peer variants next to megamoe's paths on the flash preset, every point checked
    against the peer's reference (its Stream-K rounding points included) over 2 routings (one masked slot in four),
    receipt with the peers' configs."""
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
def test_moe_bench_humming_runs_one_row_block_for_both_gemms(tmp_path):
    """GPU with humming-kernels, tiny preset (I = 128): where Humming tunes the two sublayers to different row
    blocks (read here from the receipt's tuning tables; on an H100 every FP8 point: w13 40 rows, w2 8, 8, 16),
    the peer runs w2 on w13's block, says so in the row and its config, and the point is checked correct against
    the reference of the launched configs (Stream-K rounding points included); elsewhere (BF16 on an H100: one
    block) it runs as vLLM's call. No point is refused."""
    pytest.importorskip("humming")
    path = tmp_path / "moe.json"
    rows = bench_moe.main(["--preset", "tiny", "--tokens", "1,8,33", "--routings", "2", "--paths", "humming",
                           "--peers", "humming", "--warmup", "1", "--iters", "3", "--json", str(path)])
    assert all(r["correct"] and r["us"] > 0 for r in rows)
    receipt = json.loads(path.read_text())
    forced_points = 0
    for name, recorded in receipt["peers"].items():
        tables = recorded["tuning_configs"]
        peer_rows = [r for r in rows if r["path"] == name]
        assert [r["tokens_per_rank"] for r in peer_rows] == [1, 8, 33]
        for r in peer_rows:
            m = 4 * r["tokens_per_rank"]
            w13, w2 = (_tuned(tables[n], m)["block_shape"][0] for n in ("w13", "w2"))
            if w13 == w2:
                assert "row_blocks_forced" not in r and str(m) not in recorded["row_blocks_forced"]
                continue
            forced_points += 1
            record = r["row_blocks_forced"]["w2"]
            assert (record["block_m"], record["tuned_block_m"]) == (w13, w2) and set(r["row_blocks_forced"]) == {"w2"}
            assert recorded["row_blocks_forced"][str(m)] == json.loads(json.dumps(r["row_blocks_forced"]))  # as JSON
    if "H100" in receipt["environment"]["gpu"]:
        assert forced_points == 3


@pytest.mark.gpu
def test_gemm_bench_humming_peers(tmp_path):
    """GPU with humming-kernels: the peer's grouped GEMMs at the EP8 points whose Stream-K BF16 reductions a
    one-rounding reference missed (flash L1 64 rows, pro L1 1 and 64, pro L2 1 and 64) and their neighbours, all
    checked against the reference with those rounding points at the GEMM check's 1e-3."""
    pytest.importorskip("humming")
    from megamoe.bench.gemm import main as gemm_main

    path = tmp_path / "gemm.json"
    assert gemm_main(["--presets", "flash,pro", "--ep", "8", "--rows", "1,64", "--layers", "l1,l2", "--mma", "bf16",
                      "--no-baselines", "--no-alt", "--routings", "2", "--peers", "humming", "--json", str(path)]) == 0
    receipt = json.loads(path.read_text())
    split = set()
    for record in receipt["records"]:
        impls = {r["impl"] for r in record["results"]}
        assert {"humming bf16-act", "humming fp8-act"} <= impls
        assert all(r["verdict"].startswith("PASS") and r["us"] > 0 for r in record["results"])
        point = record["point"]
        split |= {(point["preset"], point["layer"], point["rows_per_expert"], r["impl"].split()[1])
                  for r in record["results"] if r["impl"].startswith("humming") and "up to 1 " not in r["config"]}
    # the tuning configs humming-kernels 0.1.20 picks on a 132-SM H100 / H200 (reproduced on CPU from its heuristics)
    assert split == {("flash", "l1", 64, "bf16-act"), ("flash", "l1", 64, "fp8-act"), ("pro", "l1", 1, "bf16-act"),
                     ("pro", "l1", 1, "fp8-act"), ("pro", "l1", 64, "bf16-act"), ("pro", "l2", 64, "bf16-act"),
                     ("pro", "l2", 1, "fp8-act")}
