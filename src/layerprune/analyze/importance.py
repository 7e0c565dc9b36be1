"""`analyze importance`: per-block ablation drops per model and task, compared across models and tasks."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

from layerprune.analyze import charts, importance_cache, metrics
from layerprune.analyze.records import Timer, clean_json, loaded_models, resolve_models, run_record, write_json
from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.analyze.tasks import ANALYSIS_TASKS, Task, TaskItem, task_items
from layerprune.analyze.walk import GenerationPlan, ablate_blocks, ablate_generation, build_batches
from layerprune.core import paired
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, ModelSource, find_decoder_stack
from layerprune.tasks.data import resolve_data_dir

log = logging.getLogger(__name__)


def measure_block_importance(loaded: LoadedModel, task: str, items: list[TaskItem], config: ImportanceAnalysis,
                             seed: int = 0) -> dict[str, Any]:
    """Base score, per-block ablated scores, relative drops with bootstrap intervals, and critical blocks
    (drop above the threshold and significant) of one model on one task; every per-item value is kept."""
    tokens, plan = None, None
    if config.metric == "generate":
        spec = ANALYSIS_TASKS.get(task)
        plan = generation_plan(config, loaded, spec, seed)
        result: Any = ablate_generation(loaded.model, loaded.tokenizer, items, spec, config.batch_size, plan)
        base_items, ablated_items, kind = result.base_item_correct, result.ablated_item_correct, "mean"
        scores = result.ablated_accuracy
    else:
        batches = build_batches(loaded.tokenizer, items, config.batch_size, config.max_length)
        result = ablate_blocks(loaded.model, batches)
        if config.metric == "nll":
            base_items, ablated_items, kind = result.base_item_nll, result.ablated_item_nll, "probability"
            tokens = result.item_tokens
            scores = [metrics.answer_probability(nll) for nll in result.ablated_nll]
        else:
            base_items, ablated_items, kind = result.base_item_correct, result.ablated_item_correct, "mean"
            scores = result.ablated_accuracy
    statistics = paired.block_statistics(base_items, ablated_items, kind, config.threshold, tokens, config.resamples,
                                        config.alpha, config.min_base_score, seed)
    per_item = {"prompts": [item.prompt for item in items], "answers": [item.answer for item in items], **vars(result)}
    return {**statistics, "scores": scores, "depth": len(scores), "generation": vars(plan) if plan else None,
            "per_item": per_item}


def generation_plan(config: ImportanceAnalysis, loaded: LoadedModel, task: Task, seed: int) -> GenerationPlan:
    """This model's prompt and decoding for this task (per_model over the analysis-wide settings)."""
    decoding = config.decoding(loaded.source.spec)
    has_template = bool(getattr(loaded.tokenizer, "chat_template", None))
    wanted = decoding.chat_template == "on" or (decoding.chat_template == "auto" and task.chat_protocol)
    chat = has_template and wanted
    return GenerationPlan(decoding.max_new_tokens or task.max_new_tokens, task.stops, chat, decoding.instruction,
                          decoding.temperature or 0.0, decoding.top_p or 1.0, seed)


def defined(values: list[float | None]) -> bool:
    return all(v is not None for v in values)


def spearman_of(a: list[float | None], b: list[float | None]) -> float | None:
    """Spearman of two drop profiles; None when either has undefined drops."""
    return metrics.spearman(a, b) if defined(a) and defined(b) else None  # type: ignore[arg-type]


def compare_models(per_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pairwise Spearman of drops and Jaccard of critical sets, on a grid aligned by relative depth."""
    depths = {label: result["depth"] for label, result in per_model.items()}
    grid = max(depths.values())
    aligned = len(set(depths.values())) > 1
    drops = {label: metrics.align_by_depth(r["drops"], grid) for label, r in per_model.items()}
    critical = {label: metrics.align_blocks(r["critical"], r["depth"], grid) for label, r in per_model.items()}
    significant = {label: metrics.align_blocks([i for i, s in enumerate(r["significant"]) if s], r["depth"], grid)
                   for label, r in per_model.items()}
    pairs = {}
    for a, b in itertools.combinations(per_model, 2):
        pairs[f"{a} vs {b}"] = {"spearman": spearman_of(drops[a], drops[b]),
                                "critical_jaccard": metrics.jaccard(critical[a], critical[b])}
    return {"aligned_by": "relative depth" if aligned else "block index", "rows": grid, "depths": depths,
            "aligned_drops": drops, "aligned_critical": critical, "aligned_significant": significant, "pairs": pairs}


def compare_tasks(per_task: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """For one model: Spearman of drops between tasks and which critical blocks each task has alone."""
    pairs = {}
    for a, b in itertools.combinations(per_task, 2):
        ca, cb = set(per_task[a]["critical"]), set(per_task[b]["critical"])
        pairs[f"{a} vs {b}"] = {"spearman": spearman_of(per_task[a]["drops"], per_task[b]["drops"]),
                                "critical_jaccard": metrics.jaccard(ca, cb), "both": sorted(ca & cb),
                                f"only_{a}": sorted(ca - cb), f"only_{b}": sorted(cb - ca)}
    return pairs


def collect_scores(config: ImportanceAnalysis, settings: RunSettings, timer: Timer) -> tuple[dict, dict]:
    """Run every task on every model (one model in memory at a time); a model's result on a task that the cache
    keeps for the same weights, items and settings is read (analyze/importance_cache.py), and a model whose every
    task is kept is not loaded."""
    data_dir = resolve_data_dir(config.data_dir)
    sources = resolve_models(config.models, settings)
    items = {task: task_items(task, config.samples, settings.seed, config.shots, data_dir) for task in config.tasks}
    results: dict[str, dict[str, Any]] = {task: {} for task in config.tasks}
    models: dict[str, Any] = {}
    for label, source in sources:
        fingerprint = importance_cache.model_key(source, settings)
        keys = {task: importance_cache.result_key(config, task, items[task], source.spec, settings)
                for task in config.tasks}
        kept = {task: importance_cache.kept_result(settings, fingerprint, task, keys[task]) for task in config.tasks}
        missing = [task for task, result in kept.items() if result is None]
        if missing:
            models[label] = score_model(label, source, missing, items, config, settings, timer, results)
            for task in missing:
                importance_cache.keep_result(settings, fingerprint, task, keys[task], results[task][label])
        else:
            models[label] = {"spec": source.spec, "source": vars(source),
                             "depth": next(iter(kept.values()))["depth"], "load_seconds": 0.0}  # type: ignore[index]
        models[label]["kept"] = sorted(set(config.tasks) - set(missing))
        for task in config.tasks:
            if kept[task] is not None:
                log.info("importance: %s on %s kept in the cache (the same weights, items and settings)", label, task)
                results[task][label] = kept[task]
    for task in config.tasks:  # the models in the order asked, whichever came from the cache
        results[task] = {label: results[task][label] for label in models}
    return models, results


def score_model(label: str, source: ModelSource, tasks: list[str], items: dict[str, list[TaskItem]],
                config: ImportanceAnalysis, settings: RunSettings, timer: Timer,
                results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Load one model, measure it on `tasks` into `results` (as JSON keeps them), free it; its record in the
    report."""
    for _, loaded in loaded_models([(label, source)], settings):
        depth = len(find_decoder_stack(loaded.model))
        for task in tasks:
            log.info("importance: %s on %s (%d blocks, %d items, %s)", label, task, depth, len(items[task]),
                     config.metric)
            with timer(f"{label}/{task}"):
                results[task][label] = clean_json(measure_block_importance(loaded, task, items[task], config,
                                                                           settings.seed))
        record = {"spec": loaded.source.spec, "source": vars(loaded.source), "depth": depth,
                  "load_seconds": round(loaded.load_seconds, 2)}
    return record


def analyze_importance(config: ImportanceAnalysis, settings: RunSettings, out: Path) -> dict[str, Any]:
    """Compute everything and write importance.json, heatmap.png, drops.png and summary.md into `out`."""
    from layerprune.core.extras import require_extra

    require_extra("analyze", "analyze importance")  # before any model loads
    timer = Timer()
    models, results = collect_scores(config, settings, timer)
    across_models = {task: compare_models(per_model) for task, per_model in results.items()}
    across_tasks = {label: compare_tasks({task: results[task][label] for task in results}) for label in models}
    report = {"config": config.model_dump(mode="json"), "models": models, "tasks": results,
              "across_models": across_models, "across_tasks": across_tasks, "timings_s": timer.seconds,
              "cpu_s": timer.cpu_seconds,
              "score": score_description(config), "run": run_record(settings)}
    write_json(out / "importance.json", report)
    write_importance_charts(out, results, across_models, config.threshold)
    (out / "summary.md").write_text(importance_summary(report), encoding="utf-8")
    return report


def score_description(config: ImportanceAnalysis) -> str:
    score = {"nll": "exp(-mean answer-token NLL), the geometric-mean probability of the answer tokens",
             "accuracy": "teacher-forced exact match (every answer token is the model's argmax)",
             "generate": "greedy generation graded by layerprune.tasks.grading (numeric equivalence for numbers, "
                         "lm-eval's triviaqa normalisation over every alias for short answers)"}[config.metric]
    return (f"score = {score}; drop = (score_full - score_skipped) / score_full, with a paired bootstrap "
            f"{1 - config.alpha:.0%} interval over items ({config.resamples} resamples); critical = drop > "
            f"{config.threshold:g} and the interval above 0; drops undefined when score_full < "
            f"{config.min_base_score:g}")


def write_importance_charts(out: Path, results: dict, across: dict, threshold: float) -> None:
    aligned = any(a["aligned_by"] == "relative depth" for a in across.values())
    charts.plot_heatmaps(out / "heatmap.png", {t: a["aligned_drops"] for t, a in across.items()},
                         {t: a["aligned_critical"] for t, a in across.items()}, aligned,
                         {t: a["aligned_significant"] for t, a in across.items()})
    drops = {task: {label: r["drops"] for label, r in per.items()} for task, per in results.items()}
    charts.plot_drop_curves(out / "drops.png", drops, threshold)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def importance_summary(report: dict[str, Any]) -> str:
    """A short markdown summary of importance.json."""
    config = report["config"]
    lines = ["# Block importance", "", f"Metric: {config['metric']} ({report['score']}); {config['samples']} items "
             "per task.", ""]
    for task, per_model in report["tasks"].items():
        across = report["across_models"][task]
        lines += [f"## {task}", "", "| model | blocks | full score | critical blocks |", "|---|---|---|---|"]
        lines += [f"| {m} | {r['depth']} | {_fmt(r['base_score'])} | {r['undefined'] or r['critical']} |"
                  for m, r in per_model.items()]
        if across["aligned_by"] == "relative depth":
            lines += ["", f"Models have different depths {across['depths']}: compared on {across['rows']} rows "
                          "aligned by relative depth."]
        lines += [f"- {pair}: Spearman {_fmt(v['spearman'])}, critical-set Jaccard {_fmt(v['critical_jaccard'])}"
                  for pair, v in across["pairs"].items()]
        lines.append("")
    kept = {label: m["kept"] for label, m in report["models"].items() if m.get("kept")}
    if kept:
        lines += ["Read from the cache (the same weights, items and settings scored before): " + "; ".join(
            f"{label}: {', '.join(tasks)}" for label, tasks in kept.items()), ""]
    lines += ["## Task vs task (per model)", ""]
    for label, pairs in report["across_tasks"].items():
        for pair, v in pairs.items():
            only = "; ".join(f"{k.removeprefix('only_')} only: {v[k]}" for k in v if k.startswith("only_"))
            lines.append(f"- {label}, {pair}: Spearman {_fmt(v['spearman'])}; both: {v['both']}; {only}")
    return "\n".join(lines) + "\n"

