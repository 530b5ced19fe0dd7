"""Write bench/results/README.md: one row per receipt with its date, build, command and the files that cite it.

    python bench/results/index.py           # regenerate the index
    python bench/results/index.py --check   # also fail if a receipt outside archive/ is cited nowhere,
                                            # or one in archive/ is cited (move it back)

Standard library only. A receipt is any file under the topic folders (gemm/, mega/, moe/, decode/) or archive/.
Its build is the commit hash in its file name, else the hashes in its JSON's build fields (or a text receipt's
first lines); its command is the JSON's "command" (or the bench/ab.py arguments it records, or a text receipt's
first command line). "Cited by" lists the repository's *.md and *.py files that contain the receipt's file name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FOLDERS = ("gemm", "mega", "moe", "decode", "archive")
SKIP_DIRS = {".git", ".ab", "scratch", "__pycache__", ".pytest_cache", "build", "dist"}
DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})_")
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")
"""A git commit, abbreviated (7-12 hex digits) or full; not the 16-digit source digests (``megamoe_source``)."""
BUILD_KEYS = ("build", "builds", "commit", "commits", "code", "new_code", "benchmark", "what", "description",
              "experiment")
COMMAND_LINE = re.compile(r"^\W{0,3}((?:python|torchrun)\s.*)$")


def receipts() -> list[Path]:
    return sorted(p for folder in FOLDERS if (HERE / folder).is_dir()
                  for p in (HERE / folder).iterdir() if p.is_file() and DATE.match(p.name))


def strings(value) -> list[str]:
    """Every string inside a JSON value (keys of dicts included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def hashes(texts) -> list[str]:
    seen = []
    for text in texts:
        for h in HASH.findall(text):
            h = h[:7]
            if h not in seen:
                seen.append(h)
    return seen


def describe(path: Path) -> tuple[str, str]:
    """(build, command) of one receipt."""
    stem = path.stem.split("_")
    named = [w for w in stem if HASH.fullmatch(w)]
    text = path.read_text(errors="replace")
    data = None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            data = None
    if isinstance(data, dict):
        build = named or hashes(s for k in BUILD_KEYS if k in data for s in strings(data[k]))
        command = data.get("command") if isinstance(data.get("command"), str) else ""
        if not command and isinstance(data.get("bench_args"), list):
            command = f"bench/ab.py run --nproc {data.get('nproc', '?')} -- " + " ".join(map(str, data["bench_args"]))
        if not command and isinstance(data.get("runs"), dict):
            command = next((r["command"] for r in data["runs"].values()
                            if isinstance(r, dict) and isinstance(r.get("command"), str)), "")
    else:
        head = text[:1500]
        build = named or hashes([head])
        command = next((m.group(1) for line in head.splitlines() if (m := COMMAND_LINE.match(line.strip()))), "")
    return ", ".join(build[:4]) + (" ..." if len(build) > 4 else ""), command.strip()


def citing_files() -> dict[Path, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix in (".md", ".py") and p != HERE / "README.md" and p != Path(__file__).resolve():
                out[p] = p.read_text(errors="replace")
    return out


def cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on uncited receipts outside archive/")
    args = parser.parse_args()
    files = citing_files()
    rows, problems = [], []
    for path in receipts():
        rel = path.relative_to(HERE).as_posix()
        build, command = describe(path)
        cited = sorted(f.relative_to(ROOT).as_posix() for f, text in files.items() if path.name in text)
        archived = rel.startswith("archive/")
        if not cited and not archived:
            problems.append(f"cited nowhere, move to archive/: {rel}")
        if cited and archived:
            problems.append(f"in archive/ but cited by {', '.join(cited)}: {rel}")
        rows.append(f"| [{rel}]({rel}) | {DATE.match(path.name).group(1)} | {cell(build)} | "
                    f"{'`' + cell(command) + '`' if command else ''} | {', '.join(cited)} |")
    lines = [
        "# Benchmark receipts",
        "",
        "Generated by `python bench/results/index.py`; do not edit by hand. A receipt is what a benchmark run wrote",
        "(the machine, the versions, the method and every point's correctness verdict beside its time). Folders:",
        "`gemm/` (grouped GEMM alone, plain-read probes), `mega/` (the Mega MoE kernel's A/Bs, timelines and experiments),",
        "`moe/` (whole-layer tables, Mega MoE and the staged path), `decode/` (one-GPU warp decode), `archive/` (receipts",
        "no document cites any more; kept). Build: the commit in the file name, else those its JSON or text header",
        "names. The current tables are in [docs/performance.md](../../docs/performance.md), the history in",
        "[bench/findings/](../findings/README.md).",
        "",
        f"{len(rows)} receipts.",
        "",
        "| file | date | build | command | cited by |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ]
    (HERE / "README.md").write_text("\n".join(lines) + "\n")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
