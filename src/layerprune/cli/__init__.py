"""The `layerprune` console script (top floor): subcommands, each a thin layer over a Python function.

Nothing below this package imports it; a stage's schema carries the help text and `flags` turns it into options.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.recipe_loading import validation_message
from layerprune.core.version import package_version

# subcommand -> module exposing `configure(parser)` and `run(args) -> int` (heavy imports inside `run`)
COMMANDS: dict[str, tuple[str, str]] = {
    "prune": ("layerprune.cli.prune", "score decoder blocks, drop the least important, save the smaller model"),
    "evaluate": ("layerprune.cli.evaluate", "evaluate models with lm-eval suites and algorithmic probes"),
    "recover": ("layerprune.cli.recover", "fine-tune a pruned model on the original model's own responses"),
    "recipes": ("layerprune.cli.recipes", "list, show, copy or validate the shipped recipes"),
    "run": ("layerprune.cli.run", "prune -> evaluate -> recover -> evaluate -> report, from one recipe"),
    "study": ("layerprune.cli.study", "sweep (one k: prune once, recover with several methods, compare) "
                                       "or grain study"),
    "variant-study": ("layerprune.cli.variant_study", "make a variant with our recovery code and compare its "
                      "importance profile with the original's"),
    "variant": ("layerprune.cli.variant", "post-train a model that can reason (sft, rft, grpo, distill), cached by "
                "recipe"),
    "analyze": ("layerprune.cli.analyze", "critical blocks across models, representation drift, degeneration, "
                "sweeps compared"),
    "export": ("layerprune.cli.export", "write a pruned or recovered model as GGUF for llama.cpp / Ollama"),
    "check-serve": ("layerprune.cli.check_serve", "vLLM loads a model and continues as transformers does"),
    "records": ("layerprune.cli.records", "pack a run's per-item records (no document text) to keep, or unpack them"),
    "push": ("layerprune.cli.push", "share a pruned, recovered or variant folder, or a GGUF file, on the hub"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors in one line (the command's --help says the rest), not the usage block first:
    every bad input ends in one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="layerprune",
                                     description="Make decoder-only LLMs shallower and measure the cost.")
    parser.add_argument("--version", action="version", version=f"layerprune {package_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                             help="print warnings and errors only")
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the full traceback of an unexpected error")
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
        import layerprune.posttrain  # noqa: F401  (`variant:NAME` wherever a model is accepted)
        from layerprune.models.loading import planning

        with planning() if getattr(args, "dry_run", False) else contextlib.nullcontext():
            code = int(args.handler(args) or 0)
            sys.stdout.flush()  # a closed pipe found here, not by Python's own flush at exit
            return code
    except LayerpruneError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        print(f"error: {validation_message(exc, exc.title)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; re-run the same command to resume where possible", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`| head`): nothing to say, as a Unix tool
        with contextlib.suppress(OSError, ValueError):  # no second error when Python flushes at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # a library's own failure: one line naming the stage, the traceback kept
        if args.debug:
            raise
        stage = getattr(exc, "layerprune_stage", args.command)
        where = save_traceback(exc, traceback_folder(exc, args), args.command)
        kept = f"traceback in {where}" if where else "traceback not saved"
        print(f"error: {stage} failed: {type(exc).__name__}: {one_line(exc)[:300]} ({kept}; --debug shows it)",
              file=sys.stderr)
        return 1


def traceback_folder(exc: BaseException, args: argparse.Namespace) -> Path:
    """Where the traceback goes: the run's folder (a pipeline's, or recover's work folder, or an existing output
    folder), else layerprune's cache."""
    folder = getattr(exc, "layerprune_folder", None)
    output = getattr(args, "output", None)
    candidates = [folder] if folder is not None else []
    if output is not None:
        candidates += [Path(output).parent / f"{Path(output).name}.work", Path(output)]
    existing = next((Path(c) for c in candidates if Path(c).is_dir()), None)
    if existing is not None:
        return existing
    from layerprune.core.settings import RunSettings

    return RunSettings().resolved_cache_dir() / "errors"


def save_traceback(exc: BaseException, folder: Path, command: str) -> Path | None:
    """Write the exception's traceback to FOLDER/traceback-COMMAND-TIME.txt; None when it cannot be written."""
    import time
    import traceback

    path = folder / f"traceback-{command}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


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
