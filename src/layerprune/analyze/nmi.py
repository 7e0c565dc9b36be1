"""`analyze nmi`: how far each block moves tokens away from their embedding-layer grouping.

Tokens of a calibration set are clustered (k-means) at the embedding layer (the reference labels) and
after every block; NMI(reference, block clusters) over depth shows where the representation drifts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.analyze import charts, metrics, pos
from layerprune.analyze.records import Timer, model_label, run_record, write_json
from layerprune.analyze.schemas import NmiAnalysis
from layerprune.analyze.tasks import TaskItem, task_items
from layerprune.analyze.walk import ablate_blocks, build_batches, token_states
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import load_model, resolve_model
from layerprune.models.loading import load_tokenizer
from layerprune.models.walker import CalibBatch
from layerprune.tasks.data import resolve_data_dir

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


def ami(reference: Sequence[int], labels: Sequence[int]) -> float:
    """Adjusted mutual information (0 for independent labelings, whatever k and the token count)."""
    from sklearn.metrics import adjusted_mutual_info_score

    return float(adjusted_mutual_info_score(reference, labels))


def nmi_over_depth(states: Sequence[np.ndarray], k: int, seed: int, normalize: bool, seeds: int = 3,
                   pos: Sequence[str | None] | None = None) -> dict[str, list[float]]:
    """Agreement of each state's clusters with the embedding layer's (seed `seed`), no value assumed.

    Every state is clustered with `seeds` other k-means seeds; per state: `nmi`/`ami` = mean NMI/AMI against
    the reference (state 0 included: its value is the reference's own seed-to-seed agreement), and
    `seed_agreement` = mean NMI between the state's clusterings with different seeds (how much of a change
    re-clustering alone makes); `nmi_min`/`nmi_max` span the seeds.

    With `pos` (one part-of-speech group or None per token), the same clusterings are also compared with the
    groups over the tokens that have one: `pos_nmi`/`pos_ami`, and `pos_nmi_chance`, the NMI of the clusters
    with the groups shuffled among those tokens (what a clustering unrelated to syntax scores at this size)."""
    reference = cluster_labels(states[0], k, seed, normalize)
    series: dict[str, list[float]] = {"nmi": [], "nmi_min": [], "nmi_max": [], "ami": [], "seed_agreement": []}
    if pos is not None:
        tagged = np.array([group is not None for group in pos])
        groups = np.array([group for group in pos if group is not None])
        shuffled = np.random.default_rng(seed).permutation(groups)
        series.update({"pos_nmi": [], "pos_ami": [], "pos_nmi_chance": []})
    for state in states:
        labels = [cluster_labels(state, k, seed + 1 + i, normalize) for i in range(seeds)]
        values = [nmi(reference, lab) for lab in labels]
        pairs = [nmi(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :]]
        series["nmi"].append(float(np.mean(values)))
        series["nmi_min"].append(min(values))
        series["nmi_max"].append(max(values))
        series["ami"].append(float(np.mean([ami(reference, lab) for lab in labels])))
        series["seed_agreement"].append(float(np.mean(pairs)) if pairs else float("nan"))
        if pos is not None:
            series["pos_nmi"].append(float(np.mean([nmi(groups, lab[tagged]) for lab in labels])))
            series["pos_ami"].append(float(np.mean([ami(groups, lab[tagged]) for lab in labels])))
            series["pos_nmi_chance"].append(float(np.mean([nmi(shuffled, lab[tagged]) for lab in labels])))
    return series


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


def calibration_items(config: NmiAnalysis, tokenizer: Any, seed: int) -> tuple[list[TaskItem], list[CalibBatch], int]:
    """--samples texts, more when --min-tokens asks for more tokens (an error when the task runs out)."""
    data_dir, n = resolve_data_dir(config.data_dir), config.samples
    while True:
        items = task_items(config.calib, n, seed, 1, data_dir)
        batches = build_batches(tokenizer, items, config.batch_size, config.max_length)
        tokens = count_tokens(batches)
        if tokens >= config.min_tokens:
            return items, batches, tokens
        if len(items) < n:
            raise LayerpruneError(f"--calib {config.calib} has only {tokens} tokens in {len(items)} texts, fewer than "
                                  f"--min-tokens {config.min_tokens}; pick a larger task (gsm8k) or lower --min-tokens")
        n = max(n + 1, math.ceil(n * config.min_tokens / max(tokens, 1) * 1.1))


def elbow_report(series: dict[str, list[float]], critical: list[int]) -> dict[str, Any]:
    """The largest one-block NMI drop after block 0 (the first step is left out), compared with the clustering
    noise and the critical blocks."""
    nmi_values = series["nmi"]
    index = metrics.largest_drop(nmi_values, start=2)
    block = None if index is None else index - 1
    drop = None if index is None else nmi_values[index - 1] - nmi_values[index]
    noise = 1 - min(series["seed_agreement"]) if series["seed_agreement"] else None
    return {"elbow_block": block, "elbow_nmi_drop": drop,
            "first_step_drop": nmi_values[0] - nmi_values[1] if len(nmi_values) > 1 else None,
            "clustering_noise": noise, "elbow_above_noise": None if drop is None or noise is None else drop > noise,
            "elbow_distance_to_critical": metrics.distance_to_nearest(block, critical)}


def pos_groups(config: NmiAnalysis, tokenizer: Any, items: list[TaskItem],
               tokens: int) -> tuple[list[str | None] | None, str]:
    """Each calibration token's part-of-speech group, and what the reference is (or why it was not computed)."""
    if not config.pos:
        return None, "not computed (--no-pos)"
    missing = pos.tagger_missing()
    if missing:
        return None, f"not computed ({missing})"
    groups = pos.token_groups(tokenizer, items, config.max_length)
    if len(groups) != tokens:  # a tokenizer whose offsets disagree with its ids: refuse rather than misalign
        raise LayerpruneError(f"part-of-speech groups for {len(groups)} tokens, hidden states for {tokens}; "
                              "run with --no-pos")
    tagged = sum(group is not None for group in groups)
    kinds = sorted({group for group in groups if group is not None})
    return groups, (f"{pos.TAGGER}; {tagged} of {tokens} tokens in a tagged word, {len(kinds)} groups "
                    f"({', '.join(kinds)})")


def pos_elbow_report(series: dict[str, list[float]], critical: list[int]) -> dict[str, Any]:
    """The largest one-block drop of the part-of-speech NMI after block 0, as for the embedding reference."""
    if "pos_nmi" not in series:
        return {}
    values, chance = series["pos_nmi"], series["pos_nmi_chance"]
    index = metrics.largest_drop(values, start=2)
    block = None if index is None else index - 1
    drop = None if index is None else values[index - 1] - values[index]
    return {"pos_elbow_block": block, "pos_elbow_nmi_drop": drop,
            "pos_nmi_peak_block": max(range(len(values)), key=values.__getitem__) - 1,
            "pos_nmi_over_chance": [v - c for v, c in zip(values, chance, strict=True)],
            "pos_elbow_distance_to_critical": metrics.distance_to_nearest(block, critical)}


def analyze_nmi(config: NmiAnalysis, settings: RunSettings, out: Path) -> dict[str, Any]:
    """Compute NMI/AMI over depth with the clustering noise, and the critical blocks; write nmi.json, nmi.png,
    summary.md."""
    from layerprune.core.extras import require_extra

    require_extra("analyze", "analyze nmi")  # before any model loads
    timer = Timer()
    source = resolve_model(config.model, settings)
    label = model_label(source)
    items, batches, tokens = calibration_items(config, load_tokenizer(source, settings), settings.seed)
    check_k(config.k, tokens)
    preset = critical_from_report(config.critical_from, label, config.critical_task) if config.critical_from else None
    with timer("load"):
        loaded = load_model(source, settings)
    with timer("hidden_states"):
        states = [s.numpy() for s in token_states(loaded.model, batches)]
    log.info("nmi: k-means (k=%d) on %d tokens x %d states x %d seeds", config.k, tokens, len(states), config.seeds)
    groups, pos_reference = pos_groups(config, loaded.tokenizer, items, len(states[0]))
    with timer("kmeans_nmi"):
        series = nmi_over_depth(states, config.k, settings.seed, config.normalize, config.seeds, groups)
    with timer("critical_blocks"):
        drops, critical, critical_source = preset or critical_blocks_for(config, loaded.model, items, loaded.tokenizer)
    report = {"config": config.model_dump(mode="json"), "model": {"label": label, "source": vars(source)},
              "tokens": tokens, "texts": len(items),
              "reference": f"k-means clusters of the embedding layer (block 0 input), seed {settings.seed}; every "
                           f"state re-clustered with {config.seeds} other seeds",
              "pos_reference": pos_reference,
              **series, "nmi_after_block": dict(enumerate(series["nmi"][1:])),
              **elbow_report(series, critical), **pos_elbow_report(series, critical),
              "skip_drops": drops, "critical": critical, "critical_source": critical_source,
              "timings_s": timer.seconds, "cpu_s": timer.cpu_seconds, "run": run_record(settings)}
    write_json(out / "nmi.json", report)
    charts.plot_nmi(out / "nmi.png", series, report["elbow_block"], critical,
                    f"{label}: token clusters vs embedding clusters{' and part of speech' if groups else ''}\n"
                    f"({config.calib}, {tokens} tokens, k={config.k})")
    (out / "summary.md").write_text(nmi_summary(report), encoding="utf-8")
    return report


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def nmi_summary(report: dict[str, Any]) -> str:
    series = report["nmi"]
    low = min(range(len(series)), key=series.__getitem__)
    return "\n".join([
        "# Representation drift (NMI)", "",
        f"Model {report['model']['label']}, calibration {report['config']['calib']}, {report['tokens']} tokens "
        f"({report['texts']} texts), k={report['config']['k']}; reference: {report['reference']}.", "",
        f"- NMI of the embedding layer re-clustered (seed-to-seed agreement): {series[0]:.3f}; "
        f"clustering noise (1 - lowest seed agreement of any state): {_fmt(report['clustering_noise'])}.",
        f"- NMI after the last block: {series[-1]:.3f} (AMI {report['ami'][-1]:.3f}); lowest {series[low]:.3f} "
        f"{'at the embeddings' if low == 0 else f'after block {low - 1}'}.",
        f"- First step (embeddings -> after block 0): -{_fmt(report['first_step_drop'])}, left out of the elbow.",
        f"- Elbow (largest later one-block drop): block {report['elbow_block']} (-{_fmt(report['elbow_nmi_drop'])}; "
        f"above the clustering noise: {report['elbow_above_noise']}).",
        f"- Critical blocks ({report['critical_source']}): {report['critical']}; elbow's distance to the nearest: "
        f"{report['elbow_distance_to_critical']} blocks.",
        f"- Part-of-speech reference: {report['pos_reference']}.",
        *pos_summary(report),
        "", "NMI after each block: " + ", ".join(f"{v:.2f}" for v in series[1:]),
        "AMI after each block: " + ", ".join(f"{v:.2f}" for v in report["ami"][1:]),
        *(["NMI vs part of speech after each block: " + ", ".join(f"{v:.2f}" for v in report["pos_nmi"][1:]),
           "its chance level (groups shuffled): " + ", ".join(f"{v:.2f}" for v in report["pos_nmi_chance"][1:])]
          if "pos_nmi" in report else []), "",
    ])


def pos_summary(report: dict[str, Any]) -> list[str]:
    if "pos_nmi" not in report:
        return []
    values, chance = report["pos_nmi"], report["pos_nmi_chance"]
    peak = report["pos_nmi_peak_block"]
    where = "at the embeddings" if peak < 0 else f"after block {peak}"
    return [f"- NMI vs part of speech: {values[0]:.3f} at the embeddings, highest {max(values):.3f} {where}, "
            f"{values[-1]:.3f} after the last block (AMI {report['pos_ami'][-1]:.3f}; chance level "
            f"{min(chance):.3f}-{max(chance):.3f}). Its elbow: block {report['pos_elbow_block']} "
            f"(-{_fmt(report['pos_elbow_nmi_drop'])}), {report['pos_elbow_distance_to_critical']} blocks from the "
            "nearest critical block."]
