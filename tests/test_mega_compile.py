"""Mega MoE on a CPU: both staged EP kernels (the BF16 path's) compile for sm_90a (debug and not; the one-launch
kernel's compile checks are in test_sm90_compile.py), the host validates every argument before any device work, and the debug-report plumbing formats what the kernels write.
GPU behaviour: tests/distributed/test_mega_gpu.py (-m gpu)."""

from __future__ import annotations

import time

import pytest
import torch

from megamoe import get_symm_buffer_for_mega_moe, symm_buffer_layout
from megamoe.inputs import random_fp4_weights
from megamoe.kernels.comm import EpCommConfig, SITES, format_record
from megamoe.kernels.comm.combine import compile_combine
from megamoe.kernels.comm.dispatch import compile_dispatch
from megamoe.kernels.comm.protocol import SITE_READY
from megamoe.mega import (MegaMoE, bf16_mega_moe, debug_enabled, debug_timeout_ns, fp8_fp4_mega_moe, timeout_ns,
                         transform_weights_for_mega_moe)

LAYOUTS = {
    "r2_small": symm_buffer_layout(2, 16, 8, 4, 512, 512),
    "r1": symm_buffer_layout(1, 8, 33, 3, 512, 1024),
    "r8_flash_like": symm_buffer_layout(8, 256, 64, 6, 4096, 2048),
    "r4_wide_hidden": symm_buffer_layout(4, 64, 16, 8, 7168, 512),
    "r2_bf16": symm_buffer_layout(2, 16, 8, 4, 384, 256, mma_type="bf16"),
    "r2_gpt_oss_padded": symm_buffer_layout(2, 16, 8, 4, 2880, 2880),  # rows of the padded H = 2944, y of 2880
    "r2_bf16_gpt_oss": symm_buffer_layout(2, 16, 8, 4, 2880, 2880, mma_type="bf16"),
}


@pytest.mark.parametrize("debug", [False, True], ids=["release", "debug"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_ep_kernels_compile_for_sm90a(name, debug):
    for has_stats in (False, True):
        cfg = EpCommConfig(LAYOUTS[name], debug, has_stats)
        start = time.perf_counter()
        assert compile_dispatch(cfg) is not None
        print(f"{name} debug={debug} stats={has_stats}: dispatch compiled in {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    assert compile_combine(EpCommConfig(LAYOUTS[name], debug)) is not None
    print(f"{name} debug={debug}: combine compiled in {time.perf_counter() - start:.2f} s")


_PTX_CHILD = """
import json, re, sys
from megamoe import symm_buffer_layout
from megamoe.kernels.comm import EpCommConfig
from megamoe.kernels.comm.combine import compile_combine
from megamoe.kernels.comm.dispatch import compile_dispatch
report = []
for debug in (False, True):
    cfg = EpCommConfig(symm_buffer_layout(2, 16, 8, 4, 512, 512), debug, True)
    for kernel in (compile_dispatch(cfg), compile_combine(cfg)):
        ptx = kernel.__ptx__
        ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).replace("\\0", "")
        report.append([debug, "%globaltimer" in ptx, "trap;" in ptx, len(re.findall(r"^\\s*call(\\.uni)?\\s", ptx, re.M))])
print(json.dumps(report))
"""


def test_ep_kernels_time_out_in_every_build(tmp_path):
    """Dispatch and combine read the clock in their spin-waits and trap in release builds too (the runtime limit
    ``timeout_ns``, ``MEGAMOE_TIMEOUT_S``); only the debug builds printf (a function call)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DISABLE_FILE_CACHING="1",
               CUTE_DSL_DUMP_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _PTX_CHILD], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    for debug, timer, trap, calls in json.loads(done.stdout.strip().splitlines()[-1]):
        assert timer and trap, f"debug={debug}: clock read {timer}, trap {trap}"
        assert (calls > 0) == debug, f"debug={debug}: {calls} function call(s)"


def test_timeout_env(monkeypatch):
    """``MEGAMOE_TIMEOUT_S`` (release builds, read at each call): default 100 s, 0 = never; debug mode takes
    ``MEGAMOE_DEBUG_TIMEOUT_S``; anything else is refused with the variable's name."""
    monkeypatch.delenv("MEGAMOE_TIMEOUT_S", raising=False)
    monkeypatch.delenv("MEGAMOE_DEBUG_TIMEOUT_S", raising=False)
    assert timeout_ns(False) == 100_000_000_000 and timeout_ns(True) == 10_000_000_000
    monkeypatch.setenv("MEGAMOE_TIMEOUT_S", "0")
    assert timeout_ns(False) == 0
    monkeypatch.setenv("MEGAMOE_TIMEOUT_S", "0.5")
    assert timeout_ns(False) == 500_000_000
    for bad in ("-1", "soon", "nan", "1e7"):
        monkeypatch.setenv("MEGAMOE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="MEGAMOE_TIMEOUT_S"):
            timeout_ns(False)


def test_records_are_printed_once_unless_the_kernel_printed_them(capsys):
    """The host prints each record row a kernel wrote without printf (release builds) once, as the debug build's
    printf would; rows the kernel printed itself (``RECORD_PRINTED`` = 1) and empty rows are not printed."""
    from megamoe import mega
    from megamoe.kernels.comm.protocol import RECORD_PRINTED, RECORD_WORDS

    record = torch.zeros(4, RECORD_WORDS, dtype=torch.int64)
    record[1] = torch.tensor([SITE_READY + 1, 3, 1, 7, 2, 5, 4, 0])
    record[2] = torch.tensor([SITE_READY + 1, 3, 2, 9, 2, 5, 4, 0])
    record[2, RECORD_PRINTED] = 1
    mega._watch(record)
    mega.print_new_records()
    mega.print_new_records()
    err = capsys.readouterr().err.splitlines()
    want = "megamoe debug: rank 3 CTA 1 (SM 7) role dispatch: timed out: waits ready[src=2] >= 5 (call + 1), sees 4"
    assert err == [want], err


def test_debug_sites_format_like_the_kernels():
    for site, (role, text) in enumerate(SITES):
        assert text.count("%d") == 3 and role in ("dispatch", "combine", "producer")
        line = format_record([site + 1, 0, 5, 17, 1, 3, 2, 0])
        assert line.startswith(f"megamoe debug: rank 0 CTA 5 (SM 17) role {role}: ")
    assert "waits ready[src=1] >= 3 (call + 1), sees 2" in format_record([SITE_READY + 1, 0, 5, 17, 1, 3, 2, 0])


def test_debug_switches(monkeypatch):
    monkeypatch.delenv("MEGAMOE_DEBUG", raising=False)
    assert debug_enabled(None) is False and debug_enabled(True) is True
    monkeypatch.setenv("MEGAMOE_DEBUG", "1")
    assert debug_enabled(None) is True and debug_enabled(False) is False
    with pytest.raises(TypeError, match="debug"):
        debug_enabled(1)
    monkeypatch.setenv("MEGAMOE_DEBUG_TIMEOUT_S", "2.5")
    assert debug_timeout_ns() == 2_500_000_000
    monkeypatch.setenv("MEGAMOE_DEBUG_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="MEGAMOE_DEBUG_TIMEOUT_S"):
        debug_timeout_ns()


E, T_MAX, K, H, I = 8, 16, 4, 512, 512


def _weights(num_experts=E, hidden=H, inter=I):
    gen = torch.Generator().manual_seed(0)
    return random_fp4_weights(num_experts, 2 * inter, hidden, gen), random_fp4_weights(num_experts, hidden, inter, gen)


def test_transform_weights_shapes():
    l1, l2 = _weights()
    l1k, l2k = transform_weights_for_mega_moe(l1, l2)
    assert l1k[0].shape == (E, 2 * I // 64, H // 128, 64, 16) and l1k[0].dtype == torch.int32 and l1k[1].shape == (E, H // 128, 2 * I)
    assert l2k[0].shape == (E, H // 64, I // 128, 64, 16) and l2k[1].shape == (E, I // 128, H)
    l1k, l2k = transform_weights_for_mega_moe(*_weights(hidden=256, inter=96))  # I zero-padded to 128, H as it is
    assert l1k[0].shape == (E, 2 * 128 // 64, 256 // 128, 64, 16) and l2k[0].shape == (E, 256 // 64, 128 // 128, 64, 16)
    l1k, l2k = transform_weights_for_mega_moe(*_weights(hidden=1408, inter=96), recipe=(1, 1, 128))  # H to 256: 1536
    assert l1k[0].shape == (E, 2 * 128 // 64, 1536 // 128, 64, 64) and l2k[0].shape == (E, 1536 // 64, 1, 64, 64)
    with pytest.raises(ValueError, match=r"`hidden \(l1\[0\].shape\[2\] \* 2\)` must be a multiple of 32"):
        transform_weights_for_mega_moe(*_weights(hidden=200))
    with pytest.raises(ValueError, match="l1"):
        transform_weights_for_mega_moe(l1[0], l2)


@pytest.fixture(scope="module")
def cpu_call():
    """A valid CPU call: buffer, y, transformed weights, stats (it fails only at the device check)."""
    buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, device="cpu")
    l1k, l2k = transform_weights_for_mega_moe(*_weights())
    return dict(y=torch.empty(5, H, dtype=torch.bfloat16), l1=l1k, l2=l2k, sym_buffer=buf,
                cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32))


def _call(args, **change):
    fp8_fp4_mega_moe(**{**args, **change})


def test_valid_cpu_call_stops_at_the_device_check(cpu_call):
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        _call(cpu_call)


BAD_CALLS = {
    "y dtype": (dict(y=torch.empty(5, H)), "`y` must have dtype bfloat16"),
    "y width": (dict(y=torch.empty(5, 256, dtype=torch.bfloat16)), r"`y` must have shape \[\*, 512\]"),
    "too many tokens": (dict(y=torch.empty(T_MAX + 1, H, dtype=torch.bfloat16)), "tokens on this rank"),
    "stats shape": (dict(cumulative_local_expert_recv_stats=torch.zeros(E + 1, dtype=torch.int32)),
                    "cumulative_local_expert_recv_stats"),
    "recipe": (dict(recipe=(1, 128, 128)), "`recipe` must be"),
    "activation": (dict(activation="gelu"), "`activation` must be 'swiglu'"),
    "gpt-oss activation": (dict(activation="swiglu_oai"), "'swiglu_oai' and expert biases run on the staged path"),
    "clamp": (dict(activation_clamp=-1.0), "`activation_clamp` must be positive and finite"),
    "canonical weights": (dict(l1=_weights()[0]), r"`l1\[0\]` is uint8 .* transform_weights_for_mega_moe"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_call_validation(cpu_call, name):
    change, pattern = BAD_CALLS[name]
    with pytest.raises(ValueError, match=pattern):
        _call(cpu_call, **change)


def test_canonical_scales_with_kernel_weights_are_named(cpu_call):
    """Kernel-layout weights with their scales still canonical [E, N, K/128] get the chunk-major rule."""
    w1, s1 = cpu_call["l1"]
    with pytest.raises(ValueError, match=r"`l1\[1\]` must be the chunk-major scales \[E, K/128, N\] = \[8, 4, 1024\]"):
        _call(cpu_call, l1=(w1, s1.transpose(1, 2).contiguous()))


def test_fast_math_and_debug_types(cpu_call):
    with pytest.raises(TypeError, match="fast_math"):
        _call(cpu_call, fast_math=1)
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        MegaMoE(*_weights(), fast_math="yes")
    with pytest.raises(TypeError, match="debug"):
        _call(cpu_call, debug="yes")


def test_a_ring_smaller_than_the_rows_is_fine_except_staged(cpu_call):
    """The one launch reuses ring blocks; the staged BF16 path needs a row for every received row."""
    small = get_symm_buffer_for_mega_moe(None, E, T_MAX * 4, K, H, I, num_ring_tokens=128, device="cpu")
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        _call(cpu_call, sym_buffer=small)  # valid up to the device check
    small_bf16 = get_symm_buffer_for_mega_moe(None, E, T_MAX * 4, K, H, I, num_ring_tokens=128, mma_type="bf16",
                                              device="cpu")
    with pytest.raises(ValueError, match=r"`sym_buffer` ring \(num_ring_tokens = 128 .* = 256"):
        bf16_mega_moe(cpu_call["y"], torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16(), small_bf16)


def test_buffer_recipe_and_shapes(cpu_call):
    bf16 = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, H, I, mma_type="bf16", device="cpu")
    with pytest.raises(ValueError, match="mma_type='fp8xfp4'"):
        _call(cpu_call, sym_buffer=bf16)
    wide = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, 544, I, device="cpu")  # run as H = 640: not the weights'
    with pytest.raises(ValueError, match=r"`l1\[0\]` must have shape \[8, 16, 5, 64, 16\]"):
        _call(cpu_call, sym_buffer=wide, y=torch.empty(5, 544, dtype=torch.bfloat16))


def test_bf16_call_validation(cpu_call):
    buf = get_symm_buffer_for_mega_moe(None, E, T_MAX, K, 384, 256, mma_type="bf16", device="cpu")
    l1 = torch.randn(E, 512, 384).bfloat16()
    l2 = torch.randn(E, 384, 256).bfloat16()
    y = torch.empty(5, 384, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`y` must be a CUDA tensor"):
        bf16_mega_moe(y, l1, l2, buf)  # valid up to the device check
    with pytest.raises(ValueError, match=r"`l1` must have shape \[8, 512, 384\]"):
        bf16_mega_moe(y, l1[:, :256], l2, buf)
    with pytest.raises(ValueError, match="`l2` must have dtype bfloat16"):
        bf16_mega_moe(y, l1, l2.float(), buf)
    with pytest.raises(ValueError, match="mma_type='bf16' for bf16_mega_moe, got 'fp8xfp4'"):
        bf16_mega_moe(cpu_call["y"], l1, l2, cpu_call["sym_buffer"])


def test_tile_config_three_ctas_only_where_l1_tiles_leave_slots_idle():
    """Decode-sized calls run 64-row weight tiles on three CTAs per SM only where 128-row L1 tiles would not fill the
    two-CTA slots: flash EP2 at 1 token/rank (about 6 local experts x 32 tiles < 264 slots), not pro at 1 token/rank
    (6 x 48 > 264) nor 8 tokens/rank (the reasons: ``tile_config``)."""
    from megamoe.mega import tile_config

    def cfg(preset, ranks, tokens, sms=132):
        e, k, h, i = {"flash": (256, 6, 4096, 2048), "pro": (384, 6, 7168, 3072)}[preset]
        return tile_config(symm_buffer_layout(ranks, e, 64, k, h, i), tokens, sms)

    three = cfg("flash", 2, 1)
    assert (three.tile_tokens, three.tile_n, three.ctas_per_sm) == (8, 64, 3)
    assert "ctas/SM=3" in three.describe("l1_l2") and three.num_stages("l1_l2") >= 3
    for preset, ranks, tokens in (("pro", 2, 1), ("flash", 2, 8), ("pro", 2, 8), ("flash", 8, 2)):
        assert cfg(preset, ranks, tokens).ctas_per_sm == 2, (preset, ranks, tokens)
    assert cfg("flash", 2, 1, sms=64).ctas_per_sm == 2  # fewer slots than the ~190 tiles: no idle CTAs


def test_tile_config_four_warpgroups_from_one_row_per_expert():
    """From one expected row per local expert (``MEGA_FOUR_WG_MIN_ROWS``), token tiles up to 32 rows run 256-row weight
    tiles on four consumer warpgroups, one CTA per SM (the reasons: ``tile_config``); wider token tiles keep the
    128-row tiles, decode-sized calls the 128- or 64-row ones. From 32 expected rows the tile covers the expected rows
    plus two Poisson standard deviations: pro 2048 tokens/rank (64 expected, 80 covered) runs 128-row token tiles;
    flash 512 (24 expected, 33.8 covered) keeps the four-warpgroup 32-row ones."""
    from megamoe.mega import tile_config

    shapes = {"flash": (256, 6, 4096, 2048), "pro": (384, 6, 7168, 3072)}
    want = {  # (preset, tokens/rank): (tile_tokens, tile_n, ctas_per_sm); EP2, 132 SMs
        ("flash", 1): (8, 64, 3), ("flash", 8): (8, 128, 2), ("flash", 32): (8, 256, 1), ("flash", 128): (16, 256, 1),
        ("flash", 512): (32, 256, 1), ("flash", 2048): (128, 128, 1),
        ("pro", 1): (8, 128, 2), ("pro", 8): (8, 128, 2), ("pro", 128): (8, 256, 1), ("pro", 512): (32, 256, 1),
        ("pro", 2048): (128, 128, 1), ("pro", 8192): (128, 128, 1),
    }
    for (preset, tokens), expected in want.items():
        e, k, h, i = shapes[preset]
        c = tile_config(symm_buffer_layout(2, e, tokens, k, h, i), tokens, 132)
        assert (c.tile_tokens, c.tile_n, c.ctas_per_sm) == expected, (preset, tokens, c)


def test_tile_config_recipe_128():
    """Recipe (1, 1, 128): FP8 mode, per-128 token scales, 256-row weight tiles (the per-128 SwiGLU epilogue's 128
    intermediate columns; both GEMMs share the config), one CTA per SM. The rows to cover: the expected rows per
    expert plus two Poisson standard deviations (pro 512 tokens/rank: 8 expected, 13.7 covered; 1024: 16, 24; 2048:
    32, 43.3; 4096: 64, 80; flash 512: 12, 18.9; 1024: 24, 33.8). Up to 32 expected rows
    (``config.FOUR_WG_FP8_MAX_TILE_TOKENS``) four consumer warpgroups, the smallest of 8 / 16 / 32 token rows covering
    the covered rows (32 where none does: flash 1024, pro 2048); above, two 128-row passes on two consumer warpgroups
    with the smallest of 64 / 128 token rows covering them (128 beyond)."""
    from megamoe.mega import tile_config

    shapes = {"flash": (256, 6, 4096, 2048), "pro": (384, 6, 7168, 3072)}
    want = {("flash", 1): (8, 1), ("flash", 8): (8, 1), ("flash", 128): (8, 1), ("flash", 512): (32, 1),
            ("flash", 1024): (32, 1), ("flash", 2048): (64, 2), ("flash", 8192): (128, 2), ("pro", 8): (8, 1),
            ("pro", 512): (16, 1), ("pro", 1024): (32, 1), ("pro", 2048): (32, 1), ("pro", 4096): (128, 2),
            ("pro", 8192): (128, 2)}
    for (preset, tokens), (tile_tokens, passes) in want.items():
        e, k, h, i = shapes[preset]
        rows = tokens * k / e  # one rank: every expert is local
        c = tile_config(symm_buffer_layout(1, e, tokens, k, h, i, recipe=(1, 1, 128)), tokens, 132)
        assert (c.mma, c.token_block, c.tile_n, c.ctas_per_sm) == ("fp8", 128, 256, 1), (preset, tokens, c)
        assert (c.tile_tokens, c.n_passes) == (tile_tokens, passes), (preset, tokens, c)
        assert c.tile_tokens >= rows or c.tile_tokens == 128, (preset, tokens, c)
        assert c.consumer_warpgroups == 4 // passes and c.pass_n == 256 // passes, (preset, tokens, c)


def test_mega_compile_takes_the_recipes_config():
    """The Mega MoE kernel of each recipe compiles for its own kind of config only: refused before any build."""
    from megamoe.kernels.sm90 import GemmConfig, compile_mega_moe

    r128 = EpCommConfig(symm_buffer_layout(1, 8, 16, 2, 512, 512, recipe=(1, 1, 128)), False)
    r32 = EpCommConfig(symm_buffer_layout(1, 8, 16, 2, 512, 512), False)
    with pytest.raises(ValueError, match=r"`config` must be FP8 mode with token_block=128 and tile_n=256 .*recipe "
                       r"\(1, 1, 128\).* got mma='bf16'"):
        compile_mega_moe(GemmConfig(tile_tokens=8, tile_n=256), r128)
    with pytest.raises(ValueError, match=r"`config` must be FP8 mode .*got mma='fp8', token_block=128, tile_n=128"):
        compile_mega_moe(GemmConfig(tile_tokens=8, tile_n=128, mma="fp8", token_block=128), r128)
    with pytest.raises(ValueError, match=r"`config.mma` must be 'bf16' .*recipe \(1, 1, 32\), got 'fp8'"):
        compile_mega_moe(GemmConfig(tile_tokens=8, tile_n=256, mma="fp8", token_block=128), r32)
    with pytest.raises(ValueError, match=r"`config.mma` must be 'bf16' .*recipe \(1, 1, 32\), got 'fp8'"):
        compile_mega_moe(GemmConfig(tile_tokens=64, tile_n=256, mma="fp8", token_block=128, n_passes=2), r32)
    # tokens on the wgmma M side (the weights' E4M3 copies): recipe 128's two-pass 128-row tiles only
    tokens_m = dict(tile_n=256, mma="fp8", token_block=128, n_passes=2, decode="copy", token_side="m")
    with pytest.raises(ValueError, match=r"`config` must have n_passes=2 and tile_tokens=128 with token_side='m' .*"
                       r"spills registers\), got n_passes=2, tile_tokens=64"):
        compile_mega_moe(GemmConfig(tile_tokens=64, **tokens_m), r128)
    with pytest.raises(ValueError, match=r"`config.decode` 'copy' .*with token_side='m', in the Mega MoE kernel of "
                       r"recipe \(1, 1, 128\)"):
        compile_mega_moe(GemmConfig(tile_tokens=128, **tokens_m), r32)
    with pytest.raises(ValueError, match=r"`config.decode` 'copy'"):
        compile_mega_moe(GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, decode="copy"), r128)
    # two-CTA clusters: the tokens-on-M tiles of recipe 128 only, on sizes whose weight tiles pair up
    one_launch = r"`config.cluster` must be 1 for the one-launch L1/L2 and Mega MoE kernels, or 2 for the Mega MoE kernel"
    with pytest.raises(ValueError, match=one_launch + r".* got 2 with token_side='n'"):
        compile_mega_moe(GemmConfig(tile_tokens=32, tile_n=256, mma="fp8", token_block=128, cluster=2), r128)
    with pytest.raises(ValueError, match=one_launch + r".* got 4 with token_side='m'"):
        compile_mega_moe(GemmConfig(tile_tokens=128, cluster=4, **tokens_m), r128)
    with pytest.raises(ValueError, match=one_launch + r".* got 2 with token_side='m'"):
        compile_mega_moe(GemmConfig(tile_tokens=128, cluster=2, **tokens_m), r32)
    odd = EpCommConfig(symm_buffer_layout(1, 8, 16, 2, 768, 512, recipe=(1, 1, 128)), False)
    with pytest.raises(ValueError, match=r"`config.cluster` 2 needs both GEMMs' weight tiles in pairs: 2 \* "
                       r"tile_n=512 must divide 2I=1024 and H=768"):
        compile_mega_moe(GemmConfig(tile_tokens=128, cluster=2, **tokens_m), odd)
