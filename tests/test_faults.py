"""Faults on one process (CPU): boundary checks of the routing inputs, the routing policy, the device-side error word
and ``check_errors``, debug mode's unwritten-``x_sf`` check, the process-group timeout setting, and non-finite
values (NaN / Inf tokens and routing weights propagate to NaN outputs; NaN / Inf weights are rejected at load).
The multi-rank faults (the collective-call guard) are in ``distributed/test_faults_multirank.py``."""

import math

import pytest
import torch

from megamoe import (
    StagedMoE,
    check_errors,
    get_symm_buffer_for_mega_moe,
    reference_moe,
    transform_weights_for_mega_moe,
)
from megamoe.checks import InStepError, first_valid_ids, routing_faults
from megamoe.dist import pg_timeout_s
from megamoe.inputs import fill_buffer, global_problem, random_fp4_weights
from megamoe.kernels.comm.protocol import EpCommConfig
from megamoe.layouts import dequantize_fp8, quantize_fp4, quantize_fp8
from megamoe.nn import EPMoE
from megamoe.numerics import check_moe_output
from megamoe.symm_buffer import ERROR_BAD_ID, ERROR_DUPLICATE_DROPPED, ERRORS_OFFSET

E, K, H, I, T_MAX = 8, 3, 256, 128, 8


def _buf(**kw):
    return get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device="cpu", **kw)


def _inputs(t=4, seed=0):
    p = global_problem(seed, [t], E, K, H, I)
    return p, p["x"][0], p["topk_idx"][0], p["topk_weights"][0]


# ---- boundary checks ----------------------------------------------------------------------------------------------

def _bad_routing(idx, w):
    """(name, topk_idx, topk_weights, message) of inputs that were once read silently."""
    t = idx.shape[0]
    return [
        ("float ids", idx.float() + 0.7, w, "`topk_idx` must have dtype int64 or int32, got float32"),
        ("bool ids", idx >= 0, w, "`topk_idx` must have dtype int64 or int32, got bool"),
        ("[1, k] ids", idx[:1], w, rf"`topk_idx` must have shape \[{t}, {K}\], got \[1, {K}\]"),
        ("[T] weights", idx, w[:, 0], rf"`topk_weights` must have shape \[{t}, {K}\], got \[{t}\]"),
        ("meta ids", idx.to("meta"), w, "`topk_idx` must be on cpu, got meta"),
        ("meta weights", idx, w.to("meta"), "`topk_weights` must be on cpu, got meta"),
        ("int weights", idx, w.int(), "`topk_weights` must have dtype float32 or bfloat16 or float16"),
    ]


def test_fill_buffer_boundary_checks():
    _, x, idx, w = _inputs(t=K)  # T == k: a [T] weight vector would broadcast
    for what, bad_idx, bad_w, msg in _bad_routing(idx, w):
        with pytest.raises(ValueError, match=msg):
            fill_buffer(_buf(), x, bad_idx, bad_w)
    with pytest.raises(ValueError, match=rf"`x` must have shape \[{K}, {H}\], got \[{K}, 1\]"):
        fill_buffer(_buf(), x[:, :1], idx, w)
    with pytest.raises(ValueError, match="`x` must be on cpu, got meta"):
        fill_buffer(_buf(), x.to("meta"), idx, w)


def test_custom_op_boundary_checks():
    """``torch.ops.megamoe.ep_moe`` called directly (past ``forward``'s checks) raises on each, the meta-device ids
    included; the layer stays usable (one rank: it took part with no tokens)."""
    g = torch.Generator().manual_seed(1)
    layer = EPMoE(E, K, H, I, T_MAX)
    layer.load_experts(torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g) * I**-0.5)
    _, x, idx, w = _inputs(t=K)
    for what, bad_idx, bad_w, msg in _bad_routing(idx, w):
        with pytest.raises(InStepError, match=msg + ".*took part in the call with no tokens"):
            torch.ops.megamoe.ep_moe(x, bad_idx, bad_w, layer.layer_id)
    y = torch.ops.megamoe.ep_moe(x, idx, w, layer.layer_id)
    assert y.shape == (K, H) and torch.isfinite(y).all()


# ---- routing policy -----------------------------------------------------------------------------------------------

def test_routing_policy_rejects_bad_ids_and_duplicates_everywhere():
    """The same message from fill_buffer, the staged path and EPMoE; validate=False lets fill_buffer copy them."""
    _, x, idx, w = _inputs()
    bad, dup = idx.clone(), idx.clone()
    bad[2, 1] = E
    dup[3, 2] = dup[3, 0]
    rule = r"`topk_idx` must hold expert ids in \[-1, num_experts=8\) \(-1 = unused slot\) with no expert twice"
    for ids, counts in ((bad, "1 id\\(s\\) out of range, 0 duplicate"), (dup, "0 id\\(s\\) out of range, 1 duplicate")):
        with pytest.raises(ValueError, match=f"{rule}.*rank 0: {counts}"):
            fill_buffer(_buf(), x, ids, w)
        buf = _buf()
        fill_buffer(buf, x, ids, w, validate=False)
        p, _, _, _ = _inputs()
        for mode in StagedMoE.MODES:
            with pytest.raises(InStepError, match=f"{rule}.*rank 0: {counts}"):
                StagedMoE(p["l1"], p["l2"], mode)(torch.empty(4, H, dtype=torch.bfloat16), buf)
    layer = EPMoE(E, K, H, I, T_MAX)
    layer.load_experts(torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5)
    with pytest.raises(InStepError, match=f"{rule}.*rank 0: 0 id\\(s\\) out of range, 1 duplicate"):
        layer(x, dup, w)


def test_routing_faults_and_first_valid_ids_by_hand():
    idx = torch.tensor([[3, 3, -1, 5], [99, -2, 1, 1], [0, 1, 2, -1], [4, 4, 4, 8]])
    assert routing_faults(idx, 8).tolist() == [3, 4]  # 99, -2, 8 out of range; 3 once, 1 once, 4 twice repeated
    assert first_valid_ids(idx, 8).tolist() == [[3, -1, -1, 5], [-1, -1, 1, -1], [0, 1, 2, -1], [4, -1, -1, -1]]
    assert routing_faults(idx.view(2, 2, 4), 8).tolist() == [[2, 2], [1, 2]]


# ---- the device-side error word -----------------------------------------------------------------------------------

def test_check_errors_reads_the_error_word_set_by_hand():
    buf = _buf()
    assert buf.errors.data_ptr() == buf.buffer.data_ptr() + ERRORS_OFFSET == buf.buffer.data_ptr() + 8
    assert buf.errors.dtype == torch.int32 and buf.errors.shape == (1,)
    check_errors(buf)  # zero: nothing to report
    for word, msg in ((ERROR_BAD_ID, r"0x1: an expert id outside \[-1, num_experts\) was seen"),
                      (ERROR_DUPLICATE_DROPPED, "0x2: a duplicate expert in a token's top-k was dropped"),
                      (ERROR_BAD_ID | ERROR_DUPLICATE_DROPPED, "0x3: an expert id outside .*; a duplicate expert"),
                      (0x10, "0x10: unknown bits 0x10")):
        buf.signals.zero_()
        buf.signals[2] = word
        with pytest.raises(RuntimeError, match=f"rank 0's SymmBuffer error word is {msg}"):
            check_errors(buf)
    assert buf.signals[:2].tolist() == [0, 0]  # the call and barrier counters are other words
    assert EpCommConfig(buf.layout, False).errors_offset() == ERRORS_OFFSET  # where the kernels OR their bits
    with pytest.raises(TypeError, match="`buffer` must be a SymmBuffer"):
        check_errors(buf.errors)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unvalidated_low_latency_counts_bad_routing_in_the_error_word(device):
    p, x, idx, w = _inputs(t=5, seed=4)
    buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device=device)
    bad = idx.clone()
    bad[0, 1], bad[4, 2] = -7, bad[4, 0]
    fill_buffer(buf, x.to(device), bad.to(device), w.to(device), validate=False)
    y = torch.full((5, H), float("nan"), dtype=torch.bfloat16, device=device)
    l1, l2 = tuple(t.to(device) for t in p["l1"]), tuple(t.to(device) for t in p["l2"])
    StagedMoE(l1, l2, "low_latency")(y, buf, validate=False)
    clean = idx.clone()
    clean[0, 1], clean[4, 2] = -1, -1  # by hand: unused slots instead
    q, sf = quantize_fp8(x)
    check_moe_output(y.cpu(), reference_moe(q, sf, clean, w, p["l1"], p["l2"]), I, "unvalidated")
    assert buf.errors.item() == ERROR_BAD_ID | ERROR_DUPLICATE_DROPPED
    with pytest.raises(RuntimeError, match="error word is 0x3"):
        check_errors(buf)


# ---- debug mode: x_sf written this call ---------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)])
def test_debug_mode_refuses_unwritten_x_sf(recipe):
    p, x, idx, w = _inputs(t=5)
    buf = _buf(recipe=recipe)
    staged = StagedMoE(p["l1"], p["l2"], "low_latency", recipe=recipe)
    fill_buffer(buf, x, idx, w)
    y = torch.empty(5, H, dtype=torch.bfloat16)
    staged(y, buf, debug=True)
    sf = buf.x_sf
    assert (sf.isnan() if sf.is_floating_point() else sf == -1).all()  # poisoned after the call
    buf.x[:5] = 0  # a caller copying the tokens but forgetting their scales
    with pytest.raises(ValueError, match=r"`x_sf` rows \[0, 1, 2, 3, 4\] of the buffer were not written since the last"):
        staged(y, buf, debug=True)
    fill_buffer(buf, x, idx, w)
    staged(y, buf, debug=True)
    fill_buffer(buf, x[:3], idx[:3], w[:3])  # rows 0..2 written
    buf.x_sf[3] = buf.x_sf[0]  # row 3 by hand: only row 4 of the call's 5 left unwritten
    with pytest.raises(ValueError, match=r"`x_sf` rows \[4\]"):
        staged(y, buf, debug=True)


# ---- process-group timeout ----------------------------------------------------------------------------------------

def test_pg_timeout_setting(monkeypatch):
    monkeypatch.delenv("MEGAMOE_PG_TIMEOUT_S", raising=False)
    assert pg_timeout_s() == 300.0 and pg_timeout_s(12) == 12.0
    monkeypatch.setenv("MEGAMOE_PG_TIMEOUT_S", "45")
    assert pg_timeout_s() == 45.0 and pg_timeout_s(7.5) == 7.5
    for bad in ("0", "-3", "nan", "inf", "soon"):
        monkeypatch.setenv("MEGAMOE_PG_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="`MEGAMOE_PG_TIMEOUT_S` must be a positive, finite number of seconds"):
            pg_timeout_s()
    with pytest.raises(ValueError, match="`timeout_s` must be a positive"):
        pg_timeout_s(0)


# ---- non-finite values --------------------------------------------------------------------------------------------

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
"""The value of every float8_e4m3fn code, from torch's decoding of the bytes (codes 0x7F and 0xFF are NaN): an
oracle independent of megamoe's quantizers."""


def _rne_e4m3(v: float) -> int:
    """Round-to-nearest-even E4M3 code of a finite double ``|v| <= 448``: the nearest value of ``v``'s sign, ties
    to the even code (its mantissa's last bit 0)."""
    codes = range(128, 256) if math.copysign(1.0, v) < 0 else range(128)
    finite = [c for c in codes if not math.isnan(E4M3_VALUES[c])]
    return min(finite, key=lambda c: (abs(E4M3_VALUES[c] - v), c & 1))


def _independent_quant(block: list[float], recipe) -> list[int]:
    """Codes of one block by the recipe's written rule: scale from the finite elements, NaN code for the others."""
    finite = [abs(v) for v in block if math.isfinite(v)]
    amax = max(finite, default=0.0)
    if recipe == (1, 1, 32):
        e = -127 if amax == 0 else max(-127, math.ceil(math.log2(amax / 448.0)))
        while amax > 448.0 * 2.0**e:  # guard the log's rounding
            e += 1
        scaled = [v / 2.0**e for v in block]
    else:
        amax32 = torch.tensor(max(amax, 1e-4), dtype=torch.float32)
        factor = (torch.tensor(448.0, dtype=torch.float32) / amax32).item()
        scaled = [(torch.tensor(v, dtype=torch.float32) * torch.tensor(factor, dtype=torch.float32)).item()
                  for v in block]
        scaled = [max(-448.0, min(448.0, v)) if math.isfinite(v) else v for v in scaled]
    out = []
    for v, s in zip(block, scaled):
        if not math.isfinite(v):
            out.append(0xFF if math.copysign(1.0, v) < 0 else 0x7F)
        else:
            out.append(_rne_e4m3(s))
    return out


@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)])
def test_quantize_fp8_nonfinite_gives_nan_codes(recipe):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 256, generator=g) * 3
    x[0, 5], x[0, 40], x[1, 200], x[2, 130] = float("inf"), -float("inf"), float("nan"), -float("nan")
    q, sf = quantize_fp8(x, recipe=recipe)
    block = 32 if recipe == (1, 1, 32) else 128
    codes = q.view(torch.uint8)
    for row, col in ((0, 5), (0, 40), (1, 200), (2, 130)):
        start = col // block * block
        want = _independent_quant(x[row, start : start + block].double().tolist(), recipe)
        assert codes[row, start : start + block].tolist() == want, (row, col)
    assert codes[0, 5] == 0x7F and codes[0, 40] == 0xFF
    deq = dequantize_fp8(q, sf)
    for row, col in ((0, 5), (0, 40), (1, 200), (2, 130)):
        assert deq[row, col].isnan()
    assert torch.isfinite(deq).sum() == deq.numel() - 4  # nothing else turned non-finite


def _nonfinite_problem(t: int, seed: int, hidden: int = H, inter: int = I):
    """A problem whose tokens 1 and 2 hold a NaN and an Inf, and whose tokens 4 and 5 have an Inf and a NaN routing
    weight on a used slot: ``(p, x, idx, w, x_bad, w_bad, faulty rows)``."""
    p = global_problem(seed, [t], E, K, hidden, inter)
    x, idx, w = p["x"][0], p["topk_idx"][0], p["topk_weights"][0]
    assert (idx >= 0).all()  # every slot used (no masked slots drawn)
    x_bad, w_bad = x.clone(), w.clone()
    x_bad[1, 17], x_bad[2, hidden - 6] = float("nan"), float("inf")
    w_bad[4, 0], w_bad[5, 0] = float("inf"), float("nan")
    return p, x, idx, w, x_bad, w_bad, [1, 2, 4, 5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", StagedMoE.MODES)
@pytest.mark.parametrize("recipe", [(1, 1, 32), (1, 1, 128)])
def test_nonfinite_tokens_and_routing_weights_give_nan_rows(mode, recipe, device):
    """A token holding NaN or Inf, or a used slot with a NaN or Inf routing weight, gives a NaN output row in the
    reference and on the staged path (torch GEMMs); every other row is finite and as without the fault."""
    t = 7
    p, x, idx, w, x_bad, w_bad, faulty = _nonfinite_problem(t, 9)
    buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device=device, recipe=recipe)
    q, sf = fill_buffer(buf, x_bad.to(device), idx.to(device), w_bad.to(device))
    q, sf = q.cpu(), sf.cpu()
    y = torch.zeros(t, H, dtype=torch.bfloat16, device=device)
    l1, l2 = tuple(v.to(device) for v in p["l1"]), tuple(v.to(device) for v in p["l2"])
    StagedMoE(l1, l2, mode, recipe=recipe)(y, buf)
    y = y.cpu()
    ref = reference_moe(q, sf, idx, w_bad, p["l1"], p["l2"])
    for out in (y, ref):
        assert out[faulty].isnan().all()
    fine = [r for r in range(t) if r not in faulty]
    q0, sf0 = quantize_fp8(x, recipe=recipe)
    clean = reference_moe(q0, sf0, idx, w, p["l1"], p["l2"])[fine]
    check_moe_output(y[fine], clean, I, "finite rows", recipe)
    assert torch.isfinite(ref[fine]).all()


def test_nonfinite_weights_are_rejected_at_load():
    g = torch.Generator().manual_seed(3)
    w1 = torch.randn(4, 2 * I, H, generator=g)
    w1[2, 9, 70] = float("nan")
    with pytest.raises(ValueError, match=r"`w1` must be finite: 1 NaN / Inf value\(s\), the first at expert 2, row 9, "
                                         r"block 2 \(elements 64..95 of K\)"):
        quantize_fp4(w1, "w1")
    w2 = torch.randn(E, H, I, generator=g)
    w2[6, 0, 127] = -float("inf")
    full_w1 = torch.randn(E, 2 * I, H, generator=g)
    for mma in ("fp8xfp4", "bf16"):
        layer = EPMoE(E, K, H, I, T_MAX, mma_type=mma)
        with pytest.raises(ValueError, match=r"`w2` must be finite: .* expert 6, row 0, block 3"):
            layer.load_experts(full_w1, w2)
    i = I
    sd = {f"m.experts.{e}.{n}.weight": t for e in range(E) for n, t in
          (("gate_proj", full_w1[e, :i]), ("up_proj", full_w1[e, i:]), ("down_proj", w2[e]))}
    with pytest.raises(ValueError, match=r"`w2` must be finite: .* expert 6, row 0, block 3"):
        EPMoE.from_checkpoint(sd, "m.", E, K, T_MAX)
    l1, l2 = random_fp4_weights(E, 2 * I, H, g), random_fp4_weights(E, H, I, g)
    l2[1].view(torch.uint8)[5, 3, 2] = 255  # UE8M0 code 255 (NaN) as block 2 of expert 5, row 3
    with pytest.raises(ValueError, match=r"`l2\[1\]` must hold finite UE8M0 scales \(code 255 is NaN\): 1 such "
                                         r"block\(s\), the first at expert 5, row 3, block 2"):
        StagedMoE(l1, l2)
    with pytest.raises(ValueError, match=r"`l2\[1\]` must hold finite UE8M0 scales"):
        transform_weights_for_mega_moe(l1, l2)


@pytest.mark.gpu
def test_nonfinite_rows_mega_and_sm90_gpu():
    """On the GPU kernels (the staged path with the SM90 GEMMs, and the Mega MoE kernel): the same faulty rows are
    NaN, the others as without the fault. Needs the device side's NaN-propagating L1 epilogue."""
    from megamoe import MegaMoE

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    t, hidden, inter, dev = 7, 512, 512, "cuda"
    p, x, idx, w, x_bad, w_bad, faulty = _nonfinite_problem(t, 13, hidden, inter)
    l1, l2 = tuple(v.to(dev) for v in p["l1"]), tuple(v.to(dev) for v in p["l2"])
    q0, sf0 = quantize_fp8(x)
    fine = [r for r in range(t) if r not in faulty]
    clean = reference_moe(q0, sf0, idx, w, p["l1"], p["l2"])[fine]
    for name, run in (("staged sm90", StagedMoE(l1, l2, "low_latency", gemm="sm90")), ("mega", MegaMoE(l1, l2))):
        buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, hidden, inter, device=dev)
        fill_buffer(buf, x_bad.to(dev), idx.to(dev), w_bad.to(dev))
        y = torch.zeros(t, hidden, dtype=torch.bfloat16, device=dev)
        run(y, buf)
        y = y.cpu()
        assert y[faulty].isnan().all(), name
        check_moe_output(y[fine], clean, inter, name)


@pytest.mark.gpu
def test_mega_debug_mode_refuses_unwritten_x_sf_gpu():
    from megamoe import MegaMoE

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    p = global_problem(17, [5], E, K, 512, 512)
    dev = "cuda"
    moe = MegaMoE(tuple(v.to(dev) for v in p["l1"]), tuple(v.to(dev) for v in p["l2"]))
    buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, 512, 512, device=dev)
    x, idx, w = (v.to(dev) for v in (p["x"][0], p["topk_idx"][0], p["topk_weights"][0]))
    fill_buffer(buf, x, idx, w)
    y = torch.empty(5, 512, dtype=torch.bfloat16, device=dev)
    moe(y, buf, debug=True)
    with pytest.raises(ValueError, match=r"`x_sf` rows \[0, 1, 2, 3, 4\] of the buffer were not written"):
        moe(y, buf, debug=True)
    fill_buffer(buf, x, idx, w)
    moe(y, buf, debug=True)
    torch.cuda.synchronize()
