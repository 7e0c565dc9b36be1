"""Ablation: how much worse the model gets when a block is skipped (NLL or exact-match accuracy)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from pydantic import Field

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import skipped_blocks
from layerprune.models.generate import end_token_ids, generate_greedy
from layerprune.models.row_skips import row_skipped_blocks
from layerprune.models.walker import BASE, BlockInputs, ablation_measures, capture_block_inputs, greedy_match
from layerprune.prune.calib import AnswerBatch, CalibItem, answer_batches, is_short_answer, stop_token_mask
from layerprune.prune.metrics import accumulate, mean, select_lowest
from layerprune.prune.scores import (
    BlockMajor,
    BlockMajorContext,
    ScoreContext,
    ScoreParams,
    ScoreResult,
    register_score,
)
from layerprune.tasks import grading

K = TypeVar("K")


class AblationParams(ScoreParams):
    stack_candidates: int = Field(
        1,
        ge=0,
        description="Ablation candidates that advance together as one stacked batch (0 = all); 1, one at "
        "a time, used the least memory and was also the fastest on a CPU",
    )


def ablation_block_major(ctx: BlockMajorContext) -> ScoreResult:
    """One-shot NLL ablation, one block in memory at a time: every candidate's state advances through each block."""
    from layerprune.prune.blockwise import check_head, sweep

    depth = len(ctx.bw)
    result = sweep(ctx.bw, ctx.batches, list(range(depth)), progress=ctx.progress)
    check = check_head(ctx.bw, ctx.batches[0], result.final) if ctx.batches and result.final is not None else None
    base = mean(*result.base)
    scores = [mean(*result.candidates[i]) - base for i in range(depth)]
    details = {"base": base, "metric": ctx.metric, "check_logits_max_abs_diff": check}
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected), details=details)


BLOCK_MAJOR = BlockMajor(
    ablation_block_major,
    live_states=lambda depth, drop: depth + 2,  # every candidate's state, the full model's and the one being skipped
    what="one-shot ablation with --metric nll",
    supports=lambda metric, iterative: metric == "nll" and not iterative,
)


@register_score("ablation", AblationParams, BLOCK_MAJOR)
def ablation(ctx: ScoreContext) -> ScoreResult:
    """One-shot: score all blocks once; iterative: drop the cheapest block, re-score the rest, repeat."""
    measure = _nll_losses if ctx.metric == "nll" else _accuracy_losses
    kept = list(range(ctx.depth))
    cache: list[BlockInputs] = []
    if not ctx.iterative:
        base, losses = measure(ctx, kept, kept, cache)
        scores = [losses[i] - base for i in kept]
        drop = sorted(sorted((s, -i, i) for i, s in enumerate(scores) if i not in ctx.protected)[: ctx.drop])
        return ScoreResult(scores, sorted(i for _, _, i in drop), details={"base": base, "metric": ctx.metric})
    return _iterative(ctx, measure, kept, cache)


def _iterative(ctx: ScoreContext, measure, kept: list[int], cache: list[BlockInputs]) -> ScoreResult:  # noqa: ANN001
    steps: list[dict] = []
    first: dict[int, float] = {}
    for step in range(ctx.drop):
        candidates = [i for i in kept if i not in ctx.protected]
        base, losses = measure(ctx, kept, candidates, cache)
        chosen = min(candidates, key=lambda i: (losses[i], -i))
        steps.append(
            {"step": step + 1, "base": base, "deltas": {i: losses[i] - base for i in candidates}, "dropped": chosen}
        )
        first = first or {i: losses[i] - base for i in candidates}
        kept = [i for i in kept if i != chosen]
        if ctx.progress:
            ctx.progress(f"iterative step {step + 1}/{ctx.drop}: dropped block {chosen}", 0)
    scores = [first.get(i) for i in range(ctx.depth)]
    return ScoreResult(
        scores,
        sorted(s["dropped"] for s in steps),
        steps,
        {"metric": ctx.metric, "order": [s["dropped"] for s in steps]},
    )


def _nll_losses(
    ctx: ScoreContext, kept: Sequence[int], candidates: Sequence[int], cache: list[BlockInputs]
) -> tuple[float, dict[int, float]]:
    """Mean NLL of the `kept` model, and of it with each candidate skipped (prefix reused)."""
    full = len(kept) == ctx.depth
    totals = {c: [0.0, 0] for c in [BASE, *candidates]}
    with torch.inference_mode():
        for number, batch in enumerate(ctx.batches):
            inputs = cache[number] if number < len(cache) else capture_block_inputs(ctx.stack, batch, keep_hidden=full)
            if not full and number >= len(cache):
                cache.append(inputs)
            for key, loss in ablation_measures(ctx.stack, inputs, kept, candidates, _group(ctx)).items():
                accumulate(totals[key], loss)
            if ctx.progress:
                ctx.progress("ablation", 1)
    means = {c: s / max(n, 1) for c, (s, n) in totals.items()}
    return means.pop(BASE), means


def _group(ctx: ScoreContext) -> int:
    return ctx.params_of(AblationParams).stack_candidates


def _accuracy_losses(
    ctx: ScoreContext, kept: Sequence[int], candidates: Sequence[int], cache: list
) -> tuple[float, dict[int, float]]:
    """Error rate (1 - exact-match accuracy) of greedy answers with each candidate skipped: short answers
    teacher-forced in one pass per candidate (prefix reused), free-form ones (GSM8K) generated."""
    items = [item for item in ctx.calib.items if item.expected is not None]
    if not items:
        raise LayerpruneError(
            "--metric accuracy needs calibration items with answers (gsm8k, arithmetic, prompt+answer JSONL)"
        )
    short = [item for item in items if is_short_answer(item)]
    free = [item for item in items if not is_short_answer(item)]
    wrong = {c: 0 for c in [BASE, *candidates]}
    if short:
        for candidate, correct in teacher_forced_correct(ctx, short, kept, candidates, cache).items():
            wrong[candidate] += correct.count(False)
    dropped = [i for i in range(ctx.depth) if i not in kept]
    if free:
        skips = {c: dropped if c == BASE else sorted([*dropped, c]) for c in wrong}
        for candidate, correct in free_form_correct(ctx, free, skips).items():
            wrong[candidate] += correct.count(False)
    if ctx.progress:
        ctx.progress("ablation", len(candidates))
    rates = {c: count / len(items) for c, count in wrong.items()}
    return rates.pop(BASE), rates


@dataclass
class _TeacherForced:
    """Per stop string: the answer batches, the stop-token mask and (iterative runs) the captured block inputs."""

    stop: str
    batches: list[AnswerBatch]
    stops: torch.Tensor
    inputs: list[BlockInputs] = field(default_factory=list)


def teacher_forced_correct(
    ctx: ScoreContext, items: list[CalibItem], kept: Sequence[int], candidates: Sequence[int], cache: list | None = None
) -> dict[int, list[bool]]:
    """Per item, would greedy decoding give exactly its answer (then a stop): for the `kept` model (key BASE)
    and for it with each candidate skipped. One forward per batch, then each candidate from its prefix."""

    def measures(inputs: BlockInputs, batch: Any, measure: Any) -> dict[int, Any]:
        return ablation_measures(ctx.stack, inputs, kept, candidates, _group(ctx), measure)

    return correct_per_key(ctx, items, [BASE, *candidates], len(kept) == ctx.depth, cache, measures)


def correct_per_key(
    ctx: ScoreContext,
    items: list[CalibItem],
    keys: Sequence[K],
    full: bool,
    cache: list | None,
    measures: Callable[[BlockInputs, Any, Any], dict[K, Any]],
) -> dict[K, list[bool]]:
    """The teacher-forced exact-match loop of every accuracy ablation (blocks and sublayers): per stop string and
    answer batch, capture the block inputs once (kept in `cache` for iterative runs unless `full`), then
    `measures(inputs, batch, measure)` gives each key's per-row hits; an item is right when its row hit and its
    answer fit."""
    cache = cache if cache is not None else []
    if not cache:
        cache.extend(_prepare(ctx, items, stop) for stop in sorted({item.stop for item in items}))
    position = {id(item): n for n, item in enumerate(items)}
    correct = {key: [False] * len(items) for key in keys}
    with torch.inference_mode():
        for group in cache:
            members = [item for item in items if item.stop == group.stop]
            for number, answers in enumerate(group.batches):
                batch = answers.batch.to(ctx.model.device)
                inputs = (group.inputs[number] if number < len(group.inputs)
                          else capture_block_inputs(ctx.stack, batch, keep_hidden=full))
                if not full and number >= len(group.inputs):
                    group.inputs.append(inputs)
                measure = functools.partial(greedy_match, stops=group.stops, needs_stop=answers.needs_stop)
                for key, hits in measures(inputs, batch, measure).items():
                    for row, index in enumerate(answers.items):
                        correct[key][position[id(members[index])]] = bool(hits[row]) and bool(answers.fits[row])
    return correct


def _prepare(ctx: ScoreContext, items: list[CalibItem], stop: str) -> _TeacherForced:
    members = [item for item in items if item.stop == stop]
    size = ctx.stack.lm_head().weight.shape[0]
    return _TeacherForced(
        stop,
        answer_batches(members, ctx.tokenizer, ctx.batch_size, ctx.max_new_tokens),
        stop_token_mask(ctx.tokenizer, stop, size, end_token_ids(ctx.model, ctx.tokenizer)),
    )


def free_form_correct(ctx: ScoreContext, items: list[CalibItem], skips: dict[int, list[int]]) -> dict[int, list[bool]]:
    """Generated verdicts per candidate: all candidates in one batch on an accelerator, one call each on a CPU
    (there the batched rows cost more than they save: 0.69x in bench/bench_candidates_batched.py)."""
    if ctx.model.device.type == "cpu":
        return {c: generated_correct(ctx, items, skip) for c, skip in skips.items()}
    return generated_correct_per_candidate(ctx, items, skips)


def generated_correct_per_candidate(
    ctx: ScoreContext, items: list[CalibItem], skips: dict[int, list[int]]
) -> dict[int, list[bool]]:
    """`generated_correct` for every candidate at once: the rows of one `generate` call are (candidate, item)
    pairs, each row skipping its candidate's blocks (models.row_skips), so all candidates decode side by side."""
    rows = [(candidate, n) for candidate in skips for n in range(len(items))]
    correct = {candidate: [False] * len(items) for candidate in skips}
    for stop in sorted({item.stop for item in items}):
        group = [(c, n) for c, n in rows if items[n].stop == stop]
        for start in range(0, len(group), ctx.batch_size):
            chunk = group[start : start + ctx.batch_size]
            with row_skipped_blocks(ctx.model, [skips[c] for c, _ in chunk]):
                texts = generate_greedy(
                    ctx.model,
                    ctx.tokenizer,
                    [items[n].prompt for _, n in chunk],
                    ctx.max_new_tokens,
                    [stop],
                    len(chunk),
                )
            for (c, n), text in zip(chunk, texts, strict=False):
                correct[c][n] = grading.final_number(text) == items[n].expected
    return correct


def generated_correct(ctx: ScoreContext, items: list[CalibItem], skip: list[int]) -> list[bool]:
    """Per item, is the greedy answer (generated until its stop string) right, with `skip` blocks removed."""
    with skipped_blocks(ctx.model, skip):
        return greedy_correct(ctx, items)


def greedy_correct(ctx: ScoreContext, items: list[CalibItem]) -> list[bool]:
    """Per item, is the model's greedy answer (generated until its stop string) right, as the model stands now."""
    correct: dict[int, bool] = {}
    for stop in sorted({item.stop for item in items}):
        group = [n for n, item in enumerate(items) if item.stop == stop]
        texts = generate_greedy(
            ctx.model, ctx.tokenizer, [items[n].prompt for n in group], ctx.max_new_tokens, [stop], ctx.batch_size
        )
        correct.update(
            {n: grading.final_number(text) == items[n].expected for n, text in zip(group, texts, strict=False)}
        )
    return [correct[n] for n in range(len(items))]
