"""GRPO with TRL's GRPOTrainer: the model samples sample.k answers per problem and is rewarded 1 for a right one.

The reward is the project's grader (`items.grade_answer`): the first line equal to the gold answer for a probe item
(as the probes score it), the GSM8K final number for a GSM8K item.
"""

from __future__ import annotations

from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.models.train_log import LossLogCallback
from layerprune.posttrain.items import grade_answer
from layerprune.posttrain.methods import Job, prompt_text
from layerprune.posttrain.train import TrainResult, common_arguments, lora_config


def exact_reward(completions: list[Any], gold: list[str], grader: list[str], **_: Any) -> list[float]:
    """1.0 for each completion the grader marks right, else 0.0 (a chat completion: its last message's text)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(grade_answer(text, g, how)) for text, g, how in zip(texts, gold, grader, strict=True)]


def grpo_dataset(job: Job) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_text(job.tokenizer, item, "plain") if job.recipe.format == "plain"
                               else [{"role": r, "content": c} for r, c in item.messages],
                               "gold": item.gold, "grader": item.grader} for item in job.items])


def grpo_config(job: Job) -> Any:
    from trl import GRPOConfig

    recipe, train, sample = job.recipe, job.recipe.train, job.recipe.sample
    if train.sequences_per_step() % sample.k:
        raise LayerpruneError(f"grpo: train.batch_size * train.grad_accum ({train.sequences_per_step()}) must be a "
                              f"multiple of sample.k ({sample.k})")
    return GRPOConfig(**common_arguments(train, job.work, job.model.device, job.seed), num_generations=sample.k,
                      max_completion_length=sample.max_new_tokens, temperature=max(sample.temperature, 1e-3),
                      top_p=sample.top_p, beta=recipe.grpo.beta, num_iterations=recipe.grpo.num_iterations,
                      loss_type=recipe.grpo.loss_type)


def run_grpo(job: Job) -> tuple[Any, TrainResult]:
    """Train with GRPO; returns the model (a LoRA merged in) and the result (tokens: the sampled completions')."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    train = job.recipe.train
    trainer = GRPOTrainer(model=job.model, reward_funcs=[exact_reward], args=grpo_config(job),
                          train_dataset=grpo_dataset(job), processing_class=job.tokenizer,
                          peft_config=lora_config(train) if train.method == "lora" else None,
                          callbacks=[LossLogCallback()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = trainer.state.log_history
    rewards = [entry[key] for entry in history for key in ("reward", "rewards/exact_reward/mean") if key in entry]
    job.card.update(reward_first=rewards[0] if rewards else None, reward_last=rewards[-1] if rewards else None)
    model = trainer.model.merge_and_unload() if train.method == "lora" else trainer.model
    steps = int(trainer.state.global_step)
    lengths = [entry["completions/mean_length"] for entry in history if "completions/mean_length" in entry]
    sequences = steps * train.sequences_per_step()
    target = round(sum(lengths) / len(lengths) * sequences) if lengths else 0
    losses = [entry["loss"] for entry in history if "loss" in entry]
    return model.eval(), TrainResult(steps, sequences, int(trainer.state.num_input_tokens_seen or 0), target,
                                     losses[0] if losses else None, losses[-1] if losses else None)
