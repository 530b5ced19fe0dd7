"""A/B of megamoe builds on the EP MoE benchmark, alternated in one session.

A GPU's state (power cap, clocks) drifts within a session and more between sessions and machines
(bench/findings/measurement-caveats.md), so a change is only judged against its base timed in the same session, in
turns.

    python bench/ab.py prepare main new=wip/x        # here: each ref's package and tests into .ab/<label>/
    python bench/ab.py run --nproc 2 --rounds 2 --out bench/results/NAME.json -- --preset flash --tokens 1,8 \\
        --paths mega --routings 8                    # on the GPU machine (carry .ab): the builds in turns

``prepare`` exports ``megamoe/``, ``tests/`` and ``pyproject.toml`` of each git ref (``git archive``: the only step
that needs git), or copies them from a directory holding a megamoe tree (a path: ``.``, ``/...``, ``./...`` or ``../...``, e.g.
``new=../other-checkout``: its files as they are; no git needed). ``.ab`` is git-ignored; a build's GPU tests run in its directory: ``cd .ab/new && python -m
pytest -m gpu tests/...``. ``run`` starts ``python -m torch.distributed.run --standalone --nproc-per-node N -m
megamoe.bench ARGS --json ...`` (this interpreter: no ``torchrun`` on PATH needed) once per build and round, round by
round, each with the build's package first on PYTHONPATH and its own CuTe DSL cache. A run that fails, reports an
incorrect row or ran another megamoe than its build's (source digest) fails the A/B (exit 1): a time is never kept
without its check. It prints us per point and build (every round, and the ratio of the mean to the first build's)
and writes one receipt: the builds (ref, commit or None for a copied directory, source digest), the environment,
every run's rows (rewritten after each checked run: a cut-short A/B keeps its runs, ``"complete": false``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # megamoe.bench.common (source_digest), from this checkout

from megamoe.bench.common import source_digest  # noqa: E402

BUILDS_FILE = "builds.json"
EXPORTED = ("megamoe", "tests", "pyproject.toml")


def _git(*args: str, text: bool = True) -> str | bytes:
    """``git ARGS`` in this checkout; a clear SystemExit where git or the checkout is missing."""
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=text)
    except FileNotFoundError:
        raise SystemExit(f"bench/ab.py: `git {' '.join(args)}` needs git, not found on PATH (a directory holding a "
                         "megamoe tree needs no git: give its path instead of a ref)") from None
    except subprocess.CalledProcessError as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr
        raise SystemExit(f"bench/ab.py: `git {' '.join(args)}` failed in {ROOT} (not a git checkout, or an unknown "
                         f"ref?): {stderr.strip()}") from None
    return proc.stdout.strip() if text else proc.stdout


def _is_tree(ref: str) -> bool:
    """Whether ``ref`` is a path (``.``, or starting with ``/``, ``./`` or ``../``: never read as a git ref) to a
    directory holding a megamoe tree, copied as it is, rather than a git ref."""
    is_path = ref in (".", "..") or ref.startswith(("/", "./", "../"))
    return is_path and (Path(ref) / "megamoe" / "__init__.py").is_file()


def prepare(specs: list[str], directory: Path) -> list[dict]:
    """Each ``[label=]ref``'s ``megamoe/``, ``tests/`` and ``pyproject.toml`` into ``directory/<label>``: ``git
    archive`` of a git ref, or a copy of a directory holding a megamoe tree (a path: ``.``, or starting with ``/``,
    ``./`` or ``../``; ``commit`` None; no git needed). The label defaults to the ref with '/' as '_' (a directory:
    its name). Replaces ``directory``. Returns the builds (label, ref, commit, source digest)."""
    builds = []
    for spec in specs:
        label, _, ref = spec.rpartition("=")
        label = label or (Path(ref).resolve().name if _is_tree(ref) else ref.replace("/", "_"))
        if not re.fullmatch(r"[\w.@-]+", label) or label in (".", "..") or any(b["label"] == label for b in builds):
            raise SystemExit(f"build label {label!r} (from {spec!r}) must be unique, letters, digits, . _ @ -")
        builds.append({"label": label, "ref": ref, "commit": None})
    for b in builds:
        if not _is_tree(b["ref"]):
            b["commit"] = _git("rev-parse", "--verify", f"{b['ref']}^{{commit}}")
    shutil.rmtree(directory, ignore_errors=True)
    for b in builds:
        dest = directory / b["label"]
        dest.mkdir(parents=True)
        if b["commit"] is None:
            for name in EXPORTED:
                src = Path(b["ref"]) / name
                if src.is_dir():
                    shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
                elif src.exists():
                    shutil.copy2(src, dest / name)
        else:
            archive = _git("archive", b["commit"], *EXPORTED, text=False)
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        b["megamoe_source"] = source_digest(dest / "megamoe")
    (directory / BUILDS_FILE).write_text(json.dumps(builds, indent=1))
    return builds


def run(directory: Path, bench_args: list[str], nproc: int, rounds: int, timeout: int, out: Path | None = None) -> dict:
    """Every build's benchmark run, round by round; returns the receipt (raises SystemExit on a failed run). ``out``:
    the receipt is rewritten there after every checked run ("complete" false until the last), so an A/B cut short
    (a failed run, a time limit) keeps the runs it checked."""
    builds = json.loads((directory / BUILDS_FILE).read_text())
    cache_root = os.environ.get("CUTE_DSL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "cute-dsl-cache"))
    receipt = {"benchmark": "bench/ab.py run", "bench_args": bench_args, "nproc": nproc, "rounds": rounds,
               "builds": builds, "environment": None, "complete": False, "runs": []}
    for rnd in range(1, rounds + 1):
        for b in builds:
            build_dir = (directory / b["label"]).resolve()
            with tempfile.TemporaryDirectory() as tmp:
                run_json = Path(tmp) / "run.json"
                path = os.pathsep.join(filter(None, [str(build_dir), os.environ.get("PYTHONPATH")]))
                env = dict(os.environ, PYTHONPATH=path,
                           CUTE_DSL_CACHE_DIR=os.path.join(cache_root, b["label"]))
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                       "-m", "megamoe.bench", *bench_args, "--json", str(run_json)]
                try:
                    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"{b['label']} round {rnd}: still running after {timeout} s") from None
                if proc.returncode != 0 or not run_json.exists():
                    log = (proc.stdout + proc.stderr)[-4000:]
                    raise SystemExit(f"{b['label']} round {rnd}: exit {proc.returncode}\n{log}")
                result = json.loads(run_json.read_text())
            if result["environment"]["megamoe_source"] != b["megamoe_source"]:
                raise SystemExit(f"{b['label']} round {rnd} ran megamoe {result['environment']['megamoe_source']}, not "
                                 f"its build's {b['megamoe_source']} (another megamoe ahead on the path?)")
            bad = [r for r in result["results"] if not r["correct"]]
            if bad:
                raise SystemExit(f"{b['label']} round {rnd}: incorrect rows {bad}")
            receipt["environment"] = receipt["environment"] or result["environment"]
            receipt["runs"].append({"build": b["label"], "round": rnd, "preset": result["preset"],
                                    "hbm_read_gbps": result["hbm_read_gbps"], "results": result["results"]})
            print(f"{b['label']} round {rnd}: " + ", ".join(f"{r['tokens_per_rank']} {r['path']} {r['us']:.1f} us"
                                                             for r in result["results"]), flush=True)
            receipt["complete"] = rnd == rounds and b is builds[-1]
            if out is not None:  # whole or not at all, should the A/B be killed meanwhile
                partial = out.with_name(out.name + ".tmp")
                partial.write_text(json.dumps(receipt, indent=1))
                os.replace(partial, out)
    return receipt


def summary(receipt: dict) -> list[str]:
    """One line per (preset, tokens/rank, path): each build's us in every round, the ratio of its mean to the first
    build's, and the verdict (every run of the A/B is checked: incorrect runs never reach a receipt)."""
    labels = [b["label"] for b in receipt["builds"]]
    times: dict[tuple, dict[str, list[float]]] = {}
    for run_ in receipt["runs"]:
        for r in run_["results"]:
            point = times.setdefault((run_["preset"], r["tokens_per_rank"], r["path"]), {})
            point.setdefault(run_["build"], []).append(r["us"])
    lines = ["preset tokens/rank path | " + " | ".join(f"{lab} us (each round), vs {labels[0]}" for lab in labels)]
    for (preset, tokens, path), per_build in times.items():
        base = statistics.mean(per_build[labels[0]])
        cells = [" / ".join(f"{t:.1f}" for t in per_build[lab]) + f" ({statistics.mean(per_build[lab]) / base:.3f}x)"
                 for lab in labels]
        lines.append(f"{preset} {tokens} {path} | " + " | ".join(cells) + " | checked ok")
    return lines


def main(argv: list[str] | None = None) -> dict | list:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="bench/ab.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="export each [label=]ref's package and tests into --dir (a ref: a git ref, "
                        "or a directory holding a megamoe tree)")
    pp.add_argument("refs", nargs="+")
    pr = sub.add_parser("run", help="run the prepared builds in turns; benchmark arguments after --")
    pr.add_argument("--nproc", type=int, default=1)
    pr.add_argument("--rounds", type=int, default=2)
    pr.add_argument("--timeout", type=int, default=600, help="seconds per benchmark run")
    pr.add_argument("--out", type=Path, default=None, help="write the receipt here")
    for q in (pp, pr):
        q.add_argument("--dir", type=Path, default=ROOT / ".ab")
    args = p.parse_args(argv)
    if args.command == "prepare":
        builds = prepare(args.refs, args.dir)
        for b in builds:
            print(f"{b['label']}: {b['ref']} {(b['commit'] or 'copied')[:12]} megamoe {b['megamoe_source']}")
        return builds
    if args.rounds < 1 or args.nproc < 1:
        raise SystemExit("--rounds and --nproc must be >= 1")
    if "--json" in bench_args:
        raise SystemExit("bench/ab.py sets the benchmark's --json itself")
    receipt = run(args.dir, bench_args, args.nproc, args.rounds, args.timeout, args.out)
    for line in summary(receipt):
        print(line)
    return receipt


if __name__ == "__main__":
    main()
