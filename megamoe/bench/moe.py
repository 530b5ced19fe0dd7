"""The EP MoE benchmark: ``torchrun --nproc-per-node N -m megamoe.bench [--preset ...] [--tokens ...]``.

For every tokens-per-rank point: fresh random inputs, a correctness check of every path against the distributed
FP32 reference on those inputs, then timing (warm-up, CUDA events around each call after a cross-rank barrier, median
per rank, the slowest rank reported). Paths: ``staged-GEMM-MODE``, the staged baseline (``StagedMoE``) in mode
``normal`` or ``low_latency`` with torch's (``torch``) or megamoe's SM90 (``sm90``) GEMMs, e.g.
``staged-sm90-low_latency``; with ``--recipe 128`` also ``staged-sm90copy-MODE`` (the SM90 GEMMs reading the weights'
E4M3 copies, ``StagedMoE(..., e4m3_copy=True)``: one more byte per weight); ``mega``, the Mega MoE path
(``MegaMoE``) on Hopper, with ``--recipe 128`` also ``mega-copy`` (``MegaMoE(..., e4m3_copy=True)``: calls whose tile
config puts the tokens on the wgmma M side read the copies). ``--paths`` picks them by any part
of the name. Without GPUs it runs the tiny preset on CPU with gloo and says so. ``--recipe 32|128``: the FP8 x FP4
recipe (per-32 UE8M0 or per-128 FP32 token scales, ``megamoe.numerics``), checked against that recipe's reference
and tolerances; the receipt records it.

Columns: ``us`` time per call; ``TFLOP/s`` useful FLOPs ``6 * routed_rows * H * I`` per rank over
time; ``weights GB/s`` bytes of the expert weights this path reads (BF16 with the torch GEMM, FP32 there for recipe 128,
FP4 with the SM90 one, E4M3 with their copies; at the model's sizes, not counting the zero
padding the SM90 kernels also read) for experts that received rows; ``FP4 floor us`` the same experts' FP4 bytes over the HBM read bandwidth
measured in this run (the floor an FP4 kernel could reach); ``a2a GB/s`` bytes this rank sends
to other ranks (dispatch rows + combine rows) over time.

Presets (``PRESETS``) are model shapes; ``gpt-oss-120b`` and ``qwen3-30b-a3b`` run their models' routed-expert sizes
with megamoe's SwiGLU experts (gpt-oss's own activation and biases are not modelled here). ``--experts``,
``--hidden`` and ``--intermediate`` override a preset's sizes: e.g. a rank's expert count at EP8 (``--experts 16``
on one GPU for gpt-oss-120b), or the padding cost of sizes the SM90 kernels zero-pad (H, I not multiples of
``kernels.sm90.K_MULTIPLE``) against the padded sizes run natively: ``--preset gpt-oss-120b`` (2880, run as 2944;
recipe 128's Mega MoE H as 3072) against ``--preset gpt-oss-120b --hidden 2944 --intermediate 2944``;
``scripts/padding_cost.sh`` runs that comparison.

``--routings N`` (default 1): N buffers per point, each with its own random tokens and routing (each
checked); timed calls cycle through them, so consecutive calls touch different experts, as consecutive
layers of a model read different weights. With one routing, every timed call reads the same experts'
weights, and at a few tokens per rank those can stay partly in the GPU's L2 cache between calls (flash,
1 token/rank: about 6 experts x 13 MB per rank against a 50-60 MB L2); the columns then give the means
over the N routings.

``--peers humming`` (one GPU, EP1, FP8 x FP4 weights): also time what a Hopper user would run instead, on the same
FP4 weights (MXFP4 byte for byte) and the same BF16 tokens and routings: Humming's MoE layer as vLLM calls it, with
BF16 activations (``humming-bf16``) and with FP8 activations per 128 (``humming-fp8``); see ``megamoe.bench.peers``.
Every peer point is checked against an FP64 reference of the peer's own rounding points with megamoe's tolerance
rules; the peer's call starts from the BF16 tokens (its FP8 quantization inside the timed call, as in vLLM) while
megamoe's paths read their buffers' FP8 tokens; routing preparation is outside the timed call (the receipt says so).
A peer asked for that is not installed or cannot run here stops the run. With ``--json``, a plot of us per call
against tokens/rank (one line per path, log-log) is saved beside the receipt when matplotlib is importable
(``python -m megamoe.bench plot RECEIPT`` draws it later).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import torch.distributed as dist

from ..dist import init_from_env, rank_and_size
from ..inputs import fill_buffer, random_bf16_weights, random_fp4_weights, random_routing, random_tokens
from ..layouts.ue8m0 import scale_words
from ..staged import StagedMoE
from ..mega import MegaMoE, tile_config, trace_fp8_fp4_mega_moe
from ..numerics import RECIPE_32, RECIPE_128, max_row_rel_error, moe_tolerances, rel_fro_error
from ..reference import distributed_reference_moe
from ..symm_buffer import RING_ALIGNMENT, get_symm_buffer_for_mega_moe, max_recv_rows
from ..timeline import MegaTimeline, call_spans, format_summary
from . import peers as peer_lib
from .common import (
    capture_graph,
    environment_receipt,
    fp4_expert_bytes,
    measure_hbm_read_bandwidth,
    progress,
    time_events,
    time_graph,
)
from .plot import save_plot_beside

PRESETS = {
    "tiny": dict(experts=16, topk=4, hidden=256, intermediate=128),
    "flash": dict(experts=256, topk=6, hidden=4096, intermediate=2048),
    "pro": dict(experts=384, topk=6, hidden=7168, intermediate=3072),
    "gpt-oss-120b": dict(experts=128, topk=4, hidden=2880, intermediate=2880),
    "qwen3-30b-a3b": dict(experts=128, topk=8, hidden=2048, intermediate=768),
}
DEFAULT_TOKENS = {"tiny": [1, 8, 33], **{name: [1, 8, 128, 512, 2048, 8192]
                                         for name in ("flash", "pro", "gpt-oss-120b", "qwen3-30b-a3b")}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default=None, help="shape (default: flash on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=None, help="tokens per rank, e.g. 1,8,128")
    for size in ("experts", "hidden", "intermediate"):
        p.add_argument(f"--{size}", type=int, default=None, help=f"override the preset's {size} (module docstring)")
    p.add_argument("--mma-type", choices=("fp8xfp4", "bf16"), default="fp8xfp4")
    p.add_argument("--recipe", type=int, choices=(32, 128), default=32,
                   help="FP8 x FP4 recipe: 32 = (1, 1, 32), per-32 UE8M0 token scales (default); 128 = (1, 1, 128), "
                   "per-128 FP32 token scales (FP8-mode GEMMs, weights folded into E4M3)")
    p.add_argument("--masked-ratio", type=float, default=0.0, help="probability of a top-k slot being -1")
    p.add_argument("--clamp", type=float, default=None, help="activation clamp (default none)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routings", type=int, default=1, help="buffers with distinct random routings per point; "
                   "timed calls cycle through them (see the module docstring)")
    p.add_argument("--calls-per-graph", type=int, default=10,
                   help="calls in each timed CUDA graph (replayed after a cross-rank barrier); more calls time a longer "
                   "sustained run (the GPU may then lower its clocks to stay within its power limit)")
    p.add_argument("--json", default=None, help="write a JSON receipt here (rank 0)")
    p.add_argument("--paths", type=lambda s: s.split(","), default=None,
                   help="run only the paths whose name contains one of these comma-separated words (e.g. mega, "
                   "staged, sm90, low_latency)")
    p.add_argument("--peers", type=_peers_arg, default=[],
                   help="also run these peers on the same weights, tokens and routings (comma-separated: "
                   + ", ".join(peer_lib.PEERS) + "; one GPU, EP1; see megamoe.bench.peers)")
    p.add_argument("--profile", action="store_true", help="print rank 0's torch.profiler summary of one call per point")
    p.add_argument("--timeline", action="store_true",
                   help="mega FP8 x FP4 path: after timing, a CUDA graph of --calls-per-graph calls of the kernel's trace "
                   "build (the output checked bit-equal to the release build's); print every rank's phase timeline of "
                   "the last call and every call's span")
    p.add_argument("--ring-tokens", type=int, default=None,
                   help="cap the buffers' ring at this many rows (a multiple of 128; default: every row a rank can "
                   "receive). The mega FP8 x FP4 path then reuses ring blocks within a call; the mega BF16 "
                   "path (staged kernels) refuses a ring that small")
    args = p.parse_args(argv)
    if args.routings < 1:
        p.error(f"--routings must be >= 1, got {args.routings}")
    if args.calls_per_graph < 1:
        p.error(f"--calls-per-graph must be >= 1, got {args.calls_per_graph}")
    if args.ring_tokens is not None and (args.ring_tokens < RING_ALIGNMENT or args.ring_tokens % RING_ALIGNMENT):
        p.error(f"--ring-tokens must be a positive multiple of {RING_ALIGNMENT}, got {args.ring_tokens}")
    if args.recipe == 128 and args.mma_type != "fp8xfp4":
        p.error("--recipe 128 applies to --mma-type fp8xfp4 only")
    return args


def _peers_arg(text: str) -> list[str]:
    try:
        return peer_lib.parse_peers(text)
    except ValueError as ex:
        raise argparse.ArgumentTypeError(str(ex)) from ex


def _max_over_ranks(value: float, group, device) -> float:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _sum_over_ranks(value: float, group, device) -> float:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


def _traffic_bytes(idx: torch.Tensor, rank: int, num_ranks: int, num_local: int, row_bytes: int, hidden: int) -> int:
    """Bytes this rank sends to other ranks: one dispatch row per (token, remote rank) and one BF16
    combine row per remote slot it computed (approximated by its own remote slots, symmetric)."""
    valid = idx >= 0
    dest = torch.where(valid, idx // num_local, rank)
    remote = valid & (dest != rank)
    per_rank = torch.zeros(idx.shape[0], num_ranks, dtype=torch.bool, device=idx.device)
    per_rank.scatter_(1, torch.where(remote, dest, rank), remote)
    return int(per_rank.sum()) * row_bytes + int(remote.sum()) * hidden * 2


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    group, device = init_from_env()
    rank, num_ranks = rank_and_size(group)
    lead = rank == 0
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)
    preset = args.preset or ("flash" if device.type == "cuda" else "tiny")
    if device.type != "cuda":
        if preset != "tiny":
            say(f"no CUDA device: the {preset} preset is too large for a CPU, running tiny instead")
            preset = "tiny"
        say(f"no CUDA device: running the tiny preset on CPU with gloo ({num_ranks} rank(s)); "
            "staged path and FP32 reference only, times are CPU wall clock")
    shape = {**PRESETS[preset], **{n: getattr(args, n) for n in ("experts", "hidden", "intermediate")
                                   if getattr(args, n) is not None}}
    e, k, h, i = shape["experts"], shape["topk"], shape["hidden"], shape["intermediate"]
    tokens = args.tokens or DEFAULT_TOKENS[preset]
    if e % num_ranks:
        raise SystemExit(f"megamoe.bench: {e} experts do not split over {num_ranks} ranks")
    num_local = e // num_ranks
    fp8 = args.mma_type == "fp8xfp4"
    recipe = RECIPE_128 if args.recipe == 128 else RECIPE_32
    tol = moe_tolerances(i, recipe if fp8 else RECIPE_32)

    receipt = environment_receipt(device, num_ranks)
    label = f"{args.mma_type} recipe {recipe}" if fp8 else args.mma_type
    say(f"megamoe.bench: preset {preset} {shape}, {num_ranks} rank(s), {label}, {receipt.get('gpu')}")
    hbm = measure_hbm_read_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    if fp8:
        l1 = random_fp4_weights(num_local, 2 * i, h, gen, device)
        l2 = random_fp4_weights(num_local, h, i, gen, device)
    else:
        l1 = random_bf16_weights(num_local, 2 * i, h, gen, device)
        l2 = random_bf16_weights(num_local, h, i, gen, device)
    gemms = ["torch"]
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        gemms.append("sm90")
    # Each path's name and what it runs; only the paths --paths selects are built (a path's prepared weights can
    # be several times the FP4 ones: torch's GEMMs take BF16), and a GEMM's two staged modes share them.
    if "sm90" in gemms and recipe == RECIPE_128:  # the SM90 GEMMs reading the weights' E4M3 copies (e4m3_copy)
        gemms.append("sm90copy")
    names = [(f"staged-{gemm}-{mode}", gemm, mode) for gemm in gemms for mode in StagedMoE.MODES]
    if "sm90" in gemms or (not fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)):
        # FP8 x FP4: one persistent launch (dispatch, SM90 GEMM tiles, combine); BF16: the dispatch and combine
        # kernels around torch's grouped GEMMs (bf16_mega_moe). The receipt's mma_type tells which.
        names.append(("mega", "mega", None))
        if "sm90copy" in gemms:
            names.append(("mega-copy", "mega-copy", None))
    if args.peers:
        peer_lib.check_peer_setup(args.peers, device, num_ranks, fp8)
        names += [(name, "peer", None) for name in peer_lib.peer_paths(args.peers)]
    if args.paths:
        unmatched = [word for word in args.paths if not any(word in name for name, _, _ in names)]
        if unmatched:
            raise SystemExit(f"megamoe.bench: --paths {','.join(unmatched)} matches none of the paths here: "
                             + "; ".join(name for name, _, _ in names))
        names = [entry for entry in names if any(word in entry[0] for word in args.paths)]
        dropped = [peer for peer in args.peers if not any(name.startswith(f"{peer}-") for name, _, _ in names)]
        if dropped:
            raise SystemExit(f"megamoe.bench: --peers {','.join(dropped)} asked for, but --paths {','.join(args.paths)} "
                             "selects none of its paths (add its name to --paths)")
    paths, prepared = {}, {}  # prepared: one StagedMoE per GEMM, its weights shared by both modes
    for name, gemm, mode in names:
        if gemm == "peer":
            paths[name] = peer_lib.make_moe_peer(name, l1, l2, args.clamp)
            continue
        if gemm.startswith("mega"):
            paths[name] = (MegaMoE(l1, l2, recipe=recipe, e4m3_copy=gemm == "mega-copy") if fp8
                           else MegaMoE(l1, l2))
            continue
        if gemm not in prepared:  # "sm90copy": the SM90 GEMMs given the weights' E4M3 copies
            kw = {"recipe": recipe, "e4m3_copy": gemm == "sm90copy"} if fp8 else {}
            prepared[gemm] = StagedMoE(l1, l2, mode, "sm90" if gemm == "sm90copy" else gemm, **kw)
        paths[name] = prepared[gemm].with_mode(mode)
    if args.timeline and not any(isinstance(path, MegaMoE) and path.fp8 for path in paths.values()):
        say("--timeline: no mega FP8 x FP4 path runs here (it needs an SM90 GPU): no timeline")
    torch_bytes_per_expert = 3 * h * i * (4 if fp8 and recipe == RECIPE_128 else 2)  # the torch GEMMs' weights
    fp4_bytes_per_expert = fp4_expert_bytes(h, i)
    copy_bytes_per_expert = 3 * h * i * (1 + 1 / 32)  # the E4M3 copies and their folded scale words
    token_bytes = h + 4 * scale_words(h) if fp8 else 2 * h  # FP8 + one 4-byte scale word per 128 (either recipe), or BF16
    dispatch_row_bytes = k * 12 + token_bytes
    clock = "CUDA events" if device.type == "cuda" else "CPU wall clock"

    def barrier():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier(group)

    rows = []
    for t in progress(tokens, f"{preset}: tokens/rank", enabled=lead):
        # Buffers sized to the point: the low-latency path moves num_max_tokens_per_rank rows.
        ring = -(-max_recv_rows(num_ranks, max(t, 1), k, num_local) // RING_ALIGNMENT) * RING_ALIGNMENT  # every row
        if args.ring_tokens is not None:
            ring = min(ring, args.ring_tokens)
        cases = []  # (buffer, top-k ids, reference output, BF16 tokens, top-k weights), one per routing
        for r in range(args.routings):
            buf = get_symm_buffer_for_mega_moe(group, e, max(t, 1), k, h, i, mma_type=args.mma_type,
                                               num_ring_tokens=ring, device=device,
                                               **({"recipe": recipe} if fp8 else {}))
            cpu_gen = torch.Generator().manual_seed(args.seed * 7919 + t * 31 + rank + 104729 * r)
            x = random_tokens(t, h, cpu_gen, device)
            idx, w = random_routing(t, e, k, cpu_gen, args.masked_ratio, device=device)
            x_q, x_sf = fill_buffer(buf, x, idx, w)
            cases.append((buf, idx, distributed_reference_moe(x_q, x_sf, idx, w, l1, l2, group, max(t, 1), args.clamp),
                          x, w))
        for name, path in paths.items():
            if isinstance(path, peer_lib.HummingMoE):
                rows.append(_peer_row(name, path, cases, t, args, barrier, hbm, fp4_bytes_per_expert, h, i, say))
                continue
            mega = isinstance(path, MegaMoE)
            config = None  # the Mega MoE kernel's tile config at this point (FP8 x FP4)
            if mega and path.fp8:
                config = tile_config(cases[0][0].layout, t, torch.cuda.get_device_properties(device).multi_processor_count,
                                     len(path.l1) == 3)
            y = torch.empty((t, h), dtype=torch.bfloat16, device=device)
            fro = row_rel = routed = touched = sent = 0.0
            for buf, idx, ref, _, _ in cases:
                y.fill_(float("nan"))
                stats = torch.zeros(num_local, dtype=torch.int32, device=device)
                path(y, buf, stats, activation_clamp=args.clamp)
                fro = max(fro, _max_over_ranks(rel_fro_error(y, ref) if t else 0.0, group, device))
                row_rel = max(row_rel, _max_over_ranks(max_row_rel_error(y, ref), group, device))
                routed += _sum_over_ranks(float(stats.sum()), group, device) / num_ranks / len(cases)
                touched += _sum_over_ranks(float((stats > 0).sum()), group, device) / num_ranks / len(cases)
                if mega:  # one pulled row (token, scales, weight) and one combine row per remote slot
                    remote = (idx >= 0) & (idx // num_local != rank)
                    bytes_out = float(int(remote.sum()) * (token_bytes + 4 + 2 * h))
                elif path.mode == "normal":
                    bytes_out = float(_traffic_bytes(idx, rank, num_ranks, num_local, dispatch_row_bytes, h))
                else:
                    bytes_out = float((num_ranks - 1) * t * (dispatch_row_bytes + k * h * 2))
                sent += _max_over_ranks(bytes_out, group, device) / len(cases)
            ok = fro <= tol["rel_fro"] and row_rel <= tol["max_row_rel"]
            turn = itertools.count()

            def call():
                buf = cases[next(turn) % len(cases)][0]  # cycle through the routings
                if mega:
                    path(y, buf, None, activation_clamp=args.clamp)
                else:
                    path(y, buf, None, activation_clamp=args.clamp, validate=False)

            # recipe 128's torch GEMMs run in FP32, a per-group loop with a host sync on CUDA: timed eagerly
            fp32_torch = not mega and fp8 and recipe == RECIPE_128 and path.gemm == "torch"
            graphed = (mega or path.mode == "low_latency") and device.type == "cuda" and not fp32_torch
            traced = args.timeline and mega and fp8
            if graphed:
                times = time_graph(call, args.warmup, args.iters, args.calls_per_graph, before=barrier)
                method = f"CUDA graph of {args.calls_per_graph} calls"
            else:
                times = time_events(call, args.warmup, args.iters, before=barrier)
                method = f"{clock}, one call"
            us = _max_over_ranks(statistics.median(times), group, device)
            if traced:
                timeline = _timeline(path, cases, y, args.clamp, group, barrier, say, f"{t} tokens/rank",
                                     args.calls_per_graph)
                ok = ok and timeline["bit_equal"]
            if args.profile:
                replay = capture_graph(call, 1, args.calls_per_graph).replay if graphed else call
                what = f"one replay of a {method}" if graphed else "one call"
                _profile(replay, barrier, lead, f"{t} tokens/rank, {name}, {what}")
            rows.append({
                "tokens_per_rank": t,
                "ring_tokens": ring,
                "routings": len(cases),
                "path": name,
                "method": method,
                "us": us,
                "tflops": 6 * routed * h * i / (us * 1e-6) / 1e12,
                "routed_rows_per_rank": routed,
                "experts_touched_per_rank": touched,
                "weights_gbps": touched * _weight_bytes_per_expert(path, config, fp4_bytes_per_expert,
                                                                   copy_bytes_per_expert, torch_bytes_per_expert)
                / (us * 1e-6) / 1e9,
                "fp4_floor_us": touched * fp4_bytes_per_expert / (hbm * 1e9) * 1e6 if hbm else None,
                "a2a_gbps": sent / (us * 1e-6) / 1e9,
                "rel_fro": fro,
                "max_row_rel": row_rel,
                "correct": ok,
                **({"tile_config": config.describe("l1_l2")} if config is not None else {}),
                **({"timeline": timeline} if traced else {}),
            })
            if not ok:
                say(f"INCORRECT: {name} at {t} tokens/rank: rel_fro={fro:.3e} max_row_rel={row_rel:.3e}")
        for case in cases:
            case[0].destroy()
        cases.clear()  # drop the references before the next point allocates

    method = (f"median of {args.iters} timings after {args.warmup} warm-up calls, each after a cross-rank "
              f"barrier; slowest rank; per-row method column; {args.routings} routing(s) per point, the timed "
              "calls cycling through them")
    if args.peers:
        method += f"; peers: routing preparation {peer_lib.ROUTING_PREP}, FP8 token quantization inside the call"
    if lead:
        _print_table(preset, shape, num_ranks, label, hbm, rows, receipt, method)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({
                    "benchmark": "megamoe.bench moe", "preset": preset, "shape": shape,
                    "mma_type": args.mma_type, "recipe": list(recipe) if fp8 else None,
                    "masked_ratio": args.masked_ratio, "clamp": args.clamp,
                    "routings": args.routings,
                    "hbm_read_gbps": hbm, "warmup": args.warmup, "iters": args.iters, "method": method,
                    "tolerance": tol,
                    "peers": {name: path.config() for name, path in paths.items()
                              if isinstance(path, peer_lib.HummingMoE)},
                    "environment": receipt, "results": rows,
                }, f, indent=1)
            say(f"receipt written to {args.json}")
            save_plot_beside(args.json, say)
    if group is not None:
        dist.destroy_process_group()
    if not all(r["correct"] for r in rows):
        sys.exit(1)
    return rows


def _weight_bytes_per_expert(path, config, fp4: float, copy: float, torch_gemm: float) -> float:
    """Weight bytes per touched expert a path reads: FP4 (Mega MoE, the SM90 GEMMs), the E4M3 copies (the SM90 GEMMs
    given them; the Mega MoE kernel where its tile ``config`` reads them), or the torch GEMMs' dequantized
    weights."""
    if isinstance(path, MegaMoE):
        return copy if config is not None and config.decode == "copy" else fp4
    if path.gemm != "sm90":
        return torch_gemm
    return copy if path.l1k_e4m3 is not None else fp4


def _peer_row(name: str, peer, cases: list, t: int, args, barrier, hbm: float, fp4_bytes_per_expert: int,
              hidden: int, inter: int, say) -> dict:
    """One peer at one point (one rank): its routings prepared (outside the timed call), every routing checked against
    the peer's own FP64 reference (``megamoe.bench.peers``), then timed as CUDA graphs of calls cycling through the
    routings. Returns the table row (fields as megamoe's; no ring, no traffic; where the peer launched a sublayer with
    another config than its tuned one, ``row_blocks_forced``: the record of ``peers.RowBlockPlan.forced``, also
    said). A point the peer refuses before any launch (``peers.PeerRefused``) is said and returned as a row with
    method ``refused``, its reason under ``refused``, no figures (NaN) and ``correct`` False."""
    tol = peer.tolerances()
    try:
        routings = [peer.prepare(x, idx, w) for _, idx, _, x, w in cases]
    except peer_lib.PeerRefused as ex:  # before any launch: a row saying why, counted as not correct
        say(f"REFUSED: {name} at {t} tokens/rank: {ex}")
        nan = float("nan")
        return {"tokens_per_rank": t, "ring_tokens": None, "routings": len(cases), "path": name, "method": "refused",
                "us": nan, "tflops": nan, "routed_rows_per_rank": nan, "experts_touched_per_rank": nan,
                "weights_gbps": nan, "fp4_floor_us": None, "a2a_gbps": nan, "rel_fro": nan, "max_row_rel": nan,
                "correct": False, "refused": str(ex)}
    forced = routings[0].forced  # one plan per point: every routing has t * k rows
    for sublayer, record in forced.items():
        say(f"NOTE: {name} at {t} tokens/rank: {sublayer} row block forced {record['tuned_block_m']} -> "
            f"{record['block_m']} ({record['reason']})")
    fro = row_rel = routed = touched = 0.0
    for (_, idx, _, x, w), routing in zip(cases, routings):
        y = routing.buffers["y"]
        y.fill_(float("nan"))
        peer(routing)
        ref = peer.reference(routing)
        fro = max(fro, rel_fro_error(y, ref) if t else 0.0)
        row_rel = max(row_rel, max_row_rel_error(y, ref))
        used = idx[idx >= 0]
        routed += used.numel() / len(cases)
        touched += used.unique().numel() / len(cases)
    ok = fro <= tol["rel_fro"] and row_rel <= tol["max_row_rel"]
    turn = itertools.count()
    times = time_graph(lambda: peer(routings[next(turn) % len(routings)]), args.warmup, args.iters,
                       args.calls_per_graph, before=barrier)
    us = statistics.median(times)
    if not ok:
        say(f"INCORRECT: {name} at {t} tokens/rank: rel_fro={fro:.3e} max_row_rel={row_rel:.3e} (tolerance {tol})")
    return {
        "tokens_per_rank": t, "ring_tokens": None, "routings": len(cases), "path": name,
        "method": f"CUDA graph of {args.calls_per_graph} calls", "us": us,
        "tflops": 6 * routed * hidden * inter / (us * 1e-6) / 1e12,
        "routed_rows_per_rank": routed, "experts_touched_per_rank": touched,
        "weights_gbps": touched * fp4_bytes_per_expert / (us * 1e-6) / 1e9,
        "fp4_floor_us": touched * fp4_bytes_per_expert / (hbm * 1e9) * 1e6 if hbm else None,
        "a2a_gbps": 0.0, "rel_fro": fro, "max_row_rel": row_rel, "correct": ok,
        **({"row_blocks_forced": forced} if forced else {}),
    }


def _timeline(path: MegaMoE, cases: list, y: torch.Tensor, clamp, group, barrier, say, label: str,
              calls: int) -> dict:
    """The mega path's phase timeline as the timed loop runs it: a CUDA graph of ``calls`` calls of the kernel's
    trace build cycling through ``cases``' routings (each call its own trace), replayed after warm-up replays; the
    summary is the last call's, plus every call's span. Its output must be bit-equal to the release build's on the
    same routing on every rank; rank 0 prints every rank's timeline. Returns ``{"bit_equal", "ranks": summaries}``."""
    last = cases[(calls - 1) % len(cases)][0]
    y.fill_(float("nan"))
    path(y, last, None, activation_clamp=clamp)
    release = y.clone()
    traces = [None] * calls
    turn = itertools.count()

    def call():
        i = next(turn) % calls
        traces[i] = trace_fp8_fp4_mega_moe(y, path.l1, path.l2, cases[i % len(cases)][0], None, clamp, traces[i],
                                           fast_math=path.fast_math)

    graph = capture_graph(call, warmup=calls, calls_per_graph=calls)  # the warm-up calls allocate the traces
    for _ in range(3):
        barrier()
        y.fill_(float("nan"))
        graph.replay()
    barrier()
    timelines = [MegaTimeline.from_buffer(t) for t in traces]
    summary = {**timelines[-1].summary(), "calls": call_spans(timelines)}
    same = _max_over_ranks(0.0 if torch.equal(y.view(torch.int16), release.view(torch.int16)) else 1.0, group, y.device) == 0.0
    summaries = [summary]
    if group is not None:
        summaries = [None] * dist.get_world_size(group)
        dist.all_gather_object(summaries, summary, group=group)
    say(f"timeline at {label}, last of a CUDA graph of {calls} calls (trace build; output "
        f"{'bit-equal to' if same else 'DIFFERS from'} the release build's), us after the rank's earliest CTA start:")
    for r, s in enumerate(summaries):
        for line in format_summary(s):
            say(f"  rank {r}  {line}")
        spans, gaps = [c["us"] for c in s["calls"]], [c["gap_us"] for c in s["calls"][1:]]
        say(f"  rank {r}  the graph's {calls} call(s): span {min(spans):.1f}-{max(spans):.1f} us (median "
            f"{statistics.median(spans):.1f})" + (f", gaps between calls {min(gaps):.1f}-{max(gaps):.1f} us" if gaps else ""))
    return {"bit_equal": same, "ranks": summaries}


def _profile(fn, barrier, lead: bool, label: str) -> None:
    """Run ``fn`` under torch.profiler on every rank (it is collective); rank 0 prints the top ops. Profile a
    graph replay where the path allows it: an eager call's communication kernels also time the peers'
    launch skew."""
    from torch.profiler import ProfilerActivity, profile

    barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        barrier()
    if lead:
        print(f"profile at {label}:")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=18, max_name_column_width=60))


def _print_table(preset, shape, num_ranks, mma_type, hbm, rows, receipt, method) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"megamoe EP MoE, {preset} {shape}, {mma_type}, {num_ranks} rank(s) | {receipt.get('gpu')} "
             f"CC {receipt.get('compute_capability', '-')} | torch {receipt['torch']} CUDA {receipt['cuda']} "
             f"DSL {receipt['cutlass_dsl']} | HBM read {hbm:.0f} GB/s")
    table = Table(title=title, caption=method)
    for col in ("tokens/rank", "ring rows", "path", "method", "us", "TFLOP/s", "rows/rank", "experts/rank", "weights GB/s", "FP4 floor us", "a2a GB/s", "verdict"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["tokens_per_rank"]), "-" if r["ring_tokens"] is None else str(r["ring_tokens"]), r["path"], r["method"], f"{r['us']:.1f}", f"{r['tflops']:.1f}", f"{r['routed_rows_per_rank']:.0f}",
            f"{r['experts_touched_per_rank']:.1f}", f"{r['weights_gbps']:.0f}",
            "-" if r["fp4_floor_us"] is None else f"{r['fp4_floor_us']:.1f}", f"{r['a2a_gbps']:.1f}",
            f"{'ok' if r['correct'] else 'WRONG'} {r['rel_fro']:.1e}",
        )
    Console(width=200).print(table)
