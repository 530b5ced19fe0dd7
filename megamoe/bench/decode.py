"""Warp-decode MoE on one GPU: ``python -m megamoe.bench decode [--shapes flash,pro] [--batches 1,..] [--json F]``.

For every shape (flash: hidden 4096, intermediate 2048, 32 and 128 experts; pro: 7168, 3072, 48 and
192 experts), top-k and batch it builds random FP4 weights (random codes, scales around 2**-6) and
``--routings`` random routings, checks ``moe_decode`` (output poisoned first) against a float64
reference on the first tokens of one routing, then times it in a CUDA graph that cycles through the
routings (so consecutive calls read different experts and the timing is not an L2-resident replay).
Warp decode runs three ways, each checked: ``simt us`` (per-pair SIMT kernels, canonical weights), ``mma
us`` (gate_up on tensor cores over the Mega MoE L1, SIMT down) and ``tc us`` (both weights in the Mega MoE layout,
both projections on tensor cores: the token-major kernels up to 4 tokens, the expert-major ones above; the last two
for shapes with the grouped path); GB/s,
%HBM and the crossover use the one ``MoEDecoder`` runs at that batch (``MoEDecoder.warp_weights``). Bandwidth counts the weight
bytes the routing actually needs: every row (and its scales) of W1 and W2 of each distinct routed
expert. The HBM ceiling is measured in the same run (``torch.sum`` over ``--hbm-gib`` GiB). Beside it,
torch's grouped GEMMs (FP8 rowwise ``torch._scaled_grouped_mm``, else BF16 ``torch._grouped_mm``) on
the same routed rows: L1 and L2 GEMMs only (routing permutation and SwiGLU excluded), each checked,
and megamoe's grouped path for the whole layer on one GPU (``MoEDecoder(..., path="grouped")``: FP8
token quantization, then the Mega MoE on one rank with the SM90 grouped GEMMs), checked against
the FP32 reference of the FP8 contract. The two megamoe columns give the crossover ``MoEDecoder``'s
``auto`` path uses (``megamoe.decode.MEASURED_CROSSOVERS``), printed per expert set.
Every time printed carries its run's correctness verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ..decode import MoEDecoder
from ..inputs import random_fp4_weights, random_routing, random_tokens
from ..numerics import max_row_rel_error, moe_tolerances, rel_fro_error
from ..reference import reference_decode, reference_moe
from .common import environment_receipt, fp4_expert_bytes, measure_hbm_read_bandwidth, time_graph

SHAPES = {"flash": (4096, 2048, (32, 128)), "pro": (7168, 3072, (48, 192)),
          "gpt-oss-120b": (2880, 2880, (16, 128)), "qwen3-30b-a3b": (2048, 768, (16, 128))}
"""name -> (hidden, intermediate, expert counts run). For the two model shapes: one rank's experts at EP8 and all of
them; their top-k (4 and 8) goes in ``--topk``; gpt-oss's sizes run zero-padded to 2944, Qwen3-30B-A3B's as they
are (``megamoe.decode``: warp decode reads the Mega MoE layout at those sizes)."""
DECODE_TOL = 2.0**-8  # BF16 rounding of y; FP32 accumulation (see tests/test_warp_decode.py)
ROW_TOL = 2.0**-8 * 1.05
TORCH_TOL = 2.0**-4  # FP8 rowwise activations in the torch baseline: a few 2**-5 per row


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class TorchGroupedGemm:
    """torch's grouped GEMMs for the routed rows (FP8 rowwise, else BF16): ``x W1^T`` then ``a W2^T``."""

    def __init__(self, experts: int, hidden: int, inter: int, device: torch.device, gen: torch.Generator):
        self.fp8 = hasattr(torch, "_scaled_grouped_mm")
        dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        # random weights with magnitudes in [2**-3, 2): E4M3 bytes 0x20..0x3f with random signs
        self.w1 = self._random(experts, 2 * inter, hidden, device, gen, dtype)
        self.w2 = self._random(experts, hidden, inter, device, gen, dtype)
        self.name = "torch fp8 grouped" if self.fp8 else "torch bf16 grouped"

    @staticmethod
    def _random(e, n, k, device, gen, dtype):
        codes = torch.randint(0x20, 0x40, (e, n, k), generator=gen, device=device, dtype=torch.uint8)
        codes |= torch.randint(0, 2, (e, n, k), generator=gen, device=device, dtype=torch.uint8) << 7
        w = codes.view(torch.float8_e4m3fn)
        return w if dtype == torch.float8_e4m3fn else w.to(dtype)

    def prepare(self, x: torch.Tensor, topk_idx: torch.Tensor):
        """Rows of x sorted by expert, group end offsets, activations for L2 (outside the timing)."""
        flat = topk_idx.flatten()
        valid = (flat >= 0).nonzero().squeeze(1)
        order = valid[torch.argsort(flat[valid], stable=True)]
        rows = x[order // topk_idx.shape[1]]
        counts = torch.bincount(flat[order], minlength=self.w1.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        a = torch.randn(rows.shape[0], self.w2.shape[2], device=x.device) * 0.1
        return rows, offs, a, flat[order]

    def _mm(self, act: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            scale = act.float().abs().amax(1).clamp(min=1e-12) / 448
            q = (act.float() / scale.unsqueeze(1)).to(torch.float8_e4m3fn)
            ones = torch.ones(w.shape[0], w.shape[1], device=w.device)
            return torch._scaled_grouped_mm(q, w.transpose(-2, -1), scale, ones, offs=offs, out_dtype=torch.bfloat16)
        return torch._grouped_mm(act.to(torch.bfloat16), w.transpose(-2, -1), offs=offs)

    def __call__(self, prepared) -> tuple[torch.Tensor, torch.Tensor]:
        rows, offs, a, _ = prepared
        return self._mm(rows, self.w1, offs), self._mm(a, self.w2, offs)

    def check(self, prepared) -> str:
        """Compare both GEMMs with float64 products of the rows actually fed (first rows)."""
        rows, _, a, experts = prepared
        if rows.shape[0] == 0:
            return "ok"
        h, o = self(prepared)
        n = min(4, rows.shape[0])
        errs = []
        for out, act, w in ((h, rows, self.w1), (o, a, self.w2)):
            ref = torch.stack([w[int(experts[r])].double() @ act[r].double() for r in range(n)])
            errs.append(rel_fro_error(out[:n], ref))
        return "ok" if max(errs) <= TORCH_TOL else f"FAIL({max(errs):.1e})"


def _check_decode(run, x, idx, wts, l1, l2, tokens: int) -> str:
    """``run(x, idx, wts, out)`` (out NaN-poisoned first) against the float64 reference on canonical l1, l2."""
    y = torch.full_like(x, float("nan"))
    run(x, idx, wts, y)
    ref = reference_decode(x[:tokens], idx[:tokens], wts[:tokens], l1, l2)
    fro, row = rel_fro_error(y[:tokens], ref), max_row_rel_error(y[:tokens], ref)
    return "ok" if fro <= DECODE_TOL and row <= ROW_TOL else f"FAIL({fro:.1e}/{row:.1e})"


def _check_grouped(decoder: MoEDecoder, x, route, l1, l2) -> str:
    """The grouped path (y poisoned first) against the FP32 reference on the FP8 tokens it quantized."""
    y = torch.full_like(x, float("nan"))
    decoder(x, *route, out=y, path="grouped")
    t = x.shape[0]
    ref = reference_moe(decoder.buf.x[:t], decoder.buf.x_sf[:t], *route, l1, l2)
    fro, row = rel_fro_error(y, ref), max_row_rel_error(y, ref)
    tol = moe_tolerances(decoder.l2[0].shape[2] * 2)
    return "ok" if fro <= tol["rel_fro"] and row <= tol["max_row_rel"] else f"FAIL({fro:.1e}/{row:.1e})"


def _time_cycling(fn, items: list, args) -> float:
    """Median us per call of ``fn(item)`` from a CUDA graph holding one call per item, in order."""
    calls = iter(range(10**9))
    return statistics.median(
        time_graph(lambda: fn(items[next(calls) % len(items)]), args.warmup, args.iters, calls_per_graph=len(items))
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench decode", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="flash,pro", help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--experts", default="", help="comma list overriding each shape's expert counts")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--routings", type=int, default=8, help="routings cycled through inside the timed graph")
    parser.add_argument("--check-tokens", type=int, default=2, help="tokens checked against the float64 reference")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hbm-gib", type=float, default=4.0)
    parser.add_argument("--down-rows", type=int, default=None, help="outputs per down warp (tuning)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch grouped-GEMM baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write a JSON receipt here: every row and crossover printed")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("megamoe.bench decode needs a CUDA GPU (Hopper); nothing to measure here.")
        return
    from ..kernels import decode as warp_decode

    device = torch.device("cuda")
    rows_kw = {} if args.down_rows is None else {"down_rows": args.down_rows}

    def moe_decode(x, idx, wts, l1, l2, out=None):
        return warp_decode.moe_decode(x, idx, wts, l1, l2, out=out, **rows_kw)

    receipt = environment_receipt(device, 1)
    print(receipt)
    hbm = measure_hbm_read_bandwidth(device, args.hbm_gib)
    print(f"measured HBM read bandwidth: {hbm:.0f} GB/s (torch.sum over {args.hbm_gib} GiB)")
    header = (f"{'shape':6} {'E':>4} {'T':>3} {'simt us':>8} {'check':>7} {'mma us':>8} {'check':>7} {'tc us':>8} {'check':>7} {'MB read':>8} "
              f"{'GB/s':>7} {'%HBM':>6}  {'grouped us':>10} {'check':>7}  {'torch us':>9} {'torch check':>11}")
    print(header)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    rows, crossovers = [], []
    for shape in args.shapes.split(","):
        hidden, inter, expert_counts = SHAPES[shape]
        for experts in _ints(args.experts) or expert_counts:
            l1 = random_fp4_weights(experts, 2 * inter, hidden, gen, device)
            l2 = random_fp4_weights(experts, hidden, inter, gen, device)
            baseline = None
            if not args.no_torch:
                try:
                    baseline = TorchGroupedGemm(experts, hidden, inter, device, gen)
                except (RuntimeError, torch.OutOfMemoryError) as exc:
                    print(f"torch baseline unavailable: {exc}")
            decoder = MoEDecoder(l1, l2, args.topk, max(_ints(args.batches)))
            warp_wins = []
            for tokens in _ints(args.batches):
                x = random_tokens(tokens, hidden, cpu_gen).to(device)
                routes = [random_routing(tokens, experts, args.topk, cpu_gen) for _ in range(args.routings)]
                routes = [(i.to(device), w.to(device)) for i, w in routes]
                checked = min(tokens, args.check_tokens)
                # gate_up on SIMT pipes over canonical L1; on tensor cores over the Mega MoE L1; both on tensor cores
                runs = {"simt": (decoder.l1, decoder.l2)}
                if decoder.grouped:
                    runs["mma"] = (decoder.mega.l1, decoder.l2)
                    runs["tc"] = (decoder.mega.l1, decoder.mega.l2)
                timed = {}
                for name, (w1, w2) in runs.items():
                    fn = lambda r, x=x, y=None, w1=w1, w2=w2: moe_decode(x, *r, w1, w2, out=y)  # noqa: E731
                    check = _check_decode(lambda x, i, w, y, fn=fn: fn((i, w), x, y), x, *routes[0], l1, l2, checked)
                    timed[name] = (_time_cycling(fn, routes, args), check)
                w1, w2 = decoder.warp_weights()
                chosen = next(n for n, ws in runs.items() if ws[0] is w1 and ws[1] is w2)
                us, verdict = timed[chosen]
                simt_cols = f"{timed['simt'][0]:8.1f} {timed['simt'][1]:>7}"
                mma_cols = " ".join(f"{timed[n][0]:8.1f} {timed[n][1]:>7}" if n in timed else f"{'-':>8} {'-':>7}"
                                    for n in ("mma", "tc"))
                unique = statistics.mean(int(torch.unique(i[i >= 0]).numel()) for i, _ in routes)
                nbytes = unique * fp4_expert_bytes(hidden, inter)
                gbs = nbytes / (us * 1e-6) / 1e9
                y = torch.empty_like(x)
                grouped_verdict = _check_grouped(decoder, x, routes[0], l1, l2)
                grouped_us = _time_cycling(lambda r, x=x, y=y: decoder(x, *r, out=y, path="grouped"), routes, args)
                grouped_cols = f"{grouped_us:10.1f} {grouped_verdict:>7}"
                if verdict == "ok" and grouped_verdict == "ok" and us < grouped_us:
                    warp_wins.append(tokens)
                torch_cols = f"{'-':>9} {'-':>11}"
                row = {"shape": shape, "experts": experts, "topk": args.topk, "tokens": tokens,
                       **{f"{n}_us": t for n, (t, _) in timed.items()},
                       **{f"{n}_check": c for n, (_, c) in timed.items()},
                       "decoder_runs": chosen, "weight_bytes": nbytes, "gbps": gbs, "hbm_fraction": gbs / hbm,
                       "grouped_us": grouped_us, "grouped_check": grouped_verdict}
                if baseline is not None:
                    try:
                        prepared = [baseline.prepare(x, i) for i, _ in routes]
                        row["torch_check"] = baseline.check(prepared[0])
                        row["torch_us"] = _time_cycling(baseline, prepared, args)
                        torch_cols = f"{row['torch_us']:9.1f} {row['torch_check']:>11}"
                    except (RuntimeError, TypeError, ValueError) as exc:  # torch builds without these kernels
                        torch_cols = f"{'n/a':>9} {str(exc).splitlines()[0][:40]}"
                        row["torch_check"] = f"n/a: {str(exc).splitlines()[0]}"
                rows.append(row)
                print(f"{shape:6} {experts:4d} {tokens:3d} {simt_cols} {mma_cols} {nbytes / 1e6:8.1f} {gbs:7.0f} "
                      f"{100 * gbs / hbm:5.1f}%  {grouped_cols}  {torch_cols}", flush=True)
            batches = _ints(args.batches)
            crossover = next((b for b in batches if b not in warp_wins), None)
            crossover = batches[-1] if crossover is None else max([b for b in batches if b < crossover], default=0)
            print(f"crossover {shape} E={experts} k={args.topk}: warp decode faster (both checked ok) at batches "
                  f"{warp_wins}; largest batch below the first grouped win: {crossover}", flush=True)
            crossovers.append({"shape": shape, "hidden": hidden, "intermediate": inter, "experts": experts,
                               "topk": args.topk, "warp_decode_faster_at": warp_wins, "crossover": crossover})
            l1 = l2 = baseline = decoder = None  # free this expert set before the next one is drawn
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "megamoe.bench decode", "args": vars(args), "environment": receipt,
                       "hbm_read_gbps": hbm, "method": f"CUDA graph of one call per routing ({args.routings}), "
                       f"median of {args.iters} replays after {args.warmup} warm-up", "rows": rows,
                       "crossovers": crossovers}, f, indent=1)
        print(f"receipt written to {args.json}")


if __name__ == "__main__":
    main()
