"""One short line per logged training step (loss, learning rate, reward where there is one) in place of the
trainer's dict printout: what recover and variant print while they train."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

log = logging.getLogger("layerprune.train")


class LossLogCallback(TrainerCallback):
    """Print the train and held-out losses as one short line each (and GRPO's mean reward)."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        logs = logs or {}
        if "loss" in logs:
            reward = logs.get("reward")
            log.info("  step %d/%d  loss %.4f  lr %.2e%s", state.global_step, state.max_steps, logs["loss"],
                     logs.get("learning_rate", 0.0), "" if reward is None else f"  reward {reward:.3f}")
        if "eval_loss" in logs:
            log.info("  step %d/%d  held-out loss %.4f", state.global_step, state.max_steps, logs["eval_loss"])
