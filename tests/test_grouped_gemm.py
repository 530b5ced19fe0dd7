"""SM90 FP4 grouped GEMM (BF16 and FP8 MMA modes): CPU compile/validation/layout checks and GPU correctness.

CPU (CI): every kernel variant compiles for sm_90a, bad inputs raise ValueError naming the tensor, the
weight layouts + decodes emulate to the exact E2M1 (times scale) values. GPU (``-m gpu``): results against an
FP64 reference built from ``megamoe.layouts`` dequantization, poisoned outputs, padding never written; the
BF16-mode tests carry ``bf16`` in their names (``-k bf16``: about 8 compiles).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the first cutlass import (CPU compile)

import itertools
import struct

import pytest
import torch

from megamoe.kernels.weight_layout import (
    BF16_ACC_SHIFT,
    BF16_CODE_BITS,
    BF16_MAX_SCALE_CODE,
    BF16_MIN_SCALE_CODE,
    BF16_SCALE_FIELD_OFFSET,
    E4M3_LUT_HI,
    E4M3_LUT_LO,
    FOLD_LUT_HI,
    FOLD_LUT_LO,
    FOLD_MAX_SHIFT,
    FOLD_MIN_SHIFT,
    fold_fp8_scales,
    from_sm90_bf16_weight_layout,
    from_sm90_weight_layout,
    nonzero_blocks,
    to_sm90_bf16_weight_layout,
    to_sm90_weight_layout,
    unfold_fp8_scales,
)
from megamoe.kernels.sm90 import (
    TILE_COUNTER_SLOTS,
    GemmConfig,
    compile_grouped_gemm,
    compile_l1_l2,
    grouped_gemm_fp8_fp4_contiguous,
    grouped_gemm_fp8_fp4_l1_l2_contiguous,
    grouped_gemm_fp8_fp4_masked,
    grouped_gemm_fp8_fp4_swiglu_contiguous,
    grouped_gemm_fp8_fp4_swiglu_masked,
    prepare_fp4_weights,
    prepare_fp4_weights_l1,
    tile_counters,
    select_config,
    token_widths,
)
from megamoe.layouts import (
    contiguous_layout,
    dequantize_fp4,
    dequantize_fp8,
    pack_ue8m0,
    quantize_fp4,
    quantize_fp8,
    unpack_ue8m0,
)
from megamoe.layouts.fp4 import e2m1_table, pack_fp4_codes, unpack_fp4_codes
from megamoe.numerics import l1_epilogue, max_row_rel_error, moe_tolerances, rel_fro_error

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 (Hopper) CUDA GPU")


# ----------------------------------------------------------------------------------------------------
# CPU: compile, validation, layout/decode emulation
# ----------------------------------------------------------------------------------------------------

# Every code path of both MMA modes: each token tile (tile_tokens=8 has its own accumulator shape), one and
# two (and, BF16 mode, four) consumer warpgroups, one and two CTAs per SM, the three group modes, the five epilogues.
FP8 = {"mma": "fp8"}
COMPILE_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=32, tile_n=128, **FP8), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=64, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=8, tile_n=64, **FP8), "masked", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, stages=4, **FP8), "masked", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=128, **FP8), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=64, **FP8), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=16, tile_n=128, **FP8), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2, **FP8), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=64, **FP8), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, **FP8), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "offsets", "bf16"),
    (GemmConfig(tile_tokens=32, tile_n=128), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=64), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=64, stages=3), "masked", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=8, tile_n=64), "offsets_counts", "swiglu_fp8"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=64), "offsets_counts", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), "masked", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=32, tile_n=64), "offsets_counts", "bf16_scatter"),
    (GemmConfig(tile_tokens=16, tile_n=256), "offsets", "bf16"),
    (GemmConfig(tile_tokens=64, tile_n=256), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=32, tile_n=256), "offsets_counts", "swiglu_fp8_bf16"),
    (GemmConfig(tile_tokens=8, tile_n=256), "offsets", "bf16_scatter"),
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2"),
    (GemmConfig(tile_tokens=32, tile_n=64), "offsets", "l1_l2"),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "l1_l2"),
]
# FP8 mode with folded weight scales (``fold_fp8_scales``): every FP8 promotion path (8-row deferred, the
# alternating pair, wide tiles), both epilogues.
FOLDED_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=16, tile_n=64, **FP8), "masked", "swiglu_fp8"),
    (GemmConfig(tile_tokens=64, tile_n=128, **FP8), "offsets_counts", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, **FP8), "offsets", "bf16"),
    (GemmConfig(tile_tokens=128, tile_n=128, **FP8), "offsets", "swiglu_fp8"),
    (GemmConfig(tile_tokens=128, tile_n=64, **FP8), "masked", "bf16"),
]
# The one-launch Mega MoE kernel ("l1_l2" with the comm phases) for SymmBuffer layouts (symm_buffer_layout
# arguments: ranks, experts, T_max, top-k, H, I): every CTA-per-SM mode, four consumer warpgroups, a wide hidden size,
# 8 ranks.
MEGA_CASES = [
    (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), (2, 256, 64, 8, 4096, 2048)),
    (GemmConfig(tile_tokens=64, tile_n=128), (8, 256, 128, 8, 7168, 2048)),
    (GemmConfig(tile_tokens=16, tile_n=64, ctas_per_sm=2), (1, 8, 33, 3, 512, 1024)),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2), (2, 256, 128, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=32, tile_n=128, ctas_per_sm=2), (2, 384, 512, 6, 7168, 3072)),
    (GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3), (2, 256, 64, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=8, tile_n=256), (2, 256, 64, 6, 4096, 2048)),
    (GemmConfig(tile_tokens=32, tile_n=256), (2, 384, 512, 6, 7168, 3072)),
    (GemmConfig(tile_tokens=16, tile_n=256), (8, 256, 128, 8, 7168, 2048)),
]


# The fused launch's debug builds (timed waits, printf): their function call serializes the wgmmas, by design.
DEBUG_CASES = [(GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2", None),
               (GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2), "offsets", "l1_l2", MEGA_CASES[0][1])]
# SwiGLU epilogues with the IEEE exp and division (fast_math=False; every other case: approximate), the Mega MoE kernel
# included.
IEEE_SILU_CASES = [
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "swiglu_fp8_bf16", None),
    (GemmConfig(tile_tokens=16, tile_n=128, ctas_per_sm=2, **FP8), "masked", "swiglu_fp8", None),
    (GemmConfig(tile_tokens=128, tile_n=128), "offsets", "l1_l2", None),
    (MEGA_CASES[6][0], "offsets", "l1_l2", MEGA_CASES[6][1]),
]
# (config, group mode, epilogue, Mega MoE layout or None, trace build, folded FP8 scales, fast_math): the trace
# build is a release build too.
RELEASE_CASES = ([(c, m, e, None, False, False, True) for c, m, e in COMPILE_CASES]
                 + [(c, m, e, None, False, True, True) for c, m, e in FOLDED_CASES]
                 + [(c, "offsets", "l1_l2", lay, False, False, True) for c, lay in MEGA_CASES]
                 + [(MEGA_CASES[0][0], "offsets", "l1_l2", MEGA_CASES[0][1], True, False, True)]
                 + [(c, m, e, lay, False, False, False) for c, m, e, lay in IEEE_SILU_CASES])

_COMPILE_CHILD = """
import json, os, re, shutil, subprocess, sys
from megamoe import symm_buffer_layout
from megamoe.kernels.comm import EpCommConfig
from megamoe.kernels import sm90
ptxas, report = shutil.which("ptxas"), []
for i, (cfg, mode, epilogue, mega, debug, trace, folded, fast) in enumerate(json.loads(sys.argv[1])):
    try:
        cfg = sm90.GemmConfig(**cfg)
        if epilogue != "l1_l2":
            kernel = sm90.compile_grouped_gemm(cfg, mode, epilogue, folded, fast)
        elif mega is None:
            kernel = sm90.compile_l1_l2(cfg, debug, fast)
        else:
            kernel = sm90.compile_mega_moe(cfg, EpCommConfig(symm_buffer_layout(*mega), debug, True, trace), fast)
        ptx = kernel.__ptx__  # the PTX text
        ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).replace("\\0", "")
        build = {"wgmma": "wgmma.mma_async" in ptx, "calls": len(re.findall(r"^\\s*call(\\.uni)?\\s", ptx, re.M)),
                 "pdl": [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")],
                 # the memory instructions laid out before the (first) wait for the previous grid
                 "before_wait": sorted(set(re.findall(
                     r"^\\s*(?:@!?%p\\d+\\s+)?((?:ld|st|atom|red|cp|mbarrier|prefetch|fence|bar|membar)\\.[\\w.:]*)",
                     ptx[: ptx.find("griddepcontrol.wait")], re.M)))}
        if ptxas:  # its performance advisories (C75xx), e.g. C7510: wgmma serialized, and why
            path = os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], f"case{i}.ptx")
            open(path, "w").write(ptx)
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
            build["ptxas"] = [l for l in out.stderr.splitlines() if "(C75" in l or "error" in l]
        report.append(build)
    except Exception as exc:  # reported per case by the test
        report.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def sm90a_builds(tmp_path_factory):
    """Compile every case of RELEASE_CASES and DEBUG_CASES (debug) for sm_90a in one child process
    that keeps the PTX (the DSL reads its dump settings at import); per case: wgmma present, call count, and
    where a ``ptxas`` is on PATH, its C75xx advisories for that PTX."""
    import dataclasses
    import json
    import subprocess
    import sys

    cases = [(dataclasses.asdict(c), m, e, lay, False, trace, folded, fast)
             for c, m, e, lay, trace, folded, fast in RELEASE_CASES]
    cases += [(dataclasses.asdict(c), m, e, lay, True, False, False, True) for c, m, e, lay in DEBUG_CASES]
    # No file cache: a kernel loaded from it comes without its PTX.
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DISABLE_FILE_CACHING="1",
               CUTE_DSL_DUMP_DIR=str(tmp_path_factory.mktemp("ptx")))
    done = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

RELEASE_IDS = [f"{c.mma}-{c.tile_tokens}x{c.tile_n}x{c.ctas_per_sm}-{m}-{e}"
               + ("" if lay is None else "-mega-r%d-e%d-h%d" % (lay[0], lay[1], lay[4]))
               + ("-trace" if trace else "") + ("-folded" if folded else "") + ("" if fast else "-ieee-silu")
               for c, m, e, lay, trace, folded, fast in RELEASE_CASES]


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_compiles_for_sm90a_without_wgmma_serialization(sm90a_builds, case):
    """Every release variant compiles, issues wgmma, and calls no function: ptxas serializes every wgmma of a
    kernel that contains a call (C7510, "wgmma pipeline crossing function boundary"), e.g. a printf."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    assert build["wgmma"], "no wgmma.mma_async in the PTX"
    assert build["calls"] == 0, f"{build['calls']} function call(s) in the PTX: ptxas would serialize its wgmmas"


# Before ``griddepcontrol.wait`` a kernel may set up shared memory and read its parameters; a separate launch may
# also read the group bounds and TMA-prefetch weights into L2 (``prefetch_first_tile``: a guess, harmless if
# stale). Nothing else may touch global memory before the previous grid on the stream has finished.
BEFORE_WAIT_ALWAYS = ("ld.param.", "ld.shared.", "st.shared.", "mbarrier.init.", "fence.mbarrier_init.", "bar.sync",
                      "prefetch.tensormap")
BEFORE_WAIT_SEPARATE = ("ld.global.", "cp.async.bulk.prefetch.tensor.")


@pytest.mark.parametrize("case", range(len(RELEASE_CASES)), ids=RELEASE_IDS)
def test_programmatic_dependent_waits_before_global_memory(sm90a_builds, case):
    """Every release variant is launched as a programmatic dependent: one wait, one launch of the next grid, and
    before the wait only the memory instructions above (PTX layout order)."""
    build = sm90a_builds[case]
    assert "error" not in build, build.get("error")
    assert build["pdl"] == [1, 1], build["pdl"]
    separate = RELEASE_CASES[case][2] != "l1_l2"
    allowed = BEFORE_WAIT_ALWAYS + (BEFORE_WAIT_SEPARATE if separate else ())
    early = [op for op in build["before_wait"] if not op.startswith(allowed)]
    assert not early, f"global-memory instructions before griddepcontrol.wait: {early}"


def test_debug_builds_compile_and_the_call_check_sees_their_printf(sm90a_builds):
    for build in sm90a_builds[len(RELEASE_CASES):]:
        assert "error" not in build, build.get("error")
        assert build["wgmma"] and build["calls"] >= 1, build  # the check above can see a call


def test_ptxas_reports_no_wgmma_serialization(sm90a_builds):
    """Any cause ptxas names (a call, register shortage, an ill-formed pipeline), every release variant; the
    debug build's C7510 shows the check can see one. Needs a ptxas on PATH (the CUDA toolkit's)."""
    if "ptxas" not in sm90a_builds[0]:
        pytest.skip("no ptxas on PATH")
    advisories = {i: b["ptxas"] for i, b in enumerate(sm90a_builds[: len(RELEASE_CASES)]) if b["ptxas"]}
    assert not advisories, "ptxas advisories: " + "; ".join(
        f"{RELEASE_CASES[i][0].describe(RELEASE_CASES[i][2])} {RELEASE_CASES[i][1]} mega={RELEASE_CASES[i][3]} "
        f"trace={RELEASE_CASES[i][4]} fast_math={RELEASE_CASES[i][6]}: {a}"
        for i, a in advisories.items())
    for build in sm90a_builds[len(RELEASE_CASES):]:
        assert any("C7510" in line for line in build["ptxas"])


def test_compile_takes_fast_math_as_a_bool():
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        compile_grouped_gemm(GemmConfig(), "offsets", "swiglu_fp8", fast_math=None)


def test_token_widths():
    assert token_widths(8) == (8,) and token_widths(16) == (8, 16) and token_widths(32) == (16, 32)
    assert token_widths(64) == (32, 64)
    assert token_widths(128) == (32, 64, 96, 128)


def test_select_config():
    # BF16 mode up to 64-row token tiles: 256-row weight tiles (four consumer warpgroups) where N allows, but not for
    # the one-launch L1/L2 and Mega MoE kernels (four_warpgroups=False), which keep two CTAs per SM up to 32-row token tiles.
    assert select_config(1, 4096, 4096) == GemmConfig(tile_tokens=8, tile_n=256, ctas_per_sm=1, mma="bf16")
    assert select_config(1, 4096, 4096, four_warpgroups=False) == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="bf16")
    assert select_config(1, 4224, 4096) == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, mma="bf16")
    assert select_config(64, 7168, 3072).tile_n == 256 and select_config(65, 7168, 3072).tile_n == 128
    assert select_config(33, 4096, 4096).ctas_per_sm == 1
    assert select_config(16, 4096, 4096) == GemmConfig(tile_tokens=32, tile_n=256, ctas_per_sm=1, mma="bf16")
    assert select_config(16, 4096, 4096, four_warpgroups=False) == GemmConfig(tile_tokens=32, tile_n=128, ctas_per_sm=2)
    assert select_config(9, 4096, 4096).tile_tokens == 16 and select_config(10, 4096, 4096).tile_tokens == 32
    assert select_config(24, 4096, 4096).tile_tokens == 32
    assert select_config(1, 4096, 4096, mma="fp8") == GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=2, **FP8)
    assert select_config(33, 4096, 4096, mma="fp8").ctas_per_sm == 1
    assert select_config(12, 4096, 4096, mma="fp8").tile_tokens == 16
    # 8 rows expected at most 4 (+ 2 sd of a Poisson count <= 8), 16 beyond in BF16 mode (8-wide K loops for <= 8 rows)
    assert select_config(4, 4096, 4096).tile_tokens == 8 and select_config(4.5, 4096, 4096).tile_tokens == 16
    assert select_config(6, 4096, 4096, mma="fp8").tile_tokens == 8
    assert select_config(4096, 4096, 4096).tile_tokens == 128
    assert select_config(4096, 4096, 4096, mma="fp8").tile_tokens == 128
    assert select_config(64, 4096, 4096, mma="fp8").tile_tokens == 64
    assert select_config(64, 192, 512).tile_n == 64
    cfg = select_config(33, 4096, 2048)
    assert "tile_tokens=64" in cfg.describe() and "mma=bf16" in cfg.describe()
    assert cfg.num_stages() * cfg.chunks_per_stage() >= 4  # 128-K chunks in flight
    assert select_config(200, 4096, 4096).num_stages("swiglu_fp8") >= 3
    with pytest.raises(ValueError, match="`mma` must be one of"):
        select_config(1, 4096, 4096, mma="fp16")


def test_config_validation():
    with pytest.raises(ValueError, match="config.tile_tokens"):
        GemmConfig(tile_tokens=24)
    with pytest.raises(ValueError, match="config.tile_tokens"):
        GemmConfig(tile_tokens=256, mma="fp8")
    with pytest.raises(ValueError, match="config.tile_n"):
        GemmConfig(tile_n=192)
    for bad in (dict(tile_tokens=128), dict(mma="fp8"), dict(tile_tokens=16, ctas_per_sm=2)):  # four warpgroups' rules
        with pytest.raises(ValueError, match="config.tile_n` 256 needs mma='bf16', ctas_per_sm=1 and tile_tokens <= 64"):
            GemmConfig(tile_n=256, **bad)
    with pytest.raises(ValueError, match="config.tile_n` must be 64 or 128 for the one-launch L1/L2 kernel without Mega MoE"):
        compile_l1_l2(GemmConfig(tile_tokens=16, tile_n=256))
    with pytest.raises(ValueError, match="config.stages"):
        GemmConfig(stages=1)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=64, ctas_per_sm=2)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=32, ctas_per_sm=2, mma="fp8")
    with pytest.raises(ValueError, match="config.ctas_per_sm.*or 3 with tile_n=64"):
        GemmConfig(tile_tokens=8, tile_n=128, ctas_per_sm=3)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=16, tile_n=64, ctas_per_sm=3)
    with pytest.raises(ValueError, match="config.ctas_per_sm"):
        GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=3, mma="fp8")
    with pytest.raises(ValueError, match="config.mma"):
        GemmConfig(mma="int8")


def _cpu_inputs(m=40, n=128, k=512, e=3):
    a = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    a_sf = torch.zeros(m, k // 128, dtype=torch.int32)
    b = torch.zeros(e, n // 64, k // 128, 64, 64, dtype=torch.uint8)
    b_sf = torch.zeros(e, k // 128, n, dtype=torch.int32)
    offsets = torch.zeros(e + 1, dtype=torch.int32)
    return dict(a=a, a_sf=a_sf, b=b, b_sf=b_sf, offsets=offsets)


@pytest.mark.parametrize(
    "name,change,pattern",
    [
        ("a", lambda d: d.update(a=d["a"].to(torch.bfloat16)), "`a` must have dtype float8_e4m3fn"),
        ("a", lambda d: d.update(a=d["a"][:, :384].contiguous(), a_sf=d["a_sf"][:, :3].contiguous()), "of 512"),
        ("a", lambda d: d.update(a=d["a"].t().contiguous().t()), "`a` must be contiguous"),
        ("a_sf", lambda d: d.update(a_sf=d["a_sf"][:, :2]), "`a_sf` must have shape"),
        ("a_sf", lambda d: d.update(a_sf=d["a_sf"].to(torch.int64)), "`a_sf` must have dtype int32"),
        ("b", lambda d: d.update(b=from_sm90_weight_layout(d["b"])), "`b` must be 5-D"),
        ("b", lambda d: d.update(b=d["b"][..., :32].contiguous()), "SM90 fp8-mode weight layout"),
        ("b", lambda d: d.update(b=d["b"][:, :, :, :32].contiguous()), "SM90 fp8-mode weight layout"),
        ("b_sf", lambda d: d.update(b_sf=d["b_sf"][:2]), "`b_sf` must have shape"),
        ("b_sf", lambda d: d.update(b_sf=d["b_sf"].transpose(1, 2).contiguous()),
         r"`b_sf` must be the chunk-major scales \[E, K/128, N\] = \[3, 4, 128\]"),
        ("offsets", lambda d: d.update(offsets=d["offsets"][:-1]), "`offsets` must have shape"),
        ("offsets", lambda d: d.update(offsets=d["offsets"].long()), "`offsets` must have dtype int32"),
        ("out", lambda d: d.update(out=torch.empty(40, 128, dtype=torch.float32)), "`out` must have dtype bfloat16"),
        ("out", lambda d: d.update(out=torch.empty(41, 128, dtype=torch.bfloat16)), "`out` must have shape"),
        ("counts", lambda d: d.update(counts=torch.zeros(2, dtype=torch.int32)), "`counts` must have shape"),
        ("out_row_ptrs", lambda d: d.update(out_row_ptrs=torch.zeros(40, dtype=torch.int32)),
         "`out_row_ptrs` must have dtype int64"),
        ("out_row_ptrs", lambda d: d.update(out_row_ptrs=torch.zeros(39, dtype=torch.int64)),
         "`out_row_ptrs` must have shape"),
        ("out", lambda d: d.update(out=torch.empty(40, 128, dtype=torch.bfloat16),
                                   out_row_ptrs=torch.zeros(40, dtype=torch.int64)), "`out` must be None"),
        ("a", lambda d: None, "`a` must be a CUDA tensor"),  # all shapes right: the device check fires last
        ("a", lambda d: d.update(out_row_ptrs=torch.zeros(40, dtype=torch.int64)), "`a` must be a CUDA tensor"),
    ],
)
def test_contiguous_validation(name, change, pattern):
    args = _cpu_inputs()
    change(args)
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_contiguous(**args)


def _cpu_inputs_bf16(m=40, n=128, k=512, e=3):
    return {"a": torch.zeros(m, k, dtype=torch.bfloat16), "a_sf": None,
            "b": torch.zeros(e, n // 64, k // 128, 64, 16, dtype=torch.int32),
            "b_sf": torch.zeros(e, k // 128, n, dtype=torch.int32), "offsets": torch.zeros(e + 1, dtype=torch.int32)}


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda d: d.update(a=d["a"].to(torch.float8_e4m3fn)), "`a` must have dtype bfloat16 .*dequantize_fp8"),
        (lambda d: d.update(a_sf=torch.zeros(40, 4, dtype=torch.int32)), "`a_sf` must be None"),
        (lambda d: d.update(b=d["b"].float()), "`b` must be a kernel weight layout"),
        (lambda d: d.update(b=d["b"][..., :8].contiguous()), "SM90 bf16-mode weight layout"),
        (lambda d: d.update(config=GemmConfig(**FP8)), "config.mma"),
        (lambda d: d.update(a=d["a"][:, :384].contiguous()), "of 512"),
        (lambda d: None, "`a` must be a CUDA tensor"),  # all shapes right: the device check fires last
    ],
)
def test_bf16_mode_validation(change, pattern):
    args = _cpu_inputs_bf16()
    change(args)
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_contiguous(**args)


def test_fp8_mode_needs_token_scales():
    args = _cpu_inputs()
    args["a_sf"] = None
    with pytest.raises(ValueError, match="`a_sf` is required"):
        grouped_gemm_fp8_fp4_contiguous(**args)
    args = _cpu_inputs()
    with pytest.raises(ValueError, match="config.mma"):
        grouped_gemm_fp8_fp4_contiguous(**args, config=GemmConfig())


def test_masked_validation():
    e, max_m, k, n = 3, 16, 512, 64
    a = torch.zeros(e, max_m, k, dtype=torch.float8_e4m3fn)
    a_sf = torch.zeros(e, max_m, k // 128, dtype=torch.int32)
    b = torch.zeros(e, n // 64, k // 128, 64, 64, dtype=torch.uint8)
    b_sf = torch.zeros(e, k // 128, n, dtype=torch.int32)
    mm = torch.zeros(e, dtype=torch.int32)
    with pytest.raises(ValueError, match="`a` must have one slab per expert"):
        grouped_gemm_fp8_fp4_masked(a[:2], a_sf[:2], b, b_sf, mm)
    with pytest.raises(ValueError, match="`masked_m` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm[:2])
    with pytest.raises(ValueError, match="`a_sf` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf[:, :8], b, b_sf, mm)
    with pytest.raises(ValueError, match="`out` must have shape"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm, out=torch.empty(e, max_m + 1, n, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_masked(a, a_sf, b, b_sf, mm)


def test_swiglu_validation():
    args = _cpu_inputs(n=256)
    args["b"], args["b_sf"] = args["b"][:, :2].contiguous(), args["b_sf"][:, :, :128].contiguous()
    with pytest.raises(ValueError, match="multiple of 256"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40))
    args = _cpu_inputs(n=256)
    with pytest.raises(ValueError, match="`row_weights` must have shape"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(39))
    with pytest.raises(ValueError, match="`row_weights` must have dtype float32"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="`out_sf` must have shape"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            **args, row_weights=torch.zeros(40), out_sf=torch.zeros(40, 2, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="`clamp` must be positive"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), clamp=-1.0)
    with pytest.raises(ValueError, match="`out_dtype` must be torch.float8_e4m3fn"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="`out_sf` must be None with out_dtype=torch.bfloat16"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.bfloat16,
                                               out_sf=torch.zeros(40, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="`out` must have dtype bfloat16"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), out_dtype=torch.bfloat16,
                                               out=torch.zeros(40, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), fast_math=1)
    with pytest.raises(ValueError, match="`a` must be a CUDA tensor"):
        grouped_gemm_fp8_fp4_swiglu_contiguous(**args, row_weights=torch.zeros(40), clamp=7.0)


def _l1_l2_cpu_inputs(hidden=512, inter=512, m=40, e=3):
    """Valid-shaped CPU operands of the fused L1/L2 entry (BF16-mode layouts)."""
    z = torch.zeros
    return dict(
        a=z(m, hidden, dtype=torch.bfloat16),
        b1=z(e, 2 * inter // 64, hidden // 128, 64, 16, dtype=torch.int32), b1_sf=z(e, hidden // 128, 2 * inter, dtype=torch.int32),
        offsets=z(e + 1, dtype=torch.int32), row_weights=z(m),
        b2=z(e, hidden // 64, inter // 128, 64, 16, dtype=torch.int32), b2_sf=z(e, inter // 128, hidden, dtype=torch.int32),
        out_row_ptrs=z(m, dtype=torch.int64),
    )


@pytest.mark.parametrize("change,pattern", [
    (dict(b1=torch.zeros(3, 16, 4, 64, 64, dtype=torch.uint8)), "fused L1/L2 launch is BF16 mode only"),
    (dict(b2=torch.zeros(2, 8, 4, 64, 16, dtype=torch.int32)), "must hold the same 3 experts"),
    (dict(b2=torch.zeros(3, 8, 8, 64, 16, dtype=torch.int32)), "must hold K/128 = 4 chunks"),
    (dict(out_row_ptrs=torch.zeros(40, dtype=torch.int32)), "`out_row_ptrs` must have dtype int64"),
    (dict(row_weights=torch.zeros(39)), "`row_weights` must have shape"),
    (dict(sync=torch.zeros(4, dtype=torch.int32)), "`sync` must have shape"),
    (dict(act=torch.zeros(40, 512, dtype=torch.float32)), "`act` must have dtype bfloat16"),
    (dict(timeout_ns=-1), "`timeout_ns` must be"),
    ({}, "`a` must be a CUDA tensor"),
])
def test_l1_l2_validation(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**{**_l1_l2_cpu_inputs(), **change})
    with pytest.raises(ValueError, match=r"`I \(rows of b1 / 2\)` must be a multiple of 512"):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**_l1_l2_cpu_inputs(inter=256))
    with pytest.raises(TypeError, match="`fast_math` must be a bool"):
        grouped_gemm_fp8_fp4_l1_l2_contiguous(**_l1_l2_cpu_inputs(), fast_math="yes")


def _row_major(bk: torch.Tensor) -> torch.Tensor:
    """A blocked kernel layout ``[E, N/64, K/128, 64, W]`` as ``[E, N, K/128, W]`` (row n = 64 * block + r)."""
    e, blocks, chunks, rows, width = bk.shape
    return bk.transpose(2, 3).reshape(e, blocks * rows, chunks, width)


def test_weight_layout_roundtrip():
    b = torch.randint(0, 256, (2, 128, 256), dtype=torch.uint8)
    bk = to_sm90_weight_layout(b)
    assert bk.shape == (2, 2, 4, 64, 64)
    assert torch.equal(from_sm90_weight_layout(bk), b)
    with pytest.raises(ValueError, match="blocks of 64"):
        to_sm90_weight_layout(b[:, :96])


def test_weight_layouts_keep_a_row_block_chunk_contiguous():
    """Both layouts: the 64 rows x 64 bytes of one row block and K chunk are one contiguous 4 KiB piece, rows
    in order, each row's chunk as in the row-major form (checked against the canonical bytes of row 70)."""
    b = torch.randint(0, 256, (1, 128, 256), dtype=torch.uint8)
    fp8 = to_sm90_weight_layout(b)
    piece = fp8[0, 1, 2].reshape(-1)  # block 1 (rows 64..127), chunk 2
    assert piece.numel() == 4096 and fp8[0, 1, 2].is_contiguous()
    one_row = torch.zeros_like(b)
    one_row[0, 70] = b[0, 70]
    assert torch.equal(piece[6 * 64: 7 * 64], to_sm90_weight_layout(one_row)[0, 1, 2, 6])
    assert torch.equal(to_sm90_bf16_weight_layout(b)[0, 1, 2, 6], to_sm90_bf16_weight_layout(one_row)[0, 1, 2, 6])


def _prmt(lo: int, hi: int, sel: int) -> int:
    src = lo.to_bytes(4, "little") + hi.to_bytes(4, "little")
    out = bytearray(4)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        out[i] = (0xFF if byte & 0x80 else 0) if nib & 8 else byte
    return int.from_bytes(out, "little")


def _decode_word(x: int, lut_lo: int = E4M3_LUT_LO, lut_hi: int = E4M3_LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of ``decode_e2m1x8`` (same instruction sequence)."""
    mag = x & 0x77777777
    lo = _prmt(lut_lo, lut_hi, mag)
    hi = _prmt(lut_lo, lut_hi, mag >> 16)
    shifted = (x << 4) & 0xFFFFFFFF
    return lo | (_prmt(shifted, x, 0x5140) & 0x80808080), hi | (_prmt(shifted, x, 0x7362) & 0x80808080)


def test_decode_emulation_matches_e2m1():
    """Kernel layout + per-thread decode reassemble the exact E2M1 values in wgmma A-fragment order:
    thread (warp w, lane l) owns rows 16w + l//4 (+8), k = 32kb + 16h + 4(l%4) + i."""
    torch.manual_seed(0)
    rows, k = 64, 256
    b = torch.randint(0, 256, (1, rows, k // 2), dtype=torch.uint8)
    words = _row_major(to_sm90_weight_layout(b)).view(torch.int32)[0]  # [rows, K/128, 16 words]
    expect = e2m1_table()[unpack_fp4_codes(b[0]).long()]  # [rows, K]
    got = torch.full((rows, k), float("nan"))
    for chunk in range(k // 128):
        for warp in range(4):
            for lane in range(32):
                g, q = lane // 4 + 16 * warp, lane % 4
                for r in range(2):
                    for kb in range(4):
                        word = int(words[g + 8 * r, chunk, 4 * q + kb]) & 0xFFFFFFFF
                        for h, reg in enumerate(_decode_word(word)):
                            vals = torch.tensor(list(struct.pack("<I", reg)), dtype=torch.uint8)
                            k0 = chunk * 128 + 32 * kb + 16 * h + 4 * q
                            got[g + 8 * r, k0 : k0 + 4] = vals.view(torch.float8_e4m3fn).float()
    assert torch.equal(got, expect), (got != expect).nonzero()[:10]


def _fold_luts(word: int, kb: int) -> tuple[int, int]:
    """Bit-exact Python model of the device ``fold_luts`` (permute, multiply-add)."""
    rep_lo = _prmt(word, 0, (kb << 12) | (kb << 8) | (kb << 4) | 4)
    rep_hi = _prmt(word, 0, kb * 0x1111)
    return (rep_lo * 8 + FOLD_LUT_LO) & 0xFFFFFFFF, (rep_hi * 8 + FOLD_LUT_HI) & 0xFFFFFFFF


def test_folded_decode_emulation_is_exact():
    """Folded FP8 mode: for every relative exponent d of the window, in every byte of the scale word, every
    E2M1 code (both signs) decodes to the E4M3 ``v * 2**d`` exactly (torch's E4M3 and E2M1 tables)."""
    table = e2m1_table().double()
    words = [0x12345678 & 0x0B0B0B0B]  # a mix of biased codes in the other bytes
    for d in range(FOLD_MIN_SHIFT, FOLD_MAX_SHIFT + 1):
        biased = d - FOLD_MIN_SHIFT
        for kb in range(4):
            word = (words[0] & ~(0xFF << (8 * kb))) | (biased << (8 * kb))
            lut_lo, lut_hi = _fold_luts(word, kb)
            for first in range(0, 16, 8):  # codes 0-7 then 8-15 as the word's 8 nibbles
                x = sum((first + i) << (4 * i) for i in range(8))
                regs = _decode_word(x, lut_lo, lut_hi)
                got = torch.tensor(list(struct.pack("<II", *regs)), dtype=torch.uint8).view(torch.float8_e4m3fn)
                want = table[first : first + 8] * 2.0**d
                assert torch.equal(got.double(), want), (d, kb, got, want)
                assert not torch.isnan(got.float()).any()


def _foldable_weights(e: int, n: int, k: int, gen: torch.Generator, device="cpu", spread: int = 11, top: int = 124):
    """Canonical FP4 weights, every E2M1 code in random blocks, scale codes ``top - spread .. top`` uniformly per
    32-block (a row then spans up to ``spread`` binades: 11 = the folded window, both ends likely used), some
    blocks all zero with code 0."""
    codes = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    scale = torch.randint(top - spread, top + 1, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    zero = torch.rand(e, n, k // 32, generator=gen) < 0.03
    codes.view(e, n, k // 32, 32)[zero] = 0
    scale[zero] = 0
    return pack_fp4_codes(codes).to(device), pack_ue8m0(scale).to(device)


def test_nonzero_blocks():
    """``nonzero_blocks`` (one expert at a time) marks exactly the 32-blocks whose dequantized values are not all
    zero: random weights with ~3% all-zero blocks, over three experts."""
    gen = torch.Generator().manual_seed(11)
    b, b_sf = _foldable_weights(3, 64, 512, gen)
    want = dequantize_fp4(b, b_sf).reshape(3, 64, 16, 32).ne(0).any(-1)
    assert 0 < int((~want).sum()) < want.numel()
    assert torch.equal(nonzero_blocks(b), want)


def test_fold_fp8_scales():
    """Folded scales round-trip on every nonzero block; the row scale is 2**(max - 6 - 127); a spread of 12
    binades or an all-zero row's default base behave as documented; ``prepare_fp4_weights``'s ``fold``."""
    gen = torch.Generator().manual_seed(5)
    b, b_sf = _foldable_weights(2, 64, 512, gen)
    folded = fold_fp8_scales(b, b_sf)
    assert folded.shape == (2, 5, 64) and folded.dtype == torch.int32
    codes = unpack_ue8m0(b_sf).long()
    nonzero = (unpack_fp4_codes(b) & 7).reshape(2, 64, 16, 32).amax(-1) > 0
    assert torch.equal(unpack_ue8m0(unfold_fp8_scales(folded))[nonzero].long(), codes[nonzero])
    top = torch.where(nonzero, codes, -1).amax(-1)
    assert torch.equal(folded[:, -1].view(torch.float32).double().t(), torch.exp2(top - FOLD_MAX_SHIFT - 127.0).t())
    biased = unpack_ue8m0(folded[:, :-1].contiguous()).long()
    assert int(biased.max()) <= FOLD_MAX_SHIFT - FOLD_MIN_SHIFT
    assert int(biased.min()) == 0 and int(biased.max()) == FOLD_MAX_SHIFT - FOLD_MIN_SHIFT  # both window ends used
    # An all-zero row folds (scale 1); one block 12 binades below its row's top does not.
    zero_row = b.clone()
    zero_row[1, 7] = 0
    assert fold_fp8_scales(zero_row, b_sf)[1, -1, 7].view(torch.float32) == 1.0
    wide = codes.clone().to(torch.uint8)
    row_nonzero = nonzero[0, 3].nonzero().flatten()
    wide[0, 3, row_nonzero[0]] = int(top[0, 3]) - FOLD_MAX_SHIFT + FOLD_MIN_SHIFT - 1
    assert fold_fp8_scales(b, pack_ue8m0(wide)) is None
    bk, bk_sf = prepare_fp4_weights(b, pack_ue8m0(wide))  # fold=None: absolute scales
    assert torch.equal(bk_sf, pack_ue8m0(wide).transpose(1, 2))
    with pytest.raises(ValueError, match="`b_sf` cannot be folded"):
        prepare_fp4_weights(b, pack_ue8m0(wide), fold=True)
    assert torch.equal(prepare_fp4_weights(b, b_sf)[1], folded)
    assert torch.equal(prepare_fp4_weights(b, b_sf, fold=False)[1], b_sf.transpose(1, 2))
    with pytest.raises(ValueError, match="`fold` applies to mma='fp8' only"):
        prepare_fp4_weights(b, b_sf, mma="bf16", fold=True)


def test_bf16_weight_layout_roundtrip():
    b = torch.randint(0, 256, (2, 128, 256), dtype=torch.uint8)
    bk = to_sm90_bf16_weight_layout(b)
    assert bk.shape == (2, 2, 4, 64, 16) and bk.dtype == torch.int32
    assert torch.equal(from_sm90_bf16_weight_layout(bk), b)


def _bf16_half(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_rne(x: float) -> int:
    """float -> BF16 bits, round to nearest even (through FP32: exact for the products modelled here)."""
    f = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF


def _mul_bf16x2(a: int, b: int) -> int:
    """``mul.rn.bf16x2``: both halves, exact product rounded once (subnormals kept)."""
    lo = _to_bf16_rne(_bf16_half(a) * _bf16_half(b))
    hi = _to_bf16_rne(_bf16_half(a >> 16) * _bf16_half(b >> 16))
    return lo | (hi << 16)


def _bf16_multiplier(codes: list[int], kb: int) -> int:
    """Model of ``ue8m0_to_bf16_multiplier_pair`` on the packed scale word of ``codes`` (4 UE8M0 codes, byte i =
    code i) for block pair ``kb // 2``, then of ``decode_e2m1x8_bf16``'s broadcast of half ``kb % 2``."""
    word = sum(c << (8 * i) for i, c in enumerate(codes))
    sel = 0x4140 + 0x202 * (kb // 2)
    src = word.to_bytes(4, "little") + bytes(4)
    placed = int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")
    pair = (placed * 0x80 + BF16_SCALE_FIELD_OFFSET * 0x00800080) & 0xFFFFFFFF
    half = (pair >> (16 * (kb % 2))) & 0xFFFF
    return half | (half << 16)


def _decode_word_bf16(x: int, mult: int) -> tuple[int, int, int, int]:
    """Bit-exact Python model of ``decode_e2m1x8_bf16`` (same instruction sequence)."""
    m32 = 0xFFFFFFFF
    d0 = _mul_bf16x2((x << 6) & m32 & 0x81C081C0, mult)
    d1 = _mul_bf16x2((x << 2) & m32 & 0x81C081C0, mult)
    d2 = _mul_bf16x2(((x >> 4) | (x << 28)) & m32 & 0x81C081C0, mult)
    d3 = _mul_bf16x2((x & 0x81808180) | ((x >> 8) & 0x00400040), mult)
    return d0, d1, d2, d3


def test_bf16_layout_needs_one_split_register():
    """The BF16-mode layout's claim: no four rotations of one window (code bits m, e0, e1 at BF16 bits 6-8,
    the sign at 15, both halves) tile a 32-bit word, so at least one register needs a second window; three
    do tile part of it, as ``BF16_CODE_BITS`` uses, and its fourth register covers exactly the rest."""
    window = {6, 7, 8, 15, 22, 23, 24, 31}
    translates = [frozenset((p - r) % 32 for p in window) for r in range(32)]
    assert not any(
        len(a | b | c | d) == 32 for a, b, c, d in itertools.combinations(translates, 4)
    )
    layout = [frozenset((p + 16 * i) % 32 for p in bits for i in range(2)) for bits in BF16_CODE_BITS]
    assert all(layout[j] in translates for j in range(3)) and layout[3] not in translates
    assert len(frozenset().union(*layout)) == 32


def _bf16_decode_case(rows=64, k=256, seed=0, low=BF16_MIN_SCALE_CODE):
    """Canonical FP4 weights covering every E2M1 code in every 32-block, scale codes sweeping
    ``[low, BF16_MAX_SCALE_CODE]`` (by default the BF16 mode's whole exact range) and all-zero blocks with
    codes below ``BF16_MIN_SCALE_CODE``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = rows * k // 32
    codes = torch.stack([torch.randperm(32, generator=gen) % 16 for _ in range(blocks)]).to(torch.uint8)
    in_range = torch.arange(low, BF16_MAX_SCALE_CODE + 1)
    scale = in_range[torch.arange(blocks) % in_range.numel()]
    zero = torch.arange(blocks) % 37 == 5  # all-zero blocks, scale codes below the range
    codes[zero] = codes[zero] & 8
    scale[zero] = torch.arange(int(zero.sum())) % BF16_MIN_SCALE_CODE
    perm = torch.randperm(blocks, generator=gen)
    codes, scale = codes[perm].reshape(1, rows, k), scale[perm].to(torch.uint8).reshape(1, rows, k // 32)
    return pack_fp4_codes(codes), pack_ue8m0(scale)


def test_bf16_decode_emulation_matches_dequantize():
    """BF16-mode layout + per-thread decode + scale multiplier reassemble ``dequantize_fp4 * 2**-P`` bit for bit
    (every code, -0 included, every exact scale code) in wgmma bf16 A-fragment order: thread (warp w, lane l)
    owns rows 16w + l//4 (+8), k = 16kk + 8h + 2(l%4) + i, register (kk, h) holding i = 0, 1."""
    rows, k = 64, 256
    b, b_sf = _bf16_decode_case(rows, k)
    words = _row_major(to_sm90_bf16_weight_layout(b))[0]  # [rows, K/128, 16]
    sf = unpack_ue8m0(b_sf[0])  # [rows, K/32] codes
    expect = (dequantize_fp4(b, b_sf)[0] * 2.0**-BF16_ACC_SHIFT).to(torch.bfloat16).view(torch.int16)
    got = torch.zeros(rows, k, dtype=torch.int32) - 1
    for chunk in range(k // 128):
        for warp in range(4):
            for lane in range(32):
                g, q = lane // 4 + 16 * warp, lane % 4
                for r in range(2):
                    row = g + 8 * r
                    for kb in range(4):
                        word = int(words[row, chunk, 4 * q + kb]) & 0xFFFFFFFF
                        mult = _bf16_multiplier(sf[row, 4 * chunk: 4 * chunk + 4].tolist(), kb)
                        for j, reg in enumerate(_decode_word_bf16(word, mult)):
                            k0 = chunk * 128 + 32 * kb + 16 * (j // 2) + 8 * (j % 2) + 2 * q
                            got[row, k0], got[row, k0 + 1] = reg & 0xFFFF, reg >> 16
    expect = expect.to(torch.int32) & 0xFFFF
    bad = (got != expect).nonzero()
    assert not bad.numel(), (
        f"{bad.shape[0]} mismatches; first (row, k, code, scale code, got, want): "
        + str([(r, c, int(unpack_fp4_codes(b[0])[r, c]), int(sf[r, c // 32]), hex(int(got[r, c])), hex(int(expect[r, c])))
               for r, c in bad[:8].tolist()])
    )


def test_bf16_prepare_checks_the_scale_range():
    b, b_sf = _bf16_decode_case(64, 128, seed=1)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    assert torch.equal(bk, to_sm90_bf16_weight_layout(b)) and torch.equal(bk_sf, b_sf.transpose(1, 2))
    codes = unpack_ue8m0(b_sf).clone()
    codes[0, 3, 1] = BF16_MAX_SCALE_CODE + 1
    with pytest.raises(ValueError, match=r"`b_sf` has UE8M0 codes above .* \[0, 3, 1\]"):
        prepare_fp4_weights(b, pack_ue8m0(codes), mma="bf16")
    codes = unpack_ue8m0(b_sf).clone()
    nonzero = (unpack_fp4_codes(b) & 7).reshape(1, 64, 4, 32).amax(-1) > 0
    e, r, blk = nonzero.nonzero()[0].tolist()
    codes[e, r, blk] = BF16_MIN_SCALE_CODE - 1
    with pytest.raises(ValueError, match="`b_sf` has UE8M0 codes below"):
        prepare_fp4_weights(b, pack_ue8m0(codes), mma="bf16")
    with pytest.raises(ValueError, match="`mma` must be one of"):
        prepare_fp4_weights(b, b_sf, mma="bf8")


# ----------------------------------------------------------------------------------------------------
# GPU correctness
# ----------------------------------------------------------------------------------------------------


def _random_tokens(m: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 tokens whose 32-blocks span many scales (exercises per-block scale indexing)."""
    x = torch.randn(m, k // 32, 32, generator=gen)
    x = x * torch.exp2(torch.randint(-6, 7, (m, k // 32, 1), generator=gen).float())
    return quantize_fp8(x.reshape(m, k).to(device), name="tokens")


def _random_weights(e: int, n: int, k: int, gen: torch.Generator, device):
    w = torch.randn(e, n, k // 32, 32, generator=gen)
    w = w * torch.exp2(torch.randint(-6, 7, (e, n, k // 32, 1), generator=gen).float())
    return quantize_fp4(w.reshape(e, n, k).to(device), name="weights")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at |x| (float64), the smallest normal's ulp at 0."""
    ax = x.abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(ax)) - 7)


def _tokens64(a: torch.Tensor, a_sf: torch.Tensor | None) -> torch.Tensor:
    """Exact token values: FP8 + scales dequantized, or BF16 tokens (a_sf None) as they are."""
    return (a if a_sf is None else dequantize_fp8(a, a_sf)).double()


def _check_rows(out: torch.Tensor, a, a_sf, b, b_sf, row_expert: torch.Tensor, what: str) -> None:
    """Rows with ``row_expert >= 0`` against the FP64 reference; all other rows must still be NaN. ``a_sf``
    None: BF16 tokens (BF16 mode)."""
    a64 = _tokens64(a, a_sf)
    w64 = dequantize_fp4(b, b_sf).double()
    valid = (row_expert >= 0).nonzero().flatten()
    untouched = (row_expert < 0).nonzero().flatten()
    problems = []
    if untouched.numel():
        written = ~torch.isnan(out[untouched].float()).all(dim=1)
        if written.any():
            problems.append(f"padding rows written: {untouched[written][:20].tolist()}")
    if valid.numel():
        ref = torch.empty(valid.numel(), out.shape[1], dtype=torch.float64, device=out.device)
        absprod = torch.empty_like(ref)
        for e in row_expert[valid].unique().tolist():
            sel = row_expert[valid] == e
            rows = valid[sel]
            ref[sel] = a64[rows] @ w64[e].T
            absprod[sel] = a64[rows].abs() @ w64[e].abs().T
        got = out[valid].double()
        ref_bf16 = ref.to(torch.bfloat16).double()
        err = (got - ref_bf16).abs()
        # Two BF16 ulps (rounding flips from FP32 summation order) plus the FP8 wgmma's own sum: inside
        # one k32 instruction the exact products are aligned to the largest and kept to about 13
        # fraction bits (truncated, so the error is biased and adds up linearly over the K blocks):
        # at most ~2**-13 of sum |a*b|. It matters only for cancelling sums.
        tol = 2 * _bf16_ulp(ref) + 2.0**-13 * absprod
        bad = ~(err <= tol)  # NaN counts as bad
        den = ref_bf16.norm()
        rel_fro = float((got - ref_bf16).norm() / den) if den > 0 else float((got - ref_bf16).norm())
        if not rel_fro < 1e-3:
            problems.append(f"relative Frobenius error {rel_fro:.3e} >= 1e-3")
        if bad.any():
            idx = bad.nonzero()
            nan = int(torch.isnan(got).sum())
            bad_rows = valid[idx[:, 0].unique()]
            bad_cols = idx[:, 1].unique()
            ratio = (err / tol).nan_to_num(float("inf"))
            worst = ratio.flatten().topk(min(8, ratio.numel())).indices
            lines = [
                f"{int(bad.sum())} of {bad.numel()} elements out of tolerance ({nan} NaN)",
                f"bad rows ({bad_rows.numel()}): {bad_rows[:24].tolist()} "
                f"experts {row_expert[bad_rows].unique().tolist()}",
                f"bad cols ({bad_cols.numel()}): {bad_cols[:24].tolist()} (col % 64 histogram "
                f"{torch.bincount(bad_cols % 64, minlength=64).nonzero().flatten().tolist()[:16]})",
            ]
            for flat in worst.tolist():
                i, j = divmod(flat, ratio.shape[1])
                lines.append(
                    f"  row {int(valid[i])} (expert {int(row_expert[valid[i]])}) col {j}: got {float(got[i, j]):.6g} "
                    f"ref {float(ref[i, j]):.6g} err/tol {float(ratio[i, j]):.3g}"
                )
            problems.append("\n".join(lines))
    assert not problems, f"{what}:\n" + "\n".join(problems)


def _contiguous_case(counts, n, k, lead_pad, tail_pad, gen, device="cuda", alignment=1):
    """Tokens in the contiguous layout; padding rows (between/around groups) hold NaN bytes."""
    e = len(counts)
    group = torch.cat([torch.full((c,), i, dtype=torch.int64) for i, c in enumerate(counts)])
    layout = contiguous_layout(group, e, alignment=alignment)
    m = lead_pad + layout.num_rows + tail_pad
    a, a_sf = _random_tokens(m, k, gen, device)
    row_expert = torch.full((m,), -1, dtype=torch.int64)
    row_expert[layout.row_index + lead_pad] = group
    pad = (row_expert < 0).to(device)
    a.view(torch.uint8)[pad] = 0x7F  # NaN in E4M3: any leak into a stored row shows
    a_sf.view(torch.uint8)[pad] = 0xFF  # NaN-scale code
    offsets = (layout.offsets + lead_pad).to(torch.int32).to(device)
    return a, a_sf, offsets, layout.counts.to(device), row_expert.to(device)


# (tile_tokens, tile_n, ctas, fold): absolute scales on every tile config; folded on every FP8 promotion path.
RAGGED_CASES = ([(t, n, c, False) for t, c in [(8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (8, 2), (16, 2)]
                 for n in (64, 128)]
                + [(8, 128, 2, True), (16, 64, 1, True), (32, 128, 1, True), (64, 128, 1, True), (128, 128, 1, True),
                   (128, 64, 1, True)])


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas,fold", RAGGED_CASES)
def test_contiguous_ragged(tile_tokens, tile_n, ctas, fold):
    """Empty and one-row groups, partial last tiles, exact 64- and 128-row tiles, 130 rows over two 128-row tiles.
    Absolute weight scales (rows spanning more binades than the folded window) or folded ones (rows spanning the
    whole 12-binade window, all-zero blocks)."""
    gen = torch.Generator().manual_seed(1000 + tile_tokens + tile_n + 2000 * fold)
    counts, n, k = [0, 1, 37, 5, 0, 130, 64, 1, 9, 128], 256, 1024
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, lead_pad=3, tail_pad=11, gen=gen)
    b, b_sf = (_foldable_weights if fold else _random_weights)(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, fold=fold)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, **FP8)
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous fold={fold} {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,ctas", [(8, 2), (128, 1)])
def test_folded_decode_exact_on_device(tile_tokens, ctas):
    """One-hot FP8 tokens (1.0, scale 2**0) read the folded decode back: out[m, n] = w[n, m] exactly for every
    E2M1 code, both ends of the window and all-zero blocks."""
    gen = torch.Generator().manual_seed(8)
    n, k = 128, 512
    b, b_sf = _foldable_weights(1, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, fold=True)
    a = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)
    a_sf = torch.full((k, k // 128), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
    out = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, k], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, ctas_per_sm=ctas, **FP8)
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    got, want = out.T.float().cpu(), dequantize_fp4(b, b_sf)[0].cpu()
    bad = ~(got == want)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} decoded weights differ; first (row, k): "
                           f"{bad.nonzero()[:8].tolist()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("n,k", [(64, 512), (192, 1536), (512, 2048), (128, 4096)])
def test_contiguous_shapes_default_config(n, k):
    gen = torch.Generator().manual_seed(n + k)
    counts = [17, 0, 200, 3, 64]
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, lead_pad=0, tail_pad=5, gen=gen)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out)
    torch.cuda.synchronize()
    cfg = select_config(a.shape[0] / len(counts), n, k, mma="fp8")
    _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous N={n} K={k} {cfg.describe()}")


@gpu
@needs_sm90
def test_contiguous_aligned_groups_with_counts():
    """``contiguous_layout`` with alignment 32 leaves padding inside [offsets[e], offsets[e+1]); passing
    ``counts`` keeps it unwritten."""
    gen = torch.Generator().manual_seed(7)
    counts, n, k = [5, 0, 33, 1, 64], 128, 512
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, 0, 0, gen, alignment=32)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    for cfg in (GemmConfig(tile_tokens=8, **FP8), GemmConfig(tile_tokens=32, **FP8)):
        out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg, counts=cnt)
        torch.cuda.synchronize()
        _check_rows(out, a, a_sf, b, b_sf, row_expert, f"contiguous+counts {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens", [8, 64, 128])
def test_masked(tile_tokens):
    gen = torch.Generator().manual_seed(99 + tile_tokens)
    masked = [0, 1, 70, 33, 8]
    e, max_m, n, k = len(masked), 70, 192, 1024
    a, a_sf = _random_tokens(e * max_m, k, gen, "cuda")
    row_expert = torch.full((e, max_m), -1, dtype=torch.int64)
    for i, c in enumerate(masked):
        row_expert[i, :c] = i
    row_expert = row_expert.flatten().cuda()
    pad = row_expert < 0
    a.view(torch.uint8)[pad] = 0x7F
    a_sf.view(torch.uint8)[pad] = 0xFF
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    out = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=64, **FP8)
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    grouped_gemm_fp8_fp4_masked(
        a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf, masked_m, out=out, config=cfg
    )
    torch.cuda.synchronize()
    _check_rows(out.view(e * max_m, n), a, a_sf, b, b_sf, row_expert, f"masked {cfg.describe()}")


def _check_graph_replay(call, offsets, out, operands, bounds_list) -> None:
    """Capture ``call`` in a CUDA graph, then replay it with new group bounds written into ``offsets`` on
    the device and check every replay (rows outside all groups must stay poisoned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    m = out.shape[0]
    for bounds in bounds_list:
        offsets.copy_(torch.tensor(bounds, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        row_expert = torch.full((m,), -1, dtype=torch.int64)
        for i in range(len(bounds) - 1):
            row_expert[bounds[i] : bounds[i + 1]] = i
        _check_rows(out, *operands, row_expert.cuda(), f"graph replay offsets={bounds}")


@gpu
@needs_sm90
def test_cuda_graph_reads_sizes_on_device():
    """Captured once, replayed with different group sizes written into ``offsets`` on the device."""
    gen = torch.Generator().manual_seed(5)
    e, n, k, m = 4, 128, 512, 96
    a, a_sf = _random_tokens(m, k, gen, "cuda")
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    offsets = torch.tensor([0, 10, 10, 50, 96], dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=16, **FP8)
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg)  # compile outside capture
    _check_graph_replay(lambda: grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out, config=cfg),
                        offsets, out, (a, a_sf, b, b_sf), ([0, 10, 10, 50, 96], [4, 5, 60, 61, 90]))


@gpu
@needs_sm90
def test_tiles_from_counters_repeated_and_on_two_streams():
    """Separate launches take their tiles from per-stream counters that every launch leaves zero: many tiles
    per CTA (768 tiles), repeated launches, a graph replayed three times, and two launches in flight at once on
    two streams, each output poisoned first and checked."""
    gen = torch.Generator().manual_seed(21)
    counts, n, k = [20] * 16, 1024, 512
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, n, k, 0, 0, gen)
    a = dequantize_fp8(a, a_sf, torch.bfloat16)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    cfg = GemmConfig(tile_tokens=8, tile_n=64, ctas_per_sm=2)
    side = torch.cuda.Stream()
    main_counters = tile_counters(a.device).data_ptr()
    assert tile_counters(a.device).data_ptr() == main_counters
    with torch.cuda.stream(side):
        assert tile_counters(a.device).data_ptr() != main_counters
    # torch hands out pooled streams (32 per priority in torch 2.11): one pair per distinct handle; with the default
    # stream's, more pairs than one allocation holds.
    streams = [torch.cuda.Stream(priority=p) for p in (0, -1) for _ in range(TILE_COUNTER_SLOTS)]
    handles, pairs = set(), set()
    for st in streams:
        with torch.cuda.stream(st):
            handles.add(st.cuda_stream)
            pairs.add(tile_counters(a.device).data_ptr())
    assert len(pairs) == len(handles) and main_counters not in pairs
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
    call = lambda o: grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=o, config=cfg)  # noqa: E731
    for i in range(3):
        out.fill_(float("nan"))
        call(out)
        torch.cuda.synchronize()
        _check_rows(out, a, None, b, b_sf, row_expert, f"launch {i}")
    assert tile_counters(a.device).tolist() == [0, 0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for i in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_rows(out, a, None, b, b_sf, row_expert, f"graph replay {i}")
    out2 = torch.full_like(out, float("nan"))
    out.fill_(float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    call(out)
    with torch.cuda.stream(side):
        call(out2)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, "main stream, side stream in flight")
    _check_rows(out2, a, None, b, b_sf, row_expert, "side stream, main stream in flight")


@gpu
@needs_sm90
def test_empty_inputs():
    e, n, k = 3, 64, 512
    gen = torch.Generator().manual_seed(3)
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf)
    a = torch.empty(0, k, dtype=torch.float8_e4m3fn, device="cuda")
    a_sf = torch.empty(0, k // 128, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    assert grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets).shape == (0, n)
    # rows exist but every group is empty: nothing may be written
    a, a_sf = _random_tokens(20, k, gen, "cuda")
    out = torch.full((20, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, a_sf, bk, bk_sf, offsets, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()


def _check_swiglu(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp, what):
    """FP8 SwiGLU rows against ``numerics.l1_epilogue`` of the FP64 GEMM; other rows keep their poison.
    ``a_sf`` None: BF16 tokens (BF16 mode)."""
    a64 = _tokens64(a, a_sf)
    w64 = dequantize_fp4(w1, w1_sf).double()
    valid = (row_expert >= 0).nonzero().flatten()
    untouched = (row_expert < 0).nonzero().flatten()
    problems = []
    if untouched.numel():
        written = (out[untouched].view(torch.uint8) != 0x7F).any(dim=1) | (out_sf[untouched] != -1).any(dim=1)
        if written.any():
            problems.append(f"padding rows written: {untouched[written][:20].tolist()}")
    if valid.numel():
        acc = torch.empty(valid.numel(), w64.shape[1], dtype=torch.float64, device=out.device)
        for e in row_expert[valid].unique().tolist():
            sel = row_expert[valid] == e
            acc[sel] = a64[valid[sel]] @ w64[e].T
        ref_q, ref_sf = l1_epilogue(acc, row_weights[valid], clamp, fp8=True)
        got = dequantize_fp8(out[valid], out_sf[valid])
        ref = dequantize_fp8(ref_q, ref_sf)
        fro, row = rel_fro_error(got, ref), max_row_rel_error(got, ref)
        same = float((out[valid].view(torch.uint8) == ref_q.view(torch.uint8)).float().mean())
        same_sf = float((out_sf[valid] == ref_sf).float().mean())
        tol = moe_tolerances(ref.shape[1])
        if not (fro <= tol["rel_fro"] and row <= tol["max_row_rel"] and same >= 0.99):
            diff = (got - ref).abs()
            worst_rows = diff.norm(dim=1).topk(min(5, diff.shape[0])).indices
            cols = (out[valid].view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()[:, 1]
            problems.append(
                f"rel_fro={fro:.3e} (tol {tol['rel_fro']:.1e}) max_row_rel={row:.3e} (tol {tol['max_row_rel']:.1e}) "
                f"identical fp8 bytes {100 * same:.2f}% scales {100 * same_sf:.2f}%; worst rows "
                f"{valid[worst_rows].tolist()}; mismatching columns (first 24) {cols.unique()[:24].tolist()} "
                f"(col % 64 set {sorted(set((cols % 64).tolist()))[:16]})"
            )
    assert not problems, f"{what}:\n" + "\n".join(problems)


@gpu
@needs_sm90
@pytest.mark.parametrize(
    "tile_tokens,tile_n,clamp,ctas,fold", [(8, 128, None, 1, False), (64, 128, 7.0, 1, False), (16, 64, None, 1, True),
                                           (32, 64, 3.0, 1, False), (16, 128, 2.0, 2, True), (128, 128, 5.0, 1, True),
                                           (128, 128, None, 1, False)]
)
def test_swiglu_contiguous(tile_tokens, tile_n, clamp, ctas, fold):
    gen = torch.Generator().manual_seed(31 + tile_tokens + tile_n)
    counts, inter, k = [0, 1, 37, 5, 0, 130, 64, 1], 256, 1024
    a, a_sf, offsets, _, row_expert = _contiguous_case(counts, 2 * inter, k, lead_pad=2, tail_pad=9, gen=gen)
    make = _foldable_weights if fold else _random_weights
    w1, w1_sf = make(len(counts), 2 * inter, k, gen, "cuda")  # canonical [gate; up] rows
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, fold=fold)
    m = a.shape[0]
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), -1, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas, **FP8)
    grouped_gemm_fp8_fp4_swiglu_contiguous(
        a, a_sf, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out, out_sf=out_sf, config=cfg
    )
    torch.cuda.synchronize()
    _check_swiglu(out, out_sf, a, a_sf, w1, w1_sf, row_expert, row_weights, clamp,
                  f"swiglu contiguous {cfg.describe('swiglu_fp8')} clamp={clamp}")


@gpu
@needs_sm90
def test_swiglu_masked():
    gen = torch.Generator().manual_seed(77)
    masked, max_m, inter, k = [3, 0, 40, 17], 40, 128, 512
    e = len(masked)
    a, a_sf = _random_tokens(e * max_m, k, gen, "cuda")
    row_expert = torch.full((e, max_m), -1, dtype=torch.int64)
    for i, c in enumerate(masked):
        row_expert[i, :c] = i
    row_expert = row_expert.flatten().cuda()
    w1, w1_sf = _random_weights(e, 2 * inter, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf)
    row_weights = torch.rand(e, max_m, generator=gen).cuda()
    out = torch.full((e, max_m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((e, max_m, inter // 128), -1, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=16, tile_n=128, **FP8)
    grouped_gemm_fp8_fp4_swiglu_masked(
        a.view(e, max_m, k), a_sf.view(e, max_m, k // 128), bk, bk_sf,
        torch.tensor(masked, dtype=torch.int32, device="cuda"), row_weights, out=out, out_sf=out_sf, config=cfg,
    )
    torch.cuda.synchronize()
    _check_swiglu(out.view(e * max_m, inter), out_sf.view(e * max_m, -1), a, a_sf, w1, w1_sf, row_expert,
                  row_weights.flatten(), None, f"swiglu masked {cfg.describe('swiglu_fp8')}")


# ----------------------------------------------------------------------------------------------------
# GPU correctness, BF16 mode (``-k bf16``: 7 compiles)
# ----------------------------------------------------------------------------------------------------

BF16_NAN = 0x7FC0


def _bf16_case(counts, n, k, gen, lead_pad=3, tail_pad=11):
    """BF16 tokens (exactly dequantized FP8) in the contiguous layout, NaN padding rows; BF16-mode weights."""
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, lead_pad, tail_pad, gen)
    a16 = dequantize_fp8(a, a_sf, torch.bfloat16)
    a16.view(torch.int16)[row_expert < 0] = BF16_NAN
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    return a16, offsets, cnt, row_expert, b, b_sf


@gpu
@needs_sm90
def test_bf16_decode_exact_on_device():
    """One-hot tokens read the decoded weights back: out[m, n] = w[n, m] exactly, for every E2M1 code in
    every 32-block, -0, and scale codes from 20 (decoded value * 2**-P still FP32-normal in the accumulator)
    to the top of the exact range. A mismatch names the (row, k) positions, codes and scale codes."""
    n, k = 128, 512
    b, b_sf = _bf16_decode_case(n, k, seed=2, low=20)
    b, b_sf = b.cuda(), b_sf.cuda()
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    a = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    out = torch.full((k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, k], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(tile_tokens=128, tile_n=128)
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    got, want = out.T.float().cpu(), dequantize_fp4(b, b_sf)[0].cpu()
    bad = ~(got == want)
    if bad.any():
        idx = bad.nonzero()
        codes, scales = unpack_fp4_codes(b[0].cpu()), unpack_ue8m0(b_sf[0].cpu())
        sample = [(r, c, int(codes[r, c]), int(scales[r, c // 32]), float(got[r, c]), float(want[r, c]))
                  for r, c in idx[:12].tolist()]
        pytest.fail(
            f"{int(bad.sum())} of {bad.numel()} decoded weights differ ({int(torch.isnan(got).sum())} NaN); "
            f"k % 32 histogram {torch.bincount(idx[:, 1] % 32, minlength=32).tolist()}; k16 block in the 128-K "
            f"stage {torch.bincount(idx[:, 1] % 128 // 16, minlength=8).tolist()}; row % 16 histogram "
            f"{torch.bincount(idx[:, 0] % 16, minlength=16).tolist()}; codes {sorted(set(codes[bad].tolist()))}; "
            f"first (row, k, code, scale code, got, want): {sample}"
        )


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas", [(8, 128, 1), (16, 128, 2), (32, 128, 2), (64, 64, 1), (128, 128, 1),
                                                    (8, 256, 1), (16, 256, 1), (64, 256, 1)])
def test_bf16_contiguous_ragged(tile_tokens, tile_n, ctas):
    gen = torch.Generator().manual_seed(2000 + tile_tokens + tile_n)
    # Tiles of every token width (token_widths): at 16 rows 1-8 and 9-16 rows, at 64 and 128 rows 1-32, 33-64,
    # 65-96, 97-128 rows.
    counts, n, k = [0, 1, 37, 5, 0, 130, 64, 1, 9, 90, 100], 256, 1024
    a, offsets, _, row_expert, b, b_sf = _bf16_case(counts, n, k, gen)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, f"contiguous {cfg.describe()}")


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas", [(8, 128, 2), (32, 64, 1), (128, 128, 1), (32, 256, 1)])
def test_bf16_scatter_rows_to_addresses(tile_tokens, tile_n, ctas):
    """out_row_ptrs: every row of a group lands at its own address (a random permutation of the rows of a
    NaN-poisoned buffer), bit-equal to the same kernel's plain BF16 output; rows of no group are not written."""
    gen = torch.Generator().manual_seed(3000 + tile_tokens + tile_n)
    counts, n, k = [0, 1, 37, 5, 0, 130, 9], 256, 1024
    a, offsets, _, row_expert, b, b_sf = _bf16_case(counts, n, k, gen)
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    m = a.shape[0]
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    plain = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=plain, config=cfg)
    dest = torch.full((m + 3, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(m + 3, generator=gen)[:m].to("cuda")
    ptrs = dest.data_ptr() + perm.to(torch.int64) * (n * 2)
    assert grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, config=cfg, out_row_ptrs=ptrs) is None
    torch.cuda.synchronize()
    routed = row_expert >= 0
    _check_rows(plain, a, None, b, b_sf, row_expert, f"plain {cfg.describe()}")
    assert torch.equal(dest[perm[routed]].view(torch.int16), plain[routed].view(torch.int16))
    written = torch.zeros(m + 3, dtype=torch.bool, device="cuda")
    written[perm[routed]] = True
    assert bool(dest[~written].isnan().all()), "a row outside every group (or no row) was written"


@gpu
@needs_sm90
def test_bf16_counts_masked_graph_and_empty():
    """offsets + counts (aligned groups), the masked layout, CUDA-graph replay with new bounds, empty groups."""
    gen = torch.Generator().manual_seed(11)
    counts, n, k = [5, 0, 33, 1, 64], 128, 512
    a, a_sf, offsets, cnt, row_expert = _contiguous_case(counts, n, k, 0, 0, gen, alignment=32)
    a = dequantize_fp8(a, a_sf, torch.bfloat16)
    b, b_sf = _random_weights(len(counts), n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    cfg8 = GemmConfig(tile_tokens=8, tile_n=128)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a, None, bk, bk_sf, offsets, out=out, config=cfg8, counts=cnt)
    torch.cuda.synchronize()
    _check_rows(out, a, None, b, b_sf, row_expert, f"contiguous+counts {cfg8.describe()}")

    masked, max_m = [0, 1, 70, 33, 8], 70
    e = len(masked)
    a2 = dequantize_fp8(*_random_tokens(e * max_m, k, gen, "cuda"), torch.bfloat16)
    row_expert = torch.tensor([i if p < c else -1 for i, c in enumerate(masked) for p in range(max_m)], device="cuda")
    a2.view(torch.int16)[row_expert < 0] = BF16_NAN
    b, b_sf = _random_weights(e, n, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights(b, b_sf, mma="bf16")
    out = torch.full((e, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = GemmConfig(tile_tokens=32, tile_n=128)
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    grouped_gemm_fp8_fp4_masked(a2.view(e, max_m, k), None, bk, bk_sf, masked_m, out=out, config=cfg)
    torch.cuda.synchronize()
    _check_rows(out.view(e * max_m, n), a2, None, b, b_sf, row_expert, f"masked {cfg.describe()}")

    m = 96
    a3 = dequantize_fp8(*_random_tokens(m, k, gen, "cuda"), torch.bfloat16)
    offsets = torch.tensor([0, 10, 10, 50, 96, 96], dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_fp4_contiguous(a3, None, bk, bk_sf, offsets, out=out, config=cfg8)  # compile outside capture
    _check_graph_replay(lambda: grouped_gemm_fp8_fp4_contiguous(a3, None, bk, bk_sf, offsets, out=out, config=cfg8),
                        offsets, out, (a3, None, b, b_sf),
                        ([0, 10, 10, 50, 96, 96], [4, 5, 60, 61, 90, 90], [0, 0, 0, 0, 0, 0]))


@gpu
@needs_sm90
@pytest.mark.parametrize("tile_tokens,tile_n,ctas,clamp,fast_math",
                         [(8, 128, 2, None, True), (16, 128, 2, None, True), (32, 64, 1, 5.0, True),
                          (32, 128, 2, None, True), (128, 128, 1, None, True), (128, 128, 1, 5.0, False)])
def test_bf16_l1_l2_one_launch_equals_two(tile_tokens, tile_n, ctas, clamp, fast_math):
    """The fused L1/L2 launch stores bit for bit what the SwiGLU launch then the scatter launch store (rows of
    no group untouched; either silu form), its L2 rows also pass the FP64 check against its own L1 output, and it
    leaves its counters zeroed: a second call (new routing weights) equals the two launches again."""
    gen = torch.Generator().manual_seed(5000 + tile_tokens + tile_n)
    counts, hidden, inter = [0, 1, 37, 5, 0, 130, 9, 64], 1024, 512
    a, offsets, _, row_expert, w1, w1_sf = _bf16_case(counts, 2 * inter, hidden, gen, lead_pad=2, tail_pad=9)
    w2, w2_sf = _random_weights(len(counts), hidden, inter, gen, "cuda")
    b1, b1_sf = prepare_fp4_weights_l1(w1, w1_sf, mma="bf16")
    b2, b2_sf = prepare_fp4_weights(w2, w2_sf, mma="bf16")
    m = a.shape[0]
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n, ctas_per_sm=ctas)
    routed = row_expert >= 0
    perm = torch.randperm(m + 3, generator=gen)[:m].to("cuda")
    sync = torch.zeros(len(counts) + 2, dtype=torch.int32, device="cuda")
    for call in range(2):
        row_weights = torch.rand(m, generator=gen).cuda()
        outs = []
        for fused in (False, True):
            act = torch.full((m, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            dest = torch.full((m + 3, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            ptrs = dest.data_ptr() + perm.to(torch.int64) * (hidden * 2)
            if fused:
                grouped_gemm_fp8_fp4_l1_l2_contiguous(a, b1, b1_sf, offsets, row_weights, b2, b2_sf, ptrs, clamp=clamp,
                                                      act=act, config=cfg, sync=sync, fast_math=fast_math)
            else:
                grouped_gemm_fp8_fp4_swiglu_contiguous(a, None, b1, b1_sf, offsets, row_weights, clamp=clamp, out=act,
                                                       config=cfg, out_dtype=torch.bfloat16, fast_math=fast_math)
                grouped_gemm_fp8_fp4_contiguous(act, None, b2, b2_sf, offsets, config=cfg, out_row_ptrs=ptrs)
            outs.append((act, dest))
        torch.cuda.synchronize()
        (act0, dest0), (act1, dest1) = outs
        assert torch.equal(act1.view(torch.int16), act0.view(torch.int16)), f"call {call}: L1 rows differ"
        assert torch.equal(dest1.view(torch.int16), dest0.view(torch.int16)), f"call {call}: L2 rows differ"
        assert bool(act1[~routed].isnan().all()), "an L1 row outside every group was written"
        plain = torch.full((m, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        plain[routed] = dest1[perm[routed]]
        _check_rows(plain, act1, None, w2, w2_sf, row_expert, f"fused L2 {cfg.describe('l1_l2')} call {call}")
        assert int(sync.abs().sum()) == 0, f"counters left at {sync.tolist()}"


@gpu
@needs_sm90
@pytest.mark.parametrize("layout,tile_tokens,tile_n,clamp,fast_math", [
    ("contiguous", 64, 128, 7.0, True), ("masked", 8, 64, None, True), ("contiguous", 32, 256, 7.0, True),
    ("masked", 64, 256, None, True), ("contiguous", 128, 128, 7.0, False), ("masked", 64, 256, None, False)])
def test_bf16_swiglu(layout, tile_tokens, tile_n, clamp, fast_math):
    """Both silu forms (approximate exp and reciprocal, or IEEE) against the FP64 GEMM and ``numerics.l1_epilogue``."""
    gen = torch.Generator().manual_seed(41 + tile_tokens)
    inter, k = 256, 1024
    cfg = GemmConfig(tile_tokens=tile_tokens, tile_n=tile_n)
    if layout == "contiguous":
        counts = [0, 1, 37, 5, 0, 130, 64, 1]
        a, offsets, _, row_expert, w1, w1_sf = _bf16_case(counts, 2 * inter, k, gen, lead_pad=2, tail_pad=9)
        m = a.shape[0]
    else:
        masked, max_m = [3, 0, 40, 17], 40
        m = len(masked) * max_m
        a = dequantize_fp8(*_random_tokens(m, k, gen, "cuda"), torch.bfloat16)
        row_expert = torch.tensor([i if p < c else -1 for i, c in enumerate(masked) for p in range(max_m)],
                                  device="cuda")
        w1, w1_sf = _random_weights(len(masked), 2 * inter, k, gen, "cuda")
    bk, bk_sf = prepare_fp4_weights_l1(w1, w1_sf, mma="bf16")
    row_weights = torch.rand(m, generator=gen).cuda()
    out = torch.full((m, inter), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_sf = torch.full((m, inter // 128), -1, dtype=torch.int32, device="cuda")
    if layout == "contiguous":
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            a, None, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out, out_sf=out_sf, config=cfg,
            fast_math=fast_math,
        )
    else:
        e, max_m = len(masked), m // len(masked)
        grouped_gemm_fp8_fp4_swiglu_masked(
            a.view(e, max_m, k), None, bk, bk_sf, torch.tensor(masked, dtype=torch.int32, device="cuda"),
            row_weights.view(e, max_m), clamp=clamp, out=out.view(e, max_m, inter), out_sf=out_sf.view(e, max_m, -1),
            config=cfg, fast_math=fast_math,
        )
    torch.cuda.synchronize()
    _check_swiglu(out, out_sf, a, None, w1, w1_sf, row_expert, row_weights, clamp,
                  f"swiglu {layout} {cfg.describe('swiglu_fp8')} clamp={clamp} fast_math={fast_math}")
    # out_dtype=bfloat16: exactly the checked FP8 values times their scales; padding rows keep their NaN.
    out_bf16 = torch.full((m, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    if layout == "contiguous":
        grouped_gemm_fp8_fp4_swiglu_contiguous(
            a, None, bk, bk_sf, offsets, row_weights, clamp=clamp, out=out_bf16, config=cfg, out_dtype=torch.bfloat16,
            fast_math=fast_math,
        )
    else:
        grouped_gemm_fp8_fp4_swiglu_masked(
            a.view(e, max_m, k), None, bk, bk_sf, torch.tensor(masked, dtype=torch.int32, device="cuda"),
            row_weights.view(e, max_m), clamp=clamp, out=out_bf16.view(e, max_m, inter), config=cfg,
            out_dtype=torch.bfloat16, fast_math=fast_math,
        )
    torch.cuda.synchronize()
    valid = row_expert >= 0
    want = dequantize_fp8(out[valid], out_sf[valid], torch.bfloat16)
    differ = (out_bf16[valid].view(torch.int16) != want.view(torch.int16)).sum().item()
    assert differ == 0, f"swiglu {layout} BF16 output: {differ} values differ from the FP8 output's dequantization"
    assert torch.isnan(out_bf16[~valid].float()).all(), f"swiglu {layout} BF16 output: padding rows written"
