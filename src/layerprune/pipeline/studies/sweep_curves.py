"""The charts of the study reports: how every chart is drawn and saved (`save_chart`, `error_bars`), the sweep's
retention against k (sweep.png), and each recovery's held-out loss curve read from its recover report (replicate 0),
with what the recovery spent and how its loss flattened (sweep_loss.png)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerprune.core.outputs import write_atomic
from layerprune.pipeline.studies.sweep_grid import recovered_label


def save_chart(path: Path, draw: Callable[[list[Any]], None], size: tuple[float, float] = (6.4, 4.2),
               panels: int = 1, dpi: int = 110) -> None:
    """Draw on `panels` axes side by side (matplotlib without a display) and save the PNG whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    try:
        draw(list(axes[0]))
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    write_atomic(path, png.getvalue())


def error_bars(cis: list[dict[str, Any]], scale: float = 1.0) -> tuple[list[float], list[list[float]]]:
    """The values of intervals and their distances to the ends (an end missing: none), as errorbar's yerr."""
    def end(ci: dict[str, Any], key: str) -> float:
        return ci[key] if ci.get(key) is not None else ci["value"]

    return ([scale * ci["value"] for ci in cis], [[scale * (ci["value"] - end(ci, "low")) for ci in cis],
                                                  [scale * (end(ci, "high") - ci["value"]) for ci in cis]])


def plot_retention(points: list[dict[str, Any]], depth: int | None, path: Path) -> None:
    """Chance-normalised retention against the pruning ratio: classification and generative, pruned and recovered
    (one line per arm with arms), with 95% paired intervals."""
    arms = list(dict.fromkeys(p.get("arm") for p in points))
    styles: dict[tuple[str, str, str | None], tuple[str, str]] = {
        ("classification", "pruned", arms[0] if arms else None): ("tab:blue", "--o"),
        ("generative", "pruned", arms[0] if arms else None): ("tab:red", "--s")}
    palette = ["tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive", "tab:cyan", "tab:pink", "tab:gray"]
    for i, arm in enumerate(arms):
        for kind, color, style in (("classification", "tab:blue", "-o"), ("generative", "tab:red", "-s")):
            styles[(kind, "recovered", arm)] = (color if arm is None else palette[i % len(palette)], style)

    def draw(axes: list[Any]) -> None:
        ax = axes[0]
        for (kind, role, arm), (color, style) in styles.items():
            series = [(p["k"], p[kind].get(f"retention_{role}")) for p in points if kind in p and p.get("arm") == arm]
            series = [(k, ci) for k, ci in series if ci and ci.get("value") is not None]
            if series:
                ys, errors = error_bars([ci for _, ci in series], 100)
                ax.errorbar([100 * k / depth if depth else k for k, _ in series], ys, yerr=errors, fmt=style,
                            color=color, capsize=3,
                            label=f"{kind}, {role}" if arm is None or role == "pruned" else f"{kind}, {arm}")
        ax.axhline(100, color="grey", lw=0.6)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set(xlabel="blocks dropped (% of depth)" if depth else "blocks dropped",
               ylabel="retention above chance (%)", title="Retention against pruning ratio (95% paired intervals)")
        if ax.get_legend_handles_labels()[0]:  # nothing drawn: no pruned model scored yet
            ax.legend(fontsize=8)

    save_chart(path, draw)


def loss_curves(study: Any, root: Path) -> dict[int | str, dict[str, Any]]:
    """Per k (with arms: per ARM-kK), replicate 0: the held-out loss curve, tokens trained and optimizer steps from
    its recover report."""
    from layerprune.pipeline.studies.sweep_cells import model_dir
    from layerprune.pipeline.studies.sweep_grid import arm_names
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    out: dict[int | str, dict[str, Any]] = {}
    for k, arm in ((k, arm) for k in study.ratios for arm in arm_names(study)):
        label = recovered_label(arm, k)
        folder = model_dir(root, label)
        if (folder / RECOVER_REPORT).is_file():
            report = read_recover_report(folder)
            out[k if arm is None else label] = {
                "held_out": report.loss_curve.get("held_out", []), "tokens": report.tokens_seen,
                "steps": report.data.get("steps"), "seconds": report.seconds.training,
                "answers": report.data.get("filter", {}), "tokens_unpadded": report.tokens_unpadded,
                "sequences": report.sequences, "optimizer_steps": report.optimizer_steps,
                "learning_rate": report.learning_rate}
    return out


def budget_text(curve: dict[str, Any]) -> str:
    """What one recovery spent: unpadded target tokens, sequences, optimizer steps and learning rate where its report
    has them (the trainer's padded count otherwise), its time and how its held-out loss flattened."""
    if curve.get("tokens_unpadded") is None:
        spent = f"{curve['tokens']} tokens (padded), {curve['steps']} steps"
    else:
        spent = (f"{curve['tokens_unpadded']} unpadded target tokens, {curve['sequences']} sequences, "
                 f"{curve['optimizer_steps']} optimizer steps, lr {curve['learning_rate']:.1e} ({curve['tokens']} "
                 "tokens as the trainer counts them)")
    return f"{spent}, {curve['seconds']:.0f} s, held-out loss {flattening(curve['held_out'])}"


def flattening(curve: list[list[float | None]]) -> str:
    """How much the held-out loss still fell over the last quarter of training (relative to its whole fall)."""
    values = [(s, v) for s, v in curve if v is not None]
    if len(values) < 3:
        return "too few held-out points"
    first, last = values[0][1], values[-1][1]
    quarter = [v for s, v in values if s >= 0.75 * values[-1][0]]
    fall = first - last
    late = quarter[0] - last if quarter else 0.0
    share = late / fall if fall > 0 else float("nan")
    return f"{first:.3f} -> {last:.3f}; the last quarter of the steps gave {100 * share:.0f}% of the fall"


def curve_name(key: int | str) -> str:
    """'k=3' for a sweep's k, the label itself (ARM-kK) with arms."""
    return f"k={key}" if isinstance(key, int) else key


def plot_losses(curves: dict[int | str, dict[str, Any]], path: Path) -> None:
    def draw(axes: list[Any]) -> None:
        ax = axes[0]
        for k, info in curves.items():
            points = [(s, v) for s, v in info["held_out"] if v is not None]
            ax.plot([s for s, _ in points], [v for _, v in points], "-o", ms=3, label=curve_name(k))
        ax.set(xlabel="optimizer step", ylabel="held-out loss (teacher answers)", title="Recovery: held-out loss per k"
               + (" and arm" if any(isinstance(k, str) for k in curves) else ""))
        if curves:  # none recovered yet (a report of a run in parts)
            ax.legend(fontsize=8)

    save_chart(path, draw, (6.4, 3.8))
