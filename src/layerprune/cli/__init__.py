"""The `layerprune` console script: subcommands, each a thin layer over a Python function."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from typing import Sequence

from pydantic import ValidationError

from layerprune import __version__
from layerprune.errors import LayerpruneError, one_line
from layerprune.schema_cli import validation_message

# subcommand -> module exposing `configure(parser)` and `run(args) -> int` (heavy imports inside `run`)
COMMANDS: dict[str, tuple[str, str]] = {
    "prune": ("layerprune.prune.cli", "score decoder blocks, drop the least important, save the smaller model"),
    "evaluate": ("layerprune.evaluate.cli", "evaluate models with lm-eval suites and algorithmic probes"),
    "recover": ("layerprune.recover.cli", "fine-tune a pruned model on the original model's own responses"),
    "recipes": ("layerprune.recipes_cli", "list, show, copy or validate the shipped recipes"),
    "run": ("layerprune.pipeline.cli", "prune -> evaluate -> recover -> evaluate -> report, from one recipe"),
    "study": ("layerprune.pipeline.study_cli", "recovery study: prune once, recover with several methods, compare"),
    "variant-study": ("layerprune.pipeline.variant_cli", "make a variant with our recovery code and compare its "
                      "importance profile with the original's"),
    "analyze": ("layerprune.analyze.cli", "critical blocks across models, representation drift, degeneration"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerprune", description="Make decoder-only LLMs shallower and measure the cost.")
    parser.add_argument("--version", action="version", version=f"layerprune {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                             help="print warnings and errors only")
        if importlib.util.find_spec(module_name) is None:
            command.set_defaults(handler=_not_yet(name))
            continue
        module = importlib.import_module(module_name)
        module.configure(command)
        command.set_defaults(handler=module.run)
    return parser


def _not_yet(name: str):  # type: ignore[no-untyped-def]
    def handler(args: argparse.Namespace) -> int:
        raise LayerpruneError(f"'{name}' is not yet available in this version")

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; user errors print one line and exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "huggingface_hub", "datasets", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.handler(args) or 0)
    except LayerpruneError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        print(f"error: {validation_message(exc, exc.title)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; re-run the same command to resume where possible", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())


def _alias(command: str) -> None:
    sys.exit(main([command, *sys.argv[1:]]))


def prune_entry() -> None:
    _alias("prune")


def recover_entry() -> None:
    _alias("recover")


def evaluate_entry() -> None:
    _alias("evaluate")
