"""Full fine-tuning at lr 1e-5: pure bf16 (train.pure_bf16, the old default) against float32 master weights, side by
side at the same budget on the same rows.

Prints, for each arm, the share of decoder-block weight elements the steps changed (in the trained copy, and after
the cast to bf16 for saving) and the token-weighted held-out cross-entropy before and after.

    PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 10 python bench/bench_full_sft_precision.py \
        --model ~/.cache/layerprune/converted/smollm2-135m-instruct-* --data ../shared/data/gsm8k/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from layerprune.core.settings import RunSettings
from layerprune.models import drop_blocks, resolve_model
from layerprune.recover import heldout, train
from layerprune.recover.methods.sft import load_student
from layerprune.recover.schema import RecoverRecipe


def rows(path: Path, n: int) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [{"id": str(i), "prompt": r["question"], "response": r["answer"], "tokens": 0} for i, r in enumerate(lines)]


def arm(model: str, pure: bool, train_rows: list[dict], held: list[dict], args: argparse.Namespace) -> dict:
    recipe = RecoverRecipe.model_validate({
        "method": "full", "generate": {"max_new_tokens": 256},
        "train": {"max_steps": args.steps, "batch_size": args.batch, "grad_accum": 1, "warmup_steps": 0,
                  "learning_rate": args.lr, "gradient_checkpointing": False, "max_length": 256,
                  "logging_steps": 5, "pure_bf16": pure}})
    settings = RunSettings(device="cpu", dtype="bfloat16")
    loaded = load_student(recipe, resolve_model(model, settings), settings)
    drop_blocks(loaded.model, list(range(args.drop_from, args.drop_from + args.drop)))
    encoded = heldout.encode_rows(loaded.tokenizer, held, recipe.generate, 256)
    before_ce = heldout.held_out_metrics(loaded.model, loaded.model, encoded)["ce"]
    blocks = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if ".layers." in n}
    with tempfile.TemporaryDirectory() as tmp:
        config = train.sft_config(recipe, Path(tmp), torch.device("cpu"), "adamw_torch", 0, has_eval=False)
        dataset = train.to_dataset(train_rows, recipe.generate, loaded.tokenizer, 256)
        trainer = train.make_trainer(recipe, loaded.model, loaded.tokenizer, config, dataset, None)
        trainer.train()
    params = dict(trainer.model.named_parameters())
    total = sum(p.numel() for p in blocks.values())
    changed = sum(int((params[n].detach() != b).sum()) for n, b in blocks.items()) / total
    saved = sum(int((params[n].detach().bfloat16() != b.bfloat16()).sum()) for n, b in blocks.items()) / total
    after_ce = heldout.held_out_metrics(trainer.model, trainer.model, encoded)["ce"]
    return {"arm": "pure bf16" if pure else "fp32 master", "dtype": str(next(iter(params.values())).dtype),
            "changed": round(changed, 4), "changed_after_bf16_cast": round(saved, 4),
            "held_out_ce_before": round(before_ce, 4), "held_out_ce_after": round(after_ce, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--drop", type=int, default=6)
    parser.add_argument("--drop-from", type=int, default=20)
    args = parser.parse_args()
    data = rows(args.data, args.steps * args.batch + 16)
    held, train_rows = data[:16], data[16:]
    torch.manual_seed(0)
    for pure in (True, False):
        print(json.dumps(arm(args.model, pure, train_rows, held, args)), flush=True)


if __name__ == "__main__":
    main()
