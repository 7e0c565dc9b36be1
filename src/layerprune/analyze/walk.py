"""Model walking for `analyze`: token batches, per-block ablation (prefix reuse), greedy answers, hidden states.

The math on the numbers these return lives in metrics.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from layerprune.analyze.tasks import Task, TaskItem
from layerprune.models import find_decoder_stack, skipped_blocks
from layerprune.models.blocks import DecoderStack
from layerprune.models.generate import generate_greedy
from layerprune.models.walker import BASE, CalibBatch, ablation_measures, capture_block_inputs


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
    """NLL and teacher-forced exact match of the full model and of each one-block-skipped model, in total and
    per item (summed answer-token NLL, answer tokens, all-argmax correct), items in input order."""

    base_nll: float
    ablated_nll: list[float]
    base_accuracy: float
    ablated_accuracy: list[float]
    scored_tokens: int
    items: int
    item_tokens: list[int]
    base_item_nll: list[float]
    ablated_item_nll: list[list[float]]
    base_item_correct: list[bool]
    ablated_item_correct: list[list[bool]]


class _Totals:
    """Per-item sums for one model variant: answer-token NLL, scored tokens, all answer tokens the argmax."""

    def __init__(self) -> None:
        self.item_nll: list[float] = []
        self.item_tokens: list[int] = []
        self.item_correct: list[bool] = []

    def add(self, logits: torch.Tensor, batch: CalibBatch) -> None:
        mask = batch.loss_mask[:, 1:].bool()
        targets = batch.input_ids[:, 1:][mask]
        rows = mask.nonzero()[:, 0]
        nll = F.cross_entropy(logits.float(), targets, reduction="none")
        per_row = torch.zeros(mask.shape[0], dtype=torch.float64, device=nll.device).index_add_(0, rows, nll.double())
        wrong = torch.bincount(rows[logits.argmax(-1) != targets], minlength=mask.shape[0])
        for row in mask.any(dim=1).nonzero()[:, 0].tolist():
            self.item_nll.append(float(per_row[row]))
            self.item_tokens.append(int(mask[row].sum()))
            self.item_correct.append(bool(wrong[row] == 0))

    def extend(self, other: _Totals) -> None:
        self.item_nll += other.item_nll
        self.item_tokens += other.item_tokens
        self.item_correct += other.item_correct

    @property
    def tokens(self) -> int:
        return sum(self.item_tokens)

    def mean_nll(self) -> float:
        return sum(self.item_nll) / max(self.tokens, 1)

    def accuracy(self) -> float:
        return sum(self.item_correct) / max(len(self.item_correct), 1)


def scored_logits(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch) -> torch.Tensor:
    """Logits at the positions that predict a scored token (the head runs on those only)."""
    return stack.logits(hidden[:, :-1][batch.loss_mask[:, 1:].bool()])


def item_totals(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch) -> _Totals:
    """The per-item sums of one batch, from the last block's output (a `measure` of models.walker's ablation)."""
    totals = _Totals()
    totals.add(scored_logits(stack, hidden, batch), batch)
    return totals


def collect(base: _Totals, ablated: list[_Totals]) -> AblationResult:
    return AblationResult(base.mean_nll(), [t.mean_nll() for t in ablated], base.accuracy(),
                          [t.accuracy() for t in ablated], base.tokens, len(base.item_tokens), base.item_tokens,
                          base.item_nll, [t.item_nll for t in ablated], base.item_correct,
                          [t.item_correct for t in ablated])


@torch.no_grad()
def ablate_blocks(model: Any, batches: Sequence[CalibBatch]) -> AblationResult:
    """Skip each block in turn; every candidate starts from the full model's hidden state before it
    (models.walker's `ablation_measures`), so block i costs only the blocks after it."""
    stack = find_decoder_stack(model)
    blocks = list(range(len(stack)))
    device = next(model.parameters()).device
    base, ablated = _Totals(), [_Totals() for _ in blocks]
    for batch in batches:
        batch = batch.to(device)
        measures = ablation_measures(stack, capture_block_inputs(stack, batch), blocks, blocks, measure=item_totals)
        base.extend(measures.pop(BASE))
        for block, totals in measures.items():
            ablated[block].extend(totals)
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


@dataclass(frozen=True)
class GenerationPlan:
    """How prompts become generations: chat template or raw, instruction, budget, greedy or seeded sampling."""

    max_new_tokens: int
    stops: tuple[str, ...] = ()
    chat: bool = False
    instruction: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def with_instruction(prompt: str, instruction: str | None) -> str:
    """The instruction on its own line after the question (before a closing 'Answer:'/'A:' line)."""
    if not instruction:
        return prompt
    for cue in ("\nAnswer:", "\nA:"):
        if prompt.endswith(cue):
            return f"{prompt[: -len(cue)]}\n{instruction}{cue}"
    return f"{prompt}\n{instruction}"


def render_prompt(tokenizer: Any, prompt: str, plan: GenerationPlan) -> str:
    """The text the model sees: the prompt as one user turn of the chat template, or the raw prompt."""
    prompt = with_instruction(prompt, plan.instruction)
    if not plan.chat:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def generate_texts(model: Any, tokenizer: Any, prompts: Sequence[str], plan: GenerationPlan,
                   batch_size: int) -> list[str]:
    """Continuations of `prompts` (models.generate: left-padded batches), cut at the first stop string; sampled
    runs reseed with `plan.seed` first, so every variant of a model draws the same random numbers."""
    sampling = {"do_sample": True, "temperature": plan.temperature, "top_p": plan.top_p} if plan.temperature > 0 else {}
    if sampling:
        torch.manual_seed(plan.seed)
    rendered = [render_prompt(tokenizer, prompt, plan) for prompt in prompts]
    return generate_greedy(model, tokenizer, rendered, plan.max_new_tokens, plan.stops, batch_size,
                           add_special_tokens=not plan.chat, **sampling)


@dataclass
class GenerationResult:
    """Generations and their grades for the full model and for each one-block-skipped model, per item."""

    base_generations: list[str]
    base_item_correct: list[bool]
    ablated_generations: list[list[str]]
    ablated_item_correct: list[list[bool]]

    @property
    def base_accuracy(self) -> float:
        return sum(self.base_item_correct) / max(len(self.base_item_correct), 1)

    @property
    def ablated_accuracy(self) -> list[float]:
        return [sum(c) / max(len(c), 1) for c in self.ablated_item_correct]


def graded_generations(model: Any, tokenizer: Any, items: Sequence[TaskItem], task: Task, batch_size: int,
                       plan: GenerationPlan) -> tuple[list[str], list[bool]]:
    texts = generate_texts(model, tokenizer, [item.prompt for item in items], plan, batch_size)
    return texts, [task.grade(text, item) for text, item in zip(texts, items, strict=False)]


def ablate_generation(model: Any, tokenizer: Any, items: Sequence[TaskItem], task: Task, batch_size: int,
                      plan: GenerationPlan | None = None) -> GenerationResult:
    """Graded generations of the full model and of each one-block-skipped model (slow: generates L + 1 times;
    for tasks whose answer follows a free-form solution, e.g. gsm8k). Default plan: greedy, the task's budget
    and stop strings, raw prompts."""
    plan = plan or GenerationPlan(task.max_new_tokens, task.stops)
    depth = len(find_decoder_stack(model))
    base = graded_generations(model, tokenizer, items, task, batch_size, plan)
    ablated = []
    for block in range(depth):
        with skipped_blocks(model, [block]):
            ablated.append(graded_generations(model, tokenizer, items, task, batch_size, plan))
    return GenerationResult(base[0], base[1], [a[0] for a in ablated], [a[1] for a in ablated])


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
        if not per_state:
            per_state = [[s] for s in states]
        else:
            per_state = [p + [s] for p, s in zip(per_state, states, strict=False)]
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
