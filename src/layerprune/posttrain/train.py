"""Supervised fine-tuning of a variant on (item, completion) rows with TRL's SFTTrainer, completion-only loss.

Plain format: the prompt encoded as the evaluation encodes it, the completion (answer and stop) as the continuation of
those tokens, the loss on the completion's tokens only (a pre-tokenized dataset with TRL's `completion_mask`). Chat
format: prompt and completion conversations, which TRL renders through the tokenizer's template.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerprune.models.train_log import LossLogCallback
from layerprune.posttrain.items import Item
from layerprune.posttrain.schema import TrainSection, VariantRecipe


@dataclass(frozen=True)
class Row:
    """One training example: a problem and the completion the variant learns (gold, sampled or the teacher's)."""

    item: Item
    completion: str  # without the stop


@dataclass
class TrainResult:
    """What a training run did."""

    steps: int
    sequences: int
    tokens: int  # unpadded prompt + completion tokens over the sequences trained
    target_tokens: int  # unpadded completion (loss) tokens over the sequences trained
    loss_first: float | None
    loss_last: float | None


def plain_ids(tokenizer: Any, row: Row, max_length: int) -> tuple[list[int], int]:
    """(token ids, index of the first completion token) of prompt + completion + stop, cut to max_length."""
    prompt = list(tokenizer(row.item.prompt)["input_ids"])
    completion = list(tokenizer(row.completion + row.item.stop, add_special_tokens=False)["input_ids"])
    return (prompt + completion)[:max_length], len(prompt)


def chat_messages(item: Item) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in item.messages]


def chat_ids(tokenizer: Any, row: Row, max_length: int) -> tuple[list[int], int]:
    """(token ids, first completion index) of the chat rendering, for counting tokens (TRL renders its own)."""
    prompt = tokenizer.apply_chat_template(chat_messages(row.item), tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*chat_messages(row.item), {"role": "assistant",
                                                                      "content": row.completion.strip()}],
                                          tokenize=False)
    ids = list(tokenizer(whole, add_special_tokens=False)["input_ids"])
    return ids[:max_length], len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encoded(tokenizer: Any, rows: list[Row], fmt: str, max_length: int) -> list[tuple[list[int], int]]:
    encode = plain_ids if fmt == "plain" else chat_ids
    return [encode(tokenizer, row, max_length) for row in rows]


def to_dataset(tokenizer: Any, rows: list[Row], fmt: str, max_length: int) -> Any:
    """The rows as TRL reads them: pre-tokenized with a completion mask (plain) or prompt-completion turns (chat)."""
    from datasets import Dataset

    if fmt == "plain":
        return Dataset.from_list([{"input_ids": ids, "completion_mask": [0] * start + [1] * (len(ids) - start)}
                                  for ids, start in encoded(tokenizer, rows, fmt, max_length)])
    return Dataset.from_list([{"prompt": chat_messages(row.item),
                               "completion": [{"role": "assistant", "content": row.completion.strip()}]}
                              for row in rows])


def planned_steps(train: TrainSection, rows: int) -> int:
    """Optimizer steps the trainer takes: max_steps, else epochs over the rows."""
    if train.max_steps:
        return train.max_steps
    return max(1, math.ceil(math.ceil(rows / train.batch_size) / train.grad_accum * train.epochs))


def token_counts(tokenizer: Any, rows: list[Row], fmt: str, train: TrainSection) -> tuple[int, int, int]:
    """(sequences, tokens, target tokens) over the sequences the planned steps train on (whole passes over the rows,
    then a share of one: the data's mean for the partial pass), unpadded."""
    pairs = encoded(tokenizer, rows, fmt, train.max_length)
    if train.max_steps:
        sequences = train.max_steps * train.sequences_per_step()
    else:
        sequences = math.ceil(len(rows) * train.epochs)
    share = sequences / max(len(rows), 1)
    total, target = sum(len(ids) for ids, _ in pairs), sum(len(ids) - start for ids, start in pairs)
    return sequences, round(total * share), round(target * share)


def common_arguments(train: TrainSection, output_dir: Path, device: torch.device, seed: int) -> dict[str, Any]:
    """TrainingArguments fields shared by SFT and GRPO."""
    return dict(
        output_dir=str(output_dir), learning_rate=train.learning_rate, lr_scheduler_type=train.lr_scheduler,
        warmup_steps=train.warmup_steps, weight_decay=train.weight_decay, max_grad_norm=train.max_grad_norm,
        optim="adamw_torch", per_device_train_batch_size=train.batch_size,
        gradient_accumulation_steps=train.grad_accum, num_train_epochs=train.epochs, max_steps=train.max_steps or -1,
        bf16=train.bf16 and device.type == "cuda", gradient_checkpointing=train.gradient_checkpointing,
        logging_steps=train.logging_steps, logging_first_step=True,
        save_strategy="no", report_to="none", seed=seed, data_seed=seed, use_cpu=device.type == "cpu",
        disable_tqdm=True, dataloader_num_workers=0,
    )


def lora_config(train: TrainSection) -> Any:
    """The recipe's flat LoRA fields as peft.LoraConfig (every linear layer but the head)."""
    from peft import LoraConfig

    return LoraConfig(r=train.lora_r, lora_alpha=train.lora_alpha, lora_dropout=train.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")


def run_sft(model: Any, tokenizer: Any, rows: list[Row], recipe: VariantRecipe, work: Path, seed: int) -> tuple[Any,
                                                                                                            TrainResult]:
    """Fine-tune on the rows (completion-only loss); returns the trained model (a LoRA merged in) and the result."""
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    train = recipe.train
    args = SFTConfig(**common_arguments(train, work, model.device, seed), max_length=train.max_length,
                     completion_only_loss=True, packing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=to_dataset(tokenizer, rows, recipe.format,
                                                                          train.max_length),
                         processing_class=tokenizer, peft_config=lora_config(train) if train.method == "lora" else None,
                         callbacks=[LossLogCallback()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return finished(trainer, train), result_of(trainer, tokenizer, rows, recipe)


def finished(trainer: Any, train: TrainSection) -> Any:
    """The trained model, a LoRA adapter merged into its weights."""
    model = trainer.model
    if train.method == "lora":
        model = model.merge_and_unload()
    return model.eval()


def result_of(trainer: Any, tokenizer: Any, rows: list[Row], recipe: VariantRecipe) -> TrainResult:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    sequences, tokens, target = token_counts(tokenizer, rows, recipe.format, recipe.train)
    return TrainResult(int(trainer.state.global_step), sequences, tokens, target, losses[0] if losses else None,
                       losses[-1] if losses else None)
