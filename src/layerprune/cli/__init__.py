"""The `layerprune` console script (top floor): subcommands, each a thin layer over a Python function.

Nothing below this package imports it; a stage's schema carries the help text and `flags` turns it into options.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from layerprune import __version__
from layerprune.errors import LayerpruneError, one_line
from layerprune.recipe_loading import validation_message

# subcommand -> module exposing `configure(parser)` and `run(args) -> int` (heavy imports inside `run`)
COMMANDS: dict[str, tuple[str, str]] = {
    "prune": ("layerprune.cli.prune", "score decoder blocks, drop the least important, save the smaller model"),
    "evaluate": ("layerprune.cli.evaluate", "evaluate models with lm-eval suites and algorithmic probes"),
    "recover": ("layerprune.cli.recover", "fine-tune a pruned model on the original model's own responses"),
    "recipes": ("layerprune.cli.recipes", "list, show, copy or validate the shipped recipes"),
    "run": ("layerprune.cli.run", "prune -> evaluate -> recover -> evaluate -> report, from one recipe"),
    "study": ("layerprune.cli.study", "recovery study: prune once, recover with several methods, compare"),
    "variant-study": ("layerprune.cli.variant_study", "make a variant with our recovery code and compare its "
                      "importance profile with the original's"),
    "analyze": ("layerprune.cli.analyze", "critical blocks across models, representation drift, degeneration"),
    "export": ("layerprune.cli.export", "write a pruned or recovered model as GGUF for llama.cpp / Ollama"),
    "check-serve": ("layerprune.cli.check_serve", "vLLM loads a model and continues as transformers does"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerprune",
                                     description="Make decoder-only LLMs shallower and measure the cost.")
    parser.add_argument("--version", action="version", version=f"layerprune {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                             help="print warnings and errors only")
        module = importlib.import_module(module_name)
        module.configure(command)
        command.set_defaults(handler=module.run)
    return parser


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
