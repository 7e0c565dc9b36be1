"""report.md of a run: the outcome at a glance, then the evidence (tables, charts, settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.evaluate.summary import SUMMARY_FILE, Summary, read_summary
from layerprune.pipeline.cards import refresh_run_cards
from layerprune.pipeline.degeneration import degeneration_lines
from layerprune.pipeline.recipe import RunRecipe
from layerprune.pipeline.report_glance import glance_table
from layerprune.pipeline.serving import serving_lines

if TYPE_CHECKING:
    from layerprune.models.lineage import PrunedLineage
    from layerprune.prune.report import PruneReport
    from layerprune.recover.report import RecoverReport


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def dir_size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e6


def load_summaries(paths: Any) -> dict[str, Summary]:
    """Each role's evaluation summary that exists (a run may stop before some are written)."""
    found = {role: paths.eval(role) / SUMMARY_FILE for role in ("baseline", "pruned", "recovered")}
    return {role: read_summary(path) for role, path in found.items() if path.is_file()}


def measure_speed(paths: Any, model: str | None) -> dict[str, Any]:
    """Tokens/s of the original and the pruned model on this machine (cached in speed.json)."""
    cached = _json(paths.root / "speed.json")
    if cached is not None:
        return cached
    import platform

    import torch

    from layerprune.models import load_model
    from layerprune.models.speed import measure_throughput

    result: dict[str, Any] = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads"}
    for role, spec in (("original", model), ("pruned", str(paths.pruned))):
        loaded = load_model(spec)
        result[role] = measure_throughput(loaded.model, loaded.tokenizer)
        del loaded
    (paths.root / "speed.json").write_text(json.dumps(result, indent=2))
    return result


def _change(avg: dict[str, Any], key: str) -> str:
    diff = avg.get(key)
    if diff is None:
        return ""
    se = "?" if diff["se"] is None else f"{diff['se']:.3f}"
    if diff.get("low") is not None:
        return f"{diff['diff']:+.3f}, paired 95% interval [{diff['low']:+.3f}, {diff['high']:+.3f}]"
    return f"{diff['diff']:+.3f} ± {se}"


def _normalised(avg: dict[str, Any], role: str) -> float | None:
    ci = (avg.get("intervals") or {}).get(f"retention_norm_{role}") or {}
    return ci.get("value")


def _drop_phrase(kind: str, avg: dict[str, Any]) -> str:
    if avg.get("clear_drop"):
        change = _change(avg, "pruned_vs_baseline")
        norm = _normalised(avg, "pruned")
        above = "" if norm is None else f", {100 * norm:.0f}% of its margin above chance"
        return f"{kind} kept {100 * avg['retention_pruned']:.0f}% of the original{above} ({change})"
    noise = "its paired interval holds 0" if avg.get("intervals") is not None else "within 2 standard errors"
    return f"{kind} shows no clear drop ({_change(avg, 'pruned_vs_baseline')}, {noise}, or a gain)"


def _kept(avg: dict[str, Any]) -> float:
    """Retention above chance where the figures are paired (raw retention of a multiple-choice task starts at
    chance, so raw retentions of the two kinds are not comparable), else raw retention."""
    norm = _normalised(avg, "pruned")
    return norm if norm is not None else avg["retention_pruned"]


def verdict(averages: list[dict[str, Any]]) -> list[str]:
    """Does the run show the study's pattern, beyond noise? Said plainly either way."""
    by_kind = {a["kind"]: a for a in averages}
    cls, gen = by_kind.get("classification"), by_kind.get("generative")
    if not cls or not gen:
        return ["Only one kind of task was evaluated, so the classification-vs-generative pattern cannot be checked."]
    if gen.get("clear_drop") is None:
        return []
    if not gen["clear_drop"]:
        outcome = "generative tasks did NOT drop clearly; the study pattern does not show on this run"
    elif not cls.get("clear_drop") or _kept(gen) < _kept(cls):
        outcome = "generative tasks suffered more, as the study describes"
    else:
        outcome = "generative tasks did NOT suffer more here; the study pattern does not show on this run"
    drops = f"{_drop_phrase('classification', cls)}; {_drop_phrase('generative tasks', gen)}"
    lines = [f"Pruning: {drops} -> {outcome}."]
    if gen.get("recovered_vs_pruned") is not None:
        lines.append(f"Recovery: {_recovery_phrase('classification', cls)}; {_recovery_phrase('generative', gen)}.")
    return lines


def _recovery_phrase(kind: str, avg: dict[str, Any]) -> str:
    change = avg["recovered_vs_pruned"]
    text = f"{kind} {_change(avg, 'recovered_vs_pruned')} over the pruned model"
    if change["within_noise"]:
        return text + " (within noise: nothing won back beyond noise)"
    if avg.get("clear_drop") and avg.get("recovered_share_note"):
        return text + " (the drop's interval comes near 0: the share won back is unbounded)"
    if avg.get("clear_drop") and avg.get("recovered_share") is not None:
        ci = (avg.get("intervals") or {}).get("recovered_share") or {}
        bounds = f" [{100 * ci['low']:.0f}, {100 * ci['high']:.0f}]" if ci.get("low") is not None else ""
        return text + (f", {100 * avg['recovered_share']:.0f}%{bounds} of the drop won back, "
                       f"{100 * avg['retention_recovered']:.0f}% of the original")
    return text + " (no clear drop to win back)"


def noise_note(summaries: dict[str, Any]) -> list[str]:
    """Small evaluation limits make single numbers noisy: say how small."""
    heads = [r for s in summaries.values() for r in s.results if r.headline and r.n]
    counts = sorted({r.n for r in heads})
    if not counts:
        return []
    errors = sorted(r.stderr for r in heads if r.stderr)
    spread = f" (standard errors of {errors[0]:.3f}-{errors[-1]:.3f})" if errors else ""
    return [f"Each task was scored on {counts[0]}-{counts[-1]} documents{spread}, every model on the same ones: the "
            "tables pair the models item by item and mark a difference whose paired 95% interval holds 0 \"within "
            "noise\", and give retention only where the drop's interval is above 0."]


def overlap_note(summaries: dict[str, Any]) -> list[str]:
    """Loud: evaluated documents that were among the calibration items (allowed with --allow-overlap)."""
    return [f"WARNING: {role} was evaluated on documents that chose the pruned blocks (calibration items): "
            f"{s.calibration_overlap['tasks']} (--allow-overlap)."
            for role, s in summaries.items() if s.calibration_overlap and s.calibration_overlap["tasks"]]


def recipe_yaml(recipe: RunRecipe) -> str:
    """The run's recipe as YAML (what was set, defaults left out where unset), in the order the schema declares."""
    import yaml

    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_none=True), sort_keys=False, width=120)


def write_report(recipe: RunRecipe, paths: Any) -> Path:
    from layerprune.evaluate.report import compare
    from layerprune.models.lineage import PRUNE_REPORT
    from layerprune.prune.report import read_prune_report
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    prune = read_prune_report(paths.pruned) if (paths.pruned / PRUNE_REPORT).is_file() else None
    recover = read_recover_report(paths.recovered) if (paths.recovered / RECOVER_REPORT).is_file() else None
    summaries = load_summaries(paths)
    folders = {role: paths.eval(role) for role in summaries}
    comparison = compare(summaries, paths.root / "eval", folders) if len(summaries) > 1 else None
    speed = measure_speed(paths, recipe.model)
    lines = [f"# layerprune run: {recipe.name}", "", recipe.description, "", "## Outcome at a glance", ""]
    if comparison:  # the compact table leads: task, n, the three scores, the share won back with its interval
        lines += [glance_table(comparison["rows"], comparison["averages"], list(summaries)), ""]
    lines += [f"- {line}" for line in verdict(comparison["averages"] if comparison else []) + noise_note(summaries)
              + overlap_note(summaries)]
    lines += _model_lines(prune, paths, speed)
    lines += ["", "## Evaluation: baseline / pruned / recovered, every paired figure", ""]
    if comparison:
        lines += [comparison["table"], ""]
        lines += [f"![{name}](eval/{name})" for name in comparison["paths"] if name.endswith(".png")]
    lines += degeneration_lines(_json(paths.root / "degeneration.json"))
    lines += _prune_lines(prune, prune.scores_png if prune else None)
    lines += _recover_lines(recover)
    lines += serving_lines(paths.root / "gguf")
    lines += ["", "## How it was made", "",
              f"- rerun: `layerprune run <recipe> --output {paths.root}` (complete stages are skipped)",
              "- recipe:", "", "```yaml", recipe_yaml(recipe).rstrip(), "```"]
    refresh_run_cards(recipe.name, {"pruned": paths.pruned, "recovered": paths.recovered}, summaries, comparison)
    paths.report.write_text("\n".join(lines) + "\n")
    return paths.report


def _model_lines(prune: PruneReport | None, paths: Any, speed: dict[str, Any]) -> list[str]:
    if prune is None:
        return []
    orig, pruned = speed["original"], speed["pruned"]
    return [
        f"- Blocks {prune.num_blocks_before} -> {prune.num_blocks_after}; parameters "
        f"{prune.params_before / 1e6:.1f}M -> {prune.params_after / 1e6:.1f}M; pruned weights "
        f"{dir_size_mb(paths.pruned):.0f} MB on disk.",
        f"- Speed on this machine ({speed['machine']}): prefill {orig['prefill_tokens_per_s']:.0f} -> "
        f"{pruned['prefill_tokens_per_s']:.0f} tokens/s "
        f"({pruned['prefill_tokens_per_s'] / orig['prefill_tokens_per_s']:.2f}x), "
        f"decode {orig['decode_tokens_per_s']:.1f} -> {pruned['decode_tokens_per_s']:.1f} tokens/s "
        f"({pruned['decode_tokens_per_s'] / orig['decode_tokens_per_s']:.2f}x).",
    ]


def _prune_lines(prune: PrunedLineage | None, scores_png: str | None = None) -> list[str]:
    if prune is None:
        return []
    method = prune.method
    removal = prune.removal()
    lines = [
        "",
        "## Removed sublayers" if prune.removed_sublayers is not None else "## Dropped blocks",
        "",
        f"Score `{method.score}`"
        + (
            f" ({method.metric}, {'iterative' if method.iterative else 'one-shot'})"
            if method.score == "ablation"
            else ""
        )
        + f"; calibration: {prune.calibration.description if prune.calibration else 'none'}.",
        (f"Dropped (original numbering): {prune.dropped}" if prune.removed_sublayers is None
         else removal[:1].upper() + removal[1:]) + f"; protected: {method.protect}.",
        "",
    ]
    if scores_png:
        lines.append(f"![block scores](pruned/{scores_png})")
    return lines


def _recover_lines(recover: RecoverReport | None) -> list[str]:
    if recover is None:
        return []
    loss = recover.held_out_loss
    return [
        "",
        "## Recovery",
        "",
        f"Recipe `{recover.recipe.name}` ({recover.recipe.method}), teacher `{recover.teacher}`; "
        f"held-out loss on teacher responses {_loss(loss.before)} -> {_loss(loss.after)}; "
        f"{recover.tokens_seen} tokens seen; {recover.seconds.total:.0f} s.",
        f"Data: {json.dumps(recover.data.get('filter', {}))}",
        "",
        "![loss curve](recovered/loss_curve.png)",
    ]


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
