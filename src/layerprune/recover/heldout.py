"""One yardstick for every recovery method: cross-entropy and KL(teacher || student) on held-out teacher answers.

The trainers log different quantities (SFT: cross-entropy; KD/GKD: forward KL; OPD: the divergence on the student's
own samples), so a curve of one method cannot be read against another's. Here both quantities are measured on the
same held-out rows (prompt + the teacher's response, completion tokens only), before, during and after training.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import TrainerCallback

from layerprune.recover.schema import GenerationSection
from layerprune.recover.selfgen import chat_messages, plain_example


def held_out_ids(ids: list[str], held_out: float, seed: int) -> set[str]:
    """The held-out prompt ids: the share `held_out` (at least one of two or more) with the smallest seeded hash,
    so every method holds out the same prompts given the same prompt set, in whatever order it comes."""
    unique = sorted(set(ids))
    n = 0 if held_out == 0 or len(unique) < 2 else max(1, round(len(unique) * held_out))
    return set(sorted(unique, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())[:n])


def report_metrics(pruned: dict[str, Any] | None, after: dict[str, Any] | None, held: set[str],
                   **extra: dict[str, Any] | None) -> dict[str, Any]:
    """recover_report.json's held_out_metrics, one shape for every method: CE and KL (None without a teacher) of
    the pruned and the trained model on the same held-out prompts' teacher answers, token-weighted."""
    def pick(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if metrics is None else {"ce": metrics["ce"], "kl": metrics.get("kl")}

    tokens = next((m["tokens"] for m in (pruned, after) if m is not None), 0)
    return {"pruned": pick(pruned), "after": pick(after), **{k: pick(v) for k, v in extra.items()},
            "tokens": tokens, "prompts": sorted(held)}


def encode_rows(tokenizer: Any, rows: list[dict[str, Any]], settings: GenerationSection,
                max_length: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first completion token) per row, cut to max_length: in the chat format, or plain
    prompt + answer + stop where generate.chat_template is false (the format every method trains on). A row cut
    before its first completion token is left out; one with a single completion token is kept, as SFT and kd keep it."""
    encoded = [encode_row(tokenizer, row, settings, max_length) for row in rows]
    return [(ids, start) for ids, start in encoded if 0 < start < len(ids)]


def encode_row(tokenizer: Any, row: dict[str, Any], settings: GenerationSection,
               max_length: int) -> tuple[list[int], int]:
    """One row's (token ids, index of the first completion token), cut at its end to max_length, as SFT cuts it: the
    completion starts where the conversation's ids leave the prompt's (TRL's common prefix; a template may render
    the prompt alone otherwise than inside the conversation)."""
    from trl.data_utils import common_prefix_length

    if not settings.chat_template:
        return plain_example(tokenizer, row["prompt"], row["response"], settings, max_length)
    prompt = chat_messages(row["prompt"], settings.system_prompt)
    full = [*prompt, {"role": "assistant", "content": row["response"]}]
    prompt_ids = _ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    full_ids = _ids(tokenizer.apply_chat_template(full, tokenize=True))
    return full_ids[:max_length], min(common_prefix_length(prompt_ids, full_ids), len(full_ids) - 1)


def _ids(value: Any) -> list[int]:
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    return list(value)


CACHE_BYTES = 8 << 30  # the most the teacher's held-out log-probabilities may take in memory (CPU runs)


def cache_limit() -> int:
    """What the teacher's kept log-probabilities may take: a third of the memory available when a run starts (its
    models loaded, its training not yet begun), at most CACHE_BYTES."""
    import psutil

    return min(CACHE_BYTES, psutil.virtual_memory().available // 3)


class HeldOutTeacher:
    """The teacher's side of one run's held-out rows: its log-probabilities over each row's completion tokens. The
    teacher is frozen, so every evaluation of a run (before, at each eval step, after) reads the same ones: on the
    CPU they are computed once and kept while they fit in `limit` bytes (default: cache_limit; a teacher forward is
    half of each evaluation there); on an accelerator, or past the limit, they are computed again at each evaluation.
    Either way the numbers are the same: the same forward on the same rows."""

    def __init__(self, teacher: Any, encoded: list[tuple[list[int], int]], limit: int | None = None) -> None:
        self.model, self.encoded = teacher, encoded
        self.keep = limit != 0 and next(teacher.parameters()).device.type == "cpu"
        self.limit = (cache_limit() if self.keep else 0) if limit is None else limit
        self.kept: list[torch.Tensor] = []
        self.forwards = 0  # teacher forward passes run (a test reads it)

    @torch.no_grad()
    def log_probs(self, index: int, device: torch.device) -> torch.Tensor:
        """The teacher's log-probabilities over row `index`'s completion tokens, on `device`."""
        if index < len(self.kept):
            return self.kept[index].to(device)  # the same tensor where it is on `device`
        ids, start = self.encoded[index]
        input_ids = torch.tensor([ids], device=next(self.model.parameters()).device)
        self.forwards += 1
        logits = self.model(input_ids=input_ids, use_cache=False).logits[0, start - 1:-1]
        logp = torch.log_softmax(logits.float().to(device), -1)
        if self.keep and device.type == "cpu" and index == len(self.kept):  # kept in host memory only
            self.kept.append(logp)
            if sum(t.numel() * t.element_size() for t in self.kept) > self.limit:
                self.keep, self.kept = False, []  # too large to keep: computed at each evaluation from here on
        return logp

    def release(self) -> None:
        """Free the kept log-probabilities (after a run's last evaluation); later calls compute them again."""
        self.keep, self.kept = False, []


@torch.no_grad()
def held_out_metrics(student: Any, teacher: Any, encoded: list[tuple[list[int], int]]) -> dict[str, float]:
    """Token-weighted mean cross-entropy of the student and KL(teacher || student) over completion tokens.
    `teacher`: the teacher model, or a run's `HeldOutTeacher` over the same `encoded` rows (its log-probabilities
    computed once)."""
    side = teacher if isinstance(teacher, HeldOutTeacher) else HeldOutTeacher(teacher, encoded, limit=0)
    if side.encoded is not encoded:
        raise ValueError("held_out_metrics: the teacher's side was made over other rows than the student's")
    was_training = student.training
    student.eval()
    ce_sum = kl_sum = 0.0
    count = 0
    device = next(student.parameters()).device
    for index, (ids, start) in enumerate(encoded):
        input_ids = torch.tensor([ids], device=device)
        s_logp = torch.log_softmax(student(input_ids=input_ids, use_cache=False).logits[0, start - 1:-1].float(), -1)
        t_logp = side.log_probs(index, device)
        targets = input_ids[0, start:]
        ce_sum += float(-s_logp.gather(-1, targets[:, None]).sum())
        kl_sum += float((t_logp.exp() * (t_logp - s_logp)).sum())
        count += int(targets.numel())
    student.train(was_training)
    return {"ce": ce_sum / max(count, 1), "kl": kl_sum / max(count, 1), "tokens": count}


class HeldOutCallback(TrainerCallback):
    """Measure held-out CE and KL whenever the trainer evaluates (every eval_steps), into `points`."""

    def __init__(self, held: HeldOutTeacher) -> None:
        self.held = held  # the run's teacher side and its rows, shared with its other evaluations
        self.points: list[dict[str, float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if model is not None and self.held.encoded and state.global_step % args.eval_steps == 0:
            self.points.append({"step": state.global_step, **held_out_metrics(model, self.held, self.held.encoded)})


def curve_points(points: list[dict[str, float]], key: str) -> list[list[float]]:
    return [[p["step"], p[key]] for p in points]
