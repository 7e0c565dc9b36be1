"""`analyze nmi`: how far each block moves tokens away from their embedding-layer grouping.

Tokens of a calibration set are clustered (k-means) at the embedding layer (the reference labels) and
after every block; NMI(reference, block clusters) over depth shows where the representation drifts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from layerprune.analyze import charts, metrics
from layerprune.analyze.records import Timer, model_label, run_record, write_json
from layerprune.analyze.schemas import NmiAnalysis
from layerprune.analyze.tasks import TaskItem, task_items
from layerprune.analyze.walk import ablate_blocks, build_batches, token_states
from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError
from layerprune.models import load_model, resolve_model
from layerprune.models.loading import load_tokenizer
from layerprune.prune.forward import CalibBatch
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)


def cluster_labels(states: np.ndarray, k: int, seed: int, normalize: bool) -> np.ndarray:
    """k-means cluster ids of the rows of `states` (unit-normalized first when asked)."""
    from sklearn.cluster import KMeans

    if normalize:
        states = states / np.maximum(np.linalg.norm(states, axis=1, keepdims=True), 1e-12)
    return KMeans(n_clusters=k, n_init=2, max_iter=100, random_state=seed).fit_predict(states)


def nmi(reference: Sequence[int], labels: Sequence[int]) -> float:
    """Normalized mutual information (arithmetic normalization), scikit-learn's definition."""
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(reference, labels))


def nmi_over_depth(states: Sequence[np.ndarray], k: int, seed: int, normalize: bool) -> list[float]:
    """NMI of each state's clusters against the first state's clusters (the first value is 1)."""
    reference = cluster_labels(states[0], k, seed, normalize)
    return [1.0] + [nmi(reference, cluster_labels(s, k, seed, normalize)) for s in states[1:]]


def count_tokens(batches: Sequence[CalibBatch], skip_first: bool = True) -> int:
    return sum(int(b.attention_mask.sum()) - (b.attention_mask.shape[0] if skip_first else 0) for b in batches)


def check_k(k: int, tokens: int) -> None:
    if k > tokens:
        raise LayerpruneError(f"k={k} clusters is more than the {tokens} calibration tokens; "
                              "lower --k or raise --samples")


def critical_from_report(path: Path, label: str, task: str | None) -> tuple[list[float], list[int], str]:
    """Drops and critical blocks of model `label` from an `analyze importance` JSON."""
    try:
        tasks = json.loads(path.read_text(encoding="utf-8"))["tasks"]
    except (OSError, ValueError, KeyError) as exc:
        raise LayerpruneError(f"cannot read critical blocks from {path}: not an importance.json ({exc})") from exc
    task = task or next(iter(tasks))
    if task not in tasks or label not in tasks[task]:
        known = {t: sorted(models) for t, models in tasks.items()}
        raise LayerpruneError(f"{path} has no task '{task}' for model '{label}' (has: {known})")
    result = tasks[task][label]
    return result["drops"], result["critical"], f"{path} ({task})"


def critical_on_calibration(model: Any, batches: Sequence[CalibBatch],
                            threshold: float) -> tuple[list[float], list[int]]:
    """Relative drop of answer-token probability with each block skipped, and the blocks above `threshold`."""
    ablation = ablate_blocks(model, batches)
    base = metrics.answer_probability(ablation.base_nll)
    drops = metrics.relative_drops(base, [metrics.answer_probability(n) for n in ablation.ablated_nll])
    return drops, metrics.critical_blocks(drops, threshold)


def critical_blocks_for(config: NmiAnalysis, model: Any, items: list[TaskItem],
                        tokenizer: Any) -> tuple[list[float], list[int], str]:
    """Skip each block on the first --ablation-samples calibration texts (none when 0)."""
    if config.ablation_samples == 0:
        return [], [], "not computed (--ablation-samples 0)"
    subset = items[: config.ablation_samples]
    batches = build_batches(tokenizer, subset, config.batch_size, config.max_length)
    drops, critical = critical_on_calibration(model, batches, config.threshold)
    return drops, critical, f"skip drop on the first {len(subset)} {config.calib} texts"


def analyze_nmi(config: NmiAnalysis, settings: RunSettings, out: Path) -> dict[str, Any]:
    """Compute NMI over depth and the critical blocks; write nmi.json, nmi.png, summary.md."""
    timer = Timer()
    source = resolve_model(config.model, settings)
    label = model_label(source)
    items = task_items(config.calib, config.samples, settings.seed, 1, resolve_data_dir(config.data_dir))
    batches = build_batches(load_tokenizer(source, settings), items, config.batch_size, config.max_length)
    tokens = count_tokens(batches)
    check_k(config.k, tokens)
    preset = critical_from_report(config.critical_from, label, config.critical_task) if config.critical_from else None
    with timer("load"):
        loaded = load_model(source, settings)
    with timer("hidden_states"):
        states = [s.numpy() for s in token_states(loaded.model, batches)]
    log.info("nmi: k-means (k=%d) on %d tokens x %d states", config.k, tokens, len(states))
    with timer("kmeans_nmi"):
        series = nmi_over_depth(states, config.k, settings.seed, config.normalize)
    with timer("critical_blocks"):
        drops, critical, critical_source = preset or critical_blocks_for(config, loaded.model, items, loaded.tokenizer)
    elbow_index = metrics.largest_drop(series)
    report = {"config": config.model_dump(mode="json"), "model": {"label": label, "source": vars(source)},
              "tokens": tokens, "reference": "k-means clusters of the embedding layer (block 0 input)",
              "nmi": series, "nmi_after_block": dict(enumerate(series[1:])),
              "elbow_block": None if elbow_index is None else elbow_index - 1,
              "elbow_nmi_drop": None if elbow_index is None else series[elbow_index - 1] - series[elbow_index],
              "skip_drops": drops, "critical": critical, "critical_source": critical_source,
              "timings_s": timer.seconds, "cpu_s": timer.cpu_seconds, "run": run_record(settings)}
    write_json(out / "nmi.json", report)
    charts.plot_nmi(out / "nmi.png", series, report["elbow_block"], critical,
                    f"{label}: token clusters vs embedding clusters ({config.calib}, {tokens} tokens, k={config.k})")
    (out / "summary.md").write_text(nmi_summary(report), encoding="utf-8")
    return report


def nmi_summary(report: dict[str, Any]) -> str:
    series = report["nmi"]
    low = min(range(len(series)), key=series.__getitem__)
    return "\n".join([
        "# Representation drift (NMI)", "",
        f"Model {report['model']['label']}, calibration {report['config']['calib']}, {report['tokens']} tokens, "
        f"k={report['config']['k']}; reference: {report['reference']}.", "",
        f"- NMI after the last block: {series[-1]:.3f}; lowest {series[low]:.3f} after block {low - 1}.",
        f"- Elbow (largest one-block drop): block {report['elbow_block']} (-{report['elbow_nmi_drop'] or 0:.3f}).",
        f"- Critical blocks (drop > {report['config']['threshold']:g}; {report['critical_source']}): "
        f"{report['critical']}.",
        "", "NMI after each block: " + ", ".join(f"{v:.2f}" for v in series[1:]), "",
    ])
