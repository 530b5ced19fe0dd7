"""Plots of benchmark receipts: ``python -m megamoe.bench plot RECEIPT.json [--out PLOT.png]``.

Microseconds per call against tokens per rank (``megamoe.bench moe`` receipts; one panel) or rows per expert
(``megamoe.bench gemm`` receipts; one panel per preset, layer and EP degree), one line per path, both axes
logarithmic. Only checked points are drawn (a time is never shown without its verdict): rows marked incorrect or
failed are left out and counted in the title. matplotlib comes with the ``bench`` extra; the benchmarks save the plot
beside their JSON receipt when it is importable, and this command draws it later on a machine that has it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def panels(receipt: dict) -> list[dict]:
    """The receipt's plot data: ``[{"title", "xlabel", "lines": {path: [(x, us), ...] sorted by x}, "left_out"}]``.

    ``megamoe.bench moe`` receipts (``results``): one panel, x = tokens per rank, a line per ``path``;
    ``megamoe.bench gemm`` receipts (``records``): a panel per (preset, layer, EP), x = rows per expert, a line per
    ``impl`` (a second row of the same impl at a point, its alternative config, becomes ``impl (alt)``).
    """
    if "results" in receipt:
        lines: dict[str, list] = {}
        left_out = 0
        for row in receipt["results"]:
            if not row.get("correct") or row.get("us") is None:
                left_out += 1
                continue
            lines.setdefault(row["path"], []).append((row["tokens_per_rank"], row["us"]))
        short = {"experts": "E", "topk": "top-k", "hidden": "H", "intermediate": "I"}
        shape = " ".join(f"{short.get(key, key)}={value}" for key, value in receipt.get("shape", {}).items())
        gpu = receipt.get("environment", {}).get("gpu", "")
        title = f"MoE layer, {receipt.get('preset', '')} ({shape}), {receipt.get('mma_type', '')}\n{gpu}"
        return [{"title": title, "xlabel": "tokens per rank", "lines": _sorted(lines), "left_out": left_out}]
    if "records" in receipt:
        out: dict[tuple, dict] = {}
        for record in receipt["records"]:
            p = record["point"]
            key = (p["preset"], p["layer"], p["ep"])
            panel = out.setdefault(key, {
                "title": f"{p['preset']} {p['layer']} EP{p['ep']}: {p['experts']} experts, N={p['n']} K={p['k']}",
                "xlabel": "rows per expert", "lines": {}, "left_out": 0})
            seen = set()
            for result in record["results"]:
                name = result["impl"] + (" (alt)" if result["impl"] in seen else "")
                seen.add(result["impl"])
                if result.get("us") is None or not result["verdict"].startswith("PASS"):
                    panel["left_out"] += 1
                    continue
                panel["lines"].setdefault(name, []).append((p["rows_per_expert"], result["us"]))
        for panel in out.values():
            panel["lines"] = _sorted(panel["lines"])
        return list(out.values())
    raise ValueError("not a megamoe.bench receipt: it has neither `results` (moe) nor `records` (gemm)")


def _sorted(lines: dict) -> dict:
    return {name: sorted(points) for name, points in lines.items()}


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(receipt: dict, out: str | Path) -> Path:
    """Draw ``panels(receipt)`` into the image file ``out`` (format from its suffix); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = panels(receipt)
    cols = min(2, len(data))
    rows = -(-len(data) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, data):
        for name, points in panel["lines"].items():
            ax.plot([x for x, _ in points], [us for _, us in points], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel("us per call")
        note = f" ({panel['left_out']} unchecked or failed points left out)" if panel["left_out"] else ""
        ax.set_title(panel["title"] + note, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(data):]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def save_plot_beside(json_path: str | Path, say=print) -> Path | None:
    """After a benchmark wrote its receipt ``json_path``: draw it to the same path with a ``.png`` suffix when
    matplotlib is importable, else say how to draw it later. Returns the plot's path or None."""
    if not have_matplotlib():
        say(f"matplotlib not installed: no plot (draw it where matplotlib is: python -m megamoe.bench plot {json_path})")
        return None
    path = draw(json.loads(Path(json_path).read_text()), Path(json_path).with_suffix(".png"))
    say(f"plot written to {path}")
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench plot", description=__doc__.split("\n\n")[0])
    p.add_argument("receipt", help="a JSON receipt of megamoe.bench moe or gemm")
    p.add_argument("--out", default=None, help="image file (default: the receipt's path with a .png suffix)")
    args = p.parse_args(argv)
    if not have_matplotlib():
        raise SystemExit("megamoe.bench plot needs matplotlib (pip install -e '.[bench]')")
    receipt = json.loads(Path(args.receipt).read_text())
    out = draw(receipt, args.out or Path(args.receipt).with_suffix(".png"))
    print(f"plot written to {out}")
    return out
