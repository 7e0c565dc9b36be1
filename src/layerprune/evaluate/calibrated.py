"""`probes-calibrated`: the probe levels a model can do often but not always, measured on the calibration stream.

A generative claim needs a probe the original model does well above its floor: a level at 0% or 100% cannot show a
drop or a recovery. Each candidate level is scored on items of the probe calibration stream (never an evaluation
item), greedy, the evaluation's prompt (plain few-shot text, or the model's chat template with `probe_format: chat`),
stop and token budget; a level is kept when the model scores between `low` and `high`, at most `per_family` levels a
family (those nearest the middle of the band). A level is left out before its score is read when it has no
calibration stream, or too few distinct items to show a drop (fewer than `min_items` evaluation items, or fewer
calibration items than min(`min_items`, `items`)). The record gives every candidate its calibration score with a 95%
Wilson interval, the band, `reason` (no calibration stream, too few distinct items, below band, above band, in band,
in band but not kept) and `why` in words; the same lines are printed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from layerprune.tasks.probes import (
    EVAL_SEED,
    PROBE_DOCS,
    Probe,
    distinct_items,
    easy_probe_tasks,
    family_of,
    generate_probes,
    probe_tasks,
)

CANDIDATES = ("arith_1dc", "arith_2d_add", "arith_2d_sub", "brackets_d2", "brackets_d3", "brackets_d4",
              *easy_probe_tasks())
PROBE_MAX_TOKENS = 32  # the probe evaluation's max_gen_toks (evaluate.project_tasks)
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval
Scorer = Callable[[str, list[Probe]], list[bool]]  # (task, calibration items) -> whether each answer was right


class ProbeCalibration(BaseModel):
    """Which probe levels to keep: the candidates, the band of the original's score, items per level."""

    model_config = ConfigDict(extra="forbid")

    candidates: list[str] = Field(default_factory=lambda: list(CANDIDATES),
                                  description="Probe tasks to measure (default: the easy levels and 3 classic ones)")
    items: int = Field(100, ge=10, description="Calibration-stream items per level (fewer where the stream has fewer)")
    min_items: int = Field(20, ge=1, description="Leave out a level with fewer distinct evaluation items than this "
                                                 "(too few to show a drop: brackets_d2 has 9), or with fewer "
                                                 "calibration items than this and `items`")
    low: float = Field(0.3, ge=0, le=1, description="Keep a level whose score is at least this")
    high: float = Field(0.9, ge=0, le=1, description="... and at most this")
    per_family: int = Field(1, ge=1, description="Most levels kept per probe family (nearest the band's middle)")
    batch_size: int = Field(16, ge=1, description="Prompts per generation batch")
    probe_format: Literal["plain", "chat"] = Field(
        "plain", description="Score as the evaluation will (its probe_format): plain few-shot text, or the few-shot "
                             "examples as prior turns of the model's chat template")

    @model_validator(mode="after")
    def _known(self) -> ProbeCalibration:
        known = probe_tasks()
        unknown = [task for task in self.candidates if task not in known]
        if unknown:
            raise ValueError(f"unknown probe task(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `n` independent items (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def calibration_items(task: str, n: int, trained: frozenset[str] = frozenset()) -> tuple[list[Probe], int]:
    """Up to `n` calibration-stream items of a level whose question is not in `trained` (what the model was trained
    on: a post-trained variant draws its data from the same stream), the stream's first such items; and how many
    trained ones were passed over. ([], 0) where the level has no calibration stream (every question is an
    evaluation item)."""
    args = probe_tasks()[task]
    try:
        drawn = generate_probes(args, n, EVAL_SEED, stream="calib")
    except RuntimeError:  # probes._avoiding: every draw was an evaluation question
        return [], 0
    if trained and any(p.question in trained for p in drawn):
        try:  # the stream is a prefix: a longer draw starts with the same items
            drawn = generate_probes(args, n + len(trained), EVAL_SEED, stream="calib")
        except RuntimeError:  # fewer distinct items than that: the first draw's untrained ones
            pass
    fresh: list[Probe] = []
    passed = 0
    for probe in drawn:
        if len(fresh) == n:
            break
        if probe.question in trained:
            passed += 1
        else:
            fresh.append(probe)
    return fresh, passed


def evaluation_items(task: str) -> int:
    """How many distinct evaluation items a level has (PROBE_DOCS, or fewer where the level has fewer)."""
    return min(PROBE_DOCS, distinct_items(task) or PROBE_DOCS)


def greedy_scorer(model: Any, tokenizer: Any, settings: ProbeCalibration) -> Scorer:
    """Exact match of the model's greedy answers (the evaluation's prompt, stop and token budget)."""
    from layerprune.evaluate.project_tasks import chat_prompt
    from layerprune.models.generate import generate_greedy

    def score(task: str, items: list[Probe]) -> list[bool]:
        chat = settings.probe_format == "chat"
        prompts = [chat_prompt(p, tokenizer) if chat else p.prompt for p in items]
        bos = not chat and "gemma" in str(getattr(model.config, "model_type", ""))  # lm-eval's HFLM: BOS for Gemma
        answers = generate_greedy(model, tokenizer, prompts, PROBE_MAX_TOKENS, ["\n"],
                                  batch_size=settings.batch_size, add_special_tokens=bos)
        return [a.strip() == p.answer.strip() for a, p in zip(answers, items, strict=True)]

    return score


def score_level(task: str, settings: ProbeCalibration, scorer: Scorer,
                trained: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A level's exact-match score on calibration-stream items the model was not trained on, with its 95% Wilson
    interval (score and interval None where it has no calibration stream)."""
    items, passed = calibration_items(task, settings.items, trained)
    record: dict[str, Any] = {"family": family_of(task), "items": len(items), "eval_items": evaluation_items(task),
                              "score": None, "interval": None, "trained_passed_over": passed}
    if items:
        correct = sum(scorer(task, items))
        record.update(score=correct / len(items), correct=correct, interval=list(wilson(correct, len(items))))
    return record


def _percent(record: dict[str, Any]) -> str:
    low, high = record["interval"]
    return f"{100 * record['score']:.0f}% (95% CI {100 * low:.0f}-{100 * high:.0f}%, {record['items']} items)"


def _screen(record: dict[str, Any], settings: ProbeCalibration) -> tuple[str, str] | None:
    """(reason, why) for a level left out whatever the others score; None for one in the band."""
    band = f"the band {100 * settings.low:.0f}-{100 * settings.high:.0f}%"
    if record["score"] is None:
        return "no calibration stream", "no calibration stream (every question is an evaluation item)"
    if record["eval_items"] < settings.min_items or record["items"] < min(settings.min_items, settings.items):
        return "too few distinct items", (f"too few distinct items: {record['eval_items']} evaluation, "
                                          f"{record['items']} calibration (min_items {settings.min_items})")
    if record["score"] < settings.low:
        return "below band", f"{_percent(record)} is below {band}"
    if record["score"] > settings.high:
        return "above band", f"{_percent(record)} is above {band}"
    return None


def select_levels(scores: dict[str, dict[str, Any]], settings: ProbeCalibration) -> dict[str, dict[str, Any]]:
    """Each level's record with `kept`, `reason`, `why` and `band`: in the band, and among the `per_family`
    nearest its middle."""
    middle = (settings.low + settings.high) / 2
    out = {task: {**record, "band": [settings.low, settings.high]} for task, record in scores.items()}
    in_band = []
    for task, record in out.items():
        screened = _screen(record, settings)
        if screened is None:
            in_band.append(task)
        else:
            record.update(kept=False, reason=screened[0], why=screened[1])
    for family in sorted({out[t]["family"] for t in in_band}):
        ranked = sorted((t for t in in_band if out[t]["family"] == family),
                        key=lambda t: (abs(out[t]["score"] - middle), t))
        for rank, task in enumerate(ranked):
            kept = rank < settings.per_family
            out[task].update(kept=kept, reason="in band" if kept else "in band, not kept",
                             why=f"{_percent(out[task])} is in the band" + (
                                 "" if kept else f"; {family} keeps {settings.per_family} level(s), nearer the "
                                                 "middle first"))
    return out


def level_lines(levels: dict[str, dict[str, Any]]) -> list[str]:
    """One line per candidate level: kept or left out, and why (its score, interval and band in the words)."""
    return [f"{task}: {'kept' if r['kept'] else 'left out'} - {r['why']}" for task, r in levels.items()]


def calibrate_probes(model: Any, tokenizer: Any, settings: ProbeCalibration, progress: Any = None,
                     scorer: Scorer | None = None, trained: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Measure every candidate level on the calibration stream and select; returns the record (kept tasks first).

    `trained`: questions the model was trained on (a variant's data, `posttrain.api.trained_questions`), passed
    over: a gate read on them would say what the model memorized, not what it can do. `scorer` replaces the model's
    greedy answers (a test's stand-in); every level's line goes to `progress`."""
    start = time.perf_counter()
    scorer = scorer or greedy_scorer(model, tokenizer, settings)
    scores = {}
    for task in settings.candidates:
        scores[task] = score_level(task, settings, scorer, trained)
        if progress is not None and scores[task]["score"] is not None:
            passed = scores[task]["trained_passed_over"]
            progress(f"{task}: {_percent(scores[task])} on the calibration stream"
                     + (f" ({passed} items the model was trained on passed over)" if passed else ""))
    levels = select_levels(scores, settings)
    if progress is not None:
        progress(f"probes-calibrated: band {100 * settings.low:.0f}-{100 * settings.high:.0f}%, at most "
                 f"{settings.per_family} a family, min_items {settings.min_items}")
        for line in level_lines(levels):
            progress(line)
    return {"kept": [t for t, r in levels.items() if r["kept"]], "levels": levels,
            "settings": settings.model_dump(), "stream": "calib", "trained_questions": len(trained),
            "seconds": time.perf_counter() - start}


def kept_tasks(record_path: Path) -> list[str]:
    """The kept levels of a saved calibration record."""
    import json

    return list(json.loads(record_path.read_text())["kept"])
