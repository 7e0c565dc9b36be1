"""What a pruned model directory records about how it was made: JSON report, model card, chart."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from layerprune import __version__


def package_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"layerprune": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", "peft", "trl", "lm_eval", "accelerate"):
        try:
            versions[name] = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            continue
    return versions


def write_report(directory: Path, report: dict[str, Any]) -> Path:
    path = directory / "prune_report.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def plot_scores(path: Path, scores: list[float | None], dropped: list[int], protected: list[int], title: str) -> Path:
    """Bar chart of block scores: dropped blocks red, protected hatched, unscored grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(scores) * 0.3), 3.2))
    values = [0.0 if s is None else s for s in scores]
    colors = ["#d62728" if i in dropped else "#bbbbbb" if scores[i] is None else "#1f77b4" for i in range(len(scores))]
    bars = ax.bar(range(len(scores)), values, color=colors)
    for i in protected:
        bars[i].set_hatch("//")
    ax.set_xlabel("decoder block (original numbering)")
    ax.set_ylabel("importance score")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(len(scores)))
    ax.tick_params(axis="x", labelsize=7)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#1f77b4", label="kept"), Patch(color="#d62728", label="dropped"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="protected")], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def model_card(report: dict[str, Any]) -> str:
    method = report["method"]
    lines = [
        "---", "library_name: transformers", "tags: [layerprune, pruned]", "---", "",
        f"# {report['source']['spec']} pruned to {report['num_blocks_after']} blocks", "",
        f"Made with layerprune {report['versions']['layerprune']} from `{report['source']['spec']}`: "
        f"{report['num_blocks_before']} -> {report['num_blocks_after']} decoder blocks, "
        f"{report['params_before'] / 1e6:.1f}M -> {report['params_after'] / 1e6:.1f}M parameters.", "",
        f"- score: `{method['score']}`" + (f" (metric {method['metric']}, {'iterative' if method['iterative'] else 'one-shot'})"
                                           if method["score"] == "ablation" else ""),
        f"- calibration: {report['calibration']['description'] if report['calibration'] else 'none'}",
        f"- dropped blocks (original numbering): {report['dropped']}",
        f"- protected blocks: {method['protect']}", "",
        "Pruned models lose generative reasoning first (math, code) even when classification benchmarks hold up; "
        "evaluate with `layerprune evaluate` before use. See `prune_report.json` for every block's score.",
    ]
    if report.get("scores_png"):
        lines += ["", f"![block scores]({report['scores_png']})"]
    return "\n".join(lines) + "\n"
