"""Span-local training (after LLM-Streamline, arXiv 2403.19135): for each dropped span, only one kept block next to
the cut learns, with an MSE on the teacher's hidden states, what the span computed.

block 'before' (the kept block p = s - 1 before span s..e): input = the teacher's state entering block p, target =
the teacher's state after block e, so that p alone stands in for p and the span. block 'after' (the kept block
q = e + 1): input = the teacher's state entering the span (after block s - 1), target = the teacher's state after q.
The states are cached one span at a time (block-major: one teacher forward per sequence up to the span's end), and
the block is trained alone on them: a forward and backward through one block, never the whole model. The block is
trained in float32 and copied back in the model's dtype. It trains on the sequences in the order every trainer
reads them (budget.order), batch x grad_accum a step, and counts train.max_tokens in budget.py's unit: the answer
tokens of those sequences (every position is regressed, but a trainer's loss is taken on the answer alone), each
span's block on the whole budget, so that one budget trains local and a trainer on the same sequences.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from layerprune.core.errors import LayerpruneError
from layerprune.recover.replace import _first, _Stop, decoder_layers, dropped_runs

log = logging.getLogger(__name__)
DROPPED_KWARGS = ("cache", "past_key_values", "past_key_value", "use_cache", "hidden_states")


@dataclass(frozen=True)
class Span:
    """A dropped span and the block trained for it: original numbering, and the block's index in the pruned model."""

    first: int
    last: int
    trained: int  # original index of the trained kept block
    student: int  # its index in the pruned model
    enter: int  # original block whose input is the training input
    leave: int  # original block whose output is the target
    lost: str | None = None  # a block that lost one sublayer and is trained for it: the part removed (attn, mlp)


def local_spans(dropped: list[int], num_blocks_before: int, block: str,
                partial: dict[int, str] | None = None) -> list[Span]:
    """The spans and, per span, the kept block to train (one-line errors where there is no such block), in block
    order; with `partial` (a sublayer prune: block -> the one part it lost), each such block not already trained for
    a span is trained for itself: input the teacher's state entering it, target the teacher's state after it, so
    that its kept sublayer learns what the pair computed."""
    spans = _block_spans(dropped, num_blocks_before, block) if dropped else []
    drops = sorted(set(dropped))
    trained = {span.trained for span in spans}
    spans += [Span(b, b, b, b - sum(d < b for d in drops), b, b, lost)
              for b, lost in (partial or {}).items() if b not in trained]
    return sorted(spans, key=lambda span: span.trained)


def _block_spans(dropped: list[int], num_blocks_before: int, block: str) -> list[Span]:
    drops = sorted(set(dropped))
    if block == "before" and drops and drops[0] == 0:
        raise LayerpruneError("local cannot train a block before a span at block 0; set local.block: after")
    if block == "after" and drops and drops[-1] == num_blocks_before - 1:
        raise LayerpruneError("local cannot train a block after a span at the last block; set local.block: before")
    if drops and drops[0] == 0:  # block 'after' at block 0: dropped_runs needs a kept block before, compute here
        runs = [(r[0], r[-1]) for r in contiguous(drops)]
    else:
        runs = [(r.first, r.last) for r in dropped_runs(drops, num_blocks_before)]
    spans = []
    for first, last in runs:
        trained = first - 1 if block == "before" else last + 1
        if trained in drops:
            raise LayerpruneError(f"local: block {trained} next to span {first}-{last} is dropped too")
        enter, leave = (trained, last) if block == "before" else (first, trained)
        spans.append(Span(first, last, trained, trained - sum(d < trained for d in drops), enter, leave))
    return spans


def contiguous(drops: list[int]) -> list[list[int]]:
    """The runs of adjacent blocks of sorted `drops` (each a span local trains one block for)."""
    runs: list[list[int]] = []
    for d in drops:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


@torch.no_grad()
def capture_states(teacher: Any, span: Span, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(input, target, the trained block's call kwargs) of one sequence, from one teacher forward up to span.leave."""
    layers = decoder_layers(teacher)
    seen: dict[str, Any] = {}

    def on_enter(_module: Any, args: Any, kwargs: Any) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def on_trained(_module: Any, _args: Any, kwargs: Any) -> None:
        seen["kwargs"] = {k: _detached(v) for k, v in kwargs.items() if k not in DROPPED_KWARGS}

    def on_leave(_module: Any, _inputs: Any, output: Any) -> None:
        seen["y"] = _first(output).detach()
        raise _Stop

    handles = [layers[span.enter].register_forward_pre_hook(on_enter, with_kwargs=True),
               layers[span.trained].register_forward_pre_hook(on_trained, with_kwargs=True),
               layers[span.leave].register_forward_hook(on_leave)]
    try:
        teacher(input_ids=torch.tensor([ids], device=next(teacher.parameters()).device), use_cache=False)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen["x"], seen["y"], seen["kwargs"]


STATES_FORMAT = 1  # what capture_states keeps; a change to it makes every kept file another key


def teacher_digest(teacher: Any) -> str:
    """xxh3-128 of what the teacher's states depend on: its weights and buffers (names, dtypes, shapes and bytes), its
    config (attention implementation, rope), its device type, and the torch and transformers versions."""
    import transformers

    device = next(teacher.parameters()).device.type
    config = teacher.config.to_json_string(use_diff=False)
    digest = xxhash.xxh3_128(f"{STATES_FORMAT}:{torch.__version__}:{transformers.__version__}:{device}:"
                             f"{getattr(teacher.config, '_attn_implementation', None)}:{config}".encode())
    for name, tensor in teacher.state_dict().items():
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode())
        if flat.numel():
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def span_states(teacher: Any, span: Span, sequences: list[list[int]], states: Path | None,
                digest: str) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """The teacher's (input, target, kwargs) of every sequence for `span`. With `states` (a folder the runs of a study
    share), read from the file a run with the same teacher (`digest`: teacher_digest), span and sequences left there:
    the same forward's numbers, so a study's runs at several budgets capture them once; else captured here and left
    there for the next run."""
    if states is None:
        return [capture_states(teacher, span, ids) for ids in sequences]
    key = xxhash.xxh3_128(f"{digest}:{astuple(span)}".encode())
    for ids in sequences:
        key.update(f"{len(ids)}:{','.join(map(str, ids))};".encode())
    path = states / f"{key.hexdigest()}.pt"
    if path.is_file():
        try:
            cache = torch.load(path, weights_only=True)
            if len(cache) != len(sequences) or any(x.shape[-2] != len(ids) for (x, _, _), ids in zip(
                    cache, sequences, strict=True)):
                raise ValueError("its states do not match the sequences")
            log.info("local: the teacher's states for block %d read from %s", span.trained, path)
            return cache
        except Exception as err:  # noqa: BLE001 (a torn or foreign file fails in many ways: captured again)
            log.warning("local: %s unreadable (%s); capturing the states again", path, err)
    cache = [capture_states(teacher, span, ids) for ids in sequences]
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        states.mkdir(parents=True, exist_ok=True)
        torch.save(cache, partial)
        os.replace(partial, path)
    except OSError as err:  # a full disk costs the next run a capture, not this run
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        log.warning("local: the teacher's states not kept in %s (%s)", states, err)
    return cache


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32 if value.is_floating_point() else value.dtype)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


def block_error(block: Any, cache: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
                device: torch.device) -> float:
    """Mean squared error of the block's output against the targets, over every cached token and dimension."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y, kwargs in cache:
            out = _first(block(_to(x, device), **_to(kwargs, device)))
            total += float((out - _to(y, device)).pow(2).sum())
            count += y.numel()
    return total / max(count, 1)


@dataclass(frozen=True)
class LocalBudget:
    """How one span trains: optimizer steps, sequences per step, AdamW settings, and the token budget."""

    steps: int
    sequences_per_step: int
    learning_rate: float
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_tokens: int | None = None  # stop a span's training once it has trained on this many target tokens


def step_batches(n: int, per_step: int, steps: int) -> list[list[int]]:
    """The sequence indices of each optimizer step: the sequences in their order, `per_step` at a time, the last
    step of a pass over them shorter (as a trainer's last accumulation window of an epoch), pass after pass."""
    chunks = [list(range(i, min(i + per_step, n))) for i in range(0, n, per_step)]
    return [chunks[s % len(chunks)] for s in range(steps)] if chunks else []


def train_block(block: Any, cache: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]], budget: LocalBudget,
                device: torch.device, targets: list[int] | None = None) -> tuple[Any, dict[str, int], int, list[float]]:
    """A float32 copy of `block` trained on the cached (input, target) pairs; the copy, what it trained on
    ({target_tokens, tokens, sequences}), the optimizer steps it took and each step's MSE (the batch's, in
    block_error's units).

    The block regresses every position of a sequence, but the token budget counts its target tokens: `targets`,
    per sequence, the answer tokens (every token where None), the unit of budget.py, so that one budget trains local
    on the same sequences as a trainer. The budget is checked after each step (at most one step past it)."""
    work = copy.deepcopy(block).to(device=device, dtype=torch.float32).train()
    params = [p for p in work.parameters()]
    for param in params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=budget.learning_rate, betas=budget.betas,
                                  weight_decay=budget.weight_decay)
    seen, steps, losses = {"target_tokens": 0, "tokens": 0, "sequences": 0}, 0, []
    for indices in step_batches(len(cache), budget.sequences_per_step, budget.steps):
        if budget.max_tokens is not None and seen["target_tokens"] >= budget.max_tokens:
            break
        steps += 1
        batch = [cache[i] for i in indices]
        count = sum(y.numel() for _, y, _ in batch)
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for i, (x, y, kwargs) in zip(indices, batch, strict=True):
            out = _first(work(_to(x, device), **_to(kwargs, device)))
            loss = (out - _to(y, device)).pow(2).sum() / count
            loss.backward()
            step_loss += loss.detach()  # the batch's mean over every token and dimension, as block_error
            seen["tokens"] += int(y.shape[-2])
            seen["target_tokens"] += int(y.shape[-2]) if targets is None else targets[i]
            seen["sequences"] += 1
        torch.nn.utils.clip_grad_norm_(params, budget.max_grad_norm)
        optimizer.step()
        losses.append(float(step_loss))  # one device sync a step, not one a sequence
    return work.eval(), seen, steps, losses


def train_spans(student: Any, teacher: Any, dropped: list[int], sequences: list[list[int]], block: str,
                budget: LocalBudget, targets: list[int] | None = None,
                partial: dict[int, str] | None = None, states: Path | None = None) -> list[dict[str, Any]]:
    """Train one kept block per dropped span, in block order; return each span's error before and after and what
    it trained on. The steps are shared out over the spans; the token budget is each span's whole (every span's
    block trains on the same sequences, those a trainer given the budget trains on). `targets`: the answer tokens
    of each sequence (train_block). `states`: a folder where the teacher's states are kept for other runs
    (span_states)."""
    if not sequences:
        raise LayerpruneError("local needs training text: no teacher answers left for training prompts")
    spans = local_spans(dropped, len(decoder_layers(teacher)), block, partial)
    layers = decoder_layers(student)
    device = next(student.parameters()).device
    per_span = max(1, budget.steps // len(spans))
    fits = []
    digest = teacher_digest(teacher) if states is not None else ""
    for span in spans:
        cache = span_states(teacher, span, sequences, states, digest)
        before = block_error(layers[span.student], cache, device)
        share = replace(budget, steps=per_span)
        trained, seen, steps, losses = train_block(layers[span.student], cache, share, device, targets)
        after = block_error(trained, cache, device)
        with torch.no_grad():
            for target, source in zip(layers[span.student].parameters(), trained.parameters(), strict=True):
                target.copy_(source.to(target.dtype))
        what = f"its {span.lost}" if span.lost else f"span {span.first}-{span.last}"
        log.info("local: block %d for %s, hidden-state MSE %.4g -> %.4g (%d tokens)", span.trained, what, before,
                 after, seen["tokens"])
        removed = {"removed_sublayer": f"{span.trained}.{span.lost}"} if span.lost else {
            "dropped": [span.first, span.last]}
        fits.append({**removed, "block": span.trained, "student_block": span.student,
                     "mse_before": before, "mse_after": after, "steps": steps, **seen,
                     "mse_per_step": [float(f"{v:.6g}") for v in losses]})
        del cache
    return fits
