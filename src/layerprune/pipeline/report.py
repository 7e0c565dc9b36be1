"""report.md of a run: the outcome at a glance, then the evidence (tables, charts, settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerprune.pipeline.recipe import RunRecipe


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def dir_size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1e6


def load_summaries(paths: Any) -> dict[str, Any]:
    from layerprune.evaluate.schema import Summary

    summaries = {}
    for role in ("baseline", "pruned", "recovered"):
        data = _json(paths.eval(role) / "summary.json")
        if data is not None:
            summaries[role] = Summary.model_validate(data)
    return summaries


def measure_speed(paths: Any, model: str | None) -> dict[str, Any]:
    """Tokens/s of the original and the pruned model on this machine (cached in speed.json)."""
    cached = _json(paths.root / "speed.json")
    if cached is not None:
        return cached
    import platform

    import torch

    from layerprune.models import load_model
    from layerprune.pipeline.speed import measure_throughput

    result: dict[str, Any] = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads"}
    for role, spec in (("original", model), ("pruned", str(paths.pruned))):
        loaded = load_model(spec)
        result[role] = measure_throughput(loaded.model, loaded.tokenizer)
        del loaded
    (paths.root / "speed.json").write_text(json.dumps(result, indent=2))
    return result


def verdict(averages: list[dict[str, Any]]) -> list[str]:
    """Does the run show the study's pattern? Said plainly either way."""
    by_kind = {a["kind"]: a for a in averages}
    cls, gen = by_kind.get("classification"), by_kind.get("generative")
    if not cls or not gen:
        return ["Only one kind of task was evaluated, so the classification-vs-generative pattern cannot be checked."]
    lines = []
    rc, rg = cls.get("retention_pruned"), gen.get("retention_pruned")
    if rc is not None and rg is not None:
        holds = rg < rc
        lines.append(f"Pruning: classification kept {100 * rc:.0f}% of the original, generative reasoning {100 * rg:.0f}%"
                     f" -> {'generative reasoning suffered more, as the study describes' if holds else 'generative reasoning did NOT suffer more here; the study pattern does not show on this run'}.")
    sc, sg = cls.get("recovered_share"), gen.get("recovered_share")
    tc, tg = cls.get("retention_recovered"), gen.get("retention_recovered")
    if tc is not None and tg is not None:
        share = "" if sc is None or sg is None else f" (recovered share of the drop: classification {100 * sc:.0f}%, generative {100 * sg:.0f}%)"
        if sc is not None and sg is not None and sc <= 0 and sg <= 0:
            outcome = "recovery won back none of the drop on either kind of task here"
        elif tg < tc:
            outcome = "recovery leaves generative reasoning further below the original than classification, as the study describes"
        else:
            outcome = "the study pattern (generative reasoning stays further below after recovery) does NOT show here"
        lines.append(f"Recovery: classification at {100 * tc:.0f}% of the original, generative at {100 * tg:.0f}%{share} -> {outcome}.")
    return lines


def noise_note(summaries: dict[str, Any]) -> list[str]:
    """Small evaluation limits make single numbers noisy: say how small."""
    heads = [r for s in summaries.values() for r in s.results if r.headline and r.n]
    counts = sorted({r.n for r in heads})
    if not counts or counts[0] >= 200:
        return []
    errors = sorted(r.stderr for r in heads if r.stderr)
    spread = f" (standard errors of {errors[0]:.2f}-{errors[-1]:.2f})" if errors else ""
    return [f"Each task was scored on {counts[0]}-{counts[-1]} documents{spread}: differences smaller than about two "
            "standard errors are noise, and retention above 100% is one such case."]


def write_report(recipe: RunRecipe, paths: Any) -> Path:
    from layerprune.evaluate.report import compare

    prune = _json(paths.pruned / "prune_report.json") or {}
    recover = _json(paths.recovered / "recover_report.json")
    summaries = load_summaries(paths)
    comparison = compare(summaries, paths.root / "eval") if len(summaries) > 1 else None
    speed = measure_speed(paths, recipe.model)
    lines = [f"# layerprune run: {recipe.name}", "", recipe.description, "", "## Outcome at a glance", ""]
    lines += [f"- {line}" for line in verdict(comparison["averages"] if comparison else []) + noise_note(summaries)]
    lines += _model_lines(prune, paths, speed)
    lines += ["", "## Evaluation: baseline / pruned / recovered", ""]
    if comparison:
        lines += [comparison["table"], ""]
        lines += [f"![{name}](eval/{name})" for name in comparison["paths"] if name.endswith(".png")]
    lines += _prune_lines(prune)
    lines += _recover_lines(recover)
    lines += ["", "## How it was made", "", f"- recipe: `{recipe.model_dump_json(exclude_none=True)}`",
              f"- rerun: `layerprune run <recipe> --output {paths.root}` (complete stages are skipped)"]
    paths.report.write_text("\n".join(lines) + "\n")
    return paths.report


def _model_lines(prune: dict[str, Any], paths: Any, speed: dict[str, Any]) -> list[str]:
    if not prune:
        return []
    orig, pruned = speed["original"], speed["pruned"]
    return [
        f"- Blocks {prune['num_blocks_before']} -> {prune['num_blocks_after']}; parameters "
        f"{prune['params_before'] / 1e6:.1f}M -> {prune['params_after'] / 1e6:.1f}M; pruned weights "
        f"{dir_size_mb(paths.pruned):.0f} MB on disk.",
        f"- Speed on this machine ({speed['machine']}): prefill {orig['prefill_tokens_per_s']:.0f} -> "
        f"{pruned['prefill_tokens_per_s']:.0f} tokens/s ({pruned['prefill_tokens_per_s'] / orig['prefill_tokens_per_s']:.2f}x), "
        f"decode {orig['decode_tokens_per_s']:.1f} -> {pruned['decode_tokens_per_s']:.1f} tokens/s "
        f"({pruned['decode_tokens_per_s'] / orig['decode_tokens_per_s']:.2f}x).",
    ]


def _prune_lines(prune: dict[str, Any]) -> list[str]:
    if not prune:
        return []
    method = prune["method"]
    lines = ["", "## Dropped blocks", "",
             f"Score `{method['score']}`" + (f" ({method['metric']}, {'iterative' if method['iterative'] else 'one-shot'})"
                                            if method["score"] == "ablation" else "")
             + f"; calibration: {(prune.get('calibration') or {}).get('description', 'none')}.",
             f"Dropped (original numbering): {prune['dropped']}; protected: {method['protect']}.", ""]
    if prune.get("scores_png"):
        lines.append(f"![block scores](pruned/{prune['scores_png']})")
    return lines


def _recover_lines(recover: dict[str, Any] | None) -> list[str]:
    if recover is None:
        return []
    loss = recover["held_out_loss"]
    data = recover["data"]
    return ["", "## Recovery", "",
            f"Recipe `{recover['recipe']['name']}` ({recover['recipe']['method']}), teacher `{recover['teacher']}`; "
            f"held-out loss on teacher responses {loss['before']:.3f} -> {loss['after']:.3f}; "
            f"{recover['tokens_seen']} tokens seen; {recover['seconds']['total']:.0f} s.",
            f"Data: {json.dumps(data.get('filter', {}))}", "", "![loss curve](recovered/loss_curve.png)"]
