"""PNG charts for `analyze` (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmaps(path: Path, tasks: dict[str, dict[str, list[float | None]]],
                  critical: dict[str, dict[str, set[int]]], relative_depth: bool,
                  significant: dict[str, dict[str, set[int]]] | None = None) -> None:
    """One heatmap per task (rows = blocks, or rows aligned by relative depth; columns = models) on one
    shared colour scale; critical cells marked with a red dot, significant drops below the threshold with a
    white ring, undefined drops (full score near zero) left blank."""
    plt = _pyplot()
    nan = float("nan")
    matrices = {task: [[nan if v is None else v for v in row] for row in zip(*columns.values(), strict=False)]
                for task, columns in tasks.items()}
    values = [v for matrix in matrices.values() for row in matrix for v in row if v == v]
    low, high = min([0.0, *values]), max([0.05, *values])
    fig, axes = plt.subplots(1, len(tasks), figsize=(2.2 + 1.6 * len(tasks) * max(2, _models(tasks)), 7),
                             squeeze=False)
    for ax, (task, columns) in zip(axes[0], tasks.items(), strict=False):
        labels, rows = list(columns), len(matrices[task])
        image = ax.imshow(matrices[task], aspect="auto", cmap="viridis", vmin=low, vmax=high, interpolation="nearest")
        marks = [(col, row) for col, label in enumerate(labels) for row in sorted(critical[task][label])]
        rings = [(col, row) for col, label in enumerate(labels) for row in sorted((significant or {}).get(task, {})
                                                                                 .get(label, set()))
                 if row not in critical[task][label]]
        if rings:
            ax.scatter(*zip(*rings, strict=False), s=22, facecolors="none", edgecolors="white", linewidths=0.8)
        if marks:
            ax.scatter(*zip(*marks, strict=False), s=14, c="red", edgecolors="white", linewidths=0.5, label="critical")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        if relative_depth:
            ticks = [round(f * rows - 0.5) for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
            ax.set_yticks(ticks, [f"{f:.2f}" for f in (0.0, 0.25, 0.5, 0.75, 1.0)])
        ax.set_title(f"{task}", fontsize=10)
    axes[0][0].set_ylabel("relative depth of the skipped block" if relative_depth else "skipped block")
    fig.colorbar(image, ax=list(axes[0]), fraction=0.04, label="relative drop")
    aligned = " (models of different depths aligned by relative depth)" if relative_depth else ""
    fig.suptitle(f"Drop when one block is skipped; red dot = critical (above threshold and significant), white ring = "
                 f"significant below threshold, blank = undefined{aligned}", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _models(tasks: dict[str, dict[str, list[float]]]) -> int:
    return max(len(columns) for columns in tasks.values())


def plot_drop_curves(path: Path, drops: dict[str, dict[str, list[float]]], threshold: float) -> None:
    """Drop over relative depth, one panel per task, one line per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(drops), figsize=(5 * len(drops), 3.6), squeeze=False)
    for ax, (task, per_model) in zip(axes[0], drops.items(), strict=False):
        for label, values in per_model.items():
            depth = len(values)
            ax.plot([(i + 0.5) / depth for i in range(depth)], [float("nan") if v is None else v for v in values],
                    marker=".", label=label)
        ax.axhline(threshold, color="red", linestyle="--", linewidth=0.8, label=f"threshold {threshold:g}")
        ax.set_xlabel("relative depth of the skipped block")
        ax.set_ylabel("relative drop")
        ax.set_title(task, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_nmi(path: Path, series: dict[str, list[float]], elbow: int | None, critical: Sequence[int],
             title: str) -> None:
    """NMI and AMI after each block (x = 0 is the embedding layer) with the spread over k-means seeds and the
    seed-to-seed agreement (the clustering noise), the part-of-speech NMI and its chance floor when computed; elbow and
    critical blocks marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    nmi = series["nmi"]
    xs = list(range(len(nmi)))
    ax.fill_between(xs, series["nmi_min"], series["nmi_max"], color="C0", alpha=0.2, linewidth=0)
    ax.plot(xs, nmi, marker="o", markersize=3, label="NMI vs embedding clusters (band: k-means seeds)")
    ax.plot(xs, series["ami"], marker=".", markersize=3, color="C2", label="AMI vs embedding clusters")
    ax.plot(xs, series["seed_agreement"], linestyle=":", color="gray", label="seed-to-seed NMI (noise ceiling)")
    if "pos_nmi" in series:
        ax.plot(xs, series["pos_nmi"], marker="s", markersize=3, color="C1", label="NMI vs part-of-speech groups")
        ax.plot(xs, series["pos_nmi_chance"], linestyle="--", color="C1", alpha=0.6,
                label="NMI vs shuffled part of speech (chance floor)")
    for block in critical:
        ax.axvspan(block + 0.5, block + 1.5, color="red", alpha=0.15, linewidth=0)
    if critical:
        ax.plot([], [], color="red", alpha=0.3, linewidth=6, label="critical block")
    if elbow is not None:
        ax.axvline(elbow + 1, color="black", linestyle="--", linewidth=1, label=f"elbow: block {elbow}")
    ax.set_xlabel("after block (0 = embeddings)")
    ax.set_ylabel("NMI / AMI")
    ax.set_ylim(min(0.0, min(series["ami"])), 1.05)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_degeneration(path: Path, stats: dict[str, dict[str, float | int | None]]) -> None:
    """Grouped bars of rep-2/3/4 and self-BLEU-4 per variant."""
    plt = _pyplot()
    keys = ["rep_2", "rep_3", "rep_4", "self_bleu_4"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(stats))
    for offset, (label, values) in enumerate(stats.items()):
        heights = [float(values.get(key) or 0.0) for key in keys]
        ax.bar([i + offset * width for i in range(len(keys))], heights, width, label=label)
    ax.set_xticks([i + width * (len(stats) - 1) / 2 for i in range(len(keys))], keys)
    ax.set_ylabel("share / score")
    ax.set_title("Degeneration (higher = more repetitive)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
