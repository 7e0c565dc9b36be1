"""`layerprune push DIR|FILE.gguf --repo OWNER/NAME`: share a pruned, recovered or variant folder, or a GGUF file,
on the Hugging Face hub with its card (base model, removals, recovery, scores)."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="A model folder layerprune made (prune, recover, variant) or a .gguf "
                        "file `layerprune export` wrote")
    parser.add_argument("--repo", required=True, metavar="OWNER/NAME", help="The hub repo (created when missing)")
    parser.add_argument("--private", action="store_true", help="Create the repo private (an existing repo keeps its "
                        "visibility)")
    parser.add_argument("--scores", type=Path, default=None, metavar="EVAL_DIR",
                        help="Put the scores of this `layerprune evaluate` output (its summary.json) on the card "
                             "first (a run's cards carry theirs already)")
    parser.add_argument("--allow-unverified", action="store_true", help="Share a model no check compared with its "
                        "source (a folder pruned with --no-verify, a GGUF file exported with --no-verify or without "
                        "its export record)")
    parser.add_argument("--dry-run", action="store_true", help="Print the files (with sizes) and the card's metadata "
                        "that would go; upload and write nothing")


def run(args: argparse.Namespace) -> int:
    from layerprune.export.push import plan_push, push

    refresh = None
    if args.scores is not None:
        from layerprune.pipeline.cards import card_with_evaluation

        refresh = partial(card_with_evaluation, evaluation=args.scores, model_name=args.repo.rsplit("/", 1)[-1],
                          model=args.model)
    plan = plan_push(args.model, args.repo, refresh, args.allow_unverified)
    if args.dry_run:
        print(plan.listing(args.private))
        print("dry run: nothing uploaded or written")
        return 0
    url = push(plan, private=args.private)
    print(f"pushed {args.model} to https://huggingface.co/{args.repo} ({url})")
    return 0
