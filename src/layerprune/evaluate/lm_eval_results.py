"""Reading lm-eval's results: a group's own entry, samples under one name, and the rows of the summary."""

from __future__ import annotations

import math
from typing import Any

from layerprune.evaluate.summary import TaskResult
from layerprune.evaluate.task_specs import TaskSpec


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def aggregate_group(spec: TaskSpec, raw: dict[str, Any]) -> None:
    """Add a group's own entry to lm-eval's results, as lm-eval's group config does it (mmlu: weighted by size).

    The subtasks' entries stay; samples are merged under the group's name, each marked with its subtask.
    """
    from lm_eval.api.metrics import aggregate_subtask_metrics, pooled_sample_stderr

    prefix = f"{spec.name}_"
    names = sorted(name for name in raw["results"] if name.startswith(prefix))
    sizes = [int(raw["n-samples"][name]["effective"]) for name in names]
    scores: dict[str, Any] = {"alias": spec.name}
    for metric in spec.metrics:
        name, _, filt = metric.partition(",")
        key, err_key = f"{name},{filt or 'none'}", f"{name}_stderr,{filt or 'none'}"
        values = [_number(raw["results"][sub].get(key)) for sub in names]
        if not names or any(v is None for v in values):
            continue
        scores[key] = aggregate_subtask_metrics(values, sizes, weight_by_size=True)
        errors = [_number(raw["results"][sub].get(err_key)) for sub in names]
        scores[err_key] = pooled_sample_stderr(errors, sizes) if all(e is not None for e in errors) else None
    raw["results"][spec.name] = scores
    raw.setdefault("n-samples", {})[spec.name] = {"effective": sum(sizes), "original": sum(
        int(raw["n-samples"][name].get("original", 0)) for name in names)}
    samples = raw.get("samples", {})
    samples[spec.name] = [{**sample, "subtask": name} for name in names for sample in samples.pop(name, [])]


def summarize(spec: TaskSpec, raw: dict[str, Any], settings: dict[str, Any], seconds: float,
              sampled: bool = False) -> list[TaskResult]:
    """Pick the task's metrics (headline first) out of lm-eval's results dict; with `sampled`, its pass@k / maj@N
    (named "<metric>[,<filter>] sampled", never the headline). Sandbox status counts go on the first row.

    A task of lm-eval's index (no metrics named) reports every metric lm-eval gives it; a group without
    aggregated metrics (e.g. leaderboard) reports each of its tasks under the task's own name.
    """
    if not spec.metrics and not sampled:
        names = [spec.name] if reported_metrics(raw["results"].get(spec.name, {})) else sorted(raw["results"])
        return [row for name in names for row in _rows(spec, name, raw, reported_metrics(raw["results"][name]),
                                                       settings, seconds)]
    metrics = sampled_metrics(raw["results"][spec.name]) if sampled else list(spec.metrics)
    return _rows(spec, spec.name, raw, metrics, settings, seconds, sampled)


def reported_metrics(scores: dict[str, Any]) -> list[str]:
    """'acc', 'exact_match,strict-match', ...: the numbers lm-eval reports for one task, in its order."""
    keys = [key for key in scores if "," in key and "_stderr," not in key and _number(scores[key]) is not None]
    return [key.removesuffix(",none") for key in keys]


def _rows(spec: TaskSpec, name: str, raw: dict[str, Any], metrics: list[str], settings: dict[str, Any],
          seconds: float, sampled: bool = False) -> list[TaskResult]:
    scores = raw["results"][name]
    n = _effective_n(name, raw)
    statuses = scores.get("status,none") if isinstance(scores.get("status,none"), dict) else None
    rows: list[TaskResult] = []
    headline_open = not sampled
    for index, metric in enumerate(metrics):
        key, _, filt = metric.partition(",")
        value = _number(scores.get(f"{key},{filt or 'none'}"))
        if value is None:
            continue
        stderr = _number(scores.get(f"{key}_stderr,{filt or 'none'}"))
        # the headline: the task's first metric, or (lm-eval's index) its first higher-is-better score in [0, 1]
        headline = headline_open and (index == 0 if spec.metrics else averageable(raw, name, key, value))
        headline_open = headline_open and not headline and not spec.metrics
        rows.append(TaskResult(task=name, kind=spec.kind, metric=f"{metric} sampled" if sampled else metric,
                               value=value, stderr=stderr, n=n, headline=headline,
                               settings=settings, seconds=seconds, statuses=None if rows else statuses))
    return rows


def higher_is_better(raw: dict[str, Any], task: str, metric: str) -> bool | None:
    """lm-eval's own word on a metric's direction (its results' higher_is_better; None where it says nothing)."""
    value = ((raw.get("higher_is_better") or {}).get(task) or {}).get(metric.partition(",")[0])
    return value if isinstance(value, bool) else None


def averageable(raw: dict[str, Any], task: str, metric: str, value: float) -> bool:
    """Whether a metric can head its task and join the averages with accuracies: not lower-is-better
    (perplexity, bits per byte), and a share in [0, 1] (not a BLEU of 0-100 or a raw count)."""
    return higher_is_better(raw, task, metric) is not False and 0.0 <= value <= 1.0


def _effective_n(name: str, raw: dict[str, Any]) -> int:
    """Documents scored: the task's own count, or the sum over a group's tasks."""
    counts = raw.get("n-samples", {})
    if name in counts:
        return int(counts[name].get("effective", 0))
    members = raw.get("group_subtasks", {}).get(name, [])
    return sum(_effective_n(member, raw) for member in members)


def sampled_metrics(scores: dict[str, Any]) -> list[str]:
    """pass@k and maj@N keys of a sampled run, as "pass@10" or "pass@10,strict-match", pass@ before maj@."""
    names = []
    for key in scores:
        name, _, filt = key.partition(",")
        if name.startswith(("pass@", "maj@")) and "_stderr" not in name:
            names.append(name if filt == "none" else f"{name},{filt}")
    return sorted(names, key=lambda m: (m.startswith("maj@"), m.partition(",")[2], int(m.split("@")[1].split(",")[0])))


def merge_samples(name: str, raw: dict[str, Any]) -> None:
    """A group's or tag's samples under its own name, each marked with its subtask."""
    samples = raw.get("samples", {})
    subs = sorted(key for key in samples if key != name)
    if subs:
        merged = [{**sample, "subtask": sub} for sub in subs for sample in samples.pop(sub)]
        samples[name] = samples.pop(name, []) + merged
