"""SymmBuffer layout arithmetic, views and validation (single process, CPU)."""

import pytest
import torch

from megamoe import SymmBuffer, get_symm_buffer_for_mega_moe, symm_buffer_layout
from megamoe.symm_buffer import DEFAULT_MAX_RING_TOKENS, SECTION_ALIGNMENT


def test_layout_sections_are_aligned_disjoint_and_sized():
    lay = symm_buffer_layout(8, 256, 1000, 6, 4096, 2048)
    end = 0
    for s in lay.sections:
        assert s.offset % SECTION_ALIGNMENT == 0 and s.offset >= end
        end = s.offset + s.num_bytes
    assert lay.num_bytes >= end
    assert lay.section("x").num_bytes == 1000 * 4096  # one FP8 byte per element
    assert lay.section("x_sf").shape == (1000, 32)
    assert lay.section("combine").shape == (6, 1000, 4096)
    # every row a rank can receive: 8 ranks x 1000 tokens x min(6, 32) slots, capped and 128-aligned
    assert lay.num_ring_tokens == min(48000, DEFAULT_MAX_RING_TOKENS) // 128 * 128 + (128 if 48000 % 128 else 0)
    text = lay.describe()
    assert all(s.name in text for s in lay.sections) and "MiB per rank" in text


def test_bf16_layout_has_no_scales():
    lay = symm_buffer_layout(2, 8, 16, 2, 256, 128, mma_type="bf16")
    assert lay.section("x").dtype == torch.bfloat16 and lay.section("x_sf").num_bytes == 0
    assert lay.num_ring_tokens == 128  # 2 x 16 x 2 = 64 rows, rounded up to one ring block


def test_views_alias_one_allocation():
    buf = get_symm_buffer_for_mega_moe(None, 16, 32, 4, 256, 96, device="cpu")
    assert buf.x.dtype == torch.float8_e4m3fn and buf.x.shape == (32, 256)
    assert buf.topk_idx.dtype == torch.int64 and buf.topk_weights.shape == (32, 4)
    assert buf.l2_acts.shape == (buf.layout.num_ring_tokens, 128)  # I = 96 as the kernels run it, zero-padded
    base = buf.buffer.data_ptr()
    for s in buf.layout.sections:
        assert getattr(buf, s.name).data_ptr() == base + s.offset
    buf.topk_idx.fill_(-1)
    assert (buf.buffer[buf.layout.section("topk_idx").offset :][:8] == 255).all()
    assert buf.peer_ptrs == [base] and buf.peer_view(0, "x").data_ptr() == buf.x.data_ptr()
    buf.check_num_tokens(32)
    with pytest.raises(ValueError, match=r"tokens on this rank\)` must be in \[0, 32\], got 33"):
        buf.check_num_tokens(33)
    buf.destroy()
    assert not hasattr(buf, "x")


@pytest.mark.parametrize("hidden,inter,recipe", [(2880, 2880, (1, 1, 32)), (2880, 2880, (1, 1, 128)),
                                                (2048, 768, (1, 1, 32)), (2048, 768, (1, 1, 128)),
                                                (1408, 1408, (1, 1, 128)), (96, 160, (1, 1, 128))])
def test_views_of_the_real_sizes_over_zero_padded_storage(hidden, inter, recipe):
    """FP8 x FP4 buffers store H and I as the kernels run them (rounded up to 128; recipe (1, 1, 128)'s H to 256, the
    Mega MoE kernel's shared 256-row weight tiles); ``x`` and ``x_sf`` are views of the real H (``ceil(H/128)`` scale
    words); what a caller writes there never reaches the padding, which stays zero. Recipe 128's ring scales are
    ``[ring, Hk/128]`` / ``[ring, Ik/128]`` views of rows padded to 4 words (16 bytes, TMA), the padding zero."""
    from megamoe.inputs import fill_buffer, random_routing, random_tokens
    from megamoe.layouts import quantize_fp8

    h_multiple = 256 if recipe == (1, 1, 128) else 128
    t, hk, ik, words = 8, -(-hidden // h_multiple) * h_multiple, -(-inter // 128) * 128, -(-hidden // 128)
    buf = get_symm_buffer_for_mega_moe(None, 8, t, 2, hidden, inter, device="cpu", recipe=recipe)
    lay = buf.layout
    assert (lay.hidden, lay.intermediate_hidden, lay.kernel_hidden, lay.kernel_intermediate) == (hidden, inter, hk, ik)
    assert buf.x.shape == (t, hidden) and buf.x_sf.shape == (t, words)
    assert lay.section("x").shape == (t, hk) and lay.section("x_sf").shape == (t, hk // 128)
    assert lay.section("combine").shape == (2, t, hk) and buf.l2_acts.shape == (lay.num_ring_tokens, ik)
    if recipe == (1, 1, 128):
        ring = lay.num_ring_tokens
        for name, k in (("l1_acts_sf", hk), ("l2_acts_sf", ik)):
            view, padded = getattr(buf, name), -(-k // 512) * 4
            assert view.shape == (ring, k // 128) and view.stride() == (padded, 1)
            assert lay.section(name).shape == (ring, padded)
            view.fill_(1.0)  # the views never reach the padding words
            row_storage = buf._view(buf.buffer, lay.section(name), lay.section(name).shape)
            assert (row_storage[:, : k // 128] == 1).all() and not row_storage[:, k // 128 :].any()
    gen = torch.Generator().manual_seed(hidden + inter)
    x = random_tokens(t, hidden, gen)
    x_q, x_sf = fill_buffer(buf, x, *random_routing(t, 8, 2, gen))
    want_q, want_sf = quantize_fp8(x, recipe=recipe)
    assert torch.equal(buf.x.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(buf.x_sf, want_sf)
    storage = {name: buf._view(buf.buffer, lay.section(name), lay.section(name).shape) for name in ("x", "x_sf")}
    assert not storage["x"].view(torch.uint8)[:, hidden:].any() and not storage["x_sf"][:, words:].any()
    bf16 = get_symm_buffer_for_mega_moe(None, 8, t, 2, hidden, inter, mma_type="bf16", device="cpu")
    assert (bf16.layout.kernel_hidden, bf16.layout.kernel_intermediate) == (hidden, inter)  # BF16: no padding
    assert bf16.x.shape == (t, hidden) and bf16.x.is_contiguous()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=100), "`hidden` must be a multiple of 32"),
        (dict(intermediate_hidden=200), "`intermediate_hidden` must be a multiple of 32"),
        (dict(num_experts=6, num_ranks=4), "`num_experts` must be a multiple of 4"),
        (dict(num_topk=0), r"`num_topk` must be in \[1, 8\]"),
        (dict(num_topk=9), r"`num_topk` must be in \[1, 8\]"),
        (dict(num_ring_tokens=200), "`num_ring_tokens` must be a multiple of 128"),
        (dict(mma_type="fp4"), "`mma_type` must be one of"),
        (dict(num_max_tokens_per_rank=0), "`num_max_tokens_per_rank` must be in"),
    ],
)
def test_validation_errors(kwargs, message):
    args = dict(num_ranks=1, num_experts=8, num_max_tokens_per_rank=16, num_topk=2, hidden=256, intermediate_hidden=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        symm_buffer_layout(**args)


def test_activation_must_be_swiglu():
    with pytest.raises(ValueError, match="`activation` must be 'swiglu'"):
        SymmBuffer(None, 8, 16, 2, 256, 128, activation="gelu", device="cpu")
