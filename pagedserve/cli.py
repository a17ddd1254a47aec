"""`pagedserve` command line: one entry point, each subcommand defined beside the code it runs.

Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int | None`` and keeps its
top-level imports light, so `pagedserve router --help` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

# name -> (module, help). Nested groups (bench) map to their own table.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.server.api.cli", "run the OpenAI-compatible engine server"),
    "generate": (
        "pagedserve.server.entrypoints.cli_generate", "generate text offline for one or more prompts"
    ),
    "router": ("pagedserve.router.cli", "run the KV-cache-aware router in front of engine replicas"),
    "operator": ("pagedserve.operator.main", "run the Kubernetes operator for ModelDeployments"),
}
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "throughput": ("pagedserve.benchmarks.throughput", "offline engine throughput, optionally against HF"),
    "serve": ("pagedserve.benchmarks.serve", "serving benchmark against an OpenAI-compatible endpoint"),
    "plot": ("pagedserve.benchmarks.plot", "plot results of `bench serve`"),
}


def _add_group(subparsers: argparse._SubParsersAction, table: dict[str, tuple[str, str]]) -> None:
    for name, (module_name, help_text) in table.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Its extra is not installed (each image carries only its own: the server image has no
            # [router]); the other subcommands must still work, this one says what it lacks, whatever
            # its arguments (no prefix character: every one is a positional the parser accepts).
            parser = subparsers.add_parser(name, help=help_text, prefix_chars="\0", add_help=False)
            parser.add_argument("ignored", nargs="*")
            parser.set_defaults(_run=_missing(name, error))
            continue
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parser)
        parser.set_defaults(_run=module.run)


def _missing(name: str, error: ModuleNotFoundError) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(
            f"pagedserve {name} cannot run: {error} (its pyproject.toml extra is not installed)",
            file=sys.stderr,
        )
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.version import __version__

    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on Kubernetes")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_group(commands, COMMANDS)
    bench = commands.add_parser("bench", help="benchmarks", description="benchmarks")
    _add_group(bench.add_subparsers(dest="bench_command", required=True), BENCH_COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads that spin while waiting make torch several times slower whenever the cores are
    # shared (several replicas on a node, a busy CI host); must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
