"""``megamoe.decode.MoEDecoder``: the batch-size choice between warp decode and the grouped path.

CPU: the crossover rule, the choice, and validation. GPU (``-m gpu``): both paths and ``auto`` against
their references on the same decoder (warp decode: the float64 BF16-activation reference, within BF16
rounding; grouped: the FP32 reference of the FP8 contract on the tokens it quantized, within
``moe_tolerances``), one token, masked slots, a batch on each side of the crossover, graph replay.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import MoEDecoder, decode
from megamoe.inputs import random_fp4_weights, random_routing, random_tokens
from megamoe.numerics import max_row_rel_error, moe_tolerances, rel_fro_error
from megamoe.reference import reference_decode, reference_moe

BF16_TOL, ROW_TOL = 2.0**-8, 2.0**-8 * 1.05  # as tests/test_warp_decode.py: one BF16 rounding of y


def _weights(experts, hidden, inter, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    l1 = tuple(t.to(device) for t in random_fp4_weights(experts, 2 * inter, hidden, gen))
    l2 = tuple(t.to(device) for t in random_fp4_weights(experts, hidden, inter, gen))
    return l1, l2


def test_crossover_rule(monkeypatch):
    monkeypatch.setattr(decode, "MEASURED_CROSSOVERS", {})
    assert decode.default_crossover(4096, 2048, 32, 6) == 0
    table = {(4096, 2048, 32, 6): 8, (4096, 2048, 128, 6): 16}
    monkeypatch.setattr(decode, "MEASURED_CROSSOVERS", table)
    assert decode.default_crossover(4096, 2048, 32, 6) == 8  # measured
    assert decode.default_crossover(4096, 2048, 128, 6) == 16
    assert decode.default_crossover(1024, 512, 40, 6) == 8  # nearest experts / k: 40/6 near 32/6
    assert decode.default_crossover(1024, 512, 100, 4) == 16  # 25 near 128/6 = 21.3


def test_path_choice_and_validation():
    l1, l2 = _weights(8, 512, 512, 0)
    dec = MoEDecoder(l1, l2, num_topk=2, max_tokens=16, crossover=4)
    assert [dec.path_for(t) for t in (1, 4, 5, 16)] == ["warp_decode"] * 2 + ["grouped"] * 2
    x = random_tokens(3, 512, torch.Generator().manual_seed(1))
    idx, wts = random_routing(3, 8, 2, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="`path` must be one of"):
        dec(x, idx, wts, path="fast")
    with pytest.raises(ValueError, match="`x` must have dtype bfloat16"):
        dec(x.float(), idx, wts)
    with pytest.raises(ValueError, match=r"`topk_idx` must have shape \[3, 2\]"):
        dec(x, idx[:, :1], wts)
    with pytest.raises(ValueError, match="max_tokens = 16"):
        dec(random_tokens(17, 512, torch.Generator().manual_seed(3)), *random_routing(17, 8, 2, torch.Generator()),
            path="grouped")
    with pytest.raises(ValueError, match="`num_topk` must be in"):
        MoEDecoder(l1, l2, num_topk=9, max_tokens=16)


def test_warp_path_picks_its_weights(monkeypatch):
    """Warp decode gets both weights in the Mega MoE layout (tensor-core kernels): at H and I where they are multiples
    of 128, zero-padded to the next multiple for other multiples of 32: then ``x`` arrives with zero columns up to
    the padded H and only the real H columns of ``y`` come back (here ``moe_decode`` stands in, returning its ``x``
    in ``out`` or a new tensor)."""
    from megamoe.kernels import decode as decode_kernels

    seen = []

    def fake_decode(x, idx, wts, l1, l2, clamp=None, out=None):
        seen.append((l1[0].dtype, l2[0].dtype, x.shape[1]))
        return x.clone() if out is None else out.copy_(x)

    monkeypatch.setattr(decode_kernels, "moe_decode", fake_decode)
    gen = torch.Generator().manual_seed(4)
    mega = torch.int32
    for hidden, inter, width in ((512, 512, 512), (384, 256, 384), (96, 160, 128), (2048, 768, 2048),
                                 (2880, 1408, 2944)):
        l1, l2 = _weights(8, hidden, inter, 0)
        dec = MoEDecoder(l1, l2, num_topk=2, max_tokens=16, crossover=16)
        assert dec.warp_weights() == (dec.mega.l1, dec.mega.l2)
        for tokens in (1, 2, 16):
            seen.clear()
            x = random_tokens(tokens, hidden, gen)
            out = torch.full_like(x, float("nan"))
            y = dec(x, *random_routing(tokens, 8, 2, gen), out=out)
            assert seen == [(mega, mega, width)], (hidden, tokens, seen)
            assert y is out and torch.equal(y, x), (hidden, tokens)


def test_every_multiple_of_32_has_the_grouped_path():
    l1, l2 = _weights(4, 96, 160, 0)
    dec = MoEDecoder(l1, l2, num_topk=2, max_tokens=8, crossover=0)
    assert dec.path_for(1) == "grouped" and dec.buf.layout.kernel_hidden == 128
    assert dec.buf.x.shape == (8, 96) and dec.mega.l2[0].shape == (4, 128 // 64, 256 // 128, 64, 16)
    with pytest.raises(ValueError, match=r"`hidden \(l1\[0\].shape\[2\] \* 2\)` must be a multiple of 32"):
        MoEDecoder(*_weights(4, 80, 160, 0), num_topk=2, max_tokens=8)


# ---------------------------------------------------------------------------------------------- GPU


def _check(dec, l1, x, idx, wts, path, clamp=None) -> str:
    """``dec``'s output for ``path`` against the reference on the canonical weights ``l1``, ``dec.l2``."""
    out = torch.full_like(x, float("nan"))
    y = dec(x, idx, wts, activation_clamp=clamp, out=out, path=path)
    torch.cuda.synchronize()
    assert y is out and not torch.isnan(y).any(), f"{path}: output not fully written"
    taken = dec.path_for(x.shape[0]) if path == "auto" else path
    if taken == "warp_decode":
        ref = reference_decode(x, idx, wts, l1, dec.l2, clamp)
        fro, row = rel_fro_error(y, ref), max_row_rel_error(y, ref)
        assert fro <= BF16_TOL and row <= ROW_TOL, f"{path} -> warp decode: rel_fro={fro:.2e} row={row:.2e}"
    else:
        t = x.shape[0]
        ref = reference_moe(dec.buf.x[:t], dec.buf.x_sf[:t], idx, wts, l1, dec.l2, clamp)
        tol = moe_tolerances(dec.l2[0].shape[2] * 2)
        fro, row = rel_fro_error(y, ref), max_row_rel_error(y, ref)
        assert fro <= tol["rel_fro"] and row <= tol["max_row_rel"], f"{path} -> grouped: rel_fro={fro:.2e} row={row:.2e}"
    return taken


@pytest.mark.gpu
def test_both_paths_and_auto_on_gpu():
    experts, hidden, inter, k = 16, 1024, 512, 4
    l1, l2 = _weights(experts, hidden, inter, 5, "cuda")
    dec = MoEDecoder(l1, l2, num_topk=k, max_tokens=24, crossover=3)
    gen = torch.Generator().manual_seed(6)
    for tokens, masked, clamp in ((1, 0.0, None), (3, 0.3, 2.0), (4, 0.0, None), (24, 0.2, 1.5)):
        x = random_tokens(tokens, hidden, gen).cuda()
        idx, wts = (t.cuda() for t in random_routing(tokens, experts, k, gen, masked_ratio=masked))
        for path in ("warp_decode", "grouped"):
            _check(dec, l1, x, idx, wts, path, clamp)
        assert _check(dec, l1, x, idx, wts, "auto", clamp) == ("warp_decode" if tokens <= 3 else "grouped")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter", [(2880, 2880), (2048, 768), (1408, 1408), (96, 160)])
def test_model_sizes_on_gpu(hidden, inter):
    """Model sizes: multiples of 128 the kernels run as they are (Qwen3-30B-A3B, I = 1408: odd chunk counts) and
    others they run zero-padded (gpt-oss, 96 / 160): warp decode (the tensor-core kernels on the Mega MoE layout, with
    padded ``x`` where H is padded) and the grouped path, one token, masked slots, a batch above the crossover."""
    experts, k = 8, 4
    l1, l2 = _weights(experts, hidden, inter, 9, "cuda")
    dec = MoEDecoder(l1, l2, num_topk=k, max_tokens=16, crossover=2)
    gen = torch.Generator().manual_seed(10)
    for tokens, masked, clamp in ((1, 0.0, None), (2, 0.3, 2.0), (16, 0.2, 1.5)):
        x = random_tokens(tokens, hidden, gen).cuda()
        idx, wts = (t.cuda() for t in random_routing(tokens, experts, k, gen, masked_ratio=masked))
        for path in ("warp_decode", "grouped", "auto"):
            _check(dec, l1, x, idx, wts, path, clamp)


@pytest.mark.gpu
def test_auto_replays_in_a_cuda_graph():
    experts, hidden, inter, k, tokens = 8, 512, 512, 2, 6
    l1, l2 = _weights(experts, hidden, inter, 7, "cuda")
    gen = torch.Generator().manual_seed(8)
    for crossover in (0, tokens):  # grouped, then warp decode
        dec = MoEDecoder(l1, l2, num_topk=k, max_tokens=tokens, crossover=crossover)
        x = random_tokens(tokens, hidden, gen).cuda()
        idx, wts = (t.cuda() for t in random_routing(tokens, experts, k, gen))
        y = dec(x, idx, wts)  # compiles outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec(x, idx, wts, out=y)
        x.copy_(random_tokens(tokens, hidden, gen).cuda())
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full_like(x, float("nan"))
        dec(x, idx, wts, out=want)
        assert torch.equal(y, want), f"crossover {crossover}: graph replay differs from an eager call"
