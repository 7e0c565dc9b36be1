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
"""

from __future__ import annotations

from typing import Any

from layerprune.recover.schema import RecoverRecipe
from layerprune.recover.selfgen import chat_messages


def gkd_agrees(recipe: RecoverRecipe) -> bool:
    """Whether TRL's GKD computes the recipe's kd loss (it applies no loss temperature and no CE term)."""
    return recipe.kd.temperature == 1.0 and recipe.kd.weight == 1.0


def messages_dataset(rows: list[dict[str, Any]], system_prompt: str | None) -> Any:
    """Teacher answers as chat conversations (GKD's ChatML collator masks the prompt)."""
    from datasets import Dataset

    return Dataset.from_list([{"messages": [*chat_messages(r["prompt"], system_prompt),
                                            {"role": "assistant", "content": r["response"]}]} for r in rows])


def prompts_dataset(texts: list[str], system_prompt: str | None) -> Any:
    """Prompts only (the student writes the completions)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": chat_messages(text, system_prompt)} for text in texts])


def gkd_trainer(recipe: RecoverRecipe, model: Any, teacher: Any, tokenizer: Any, common: dict[str, Any],
                rows: list[dict[str, Any]], lmbda: float, beta: float, peft_config: Any, callbacks: list[Any]) -> Any:
    """TRL's GKDTrainer on the teacher's answers: lmbda share of batches replaced by the student's samples."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    opd = recipe.opd
    args = GKDConfig(**common, lmbda=lmbda, beta=beta, temperature=opd.temperature, max_new_tokens=opd.max_new_tokens,
                     max_length=recipe.train.max_length, disable_dropout=True)
    return GKDTrainer(model=model, teacher_model=teacher, args=args, train_dataset=messages_dataset(
        rows, recipe.generate.system_prompt), processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)


def opd_trainer(recipe: RecoverRecipe, model: Any, teacher: Any, tokenizer: Any, common: dict[str, Any],
                prompts: list[str], peft_config: Any, callbacks: list[Any]) -> Any:
    """TRL's DistillationTrainer: the student samples, the teacher scores every token (beta 0 forward, 1 reverse KL)."""
    from trl import DistillationConfig, DistillationTrainer

    opd = recipe.opd
    common = {**common, "include_num_input_tokens_seen": "no"}  # its batches hold prompts only; it logs num_tokens
    args = DistillationConfig(**common, beta=opd.beta, temperature=opd.temperature, top_p=opd.top_p,
                              max_completion_length=opd.max_new_tokens, disable_dropout=True)
    tokenizer.padding_side = "left"
    return DistillationTrainer(model=model, teacher_model=teacher, args=args,
                               train_dataset=prompts_dataset(prompts, recipe.generate.system_prompt),
                               processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
