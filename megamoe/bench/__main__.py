"""Entry point: ``python -m megamoe.bench [moe|gemm|decode|plot] [args]``; without a subcommand, ``moe``."""

import importlib
import sys

SUBCOMMANDS = ("moe", "gemm", "decode", "plot")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else "moe"
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    importlib.import_module(f"megamoe.bench.{name}").main(rest)


if __name__ == "__main__":
    main()
