"""`probes-calibrated`: the probe levels a model can do often but not always, measured on the calibration stream.

A generative claim needs a probe the original model does well above its floor: a level at 0% or 100% cannot show a
drop or a recovery. Each candidate level is scored on items of the probe calibration stream (never an evaluation
item), greedy, the evaluation's prompt, stop and token budget; a level is kept when the model scores between `low`
and `high`, at most `per_family` levels a family (those nearest the middle of the band). The record says every
level's score and why it was kept or left out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from layerprune.errors import LayerpruneError
from layerprune.probes import EVAL_SEED, easy_probe_tasks, family_of, generate_probes, probe_tasks

CANDIDATES = ("arith_1dc", "arith_2d_add", "arith_2d_sub", *easy_probe_tasks())
PROBE_MAX_TOKENS = 32  # the probe evaluation's max_gen_toks (evaluate.project_tasks)


class ProbeCalibration(BaseModel):
    """Which probe levels to keep: the candidates, the band of the original's score, items per level."""

    model_config = ConfigDict(extra="forbid")

    candidates: list[str] = Field(default_factory=lambda: list(CANDIDATES),
                                  description="Probe tasks to measure (default: the easy levels and 3 classic ones)")
    items: int = Field(100, ge=10, description="Calibration-stream items per level")
    low: float = Field(0.3, ge=0, le=1, description="Keep a level whose score is at least this")
    high: float = Field(0.9, ge=0, le=1, description="... and at most this")
    per_family: int = Field(1, ge=1, description="Most levels kept per probe family (nearest the band's middle)")
    batch_size: int = Field(16, ge=1, description="Prompts per generation batch")

    @model_validator(mode="after")
    def _known(self) -> ProbeCalibration:
        known = probe_tasks()
        unknown = [task for task in self.candidates if task not in known]
        if unknown:
            raise ValueError(f"unknown probe task(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


def score_level(model: Any, tokenizer: Any, task: str, settings: ProbeCalibration) -> dict[str, Any]:
    """A level's exact-match score on calibration-stream items, greedy (the evaluation's prompt and stop)."""
    from layerprune.models.generate import generate_greedy

    items = generate_probes(probe_tasks()[task], settings.items, EVAL_SEED, stream="calib")
    if not items:
        raise LayerpruneError(f"probe task {task} has no calibration items (every question is an evaluation item)")
    bos = "gemma" in str(getattr(model.config, "model_type", ""))  # lm-eval's HFLM adds BOS for Gemma only
    answers = generate_greedy(model, tokenizer, [p.prompt for p in items], PROBE_MAX_TOKENS, ["\n"],
                              batch_size=settings.batch_size, add_special_tokens=bos)
    correct = sum(a.strip() == p.answer.strip() for a, p in zip(answers, items, strict=True))
    return {"family": family_of(task), "score": correct / len(items), "items": len(items)}


def select_levels(scores: dict[str, dict[str, Any]], settings: ProbeCalibration) -> dict[str, dict[str, Any]]:
    """Each level's record with `kept` and `why`: in the band, and among the `per_family` nearest its middle."""
    middle = (settings.low + settings.high) / 2
    out = {task: dict(record) for task, record in scores.items()}
    in_band = [t for t, r in out.items() if settings.low <= r["score"] <= settings.high]
    for task, record in out.items():
        if task not in in_band:
            side = "below" if record["score"] < settings.low else "above"
            record.update(kept=False, why=f"{100 * record['score']:.0f}% is {side} the band "
                                          f"{100 * settings.low:.0f}-{100 * settings.high:.0f}%")
    for family in sorted({out[t]["family"] for t in in_band}):
        ranked = sorted((t for t in in_band if out[t]["family"] == family),
                        key=lambda t: (abs(out[t]["score"] - middle), t))
        for rank, task in enumerate(ranked):
            kept = rank < settings.per_family
            out[task].update(kept=kept, why=f"{100 * out[task]['score']:.0f}% is in the band" + (
                "" if kept else f"; {family} keeps {settings.per_family} level(s), nearer the middle first"))
    return out


def calibrate_probes(model: Any, tokenizer: Any, settings: ProbeCalibration,
                     progress: Any = None) -> dict[str, Any]:
    """Measure every candidate level on the calibration stream and select; returns the record (kept tasks first)."""
    start = time.perf_counter()
    scores = {}
    for task in settings.candidates:
        scores[task] = score_level(model, tokenizer, task, settings)
        if progress is not None:
            progress(f"{task}: {100 * scores[task]['score']:.0f}% of {scores[task]['items']} calibration items")
    levels = select_levels(scores, settings)
    return {"kept": [t for t, r in levels.items() if r["kept"]], "levels": levels,
            "settings": settings.model_dump(), "stream": "calib", "seconds": time.perf_counter() - start}


def kept_tasks(record_path: Path) -> list[str]:
    """The kept levels of a saved calibration record."""
    import json

    return list(json.loads(record_path.read_text())["kept"])
