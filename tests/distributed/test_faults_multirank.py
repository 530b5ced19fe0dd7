"""Faults on several gloo ranks (2 and 4): a per-rank error in a collective call either raises in step (every rank
together, or the offending rank after taking part with no tokens) or marks that rank's buffer out of step; bad
routing with ``validate=False`` is counted in the error word. The reproduction: two staged layers on one buffer, rank
1 raises on layer A and catches it, then every rank goes on to layer B."""

import pytest
import torch
from helpers.spawn import spawn

from megamoe import (
    StagedMoE,
    check_errors,
    fp8_fp4_mega_moe,
    get_symm_buffer_for_mega_moe,
    reference_moe,
)
from megamoe.checks import InStepError, OutOfStepError
from megamoe.inputs import fill_buffer, global_problem, local_experts
from megamoe.layouts import quantize_fp4, quantize_fp8
from megamoe.numerics import check_moe_output

E, K, H, I, T_MAX = 8, 3, 256, 128, 8
TOKENS = [6, 8, 3, 7]
PG_TIMEOUT_S = "4"  # the peers of a rank that left the call wait this long in gloo, then raise
FAULTY = 1


def _problem(seed: int, num_ranks: int) -> dict:
    return global_problem(seed, TOKENS[:num_ranks], E, K, H, I)


def _reference(p: dict, rank: int, idx: list | None = None) -> torch.Tensor:
    """This rank's rows of the FP32 reference over every rank's tokens (``idx``: the routing to use per rank)."""
    idx = p["topk_idx"] if idx is None else idx
    q, sf = quantize_fp8(torch.cat(p["x"]))
    ref = reference_moe(q, sf, torch.cat(idx), torch.cat(p["topk_weights"]), p["l1"], p["l2"])
    start = sum(t.shape[0] for t in p["x"][:rank])
    return ref[start : start + p["x"][rank].shape[0]]


def _layer(p: dict, rank: int, num_ranks: int, mode: str) -> StagedMoE:
    return StagedMoE(local_experts(p["l1"], rank, num_ranks, "cpu"), local_experts(p["l2"], rank, num_ranks, "cpu"),
                     mode)


def _fill(buf, p: dict, rank: int) -> torch.Tensor:
    """Fill this rank's inputs of ``p``; returns a NaN-poisoned ``y`` for them."""
    fill_buffer(buf, p["x"][rank], p["topk_idx"][rank], p["topk_weights"][rank])
    return torch.full((p["x"][rank].shape[0], H), float("nan"), dtype=torch.bfloat16)


def _check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    check_moe_output(y, ref, I, what)
    assert not y.isnan().any(), what


IN_STEP = {
    # fault on rank 1 -> (mode, the error every rank raises, or only rank 1 when the rest complete the call)
    "ll_bad_id": ("low_latency", r"expert ids in \[-1, num_experts=8\).*rank 1: 1 id\(s\) out of range", "all"),
    "ll_duplicate": ("low_latency", r"no expert twice in a token's top-k; rank 1: 0 id\(s\) out of range, 1 dup", "all"),
    "normal_bad_id": ("normal", r"expert ids in \[-1, num_experts=8\).*rank 1: 1 id\(s\) out of range", "all"),
    "normal_duplicate": ("normal", r"rank 1: 0 id\(s\) out of range, 1 duplicate", "all"),
    "normal_too_many_tokens": ("normal", r"tokens on this rank\)` must be in \[0, 8\].*\{1: 9\}", "all"),
    "ll_too_many_tokens": ("low_latency", r"must be in \[0, 8\], got 9 \(this rank took part in the call with no tokens",
                           "faulty"),
}


def _in_step(rank, group, device, num_ranks, fault):
    """Layer A with a fault on rank 1 raises in step; each rank catches it and layer B (same buffer) is right."""
    mode, pattern, who = IN_STEP[fault]
    buf = get_symm_buffer_for_mega_moe(group, E, T_MAX, K, H, I, device=device)
    pa, pb = _problem(31, num_ranks), _problem(32, num_ranks)
    layer_a, layer_b = _layer(pa, rank, num_ranks, mode), _layer(pb, rank, num_ranks, mode)
    y = _fill(buf, pa, rank)
    if rank == FAULTY:
        if fault.endswith("bad_id"):
            buf.topk_idx[0, 0] = 99  # written into the view, as the README's copy-into-views pattern may
        elif fault.endswith("duplicate"):
            buf.topk_idx[0, 1] = buf.topk_idx[0, 0]
        else:
            y = torch.empty(T_MAX + 1, H, dtype=torch.bfloat16)
    if who == "all" or rank == FAULTY:
        with pytest.raises(InStepError, match=pattern):
            layer_a(y, buf)
    else:  # the peers' call completed, rank 1 sat it out with no tokens
        layer_a(y, buf)
        _check(y, _reference(pa, rank), f"rank {rank} layer A beside a rank that sat out")
    assert buf.out_of_step is None
    y = _fill(buf, pb, rank)
    layer_b(y, buf)
    _check(y, _reference(pb, rank), f"rank {rank} layer B after {fault}")
    buf.destroy()


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("fault", IN_STEP)
def test_rank_fault_raises_in_step(fault, num_ranks):
    spawn(_in_step, num_ranks, num_ranks, fault)


def _out_of_step(rank, group, device, num_ranks, fault):
    """Rank 1 raises a rank-local error in layer A and goes on to layer B: its buffer refuses B instead of pairing
    B with the peers' A; the peers, waiting in A's collective, get gloo's timeout, and their buffers refuse B too."""
    buf = get_symm_buffer_for_mega_moe(group, E, T_MAX, K, H, I, device=device)
    pa, pb = _problem(41, num_ranks), _problem(42, num_ranks)
    layer_a, layer_b = _layer(pa, rank, num_ranks, "low_latency"), _layer(pb, rank, num_ranks, "low_latency")
    if rank == FAULTY:
        with pytest.raises(ValueError) as first:
            if fault == "fill_buffer_bad_id":
                idx = pa["topk_idx"][rank].clone()
                idx[0, 0] = 99
                fill_buffer(buf, pa["x"][rank], idx, pa["topk_weights"][rank])
            else:  # an argument error before any collective of the call
                _fill(buf, pa, rank)
                layer_a(torch.empty(pa["x"][rank].shape[0], H), buf)
        assert not isinstance(first.value, InStepError)
    else:
        y = _fill(buf, pa, rank)
        with pytest.raises(RuntimeError) as waited:  # gloo: timed out, or the connection to rank 1 closed
            layer_a(y, buf)
        assert not isinstance(waited.value, OutOfStepError)
    with pytest.raises(OutOfStepError, match=rf"refuses StagedMoE: an earlier call raised on rank {rank} .*ranks are "
                                             r"out of step.*destroy this buffer and create a new one.*re-init the "
                                             "process group"):
        layer_b(torch.empty(pb["x"][rank].shape[0], H, dtype=torch.bfloat16), buf)
    with pytest.raises(OutOfStepError, match="refuses fill_buffer"):
        _fill(buf, pb, rank)


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("fault", ["fill_buffer_bad_id", "y_dtype"])
def test_rank_local_error_marks_the_buffer_out_of_step(fault, num_ranks, monkeypatch):
    monkeypatch.setenv("MEGAMOE_PG_TIMEOUT_S", PG_TIMEOUT_S)
    spawn(_out_of_step, num_ranks, num_ranks, fault)


def _unvalidated(rank, group, device, num_ranks):
    """Low-latency with validate=False (as under CUDA-graph capture): an id out of range and a duplicate on rank 1
    count as unused slots on every rank, the results follow the cleaned routing and every rank's error word says so."""
    buf = get_symm_buffer_for_mega_moe(group, E, T_MAX, K, H, I, device=device)
    p = _problem(51, num_ranks)
    y = _fill(buf, p, rank)
    assert int(buf.errors.item()) == 0
    check_errors(buf)  # a clean word: no error
    clean = [t.clone() for t in p["topk_idx"]]
    if rank == FAULTY:
        buf.topk_idx[0, 0] = E + 3
        buf.topk_idx[1, 2] = buf.topk_idx[1, 0]
    clean[FAULTY][0, 0] = -1  # expected by hand: the bad id and the repeat (not its first occurrence) are unused
    clean[FAULTY][1, 2] = -1
    _layer(p, rank, num_ranks, "low_latency")(y, buf, validate=False)
    _check(y, _reference(p, rank, clean), f"rank {rank} unvalidated")
    assert int(buf.errors.item()) == 0b11
    with pytest.raises(RuntimeError, match=r"error word is 0x3: an expert id outside \[-1, num_experts\) was seen.*"
                                           "a duplicate expert in a token's top-k was dropped"):
        check_errors(buf)
    buf.destroy()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_unvalidated_bad_routing_sets_the_error_word(num_ranks):
    spawn(_unvalidated, num_ranks, num_ranks)


def _mega_entry(rank, group, device):
    """The Mega MoE entry on several ranks marks the buffer on an error before the launch (here: every rank, weights
    that are not transform_weights_for_mega_moe's tuples); then a new buffer on every rank works."""
    buf = get_symm_buffer_for_mega_moe(group, E, T_MAX, K, H, I, device=device)
    y = torch.empty(2, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"`l1` must be the \(weights, scales\) tuple of transform_weights_for_mega_moe"):
        fp8_fp4_mega_moe(y, None, None, buf)
    with pytest.raises(OutOfStepError, match=r"refuses fp8_fp4_mega_moe: .*fp8_fp4_mega_moe: ValueError: .*`l1`"):
        fp8_fp4_mega_moe(y, None, None, buf)
    # every rank raised from that call: destroying the buffer and making a new one recovers
    buf.destroy()
    buf = get_symm_buffer_for_mega_moe(group, E, T_MAX, K, H, I, device=device)
    p = _problem(71, 2)
    y = _fill(buf, p, rank)
    _layer(p, rank, 2, "normal")(y, buf)
    _check(y, _reference(p, rank), f"rank {rank} on the new buffer")
    buf.destroy()


def test_mega_entry_marks_the_buffer_on_two_ranks_and_a_new_buffer_recovers():
    spawn(_mega_entry, 2)


def _epmoe_sits_out(rank, group, device, num_ranks, mode):
    """EPMoE: rank 1 passes bad routing (meta-device ids straight to the custom op, then a [1, k] index) and catches
    the error; it took part with no tokens, so the peers' outputs are right and the next call works on every rank."""
    from megamoe.nn import EPMoE

    g = torch.Generator().manual_seed(61)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g) * I**-0.5
    per = E // num_ranks
    layer = EPMoE(E, K, H, I, T_MAX, group, mode=mode, device=device)
    layer.load_experts(w1[rank * per : (rank + 1) * per], w2[rank * per : (rank + 1) * per])
    p = _problem(62, num_ranks)
    x, idx, w = p["x"][rank], p["topk_idx"][rank], p["topk_weights"][rank]
    q, sf = quantize_fp8(torch.cat(p["x"]))
    l1, l2 = quantize_fp4(w1), quantize_fp4(w2)
    ref = reference_moe(q, sf, torch.cat(p["topk_idx"]), torch.cat(p["topk_weights"]), l1, l2)
    start = sum(TOKENS[:rank])
    ref = ref[start : start + x.shape[0]]
    for bad in ("meta ids", "[1, k] ids"):
        if rank == FAULTY:
            with pytest.raises(InStepError, match=r"`topk_idx` must .*took part in the call with no tokens"):
                if bad == "meta ids":
                    torch.ops.megamoe.ep_moe(x, idx.to("meta"), w, layer.layer_id)
                else:
                    torch.ops.megamoe.ep_moe(x, idx[:1], w, layer.layer_id)
        else:
            _check(layer(x, idx, w), ref, f"rank {rank} beside a rank that sat out ({bad})")
    _check(layer(x, idx, w), ref, f"rank {rank} after the faults")
    layer.destroy()


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_epmoe_bad_input_on_one_rank_stays_in_step(mode, num_ranks):
    spawn(_epmoe_sits_out, num_ranks, num_ranks, mode)


def _epmoe_mega_sits_out(rank, group, device, num_ranks):
    """EPMoE impl="mega" on GPUs: rank 1 passes a [1, k] index, then an id of 99, then more than max_tokens tokens,
    and catches each error; it launched the kernel with no tokens each time, so rank 0's outputs are right and the
    next call works on every rank (debug mode: a wrong pairing would trap instead of hanging)."""
    from megamoe.nn import EPMoE

    hidden = inter = 512
    g = torch.Generator().manual_seed(81)
    w1, w2 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5, torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    per = E // num_ranks
    layer = EPMoE(E, K, hidden, inter, T_MAX, group, impl="mega", device=device)
    layer.load_experts(w1[rank * per : (rank + 1) * per], w2[rank * per : (rank + 1) * per])
    p = global_problem(82, TOKENS[:num_ranks], E, K, hidden, inter)
    x, idx, w = (v.to(device) for v in (p["x"][rank], p["topk_idx"][rank], p["topk_weights"][rank]))
    q, sf = quantize_fp8(torch.cat(p["x"]))
    ref = reference_moe(q, sf, torch.cat(p["topk_idx"]), torch.cat(p["topk_weights"]), quantize_fp4(w1),
                        quantize_fp4(w2))
    start = sum(TOKENS[:rank])
    ref = ref[start : start + x.shape[0]]
    bad_id = idx.clone()
    bad_id[0, 0] = 99
    faults = {"[1, k] ids": (x, idx[:1], w, "`topk_idx` must have shape"),
              "id 99": (x, bad_id, w, r"`topk_idx` must hold expert ids in \[-1, num_experts=8\)"),
              "too many tokens": (torch.cat([x, x])[: T_MAX + 1], torch.cat([idx, idx])[: T_MAX + 1],
                                  torch.cat([w, w])[: T_MAX + 1], "above max_tokens")}
    for name, (bx, bi, bw, msg) in faults.items():
        if rank == FAULTY:
            with pytest.raises(InStepError, match=msg + ".*took part in the call with no tokens"):
                torch.ops.megamoe.ep_moe(bx, bi, bw, layer.layer_id)
        else:
            _check(layer(x, idx, w).cpu(), ref, f"rank {rank} beside a rank that sat out ({name})")
    _check(layer(x, idx, w).cpu(), ref, f"rank {rank} after the faults")
    torch.cuda.synchronize()
    layer.destroy()


@pytest.mark.gpu
def test_epmoe_mega_bad_input_on_one_rank_stays_in_step_two_gpus(monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setenv("MEGAMOE_DEBUG", "1")
    monkeypatch.setenv("MEGAMOE_DEBUG_TIMEOUT_S", "60")  # above a rank's debug-build compile time
    monkeypatch.setenv("MEGAMOE_PG_TIMEOUT_S", "120")
    spawn(_epmoe_mega_sits_out, 2, 2, use_cuda=True)
