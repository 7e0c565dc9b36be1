"""A token budget for training (train.max_tokens): stop once the student has trained on that many tokens.

The trainers count tokens as transformers does (`state.num_input_tokens_seen`: every input token of each batch,
padding included), or, where a trainer logs its own count instead (TRL's DistillationTrainer: `num_tokens`), that
count. The budget is checked after each optimizer step, so a run ends at most one step past it.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback


class TokenBudget(TrainerCallback):
    """Stop training once `max_tokens` tokens have been trained on."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.logged = 0

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        self.logged = max(self.logged, int((logs or {}).get("num_tokens", 0) or 0))

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if max(int(state.num_input_tokens_seen or 0), self.logged) >= self.max_tokens:
            control.should_training_stop = True
            control.should_log = True
        return control


def limit(trainer: Any, max_tokens: int | None) -> Any:
    """Add the token budget to a trainer (no budget: the trainer as it is)."""
    if max_tokens is not None:
        trainer.add_callback(TokenBudget(max_tokens))
    return trainer
