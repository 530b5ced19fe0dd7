"""Warp-decode MoE kernels (``megamoe.kernels.decode``).

CPU: every kernel variant compiles for sm_90a (``CUTE_DSL_ARCH``, set by conftest) and bad inputs
raise ``ValueError`` naming the tensor before anything touches CUDA. GPU (``-m gpu``): outputs match
an independent float64 reference of the BF16-activation decode numerics.

Tolerance: the kernels sum in FP32 (relative error ~K * 2**-24 at worst, K <= 4096, far below BF16)
and round ``y`` once to BF16 (round-to-nearest: at most 2**-8 relative per element, ~2**-9.8 in the
Frobenius ratio for random data); ``silu``'s exp is approximate to a few FP32 ulps. So ``y`` must be
within ``BF16_TOL = 2**-8`` of the reference in the Frobenius ratio and within ``ROW_TOL`` per row
(2**-8 plus FP32 summation slack).
"""

from __future__ import annotations

import pytest
import torch

from megamoe.inputs import random_fp4_weights, random_routing, random_tokens
from megamoe.layouts import quantize_fp8
from megamoe.numerics import max_row_rel_error, rel_fro_error
from megamoe.reference import reference_decode

BF16_TOL = 2.0**-8
ROW_TOL = 2.0**-8 * 1.05


def _fp8_weights(num_experts: int, n: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(num_experts, n, k, generator=gen, device="cpu") * k**-0.5
    q, sf = quantize_fp8(w)
    return q.to(device), sf.to(device)


def _problem(tokens, hidden, inter, experts, topk, fmt, seed, device, masked_ratio=0.0, hot=None):
    gen = torch.Generator().manual_seed(seed)
    x = random_tokens(tokens, hidden, gen).to(device)
    idx, wts = random_routing(tokens, experts, topk, gen, masked_ratio=masked_ratio, hot_experts=hot)
    if fmt == "fp4":
        l1 = tuple(t.to(device) for t in random_fp4_weights(experts, 2 * inter, hidden, gen))
        l2 = tuple(t.to(device) for t in random_fp4_weights(experts, hidden, inter, gen))
    else:
        l1 = _fp8_weights(experts, 2 * inter, hidden, gen, device)
        l2 = _fp8_weights(experts, hidden, inter, gen, device)
    return x, idx.to(device), wts.to(device), l1, l2


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("has_clamp", [False, True])
def test_kernels_compile_for_sm90(fmt, has_clamp):
    from megamoe.kernels import runtime
    from megamoe.kernels.decode.simt import compile_kernels

    if not torch.cuda.is_available():
        assert runtime.compile_only_arch() == "sm_90a"
    gate_up, down = compile_kernels(4096, 2048, fmt, has_clamp, topk=6)
    assert gate_up is not None and down is not None
    if fmt == "fp4":  # the tensor-core gate_up on the Mega MoE L1 layout
        assert all(compile_kernels(4096, 2048, fmt, has_clamp, topk=6, l1_layout="mega"))
        assert all(compile_kernels(4096, 2048, fmt, has_clamp, topk=6, l1_layout="mega", x_order="mma"))
        assert all(compile_kernels(1152, 640, fmt, has_clamp, topk=1, l1_layout="mega"))
    # a shape whose rows end in a partial round of vectors (predicated lanes), one slot, and a top-k
    # deeper than the down kernel's load pipeline
    assert all(compile_kernels(1152, 640, fmt, has_clamp, topk=1))
    assert all(compile_kernels(1152, 640, fmt, has_clamp, topk=9, down_rows=4))


@pytest.mark.parametrize("has_clamp", [False, True])
def test_expert_major_kernels_compile_for_sm90(has_clamp):
    from megamoe.kernels.decode import expert_major as em

    for hidden, inter, topk in ((4096, 2048, 6), (7168, 3072, 8), (1152, 640, 1)):
        assert all(em.compile_kernels(hidden, inter, has_clamp, topk))
    assert all(em.compile_kernels(4096, 2048, has_clamp, 6, x_order="mma"))
    assert all(em.compile_kernels(1152, 640, has_clamp, 2, tuning=(2, 3)))


@pytest.mark.parametrize("has_clamp", [False, True])
def test_token_major_kernels_compile_for_sm90(has_clamp):
    from megamoe.kernels.decode import token_major as tm

    for hidden, inter, topk in ((4096, 2048, 6), (7168, 3072, 8), (1152, 640, 1)):
        assert all(tm.compile_kernels(hidden, inter, has_clamp, topk))
    assert all(tm.compile_kernels(4096, 2048, has_clamp, 6, tuning=(1, 6, 2, 1)))
    with pytest.raises(ValueError, match="tuning\\[0\\]"):  # H / 128 = 9: no two gate_up parts
        tm.compile_kernels(1152, 640, has_clamp, 1, tuning=(2, 6, 1, 4))


def test_token_major_default_tuning_and_support():
    """gate_up parts of >= 14 chunks; down at 24 warps per SM where shared memory allows (module constants)."""
    from megamoe.kernels.decode import token_major as tm

    assert tm.default_tuning(4096, 2048, 6) == (2, 6, 1, 4)  # flash: 48 KiB of staged rows per down CTA
    assert tm.default_tuning(7168, 3072, 6) == (4, 6, 2, 2)  # pro: 72 KiB, two CTAs of 12 warps
    assert tm.default_tuning(1152, 640, 9)[0] == 1
    for hidden, inter, topk in ((4096, 2048, 6), (7168, 3072, 8), (1152, 640, 9)):
        tm.check_tuning(hidden, inter, topk, tm.default_tuning(hidden, inter, topk))
    assert tm.supports(8, 3072) and not tm.supports(16, 4096) and not tm.supports(33, 128)


@pytest.mark.parametrize("tuning,match", [((3, 6, 1, 2), "tuning\\[0\\]"), ((4, 6, 5, 2), "tuning\\[2\\]"),
                                          ((4, 6, 1, 2), "top-k 33"), ((4, 0, 1, 2), "tuning\\[1\\]"),
                                          ((4, 6, 1, 4), "shared memory")])
def test_token_major_tuning_is_checked(tuning, match):
    from megamoe.kernels.decode.token_major import check_tuning

    with pytest.raises(ValueError, match=match):
        check_tuning(7168, 3072, 33 if "33" in match else 6, tuning)


def test_mma_order_matches_the_natural_loads():
    """``a`` (expert-major) and ``x`` above ``NATURAL_X_MAX_TOKENS`` sit in MMA order (``mma_position``: a
    permutation; ``interleave_tokens(x, "mma")`` puts every element there), read with ``mma.ld_mma_chunk``; smaller
    batches' ``x`` is read in its natural order with ``mma.ld_natural_chunk``: both must hand lane
    q the same elements as word j of a 128-wide chunk (the pair 16 j + 2 q, + 1 of the m16n8k16 B fragment), and
    each of a lane's 16-byte MMA-order loads must be one column's 64 contiguous bytes across the 4 lanes q."""
    from megamoe.kernels.decode.common import interleave_tokens, mma_position

    gen = torch.Generator().manual_seed(4)
    for hidden in (128, 640, 4096):
        pos = torch.tensor([mma_position(n) for n in range(hidden)])
        assert torch.equal(pos.sort().values, torch.arange(hidden))
        x = torch.randn(2, hidden, generator=gen).to(torch.bfloat16)
        assert torch.equal(interleave_tokens(x, "mma")[:, pos], x)
    for q in range(4):
        for j in range(16):  # ld_mma_chunk: byte 64 (j // 4) + 16 q + 4 (j % 4); ld_natural_chunk: byte 16 j + 4 q
            mma_elem = (64 * (j // 4) + 16 * q + 4 * (j % 4)) // 2
            natural_elem = (16 * j + 4 * q) // 2
            assert [mma_position(natural_elem), mma_position(natural_elem + 1)] == [mma_elem, mma_elem + 1]
    # element k = 16kk + 8h + 2q + i of K block 32w: lane q's load w holds bytes [64w + 16q, 64w + 16q + 16)
    for w in range(4):
        for q in range(4):
            elems = [32 * w + 16 * kk + 8 * h + 2 * q + i for kk in range(2) for h in range(2) for i in range(2)]
            assert sorted(2 * mma_position(n) for n in elems) == list(range(64 * w + 16 * q, 64 * w + 16 * q + 16, 2))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("k", [640, 1152, 4096])
@pytest.mark.parametrize("per_chunk", [4, 8])
def test_interleaved_layout_is_a_coalesced_permutation(fmt, k, per_chunk):
    from megamoe.kernels.decode.common import VECTOR_FORMATS, WARP

    f = VECTOR_FORMATS[fmt]
    i = torch.arange(k)
    pos = f.interleaved_offset(i, per_chunk)
    assert pos.unique().numel() == k and int(pos.max()) < f.interleaved_row(k)
    # chunk q of lane l's vector v = 32 r + l keeps its elements in order and contiguous, and the
    # lanes' chunks of one (round, q) are consecutive, lane order: one 512-byte warp load
    v, e = i // f.elems_per_vec, i % f.elems_per_vec
    assert torch.equal(pos % per_chunk, e % per_chunk)
    key = (v // WARP) * f.elems_per_vec + e // per_chunk
    lane_zero = {}
    for kk, lane, p in zip(key.tolist(), (v % WARP).tolist(), (pos // per_chunk).tolist()):
        assert lane_zero.setdefault(kk, p - lane) == p - lane


def test_interleave_tokens_gathers_every_element():
    from megamoe.kernels.decode.common import VECTOR_FORMATS, interleave_tokens

    gen = torch.Generator().manual_seed(3)
    for fmt, hidden in (("fp4", 1152), ("fp8", 4096)):
        x = torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
        xi = interleave_tokens(x, fmt)
        assert xi.shape == (3, VECTOR_FORMATS[fmt].interleaved_row(hidden))
        assert torch.equal(xi[:, VECTOR_FORMATS[fmt].interleaved_offset(torch.arange(hidden), 8)], x)


def _valid_cpu_inputs(fmt="fp4"):
    gen = torch.Generator().manual_seed(0)
    x = random_tokens(3, 256, gen)
    idx, wts = random_routing(3, 4, 2, gen)
    per = 2 if fmt == "fp4" else 1
    dt = torch.uint8 if fmt == "fp4" else torch.float8_e4m3fn
    l1 = (torch.ones(4, 256, 256 // per, dtype=torch.uint8).view(dt), torch.ones(4, 256, 2, dtype=torch.int32))
    l2 = (torch.ones(4, 256, 128 // per, dtype=torch.uint8).view(dt), torch.ones(4, 256, 1, dtype=torch.int32))
    return {"x": x, "topk_idx": idx, "topk_weights": wts, "l1": l1, "l2": l2}


def _with(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


def _bad_cases():
    a = _valid_cpu_inputs()
    w1, s1 = a["l1"]
    w2, s2 = a["l2"]
    return {
        "x dtype": (_with(a, x=a["x"].float()), "`x` must have dtype bfloat16"),
        "x not contiguous": (_with(a, x=torch.cat([a["x"], a["x"]], 1)[:, ::2]), "`x` must be contiguous"),
        "no tokens": (_with(a, x=a["x"][:0], topk_idx=a["topk_idx"][:0], topk_weights=a["topk_weights"][:0]), "`x`"),
        "odd hidden": (_with(a, x=a["x"][:, :200].contiguous()), "`x.shape[1] (hidden)` must be a multiple of 128"),
        "idx dtype": (_with(a, topk_idx=a["topk_idx"].int()), "`topk_idx` must have dtype int64"),
        "idx tokens": (_with(a, topk_idx=a["topk_idx"][:2]), "`topk_idx` must have shape"),
        "weights shape": (_with(a, topk_weights=a["topk_weights"][:, :1].contiguous()), "`topk_weights` must have shape"),
        "weights dtype": (_with(a, topk_weights=a["topk_weights"].double()), "`topk_weights` must have dtype float32"),
        "l1 not a pair": (_with(a, l1=w1), "`l1` must be a (weights, scales) tuple"),
        "w1 dtype": (_with(a, l1=(w1.float(), s1)), "`l1[0]` must have dtype"),
        "w1 hidden": (_with(a, l1=(w1[:, :, :64].contiguous(), s1)), "`l1[0]` must have shape"),
        "odd intermediate": (_with(a, l1=(w1[:, :200].contiguous(), s1[:, :200].contiguous())), "intermediate"),
        "sf1 dtype": (_with(a, l1=(w1, s1.view(torch.uint8))), "`l1[1]` must have dtype int32"),
        "w2 format": (_with(a, l2=(w2.view(torch.float8_e4m3fn), s2)), "`l2[0]` must have dtype uint8"),
        "sf2 shape": (_with(a, l2=(w2, s2[:, :128].contiguous())), "`l2[1]` must have shape"),
        "clamp": (_with(a, activation_clamp=-1.0), "`activation_clamp` must be positive and finite"),
        "out dtype": (_with(a, out=torch.empty(3, 256)), "`out` must have dtype bfloat16"),
        "cpu tensors": (a, "`x` must be a CUDA tensor"),
        "mega l1 shape": (_with(a, l1=(torch.ones(4, 4, 2, 64, 8, dtype=torch.int32), s1)), "`l1[0]` must have shape"),
        "mega l1 with fp8 l2": (_with(a, l1=(torch.ones(4, 4, 2, 64, 16, dtype=torch.int32), s1),
                                      l2=(w2.view(torch.float8_e4m3fn), s2)), "`l2[0]` must be FP4"),
        "mega l2 alone": (_with(a, l2=(torch.ones(4, 4, 1, 64, 16, dtype=torch.int32), s2)),
                          "`l2[0]` may be in the Mega MoE layout (int32) only when l1 is too"),
        "mega l1 canonical scales": (_with(a, l1=(torch.ones(4, 4, 2, 64, 16, dtype=torch.int32), s1)),
                                     "`l1[1]` must be the chunk-major scales [E, K/128, N] = [4, 2, 256]"),
        "mega l2 shape": (_with(a, l1=(torch.ones(4, 4, 2, 64, 16, dtype=torch.int32), s1.transpose(1, 2).contiguous()),
                                l2=(torch.ones(4, 4, 2, 64, 16, dtype=torch.int32), s2)), "`l2[0]` must have shape"),
        "too many experts": (_with(a, l1=(torch.ones(1025, 4, 2, 64, 16, dtype=torch.int32),
                                          torch.ones(1025, 2, 256, dtype=torch.int32)),
                                   l2=(torch.ones(1025, 4, 1, 64, 16, dtype=torch.int32),
                                       torch.ones(1025, 1, 256, dtype=torch.int32))), "experts"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_before_launch(case):
    from megamoe.kernels.decode import moe_decode

    kwargs, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        moe_decode(**kwargs)


def test_fp8_inputs_pass_shape_checks():
    from megamoe.kernels.decode import check_decode_inputs

    assert check_decode_inputs(**_valid_cpu_inputs("fp8")) == ("fp8", 256, 128)
    assert check_decode_inputs(**_valid_cpu_inputs("fp4")) == ("fp4", 256, 128)
    chunk_major = [s.transpose(1, 2).contiguous() for s in (_valid_cpu_inputs()["l1"][1], _valid_cpu_inputs()["l2"][1])]
    mega = _with(_valid_cpu_inputs("fp4"), l1=(torch.ones(4, 4, 2, 64, 16, dtype=torch.int32), chunk_major[0]))
    assert check_decode_inputs(**mega) == ("fp4", 256, 128)
    both = _with(mega, l2=(torch.ones(4, 4, 1, 64, 16, dtype=torch.int32), chunk_major[1]))
    assert check_decode_inputs(**both) == ("fp4", 256, 128)


# ---------------------------------------------------------------------------------------------- GPU

CASES = {
    # name: (T, H, I, E, k, fmt, clamp, masked_ratio, hot_experts)
    "batch1": (1, 1024, 512, 8, 4, "fp4", None, 0.0, None),
    "batch1-fp8": (1, 1024, 512, 8, 4, "fp8", None, 0.0, None),
    "ragged-hot": (13, 1024, 640, 16, 6, "fp4", None, 0.0, 6),  # every token on the same 6 experts
    "masked-clamp": (9, 1152, 384, 8, 3, "fp4", 0.5, 0.3, None),
    "fp8-clamp": (5, 1152, 640, 6, 2, "fp8", 0.25, 0.2, None),
    "flash-shape": (4, 4096, 2048, 32, 6, "fp4", None, 0.0, None),
    "many-experts": (11, 1024, 512, 200, 8, "fp4", None, 0.1, None),  # experts spread over 7 bitmap words
    "one-token-masked": (1, 1152, 640, 12, 9, "fp4", 0.5, 0.0, None),  # H / 128 = 9: one gate_up K part
    "one-token-dead": (1, 1024, 512, 8, 3, "fp4", None, 0.0, None),
    "two-tokens": (2, 1280, 384, 10, 5, "fp4", None, 0.2, None),  # H / 128 = 10: two gate_up K parts
}


def _run_case(name, seed=0, l1_layout="canonical"):
    from megamoe.kernels.sm90 import prepare_fp4_weights, prepare_fp4_weights_l1
    from megamoe.kernels.decode import moe_decode

    tokens, hidden, inter, experts, topk, fmt, clamp, masked, hot = CASES[name]
    x, idx, wts, l1, l2 = _problem(tokens, hidden, inter, experts, topk, fmt, seed, "cuda", masked, hot)
    if name == "masked-clamp":
        idx[2] = -1  # a token with every slot masked
        idx[5, 0] = experts + 3  # an id outside [0, E) counts as masked
        idx[3, 1] = idx[3, 0] = 1  # the same expert twice in one token
    if name == "one-token-masked":
        idx[0, 2], idx[0, 5], idx[0, 7] = -1, experts + 3, idx[0, 0]  # masked, out of range, a repeated expert
    if name == "one-token-dead":
        idx[0] = -1
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    l1_kernel = prepare_fp4_weights_l1(*l1, mma="bf16") if l1_layout != "canonical" else l1
    l2_kernel = prepare_fp4_weights(*l2, mma="bf16") if l1_layout == "expert" else l2
    y = moe_decode(x, idx, wts, l1_kernel, l2_kernel, activation_clamp=clamp, out=out)
    torch.cuda.synchronize()
    ref = reference_decode(x, idx, wts, l1, l2, clamp)
    return y, ref, (x, idx, wts, l1, l2, clamp)


@pytest.mark.gpu
@pytest.mark.parametrize("name,l1_layout", [(n, "canonical") for n in sorted(CASES)]
                         + [(n, lay) for n in sorted(CASES) if CASES[n][5] == "fp4" for lay in ("mega", "expert")])
def test_matches_fp32_reference(name, l1_layout):
    """Every path: SIMT gate_up on canonical L1, tensor-core gate_up on the Mega MoE L1, and the expert-major
    kernels on both weights in the Mega MoE layout ("expert"). Same tolerance: exact weight products, FP32
    sums, one BF16 rounding of y (the expert-major down reads a as hi + lo BF16, within 2**-17 of it: far
    below that rounding)."""
    y, ref, (_, idx, *_rest) = _run_case(name, l1_layout=l1_layout)
    assert y.dtype == torch.bfloat16 and not torch.isnan(y).any(), "output not fully written"
    errs = rel_fro_error(y, ref), max_row_rel_error(y, ref)
    assert errs[0] <= BF16_TOL and errs[1] <= ROW_TOL, f"{name}: rel_fro={errs[0]:.3e} max_row_rel={errs[1]:.3e}"
    dead = ~((idx >= 0) & (idx < CASES[name][3])).any(1)
    assert (y[dead] == 0).all(), "tokens without a valid slot must be exactly 0"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["batch1", "one-token-masked", "two-tokens", "ragged-hot"])
def test_token_major_with_one_part_equals_expert_major(name):
    """Unsplit, the token-major kernels group every FP32 sum as the expert-major kernels do (gate_up chains, down's
    four chains per output, slots in order): both weights in the Mega MoE layout, the same bits. The expert-major
    down takes its packed pass (hi and lo of up to 4 pairs as the columns of one operand) where an expert has at
    most 4 pairs (one and two tokens) and unpacked passes of 8 pairs where it has more ("ragged-hot": 13 tokens on
    the same 6 experts)."""
    from megamoe.kernels.decode.expert_major import moe_decode_by_expert
    from megamoe.kernels.sm90 import prepare_fp4_weights, prepare_fp4_weights_l1
    from megamoe.kernels.decode.token_major import moe_decode_by_token

    _, _, (x, idx, wts, l1, l2, clamp) = _run_case(name)
    l1k, l2k = prepare_fp4_weights_l1(*l1, mma="bf16"), prepare_fp4_weights(*l2, mma="bf16")
    ys = [torch.full_like(x, float("nan")) for _ in range(2)]
    moe_decode_by_token(x, idx, wts, l1k, l2k, clamp, ys[0], tuning=(1, 6, 1, 2))
    moe_decode_by_expert(x, idx, wts, l1k, l2k, clamp, ys[1])
    assert not torch.isnan(ys[0]).any() and torch.equal(ys[0], ys[1])


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [(4, 6, 2, 2), (2, 6, 1, 4), (1, 2, 4, 1)])
@pytest.mark.parametrize("tokens", [1, 4])
def test_token_major_splits_match_reference(tuning, tokens):
    """gate_up and down split over K parts (the shapes' defaults leave one-part gate_ups here), one and four tokens,
    masked slots: same tolerance as every path."""
    from megamoe.kernels.sm90 import prepare_fp4_weights, prepare_fp4_weights_l1
    from megamoe.kernels.decode.token_major import moe_decode_by_token

    x, idx, wts, l1, l2 = _problem(tokens, 2048, 1024, 16, 6, "fp4", 5, "cuda")
    idx[0, 1], idx[-1, 4] = -1, 16  # masked, out of range
    y = torch.full_like(x, float("nan"))
    moe_decode_by_token(x, idx, wts, prepare_fp4_weights_l1(*l1, mma="bf16"), prepare_fp4_weights(*l2, mma="bf16"),
                        None, y, tuning=tuning)
    ref = reference_decode(x, idx, wts, l1, l2)
    assert not torch.isnan(y).any()
    assert rel_fro_error(y, ref) <= BF16_TOL and max_row_rel_error(y, ref) <= ROW_TOL


@pytest.mark.gpu
def test_repeat_calls_are_deterministic_and_fill_out():
    from megamoe.kernels.decode import moe_decode

    x, idx, wts, l1, l2 = _problem(7, 1024, 512, 8, 4, "fp4", 3, "cuda")
    y1 = moe_decode(x, idx, wts, l1, l2)
    out = torch.full_like(y1, float("nan"))
    y2 = moe_decode(x, idx, wts, l1, l2, out=out)
    assert y2 is out and torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["canonical", "expert"])
def test_closer_to_unquantized_reference_than_fp8_contract(layout):
    """BF16 activations (this path: per-pair SIMT kernels, or the expert-major ones) vs the FP8-activation
    contract (R1..R4 roundings): against the exact-weight float64 reference with unquantized activations,
    this path must be the closer one."""
    from megamoe.reference import reference_moe

    y, ref, (x, idx, wts, l1, l2, clamp) = _run_case("flash-shape", l1_layout=layout)
    x_fp8, x_sf = quantize_fp8(x)
    contract = reference_moe(x_fp8, x_sf, idx, wts, l1, l2, clamp)
    ours, theirs = rel_fro_error(y, ref), rel_fro_error(contract, ref)
    print(f"\nrel_fro vs unquantized FP32 reference: warp decode ({layout}) {ours:.3e}, FP8 contract path {theirs:.3e}")
    assert ours < theirs
