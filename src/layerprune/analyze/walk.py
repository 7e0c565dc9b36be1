"""Model walking for `analyze`: token batches, per-block ablation (prefix reuse), greedy answers, hidden states.

The math on the numbers these return lives in metrics.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from layerprune.analyze.tasks import Task, TaskItem
from layerprune.models import find_decoder_stack, skipped_blocks
from layerprune.models.blocks import DecoderStack
from layerprune.prune.forward import CalibBatch, capture_block_inputs, prefix_states, run_blocks


def encode_item(tokenizer: Any, item: TaskItem, max_length: int) -> tuple[list[int], int]:
    """Token ids of prompt + target and how many trailing ids are the target (prompt cut from the left)."""
    prompt = tokenizer(item.prompt, add_special_tokens=True)["input_ids"]
    target = tokenizer(item.target, add_special_tokens=False)["input_ids"][: max_length - 1]
    keep = max(1, max_length - len(target))
    return prompt[-keep:] + target, len(target)


def build_batches(tokenizer: Any, items: Sequence[TaskItem], batch_size: int, max_length: int,
                  score_all: bool = False) -> list[CalibBatch]:
    """Right-padded batches; the loss mask marks the target tokens (every real token if `score_all`)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = []
    for start in range(0, len(items), batch_size):
        encoded = [encode_item(tokenizer, item, max_length) for item in items[start : start + batch_size]]
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)
        loss_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, (ids, n_target) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            loss_mask[row, len(ids) - n_target if not score_all else 1 : len(ids)] = 1
        batches.append(CalibBatch(input_ids, attention, loss_mask))
    return batches


@dataclass
class AblationResult:
    """NLL and teacher-forced exact match of the full model and of each one-block-skipped model."""

    base_nll: float
    ablated_nll: list[float]
    base_accuracy: float
    ablated_accuracy: list[float]
    scored_tokens: int
    items: int


class _Totals:
    """Running sums for one model variant: NLL, scored tokens, items whose every answer token is the argmax."""

    def __init__(self) -> None:
        self.nll, self.tokens, self.correct, self.items = 0.0, 0, 0, 0

    def add(self, logits: torch.Tensor, batch: CalibBatch) -> None:
        mask = batch.loss_mask[:, 1:].bool()
        targets = batch.input_ids[:, 1:][mask]
        self.nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        self.tokens += int(targets.numel())
        wrong_rows = mask.nonzero()[:, 0][logits.argmax(-1) != targets]
        wrong = torch.bincount(wrong_rows, minlength=mask.shape[0])
        scored = mask.any(dim=1)
        self.correct += int((scored & (wrong == 0)).sum())
        self.items += int(scored.sum())

    def mean_nll(self) -> float:
        return self.nll / max(self.tokens, 1)

    def accuracy(self) -> float:
        return self.correct / max(self.items, 1)


def scored_logits(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch) -> torch.Tensor:
    """Logits at the positions that predict a scored token (the head runs on those only)."""
    return stack.logits(hidden[:, :-1][batch.loss_mask[:, 1:].bool()])


def collect(base: _Totals, ablated: list[_Totals]) -> AblationResult:
    return AblationResult(base.mean_nll(), [t.mean_nll() for t in ablated], base.accuracy(),
                          [t.accuracy() for t in ablated], base.tokens, base.items)


@torch.no_grad()
def ablate_blocks(model: Any, batches: Sequence[CalibBatch]) -> AblationResult:
    """Skip each block in turn; every candidate starts from the full model's hidden state before it
    (prune.forward's cached block inputs), so block i costs only the blocks after it."""
    stack = find_decoder_stack(model)
    blocks = list(range(len(stack)))
    device = next(model.parameters()).device
    base, ablated = _Totals(), [_Totals() for _ in blocks]
    for batch in batches:
        batch = batch.to(device)
        inputs = capture_block_inputs(stack, batch)
        base.add(scored_logits(stack, inputs.output, batch), batch)
        states = prefix_states(stack, inputs, blocks)
        for block in blocks:
            hidden = run_blocks(stack, inputs, states[block], blocks[block + 1 :])
            ablated[block].add(scored_logits(stack, hidden, batch), batch)
    return collect(base, ablated)


@torch.no_grad()
def ablate_blocks_naive(model: Any, batches: Sequence[CalibBatch]) -> AblationResult:
    """The same numbers with a full forward per skipped block (the reference the benchmark compares to)."""
    device = next(model.parameters()).device
    depth = len(find_decoder_stack(model))

    def totals(skip: list[int]) -> _Totals:
        total = _Totals()
        with skipped_blocks(model, skip):
            for batch in batches:
                batch = batch.to(device)
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
                total.add(logits[:, :-1][batch.loss_mask[:, 1:].bool()], batch)
        return total

    return collect(totals([]), [totals([block]) for block in range(depth)])


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, items: Sequence[TaskItem], task: Task, batch_size: int) -> list[str]:
    """Greedy continuations (left-padded batches), reduced to answers by the task's extractor."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(model.parameters()).device
    answers = []
    try:
        for start in range(0, len(items), batch_size):
            prompts = [item.prompt for item in items[start : start + batch_size]]
            encoded = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
            out = model.generate(**encoded, max_new_tokens=task.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            answers.extend(task.extract(text) for text in texts)
    finally:
        tokenizer.padding_side = side
    return answers


def exact_match(answers: Sequence[str], items: Sequence[TaskItem]) -> float:
    """Share of answers equal to the expected (lower-cased) answers."""
    return sum(a == item.answer.lower() for a, item in zip(answers, items)) / max(len(items), 1)


def ablate_generation(model: Any, tokenizer: Any, items: Sequence[TaskItem], task: Task,
                    batch_size: int) -> tuple[float, list[float]]:
    """Greedy-generation exact match of the full model and of each one-block-skipped model (slow: generates
    L + 1 times; for tasks whose answer follows a free-form solution, e.g. gsm8k)."""
    depth = len(find_decoder_stack(model))
    base = exact_match(greedy_answers(model, tokenizer, items, task, batch_size), items)
    ablated = []
    for block in range(depth):
        with skipped_blocks(model, [block]):
            ablated.append(exact_match(greedy_answers(model, tokenizer, items, task, batch_size), items))
    return base, ablated


@torch.no_grad()
def token_states(model: Any, batches: Sequence[CalibBatch], skip_first: bool = True) -> list[torch.Tensor]:
    """h_0 (block 0's input) .. h_L (last block's output) for every real token: L + 1 tensors [tokens, hidden]."""
    stack = find_decoder_stack(model)
    device = next(model.parameters()).device
    per_state: list[list[torch.Tensor]] = []
    for batch in batches:
        inputs = capture_block_inputs(stack, batch.to(device))
        mask = batch.attention_mask.bool().to(device)
        if skip_first:  # the first token is an attention sink with outlier activations, not a word
            mask[:, 0] = False
        states = [state[mask].float().cpu() for state in inputs.states()]
        per_state = [[s] for s in states] if not per_state else [p + [s] for p, s in zip(per_state, states)]
    return [torch.cat(parts) for parts in per_state]


OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "c_proj")


@torch.no_grad()
def zero_block_outputs(block: torch.nn.Module) -> list[str]:
    """Zero the attention and MLP output projections of a block (weights and biases); return their names.

    In a pre-norm residual block this makes the block the identity, the same as skipping it.
    """
    names = []
    for name, module in block.named_modules():
        if name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS and isinstance(module, torch.nn.Linear):
            module.weight.zero_()
            if module.bias is not None:
                module.bias.zero_()
            names.append(name)
    return names
