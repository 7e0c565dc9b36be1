"""Distillation trainers from TRL: GKD (teacher answers, lmbda=0 is plain token-level KD) and on-policy distillation.

Which TRL trainer and why:
- On-policy distillation (`opd`, lmbda = 1) uses `trl.DistillationTrainer`. In TRL 1.16 it is the maintained one:
  promoted from `trl.experimental.distillation` (now a deprecated alias) into the stable API; it generates the
  student's completions for a whole gradient-accumulation window at once and normalises the loss by the number of
  completion tokens in that window (`num_items_in_batch`), so the gradient does not depend on grad_accum; and it
  computes the divergence in chunks without materialising the full logits. GKD itself says a fully on-policy run
  "is fully covered by DistillationTrainer" and asks users to migrate.
- `trl.experimental.gkd.GKDTrainer` stays experimental, but it is the only TRL trainer that mixes on-policy batches
  with batches of given completions (lmbda < 1) and that trains on given completions at all (lmbda = 0: KD on the
  teacher's own answers). We use it for those two cases only. With lmbda = 0 its loss is normalised by the
  trainer's `num_items_in_batch` as transformers expects. With 0 < lmbda < 1 the count is taken from the given
  completions before the student's samples replace them (a GKD limitation), so mixed runs are approximately, not
  exactly, grad_accum-invariant; the report says so.
- `kd` uses GKD (lmbda = 0, beta = 0: forward KL) where it agrees with the recipe (kd.temperature 1, kd.weight 1);
  otherwise the hand-written KD loss in train.py, now also normalised by num_items_in_batch.

The sampling settings mean one thing on both paths: opd.top_p is the student's nucleus top-p (GKD's fixed top_p 1
is overridden), and opd.temperature is the sampling temperature and the divergence's. GKD applies a temperature to
its sampling only, so mixed opd (0 < lmbda < 1) with opd.temperature != 1 is refused by the recipe.
"""

from __future__ import annotations

from typing import Any

from layerprune.recover.schema import GenerationSection, RecoverRecipe
from layerprune.recover.selfgen import chat_messages, stop_token_ids


def gkd_agrees(recipe: RecoverRecipe) -> bool:
    """Whether TRL's GKD computes the recipe's kd loss (it applies no loss temperature and no CE term)."""
    return recipe.kd.temperature == 1.0 and recipe.kd.weight == 1.0


def messages_dataset(rows: list[dict[str, Any]], settings: GenerationSection, tokenizer: Any, max_length: int) -> Any:
    """Teacher answers as chat conversations (GKD's ChatML collator masks the prompt); with generate.chat_template
    false, plain prompt + answer + stop as token ids with their completion mask, which the same collator takes.
    Where a conversation is longer than max_length, every row as token ids cut at its end as SFT cuts it
    (heldout.encode_row), and a row left without completion tokens dropped as SFT drops it: GKD's collator would keep
    its last tokens, the prompt cut first, so the two methods would train on, and count, different tokens."""
    from datasets import Dataset

    from layerprune.recover.heldout import encode_row

    whole = [encode_row(tokenizer, r, settings, 1 << 30) for r in rows]
    if settings.chat_template and all(len(ids) <= max_length for ids, _ in whole):
        return Dataset.from_list([{"messages": [*chat_messages(r["prompt"], settings.system_prompt),
                                                {"role": "assistant", "content": r["response"]}]} for r in rows])
    cut = [(r["prompt"], ids[:max_length], start) for r, (ids, start) in zip(rows, whole, strict=True)]
    kept = [(text, ids, start) for text, ids, start in cut if start < len(ids)]  # cut inside its prompt: SFT drops it
    if not kept:
        from layerprune.core.errors import LayerpruneError

        raise LayerpruneError(f"every training row is longer than train.max_length ({max_length} tokens) before its "
                              "answer starts: nothing to train on; raise train.max_length")
    return Dataset.from_list([{"prompt": text, "input_ids": ids,
                               "completion_mask": [0] * start + [1] * (len(ids) - start)} for text, ids, start in kept])


def prompts_dataset(texts: list[str], settings: GenerationSection) -> Any:
    """Prompts only (the student writes the completions): chat messages, or the plain text."""
    from datasets import Dataset

    if not settings.chat_template:
        return Dataset.from_list([{"prompt": text} for text in texts])
    return Dataset.from_list([{"prompt": chat_messages(text, settings.system_prompt)} for text in texts])


def stop_at(trainer: Any, tokenizer: Any, settings: GenerationSection) -> Any:
    """With generate.chat_template false, the student's samples end at the stop string (as the evaluation's
    continuations do), not only at the end-of-sequence token: every token holding the stop joins the trainer's
    end ids, which both stop generation and end the completion mask there (TRL 1.16 attributes)."""
    if settings.chat_template:
        return trainer
    config = trainer.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ids = [*[i for i in eos if i is not None], *stop_token_ids(tokenizer, settings.stop)]
    config.eos_token_id = ids
    if hasattr(trainer, "eos_token_ids"):  # DistillationTrainer masks with these and passes generation_kwargs
        trainer.eos_token_ids = ids
        trainer.generation_kwargs["eos_token_id"] = ids
    return trainer


def gkd_trainer(recipe: RecoverRecipe, model: Any, teacher: Any, tokenizer: Any, common: dict[str, Any],
                rows: list[dict[str, Any]], lmbda: float, beta: float, peft_config: Any, callbacks: list[Any]) -> Any:
    """TRL's GKDTrainer on the teacher's answers: lmbda share of batches replaced by the student's samples."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    opd = recipe.opd
    args = GKDConfig(**common, lmbda=lmbda, beta=beta, temperature=opd.temperature, max_new_tokens=opd.max_new_tokens,
                     max_length=recipe.train.max_length, disable_dropout=True)
    dataset = messages_dataset(rows, recipe.generate, tokenizer, recipe.train.max_length)
    trainer = GKDTrainer(model=model, teacher_model=teacher, args=args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    trainer.generation_config.top_p = opd.top_p  # GKD samples with top_p 1 whatever it is told; opd.top_p rules
    return stop_at(trainer, tokenizer, recipe.generate)


def opd_trainer(recipe: RecoverRecipe, model: Any, teacher: Any, tokenizer: Any, common: dict[str, Any],
                prompts: list[str], peft_config: Any, callbacks: list[Any]) -> Any:
    """TRL's DistillationTrainer: the student samples, the teacher scores every token (beta 0 forward, 1 reverse KL)."""
    from trl import DistillationConfig, DistillationTrainer

    opd = recipe.opd
    common = {**common, "include_num_input_tokens_seen": "no"}  # its batches hold prompts only; it logs num_tokens
    args = DistillationConfig(**common, beta=opd.beta, temperature=opd.temperature, top_p=opd.top_p,
                              max_completion_length=opd.max_new_tokens, disable_dropout=True,
                              shuffle_dataset=False)  # the prompts come in budget.order, as every method's data
    tokenizer.padding_side = "left"
    return stop_at(DistillationTrainer(model=model, teacher_model=teacher, args=args,
                                       train_dataset=prompts_dataset(prompts, recipe.generate),
                                       processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks),
                   tokenizer, recipe.generate)
