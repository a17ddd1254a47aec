"""`python -m pagedserve.router ...`: the same as `pagedserve router ...`."""

from __future__ import annotations

import argparse
import sys

from pagedserve.router.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve router", description="KV-cache-aware router")
    add_arguments(parser)
    return int(run(parser.parse_args(argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
