"""What merge and local share in a method chain (replace+local, merge+local, local): the dropped blocks, local's
budget and what it did, the chain's memory plan without a trainer, and the check that the saved model reloads as the
in-memory one. The steps themselves are methods/merge.py and methods/local.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.lineage import PRUNE_REPORT, read_lineage, read_removed_sublayers
from layerprune.models.logits_check import logits_rtol
from layerprune.recover import local, memory
from layerprune.recover.replace import decoder_layers
from layerprune.recover.schema import RecoverRecipe

PLANNED_SEQUENCES = 1000  # sequences cached per span in the plan when prompts.samples does not say


def dropped_of(student: Any, teacher: Any, method: str) -> list[int]:
    """The dropped blocks named in the student's prune_report.json; the teacher must be the source they came from
    (one-line errors otherwise)."""
    lineage = read_lineage(Path(student.location))
    if lineage is None or not lineage.dropped:
        raise LayerpruneError(f"{method} needs the dropped blocks: {Path(student.location) / PRUNE_REPORT} is missing "
                              "or lists none")
    _check_teacher_depth(teacher, lineage.num_blocks_before, method)
    return lineage.dropped


def partial_blocks(student: Any) -> dict[int, str]:
    """Blocks of a sublayer-pruned student that lost exactly one sublayer: original index -> the part removed."""
    parts: dict[int, list[str]] = {}
    for name in read_removed_sublayers(Path(student.location)):
        block, _, part = name.partition(".")
        parts.setdefault(int(block), []).append(part)
    return {block: gone[0] for block, gone in sorted(parts.items()) if len(gone) == 1}


def removals_of(student: Any, teacher: Any, method: str) -> tuple[list[int], dict[int, str]]:
    """(the dropped blocks, the blocks that lost one sublayer) of the student; one line when there is neither."""
    partial = partial_blocks(student)
    lineage = read_lineage(Path(student.location))
    if partial and lineage is not None and not lineage.dropped:
        _check_teacher_depth(teacher, lineage.num_blocks_before, method)
        return [], partial
    return dropped_of(student, teacher, method), partial


def _check_teacher_depth(teacher: Any, depth: int, method: str) -> None:
    blocks = len(decoder_layers(teacher))
    if blocks != depth:
        raise LayerpruneError(f"{method} reads the dropped blocks from the teacher, so it must be the pruned model's "
                              f"source ({depth} blocks), not a model with {blocks}")


def local_budget(recipe: RecoverRecipe, sequences: int) -> local.LocalBudget:
    """local's steps in all (local.steps, else train.max_steps, else one pass over the text) and AdamW settings."""
    per_step = recipe.train.batch_size * recipe.train.grad_accum
    steps = recipe.local.steps or recipe.train.max_steps or max(1, math.ceil(sequences / per_step))
    train = recipe.train
    return local.LocalBudget(steps=steps, sequences_per_step=per_step,
                             learning_rate=recipe.local.learning_rate or train.learning_rate,
                             weight_decay=train.weight_decay, max_grad_norm=train.max_grad_norm,
                             betas=(train.adam_beta1, train.adam_beta2), max_tokens=train.max_tokens)


def local_tokens(data: dict[str, Any]) -> int:
    """Tokens the local step trained on (over every span)."""
    return sum(int(f["tokens"]) for f in data.get("local", []))


def local_training(data: dict[str, Any]) -> dict[str, Any] | None:
    """The report's training fields of the local step (None: no local step): the target tokens, tokens and
    sequences one span's block trained on (every span trains on the same sequences), the optimizer steps over every
    span, and its learning rate."""
    fits = data.get("local") or []
    if not fits:
        return None
    return {"tokens_unpadded": max(int(f.get("target_tokens", f["tokens"])) for f in fits),
            "tokens_padded": max(int(f["tokens"]) for f in fits),
            "sequences": max(int(f.get("sequences", 0)) for f in fits), "optimizer_steps": local_steps(data),
            "learning_rate": max(float(f.get("learning_rate", 0.0)) for f in fits)}


def local_steps(data: dict[str, Any]) -> int:
    """Optimizer steps the local step took (over every span)."""
    return sum(int(f["steps"]) for f in data.get("local", []))


def local_curve(data: dict[str, Any]) -> list[list[float]]:
    """[[step, MSE], ...] of the local step, its spans one after another (steps counted on)."""
    points, step = [], 0
    for fit in data.get("local", []):
        for value in fit.get("mse_per_step", []):
            step += 1
            points.append([step, value])
    return points


def verify_saved(model: Any, directory: Path, sequences: list[list[int]]) -> dict[str, Any]:
    """Reload the saved model and compare its logits with the in-memory one's on a few sequences (a one-line error
    when they differ): the merged or locally trained weights were written as computed."""
    from layerprune.models.surgery import compare_reloaded_logits

    device = next(model.parameters()).device
    if not sequences:  # nothing held out: any tokens will do for comparing two copies of one model
        sequences = [[(7 * i + 3) % model.config.get_text_config().vocab_size for i in range(16)]]
    width = min(len(s) for s in sequences[:4])
    ids = torch.tensor([s[:width] for s in sequences[:4]], device=device)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False).logits.float()
    model.train(was_training)
    dtype = next(model.parameters()).dtype
    record = compare_reloaded_logits(directory, ids, None, reference, dtype, device, logits_rtol(dtype))
    return {"checked": True, **record}


def plan(recipe: RecoverRecipe, shape: memory.ModelShape, teacher: memory.ModelShape, weight_bytes: int,
         budget_gb: float, seq_len: int) -> memory.MemoryPlan:
    """The memory plan of a chain that ends without a trainer (merge, local, and either after replace)."""
    per_step = recipe.train.batch_size * recipe.train.grad_accum
    length = min(seq_len, recipe.local.max_length)
    sequences = recipe.prompts.samples or PLANNED_SEQUENCES
    caches = any(method.caches_states for method in recipe.chain_methods())
    result = memory.plan_surgery(shape, teacher, recipe.chain_name(), weight_bytes, budget_gb,
                                 trains_block=caches, cached_tokens=sequences * length,
                                 seq_len=length, batch_size=per_step)
    if caches:
        result.notes.append(f"local: the teacher's states of {sequences} sequences of <= {length} tokens cached per "
                            "span" + ("" if recipe.prompts.samples else " (prompts.samples unset: assumed)"))
    return result
