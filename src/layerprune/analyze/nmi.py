"""`analyze nmi`: how far each block moves tokens away from their embedding-layer grouping.

Tokens of a calibration set are clustered (k-means) at the embedding layer (the reference labels) and
after every block; NMI(reference, block clusters) over depth shows where the representation drifts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from layerprune.analyze import charts, metrics
from layerprune.analyze.records import Timer, model_label, run_record, write_json
from layerprune.analyze.schemas import NmiAnalysis
from layerprune.analyze.tasks import task_items
from layerprune.analyze.walk import ablate_nll, build_batches, token_states
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
    return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(states)


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
        raise LayerpruneError(f"k={k} clusters is more than the {tokens} calibration tokens; lower --k or raise --samples")


def analyze_nmi(config: NmiAnalysis, settings: RunSettings, out: Path) -> dict[str, Any]:
    """Compute NMI over depth plus per-block skip drops on the same texts; write nmi.json, nmi.png, summary.md."""
    timer = Timer()
    source = resolve_model(config.model, settings)
    items = task_items(config.calib, config.samples, settings.seed, 3, resolve_data_dir(config.data_dir))
    batches = build_batches(load_tokenizer(source, settings), items, config.batch_size, config.max_length)
    tokens = count_tokens(batches)
    check_k(config.k, tokens)
    with timer("load"):
        loaded = load_model(source, settings)
    with timer("hidden_states"):
        states = [s.numpy() for s in token_states(loaded.model, batches)]
    log.info("nmi: k-means (k=%d) on %d tokens x %d states", config.k, tokens, len(states))
    with timer("kmeans_nmi"):
        series = nmi_over_depth(states, config.k, settings.seed, config.normalize)
    with timer("ablation"):
        ablation = ablate_nll(loaded.model, batches)
    base = metrics.answer_probability(ablation.base_nll)
    drops = metrics.relative_drops(base, [metrics.answer_probability(n) for n in ablation.ablated_nll])
    critical = metrics.critical_blocks(drops, config.threshold)
    elbow_index = metrics.largest_drop(series)
    elbow = None if elbow_index is None else elbow_index - 1
    label = model_label(source)
    report = {"config": config.model_dump(mode="json"), "model": {"label": label, "source": vars(source)},
              "tokens": tokens, "reference": "k-means clusters of the embedding layer (block 0 input)",
              "nmi": series, "nmi_after_block": {i: v for i, v in enumerate(series[1:])}, "elbow_block": elbow,
              "elbow_nmi_drop": None if elbow_index is None else series[elbow_index - 1] - series[elbow_index],
              "skip_drops": drops, "critical": critical, "timings_s": timer.seconds,
              "cpu_s": timer.cpu_seconds, "run": run_record(settings)}
    write_json(out / "nmi.json", report)
    charts.plot_nmi(out / "nmi.png", series, elbow, critical, f"{label}: token clusters vs embedding clusters "
                    f"({config.calib}, {tokens} tokens, k={config.k})")
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
        f"- Critical blocks (skip drop > {report['config']['threshold']:g}): {report['critical']}.",
        "", "NMI after each block: " + ", ".join(f"{v:.2f}" for v in series[1:]), "",
    ])
